"""What the tests, the demo and the benchmarks share and the library does not need: the small model they
train (``models.TinyGPT``), the one bitwise comparison of states (``bitwise``) and the failures they inject
(``faults``). Installed as
``ffstate.testing``."""
