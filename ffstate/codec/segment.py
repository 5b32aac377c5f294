"""One segment of an encoded version: ``n`` elements of ``itemsize`` bytes from one dtype group of a snapshot
buffer (their XOR against the holder's base for a delta, the bytes themselves for a full version), compressed by
python-blosc2 (docs/wire-format.md).

ffstate keeps what is its own: the XOR against the base the holder has, the cut into segments (one chunk each, a
megabyte by default: XOR and compression of a segment stay in the cache), and the checksums (each chunk's, and
the whole version's, ``ffstate.checksum``). blosc2 does the entropy stage: a byte shuffle by the element size
(the sign and exponent bytes of a float's XOR delta are nearly all zero, and gathered together they compress),
then LZ4 (streaming: fast both ways) or ZSTD (smaller, slower). It releases the interpreter lock while it works,
so the codec's thread pool runs segments in parallel.

A decoder refuses, before it writes anything, a segment that is not where the manifest puts it or whose
compressed stream says another size; the chunk checksums have already refused any corrupted byte.
"""

from __future__ import annotations

import struct
import threading

import blosc2
import numpy as np

from ffstate.errors import CodecError

MAGIC = b"FFS2"
SEGMENT = struct.Struct("<4sIQQ")  # magic, itemsize, byte offset in the snapshot buffer, element count
ITEMSIZES = (1, 2, 4, 8, 16)
CODECS = {"lz4": blosc2.Codec.LZ4, "zstd": blosc2.Codec.ZSTD}
LEVEL = 1  # LZ4 and ZSTD level 1: measured (bench codec), higher levels bought little ratio for much time
# blosc2's blocks of 256 KiB, the shuffled bytes not split into streams: of the settings tried on AdamW deltas
# (levels 1-5, split or not, 64-256 KiB blocks), the fastest both ways, and the best ratio (1.39x with LZ4).
BLOCK = 256 << 10
MAX_CALL = 2**31 - 64  # bytes one blosc2 call takes (its 2 GB limit, less its header); segments stay far below
_SCRATCH = threading.local()
# blosc2 keeps the interpreter lock while it compresses unless told otherwise: released, the codec's thread pool
# runs segments side by side, and the daemon's other threads (its gRPC server, the replicator) run meanwhile.
blosc2.set_releasegil(True)
THREADS = [1]  # threads blosc2 uses inside one call; the codec's pool runs one segment per thread


def _scratch(nbytes: int) -> np.ndarray:
    """A per-thread buffer of at least ``nbytes`` (a segment's XOR, or its decompressed bytes)."""
    buf = getattr(_SCRATCH, "buf", None)
    if buf is None or buf.size < nbytes:
        buf = _SCRATCH.buf = np.empty(max(nbytes, 1 << 20), dtype=np.uint8)
    return buf[:nbytes]


def encode_segment(data: np.ndarray, base: np.ndarray | None, itemsize: int, offset: int,
                   codec: str = "lz4") -> np.ndarray:
    """One segment (``data``, and ``base`` for a delta: n*itemsize bytes each) -> its payload (header and
    compressed bytes)."""
    if data.size > MAX_CALL:
        raise CodecError(f"a segment of {data.size} bytes exceeds blosc2's {MAX_CALL}-byte call limit")
    d = data
    if base is not None:
        d = np.bitwise_xor(data, base, out=_scratch(data.size))
    body = blosc2.compress2(d, typesize=itemsize, clevel=LEVEL, codec=CODECS[codec], nthreads=THREADS[0],
                            filters=[blosc2.Filter.SHUFFLE if itemsize > 1 else blosc2.Filter.NOFILTER],
                            filters_meta=[0], splitmode=blosc2.SplitMode.NEVER_SPLIT, blocksize=BLOCK)
    out = np.empty(SEGMENT.size + len(body), dtype=np.uint8)
    SEGMENT.pack_into(out, 0, MAGIC, itemsize, offset, data.size // itemsize)
    out[SEGMENT.size:] = np.frombuffer(body, dtype=np.uint8)
    return out


def _body(payload: np.ndarray, itemsize: int, offset: int, n: int) -> np.ndarray:
    """The compressed bytes of a segment, after its header and sizes are checked against the manifest's."""
    if payload.size < SEGMENT.size + 16:
        raise CodecError(f"segment at byte {offset} is truncated: {payload.size} bytes")
    magic, got_size, got_offset, got_n = SEGMENT.unpack_from(payload)
    if magic != MAGIC:
        hint = " (wire format 1: an older ffstate sent it; run one version on every node)" if magic == b"FFS1" else ""
        raise CodecError(f"segment at byte {offset} has magic {magic!r}, expected {MAGIC!r}{hint}")
    if (got_size, got_offset, got_n) != (itemsize, offset, n):
        raise CodecError(f"segment out of place: it holds {got_n} x {got_size}-byte elements at byte {got_offset}, "
                         f"the manifest expects {n} x {itemsize} at byte {offset} (reordered or foreign chunk?)")
    body = payload[SEGMENT.size:]
    try:
        nbytes, cbytes, _ = blosc2.get_cbuffer_sizes(body)
    except Exception as e:  # a header blosc2 cannot read
        raise CodecError(f"segment at byte {offset}: not a blosc2 stream ({e})") from None
    if nbytes != n * itemsize or cbytes != body.size:
        raise CodecError(f"segment at byte {offset}: its stream says {nbytes} bytes from {cbytes}; the manifest "
                         f"expects {n * itemsize} bytes, the chunk carries {body.size}")
    return body


def apply_segment(payload: np.ndarray, itemsize: int, offset: int, out: np.ndarray, into_zeros: bool = False) -> None:
    """XORs a decoded segment into ``out`` (n*itemsize bytes: the base for a delta). ``into_zeros``: ``out`` is all
    zero (a full version's new buffer), so the segment is decompressed straight into it. Checked before ``out``
    is written.

    Raises:
        CodecError: see ``_body``; or blosc2 could not decompress it.
    """
    body = _body(payload, itemsize, offset, out.size // itemsize)
    if not out.size:
        return
    target = out if into_zeros else _scratch(out.size)
    try:
        blosc2.decompress2(body, dst=target, nthreads=THREADS[0])
    except (ValueError, RuntimeError) as e:
        raise CodecError(f"segment at byte {offset}: blosc2 could not decompress it ({e})") from None
    if not into_zeros:
        np.bitwise_xor(out, target, out=out)
