"""ffstate: bit-exact, in-memory peer replication of PyTorch training state.

The public names live here; everything else is importable by its module path (``ffstate.codec``...).
``replicate`` and ``register_comm_hook`` are loaded on first use: the daemon and the command line import the package
without torch and the training side (torch.distributed, DCP), which cost a process a second or more to import. So is
``startup`` (``ffstate.startup.exit_now()``, a script's end, as the docs write it after a plain ``import ffstate``).
"""

from typing import TYPE_CHECKING, Any

from ffstate.config import Config
from ffstate.errors import CodecError, FFStateError, ReplicaError, ReplicaUnavailable

if TYPE_CHECKING:
    from ffstate.hooks import register_comm_hook
    from ffstate.trainer import replicate

__all__ = ["CodecError", "Config", "FFStateError", "ReplicaError", "ReplicaUnavailable", "register_comm_hook",
           "replicate"]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name == "replicate":
        from ffstate.trainer import replicate

        return replicate
    if name == "register_comm_hook":
        from ffstate.hooks import register_comm_hook

        return register_comm_hook
    if name == "startup":
        import importlib

        return importlib.import_module("ffstate.startup")
    raise AttributeError(f"module 'ffstate' has no attribute {name!r}")
