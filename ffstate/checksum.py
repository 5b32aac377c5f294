"""The checksum every copy of a version is verified by: each chunk on the wire, a slot's bytes, a decoded version,
a persisted file (docs/wire-format.md). The NumPy reference; ``ffstate.kernels.checksum`` computes the same value
on a GPU.
"""

from __future__ import annotations

import threading

import numpy as np

# Checksum constants: the 64-bit golden ratio and MurmurHash3's fmix64 multipliers.
K0 = 0x9E3779B97F4A7C15
K1 = 0xFF51AFD7ED558CCD
K2 = 0xC4CEB9FE1A85EC53
_M64 = (1 << 64) - 1


def checksum(data: np.ndarray, mapper=map) -> int:
    """64-bit checksum of a byte array: position-keyed, per-word mixed, summed.

    The bytes are read as little-endian 64-bit words ``w_i`` (zero-padded to a multiple of 8), and
    ``x = (w_i ^ i*K0) * K1; x ^= x >> 29; x *= K2`` (all mod 2**64) is summed mod 2**64; the
    length is folded in last. Each step is a bijection of one word, so any single changed word
    changes the sum; the position key catches reordered words. Word-parallel, so the Triton kernel
    computes the same value, and ``mapper`` (e.g. a thread pool's map) can split the work.
    """
    data = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
    length = data.size
    full = length // 8
    words = data[: full * 8].view(np.uint64)
    total = sum(mapper(lambda s: _mix_sum(words[s : s + PIECE], s), range(0, full, PIECE)))
    return finish_checksum(total, data)


def word_sum(words: np.ndarray, start: int) -> int:
    """The part of ``checksum`` that the 64-bit words ``words`` contribute when the first is word ``start``.

    A checksum is the sum of such parts over any split of a buffer's whole words, then
    ``finish_checksum``: a reader can sum each piece while it is in cache from copying it.
    """
    return sum(_mix_sum(words[s : s + PIECE], start + s) for s in range(0, words.size, PIECE))


def finish_checksum(total: int, data: np.ndarray) -> int:
    """The checksum of ``data`` (flat uint8) from ``total``, the ``word_sum`` of all its whole words."""
    length = data.size
    full = length // 8
    if length % 8:
        tail = np.zeros(8, dtype=np.uint8)
        tail[: length % 8] = data[full * 8 :]
        total += _mix_sum(tail.view(np.uint64), full)
    return (total + length * K0) & _M64


# Words per piece of the checksum: 1 MiB, so a piece and its scratch stay in L2. (4 MiB pieces ran 3x
# slower: each piece's temporaries were fresh pages from the OS.)
PIECE = 1 << 17
_KEYS = np.arange(PIECE, dtype=np.uint64) * np.uint64(K0)  # j * K0 mod 2**64
_SCRATCH = threading.local()


def _mix_sum(words: np.ndarray, start: int) -> int:
    """The sum of the mixed words ``words`` (at most PIECE of them), the first at word index ``start``."""
    n = words.size
    if n == 0:
        return 0
    scratch = getattr(_SCRATCH, "x", None)
    if scratch is None:
        scratch = _SCRATCH.x = np.empty((2, PIECE), dtype=np.uint64)
    x, y = scratch[0, :n], scratch[1, :n]
    np.add(_KEYS[:n], np.uint64(start * K0 & _M64), out=x)  # (start + j) * K0
    np.bitwise_xor(x, words, out=x)
    np.multiply(x, np.uint64(K1), out=x)
    np.right_shift(x, np.uint64(29), out=y)
    np.bitwise_xor(x, y, out=x)
    np.multiply(x, np.uint64(K2), out=x)
    return int(np.add.reduce(x, dtype=np.uint64))
