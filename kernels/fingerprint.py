"""The razor's fingerprint of a byte buffer on its device (the definition and reference are
``ffstate.checksum.fingerprint``): per-block partial sums."""

import torch
import triton
import triton.language as tl

from ffstate.kernels._launch import block, device_of
from ffstate.checksum import K0

_M64 = (1 << 64) - 1


@triton.jit
def _fingerprint_kernel(src, partial, nbytes, WORDS: tl.constexpr):
    pid = tl.program_id(0)
    word = pid.to(tl.int64) * WORDS + tl.arange(0, WORDS).to(tl.int64)
    byte = word[:, None] * 8 + tl.arange(0, 8)[None, :]
    raw = tl.load(src + byte, mask=byte < nbytes, other=0).to(tl.uint64)
    w = tl.sum(raw << (tl.arange(0, 8)[None, :] * 8).to(tl.uint64), axis=1)
    x = word.to(tl.uint64) * 0x9E3779B97F4A7C15
    x = (x ^ w) * 0xFF51AFD7ED558CCD
    x = x ^ (x >> 29)
    x = x * 0xC4CEB9FE1A85EC53
    x = tl.where(word * 8 < nbytes, x, 0)
    tl.store(partial + pid, tl.sum(x, axis=0).to(tl.int64, bitcast=True))


def fingerprint(buf: torch.Tensor) -> int:
    """The 64-bit fingerprint of a flat uint8 tensor, computed on its device."""
    n = buf.numel()
    # 2048 words = 16 KiB per program: one wide load per thread, few enough partials to sum cheaply.
    words = block(2048, 8192)
    grid = max(1, triton.cdiv(triton.cdiv(n, 8), words))
    with device_of(buf):  # Triton launches on the current device: the buffer's made current (gather.py says why)
        partial = torch.empty(grid, dtype=torch.int64, device=buf.device)
        if n:
            _fingerprint_kernel[(grid,)](buf, partial, n, WORDS=words)
        else:
            partial.zero_()
        total = int(partial.sum().item()) & _M64
    return (total + n * K0) & _M64
