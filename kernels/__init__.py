"""Triton kernels for the snapshot codec, installed as ``ffstate.kernels``: gather a state's tensors into one flat
buffer and scatter it back, and the razor's fingerprint.

Each produces exactly the bytes of the reference in ``ffstate.codec`` and ``ffstate.checksum.fingerprint`` (the oracle; the
tests compare them bit for bit). They run natively on CUDA tensors, and on CPU tensors under
``TRITON_INTERPRET=1``.
"""

from ffstate.kernels.fingerprint import fingerprint
from ffstate.kernels.gather import gather, scatter

__all__ = ["fingerprint", "gather", "scatter"]
