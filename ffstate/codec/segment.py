"""One segment of an encoded version: ``n`` elements of ``itemsize`` bytes from one dtype group of a snapshot
buffer (for a delta, their difference from the holder's base; for a full version, the bytes themselves),
compressed by python-blosc2 (docs/wire-format.md).

ffstate keeps what is its own: the delta against the base the holder has, the cut into segments (one chunk each, a
megabyte by default: the delta and the compression of a segment stay in the cache), and the checksums (each
chunk's, and the whole version's, ``ffstate.checksum``). The delta is the elements' bit patterns subtracted as
integers of the element's width (modulo 2^bits; 16-byte elements as two 8-byte lanes), zigzag-mapped so that a
small difference either way has its high bytes zero: ``(d << 1) ^ (d >> bits-1)``. A float that moved a little
keeps its sign, exponent and upper mantissa, so its high bytes are zero more often than an XOR leaves them (an XOR
turns a carry across a mantissa bit into a run of ones). On AdamW deltas: 1.51x with LZ4 where XOR gave 1.39x,
1.64x with ZSTD for 1.53x, and bf16 3.01x and 4.33x for 2.66x and 3.70x (benchmarks/2026-11-27-zigzag-delta.md).
blosc2 does the entropy stage: a byte shuffle by the element size (the high bytes gathered together compress),
then LZ4 (streaming: fast both ways) or ZSTD (smaller, slower). It releases the interpreter lock while it works,
so the codec's thread pool runs segments in parallel. ``revert`` takes a delta off the version it made: a holder
steps a replica back by its kept deltas (docs/design.md).

A segment that does not compress is sent as it is (``STORED``): a full version of dense float state compresses by
only 1.02-1.16x per segment (fp32 AdamW state, TinyGPT-medium), for an encode and a decode at a fraction of a
memory copy's speed each, which a restore over a fast link waits for; a stored segment costs one copy each way. For
a full version the encoder compresses a sample of each segment first (``PROBE``: four slices spread over it) and
stores the segment when the sample gains less than ``STORE_BELOW``; a segment compressed (a delta's: they nearly
always compress) that gains less is stored too.

A decoder refuses, before it writes anything, a segment that is not where the manifest puts it or whose
compressed stream says another size; the chunk checksums have already refused any corrupted byte.
"""

from __future__ import annotations

import struct
import threading

import blosc2
import numpy as np

from ffstate.errors import CodecError

MAGIC = b"FFS4"  # wire format 5, a blosc2 stream follows (FFS3: format 4, before stored segments; FFS2: XOR deltas)
STORED = b"FFR4"  # wire format 5, the segment's bytes follow as they are
OLDER = {b"FFS1": "1", b"FFS2": "2 or 3", b"FFS3": "4"}  # magic -> the wire format that sent it
# A segment is stored (not compressed) when compression would shrink it by less than this: 9% fewer bytes on the
# wire is not worth an encode at 1-2 GB/s and a decode at 2 GB/s a thread where a copy runs at 5 (measured, fp32
# AdamW state: benchmarks/2026-11-28-stored-segments.md). Deltas between steps compress 1.3-1.8x: they stay compressed.
STORE_BELOW = 1.1
PROBE = 4, 16 << 10  # slices of a segment compressed to decide, and their bytes: 64 KiB of a 1 MiB segment
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
# The integer lanes a segment's elements are differenced in, by element size: (unsigned, signed, bits - 1).
LANES = {1: (np.uint8, np.int8, 7), 2: (np.uint16, np.int16, 15), 4: (np.uint32, np.int32, 31),
         8: (np.uint64, np.int64, 63), 16: (np.uint64, np.int64, 63)}


SCRATCH_KEPT = 8 << 20  # bytes of scratch a thread keeps between segments (the encoders' segments: 1 MiB)


