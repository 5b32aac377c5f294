"""``ffstate demo``: the main job with failures (``main``) and its torchrun worker (``worker``), run as
``python -m ffstate.demo.worker``. Installed as ``ffstate.demo``."""
