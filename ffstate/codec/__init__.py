"""The lossless snapshot codec: pack a state into one flat buffer, encode it (full, or a delta
against a base) into checksummed chunks, and back, bit for bit (docs/design.md I1, I2, I6).

Two levels:

- state level: ``encode(state, base) -> Packed`` and ``decode(packed, base) -> state``;
- buffer level, for the capture path and the daemon: ``pack``/``pack_into`` a state into a buffer
  the caller owns, ``encode_snapshot``/``decode_snapshot`` on buffers, ``unpack`` a buffer into a
  new state, and ``restore_into`` a live model/optimizer state in place (``copy_``).

Packing a CUDA state runs in the Triton kernels of ``ffstate.kernels`` (gather and scatter; the razor's
fingerprint); the encoding itself, the zigzag difference from the base and python-blosc2 (``segment``), runs on
host buffers, where the daemon keeps every version. The wire format is in docs/wire-format.md.

The package: ``chunks`` (Chunk, Snapshot, Packed, the header and its checks), ``packing`` (state <-> buffer),
``segment`` (one segment on the wire: blosc2), ``delta`` (buffer <-> chunks, and the state level), ``decoder``
(streamed decoding), ``backend`` (the codec's threads, the kernels' dispatch, the checksum), ``host`` (buffers as
NumPy arrays or tensors). The names below are the codec's API; those of the training side (``pack``..., ``Decoder``)
are imported on first use, so that the daemon, which only encodes and decodes buffers, runs without torch.
"""

from typing import TYPE_CHECKING

from ffstate import lazy
from ffstate.codec.backend import _map, _pool, _use_kernels, buffer_checksum, fingerprint
from ffstate.codec.chunks import (CHUNK_OVERHEAD, DEFAULT_CHUNK_BYTES, FORMAT, MAX_CHUNK_BYTES, MAX_HEADER_BYTES,
                                  MIN_CHUNK_BYTES, Chunk, Packed, Snapshot, segments, verify_chunks)
from ffstate.codec.delta import (decode, decode_snapshot, encode, encode_chunks, encode_snapshot, encode_started,
                                 revert_snapshot)

if TYPE_CHECKING:
    from ffstate.codec.decoder import Decoder
    from ffstate.codec.packing import pack, pack_into, pack_targets, restore_into, unpack, unpack_verified

# The training side's names (states and tensors), imported on first use: the daemon encodes and decodes buffers
# without torch (a second and 180 MB a process).
_TORCH_SIDE = {"Decoder": "ffstate.codec.decoder", **{n: "ffstate.codec.packing" for n in (
    "pack", "pack_into", "pack_targets", "restore_into", "unpack", "unpack_verified")}}

__getattr__, __dir__ = lazy.attach(globals(), _TORCH_SIDE)


__all__ = ["CHUNK_OVERHEAD", "DEFAULT_CHUNK_BYTES", "FORMAT", "MAX_CHUNK_BYTES", "MAX_HEADER_BYTES", "MIN_CHUNK_BYTES",
           "Chunk", "Decoder", "Packed", "Snapshot", "_map", "_pool", "_use_kernels", "buffer_checksum", "decode",
           "decode_snapshot", "encode", "encode_chunks", "encode_snapshot", "encode_started", "fingerprint", "pack",
           "pack_into", "pack_targets", "restore_into", "revert_snapshot", "segments", "unpack", "unpack_verified",
           "verify_chunks"]