def _scratch(nbytes: int, which: int = 0) -> np.ndarray:
    """Per-thread buffer ``which`` of at least ``nbytes``: 0, a segment's delta or decompressed bytes (a segment's
    size, at least 1 MiB); 1, the zigzag's sign mask (one ``MASK_BYTES`` block)."""
    if nbytes > SCRATCH_KEPT:  # a segment larger than any encoder makes: not kept for the thread's lifetime
        return np.empty(nbytes, dtype=np.uint8)
    bufs = getattr(_SCRATCH, "bufs", None)
    if bufs is None:
        bufs = _SCRATCH.bufs = [np.empty(0, dtype=np.uint8), np.empty(0, dtype=np.uint8)]
    if bufs[which].size < nbytes:
        bufs[which] = np.empty(max(nbytes, 1 << 20) if which == 0 else nbytes, dtype=np.uint8)
    return bufs[which][:nbytes]


MASK_BYTES = 256 << 10  # the zigzag runs block by block: its sign mask stays small and in cache


def delta(data: np.ndarray, base: np.ndarray, itemsize: int) -> np.ndarray:
    """``zigzag(data - base)`` in ``itemsize``-wide integer lanes (a per-thread scratch buffer: use it before the
    thread's next segment)."""
    unsigned, signed, top = LANES[itemsize]
    d = np.subtract(data.view(unsigned), base.view(unsigned), out=_scratch(data.size).view(unsigned)).view(signed)
    mask, step = _scratch(min(data.size, MASK_BYTES), 1).view(signed), MASK_BYTES // d.itemsize
    for i in range(0, d.size, step):
        blk = d[i : i + step]
        sign = np.right_shift(blk, top, out=mask[: blk.size])  # 0, or every bit set
        np.left_shift(blk, 1, out=blk)
        np.bitwise_xor(blk, sign, out=blk)
    return d.view(np.uint8)


def undelta(z: np.ndarray, out: np.ndarray, itemsize: int, revert: bool = False) -> None:
    """``out += unzigzag(z)`` in ``itemsize``-wide lanes (``revert``: ``out -=``), modulo 2^bits; ``z`` is
    overwritten."""
    unsigned = LANES[itemsize][0]
    zu, into = z.view(unsigned), out.view(unsigned)
    mask, step = _scratch(min(z.size, MASK_BYTES), 1).view(unsigned), MASK_BYTES // zu.itemsize
    combine = np.subtract if revert else np.add
    for i in range(0, zu.size, step):
        blk = zu[i : i + step]
        sign = np.bitwise_and(blk, 1, out=mask[: blk.size])
        np.negative(sign, out=sign)  # 0, or every bit set
        np.right_shift(blk, 1, out=blk)
        np.bitwise_xor(blk, sign, out=blk)
        combine(into[i : i + step], blk, out=into[i : i + step])


def compress(d: np.ndarray, itemsize: int, codec: str = "lz4") -> bytes:
    """The entropy stage alone: blosc2's stream of ``d`` (a byte shuffle by ``itemsize``, level ``LEVEL``)."""
    return blosc2.compress2(d, typesize=itemsize, clevel=LEVEL, codec=CODECS[codec], nthreads=THREADS[0],
                            filters=[blosc2.Filter.SHUFFLE if itemsize > 1 else blosc2.Filter.NOFILTER],
                            filters_meta=[0], splitmode=blosc2.SplitMode.NEVER_SPLIT, blocksize=BLOCK)


