"""The two sums ffstate computes over bytes.

- ``checksum``: what every copy of a version is verified by (each chunk on the wire, a slot's bytes, a decoded
  version, a persisted file; docs/wire-format.md). XXH3-64 (python-xxhash) of each 1 MiB piece, seeded with
  the piece's index, the pieces' hashes summed and the length folded in: a piece hashes at memory speed, pieces
  can be hashed on several threads or while each is in cache from a copy, and a moved piece changes the sum.
- ``fingerprint``: the razor's comparison of tensors a data-parallel group holds identically (``razor.py``).
  A position-keyed, per-word mixed sum: word-parallel, so that ``ffstate.kernels.fingerprint`` computes the
  same value on a GPU without copying the tensor to the host. The NumPy version here is its reference. It was the
  version checksum of wire format 2 and of the persistent tier's format 1 (still read: ``persist/read.py``).
"""

from __future__ import annotations

import threading

import numpy as np
import xxhash

K0 = 0x9E3779B97F4A7C15  # the 64-bit golden ratio: folds the length in (both sums) and keys positions (fingerprint)
_M64 = (1 << 64) - 1

# Bytes a piece of ``checksum``: large enough that a call's cost vanishes beside the hashing (XXH3 runs at tens of
# GB/s on one core), small enough to stay in L2 from a copy and to spread a buffer over the codec's threads.
PIECE_BYTES = 1 << 20


def checksum(data: np.ndarray | memoryview | bytes, mapper=map) -> int:
    """The 64-bit checksum of a byte buffer: ``finish(sum of piece_sum over its pieces, len)``.

    ``mapper`` (e.g. a thread pool's map) may split the work by pieces; python-xxhash holds the interpreter lock
    while it hashes, one piece a call.
    """
    flat = _bytes(data)
    n = flat.size
    spans = range(0, n, 4 * PIECE_BYTES)
    if len(spans) < 2:
        return finish(piece_sum(flat, 0), n)
    return finish(sum(mapper(lambda s: piece_sum(flat[s : s + 4 * PIECE_BYTES], s // PIECE_BYTES), spans)), n)


def piece_sum(data: np.ndarray, first: int) -> int:
    """The part of ``checksum`` that ``data`` contributes when it starts at piece ``first`` (byte ``first *
    PIECE_BYTES``) of a buffer: whole pieces, but for the buffer's last. The checksum of a buffer is ``finish``
    of the sum of such parts over any split of it at piece boundaries."""
    h = xxhash.xxh3_64_intdigest
    total = 0
    for i, s in enumerate(range(0, data.size, PIECE_BYTES)):
        total += h(data[s : s + PIECE_BYTES], seed=first + i)
    return total & _M64


def finish(total: int, nbytes: int) -> int:
    """The checksum of a buffer of ``nbytes`` bytes from ``total``, the ``piece_sum`` of all its pieces."""
    return (total + nbytes * K0) & _M64


def _bytes(data: np.ndarray | memoryview | bytes) -> np.ndarray:
    if isinstance(data, np.ndarray):
        return np.ascontiguousarray(data).reshape(-1).view(np.uint8)
    return np.frombuffer(data, dtype=np.uint8)


# ---------------------------------------------------------------- the razor's fingerprint

K1 = 0xFF51AFD7ED558CCD  # MurmurHash3's fmix64 multipliers
K2 = 0xC4CEB9FE1A85EC53


def fingerprint(data: np.ndarray, mapper=map) -> int:
    """64-bit position-keyed, per-word mixed sum of a byte array (``ffstate.kernels.fingerprint`` on a GPU).

    The bytes are read as little-endian 64-bit words ``w_i`` (zero-padded to a multiple of 8), and
    ``x = (w_i ^ i*K0) * K1; x ^= x >> 29; x *= K2`` (all mod 2**64) is summed mod 2**64; the length is folded
    in last. Each step is a bijection of one word, so any single changed word changes the sum; the position key
    catches reordered words.
    """
    data = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
    length = data.size
    full = length // 8
    words = data[: full * 8].view(np.uint64)
    total = sum(mapper(lambda s: _mix_sum(words[s : s + WORDS], s), range(0, full, WORDS)))
    if length % 8:
        tail = np.zeros(8, dtype=np.uint8)
        tail[: length % 8] = data[full * 8 :]
        total += _mix_sum(tail.view(np.uint64), full)
    return finish(total, length)


# Words per step of the fingerprint: 1 MiB, so that a step and its scratch stay in L2 (4 MiB ran 3x slower: each
# step's temporaries were fresh pages from the OS).
WORDS = 1 << 17
_KEYS = np.arange(WORDS, dtype=np.uint64) * np.uint64(K0)  # j * K0 mod 2**64
_SCRATCH = threading.local()


def _mix_sum(words: np.ndarray, start: int) -> int:
    """The sum of the mixed words ``words`` (at most WORDS of them), the first at word index ``start``."""
    n = words.size
    if n == 0:
        return 0
    scratch = getattr(_SCRATCH, "x", None)
    if scratch is None:
        scratch = _SCRATCH.x = np.empty((2, WORDS), dtype=np.uint64)
    x, y = scratch[0, :n], scratch[1, :n]
    np.add(_KEYS[:n], np.uint64(start * K0 & _M64), out=x)  # (start + j) * K0
    np.bitwise_xor(x, words, out=x)
    np.multiply(x, np.uint64(K1), out=x)
    np.right_shift(x, np.uint64(29), out=y)
    np.bitwise_xor(x, y, out=x)
    np.multiply(x, np.uint64(K2), out=x)
    return int(np.add.reduce(x, dtype=np.uint64))
