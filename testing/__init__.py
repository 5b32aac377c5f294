"""What the tests, the demo and the benchmarks share and the library does not need: the small model they
train (``models.TinyGPT``) and the one bitwise comparison of states (``bitwise``). Installed as
``ffstate.testing``."""