def encode_segment(data: np.ndarray, base: np.ndarray | None, itemsize: int, offset: int,
                   codec: str = "lz4") -> np.ndarray:
    """One segment (``data``, and ``base`` for a delta: n*itemsize bytes each) -> its payload (header and
    compressed bytes of the bytes themselves, or of their ``delta`` from ``base``)."""
    if data.size > MAX_CALL:
        raise CodecError(f"a segment of {data.size} bytes exceeds blosc2's {MAX_CALL}-byte call limit")
    d = data
    if base is not None:
        d = delta(data, base, itemsize)
    # A delta between steps nearly always compresses (the sample would cost it 4-7%): only a full version's is probed.
    body = compress(d, itemsize, codec) if base is not None or _compresses(d, itemsize, codec) else None
    if body is not None and len(body) * STORE_BELOW > d.size:
        body = None  # it gained too little: the receiver's decode is a copy instead
    out = np.empty(SEGMENT.size + (d.size if body is None else len(body)), dtype=np.uint8)
    SEGMENT.pack_into(out, 0, MAGIC if body is not None else STORED, itemsize, offset, data.size // itemsize)
    out[SEGMENT.size:] = d if body is None else np.frombuffer(body, dtype=np.uint8)
    return out


def _compresses(d: np.ndarray, itemsize: int, codec: str) -> bool:
    """Whether ``d`` is worth compressing, judged on ``PROBE``'s slices spread over it (a short segment: yes, and
    the result decides)."""
    count, size = PROBE
    if d.size < 4 * count * size:
        return True
    step = (d.size - size) // (count - 1) // 16 * 16  # 16: a multiple of every itemsize, so slices start on elements
    sample = np.concatenate([d[i * step : i * step + size] for i in range(count)])
    return len(compress(sample, itemsize, codec)) * STORE_BELOW <= sample.size


def _body(payload: np.ndarray, itemsize: int, offset: int, n: int) -> tuple[np.ndarray, bool]:
    """The bytes of a segment after its header, and whether they are stored as they are (else a blosc2 stream),
    once its header and sizes are checked against the manifest's."""
    if payload.size < SEGMENT.size:
        raise CodecError(f"segment at byte {offset} is truncated: {payload.size} bytes")
    magic, got_size, got_offset, got_n = SEGMENT.unpack_from(payload)
    if magic not in (MAGIC, STORED):
        older = OLDER.get(magic)
        hint = f" (wire format {older}: an older ffstate sent it; run one version on every node)" if older else ""
        raise CodecError(f"segment at byte {offset} has magic {magic!r}, expected {MAGIC!r} or {STORED!r}{hint}")
    if (got_size, got_offset, got_n) != (itemsize, offset, n):
        raise CodecError(f"segment out of place: it holds {got_n} x {got_size}-byte elements at byte {got_offset}, "
                         f"the manifest expects {n} x {itemsize} at byte {offset} (reordered or foreign chunk?)")
    body = payload[SEGMENT.size:]
    if magic == STORED:
        if body.size != n * itemsize:
            raise CodecError(f"segment at byte {offset}: stored as it is, it carries {body.size} bytes; the manifest "
                             f"expects {n * itemsize}")
        return body, True
    if body.size < 16:
        raise CodecError(f"segment at byte {offset} is truncated: {payload.size} bytes")
    try:
        nbytes, cbytes, _ = blosc2.get_cbuffer_sizes(body)
    except Exception as e:  # a header blosc2 cannot read
        raise CodecError(f"segment at byte {offset}: not a blosc2 stream ({e})") from None
    if nbytes != n * itemsize or cbytes != body.size:
        raise CodecError(f"segment at byte {offset}: its stream says {nbytes} bytes from {cbytes}; the manifest "
                         f"expects {n * itemsize} bytes, the chunk carries {body.size}")
    return body, False


def apply_segment(payload: np.ndarray, itemsize: int, offset: int, out: np.ndarray, into_zeros: bool = False,
                  revert: bool = False) -> None:
    """Adds a decoded delta segment onto ``out`` (n*itemsize bytes: the base), or with ``revert`` takes it off
    again (``out`` is then the version the delta produced). ``into_zeros``: a full version's segment, decompressed
    (or copied, if stored) straight into ``out``. Checked before ``out`` is written.

    Raises:
        CodecError: see ``_body``; or blosc2 could not decompress it.
    """
    body, stored = _body(payload, itemsize, offset, out.size // itemsize)
    if not out.size:
        return
    target = out if into_zeros else _scratch(out.size)
    if stored:
        np.copyto(target, body)  # a delta's copy too: ``undelta`` overwrites it, and the payload is the caller's
    else:
        try:
            blosc2.decompress2(body, dst=target, nthreads=THREADS[0])
        except (ValueError, RuntimeError) as e:
            raise CodecError(f"segment at byte {offset}: blosc2 could not decompress it ({e})") from None
    if not into_zeros:
        undelta(target, out, itemsize, revert)
