"""The byte-plane segment format and its reference implementation (CPU, NumPy over the tensors' memory).

A segment is a run of ``n`` elements of ``itemsize`` bytes from one dtype group of a snapshot
buffer (the XOR delta against a base, or the bytes themselves for a full version). It is split into
``itemsize`` byte planes (plane p = byte p of every element, little-endian), and each plane is
stored as the cheapest of:

- ``ZERO``: nothing (all bytes zero: an unchanged plane of a delta);
- ``SPARSE``: a bitmap of the non-zero bytes (bit j of byte k is element 8k+j), then those bytes;
- ``RAW``: the n bytes as they are.

Encoding is lossless by construction; the Triton kernels in ``ffstate.kernels`` produce the same
bytes, and this module is their oracle. The checksum is defined here too. docs/wire-format.md has
the byte-level description.
"""

from __future__ import annotations

import struct
import threading

import numpy as np

from ffstate.errors import CodecError

MAGIC = b"FFS1"
SEGMENT = struct.Struct("<4sIQQ")  # magic, itemsize, byte offset in the snapshot buffer, element count
PLANE = struct.Struct("<II")  # tag, payload length in bytes
ZERO, RAW, SPARSE = 0, 1, 2
ITEMSIZES = (1, 2, 4, 8, 16)

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


def plane_cost(n: int, nnz: int) -> tuple[int, int]:
    """(tag, payload bytes) of the cheapest encoding of a plane of n bytes with nnz non-zero."""
    if nnz == 0:
        return ZERO, 0
    sparse = (n + 7) // 8 + nnz
    return (SPARSE, sparse) if sparse < n else (RAW, n)


def encode_segment(d: np.ndarray, itemsize: int, offset: int) -> np.ndarray:
    """One segment (``d``: n*itemsize bytes) -> its encoded bytes (header, plane table, planes)."""
    n = d.size // itemsize
    # One transposing copy makes every plane contiguous; the per-plane work below is then cheap.
    planes = np.ascontiguousarray(d.reshape(n, itemsize).T)
    table, parts = [], []
    for plane in planes:
        nz = plane != 0
        tag, length = plane_cost(n, int(np.count_nonzero(nz)))
        table.append(PLANE.pack(tag, length))
        if tag == SPARSE:
            # np.compress is ~5x faster than boolean-mask indexing for this.
            parts += [np.packbits(nz, bitorder="little"), np.compress(nz, plane)]
        elif tag == RAW:
            parts.append(plane)
    head = SEGMENT.pack(MAGIC, itemsize, offset, n) + b"".join(table)
    out = np.empty(len(head) + sum(x.size for x in parts), dtype=np.uint8)
    out[: len(head)] = np.frombuffer(head, dtype=np.uint8)
    pos = len(head)
    for x in parts:
        out[pos : pos + x.size] = x
        pos += x.size
    return out


def parse_segment(payload: np.ndarray, itemsize: int, offset: int, n: int) -> list[tuple[int, int, int]]:
    """Validates a segment's header and plane table against what the manifest expects.

    Returns (tag, start, length) per plane; raises CodecError on anything unexpected.
    """
    head = SEGMENT.size + PLANE.size * itemsize
    if payload.size < head:
        raise CodecError(f"segment at byte {offset} is truncated: {payload.size} bytes, header alone is {head}")
    magic, got_size, got_offset, got_n = SEGMENT.unpack(payload[: SEGMENT.size].tobytes())
    if magic != MAGIC:
        raise CodecError(f"segment at byte {offset} has magic {magic!r}, expected {MAGIC!r}")
    if (got_size, got_offset, got_n) != (itemsize, offset, n):
        raise CodecError(
            f"segment out of place: it holds {got_n} x {got_size}-byte elements at byte {got_offset}, "
            f"the manifest expects {n} x {itemsize} at byte {offset} (reordered or foreign chunk?)"
        )
    planes, pos = [], head
    for p in range(itemsize):
        at = SEGMENT.size + PLANE.size * p
        tag, length = PLANE.unpack(payload[at : at + PLANE.size].tobytes())
        if tag not in (ZERO, RAW, SPARSE):
            raise CodecError(f"segment at byte {offset}, plane {p}: unknown tag {tag}")
        want = {ZERO: 0, RAW: n}.get(tag)
        if (want is not None and length != want) or (tag == SPARSE and length < (n + 7) // 8):
            raise CodecError(f"segment at byte {offset}, plane {p}: tag {tag} with {length} bytes for {n} elements")
        planes.append((tag, pos, length))
        pos += length
    if pos != payload.size:
        raise CodecError(f"segment at byte {offset}: planes account for {pos} bytes, payload has {payload.size}")
    return planes


def apply_segment(payload: np.ndarray, itemsize: int, offset: int, out: np.ndarray) -> None:
    """XORs a decoded segment into ``out`` (n*itemsize bytes; zeros for a full version, the base for a delta).

    Everything is validated before ``out`` is touched.
    """
    n = out.size // itemsize
    table = parse_segment(payload, itemsize, offset, n)
    if all(tag == ZERO for tag, _, _ in table):
        return
    dense = np.zeros((itemsize, n), dtype=np.uint8)
    nb = (n + 7) // 8
    for p, (tag, start, length) in enumerate(table):
        body = payload[start : start + length]
        if tag == RAW:
            dense[p] = body
        elif tag == SPARSE:
            bitmap = body[:nb]
            if n % 8 and bitmap[-1] >> (n % 8):
                raise CodecError(f"segment at byte {offset}, plane {p}: bitmap has bits past element {n}")
            # Integer scatter: ~4x faster in NumPy than np.place or boolean-mask assignment.
            where = np.flatnonzero(np.unpackbits(bitmap, count=n, bitorder="little").view(bool))
            if where.size != body.size - nb:
                raise CodecError(
                    f"segment at byte {offset}, plane {p}: bitmap marks {where.size} bytes, {body.size - nb} follow"
                )
            dense[p][where] = body[nb:]
    _xor_interleaved(out, dense)


_WORD = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def _xor_interleaved(out: np.ndarray, dense: np.ndarray) -> None:
    """``out`` (n elements of ``len(dense)`` bytes) ^= the planes in ``dense``, re-interleaved.

    Combining planes into words by shifts is ~5x faster in NumPy than a transposing XOR.
    """
    itemsize, n = dense.shape
    if itemsize == 16:  # two 8-byte halves per element
        halves = out.view(np.uint64).reshape(n, 2)
        for h in range(2):
            halves[:, h] ^= _combine(dense[8 * h : 8 * h + 8], np.uint64)
        return
    word = _WORD[itemsize]
    np.bitwise_xor(out.view(word), _combine(dense, word), out=out.view(word))


def _combine(dense: np.ndarray, word: type) -> np.ndarray:
    acc = dense[0].astype(word)
    for p in range(1, len(dense)):
        acc |= dense[p].astype(word) << word(8 * p)
    return acc
