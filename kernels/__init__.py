"""Triton kernels for the snapshot codec, installed as ``ffstate.kernels``.

Each produces exactly the bytes of the reference in ``ffstate.planes`` / ``ffstate.codec`` (the
oracle; the tests compare them bit for bit). They run natively on CUDA tensors, and on CPU tensors
under ``TRITON_INTERPRET=1``.
"""

from ffstate.kernels.checksum import checksum
from ffstate.kernels.gather import gather, scatter
from ffstate.kernels.planes import apply_segments, encode_segments

__all__ = ["apply_segments", "checksum", "encode_segments", "gather", "scatter"]
