"""ffstate: bit-exact, in-memory peer replication of PyTorch training state.

The public names live here; everything else is importable by its module path (``ffstate.codec``...).
"""

from ffstate.config import Config
from ffstate.errors import CodecError, FFStateError, ReplicaError, ReplicaUnavailable
from ffstate.trainer import replicate

__all__ = ["CodecError", "Config", "FFStateError", "ReplicaError", "ReplicaUnavailable", "replicate"]
__version__ = "0.1.0"
