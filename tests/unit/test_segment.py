"""ffstate/codec/segment.py (one segment on the wire: blosc2 after ffstate's zigzag difference) and
ffstate/checksum.py (the checksum and the razor's fingerprint)."""

import blosc2
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ffstate import checksum
from ffstate.codec import segment
from ffstate.errors import CodecError


@settings(max_examples=200, deadline=None)
@given(data=st.binary(max_size=3000), itemsize=st.sampled_from(segment.ITEMSIZES), density=st.floats(0, 1),
       codec=st.sampled_from(sorted(segment.CODECS)), delta=st.booleans())
def test_a_segment_round_trips_any_bytes_full_or_as_a_delta(data, itemsize, density, codec, delta):
    rng = np.random.default_rng(len(data))
    cur = np.frombuffer(data, dtype=np.uint8)[: len(data) // itemsize * itemsize].copy()
    base = cur.copy()
    changed = rng.random(cur.size) < density
    base[changed] = rng.integers(0, 256, int(changed.sum()), dtype=np.uint8)
    enc = segment.encode_segment(cur, base if delta else None, itemsize, 128, codec)
    out = base.copy() if delta else np.zeros_like(cur)
    segment.apply_segment(enc, itemsize, 128, out, into_zeros=not delta)
    assert out.tobytes() == cur.tobytes()
    if delta:  # taken off again, the base comes back
        segment.apply_segment(enc, itemsize, 128, out, revert=True)
        assert out.tobytes() == base.tobytes()


def test_an_unchanged_segment_costs_a_few_dozen_bytes():
    cur = np.random.default_rng(0).integers(0, 256, 1 << 20, dtype=np.uint8)
    assert segment.encode_segment(cur, cur.copy(), 4, 0).size < 64


def _encoded(n: int = 4096, itemsize: int = 4) -> bytearray:
    d = np.random.default_rng(1).integers(0, 3, n * itemsize, dtype=np.uint8)
    return bytearray(segment.encode_segment(d, None, itemsize, 64).tobytes())


@pytest.mark.parametrize("what, change, match", [
    ("an older format", lambda b: b"FFS1" + b[4:], "wire format 1: an older ffstate"),
    ("the XOR deltas' format", lambda b: b"FFS2" + b[4:], "wire format 2 or 3: an older ffstate"),
    ("format 4, before stored segments", lambda b: b"FFS3" + b[4:], "wire format 4: an older ffstate"),
    ("another place", lambda b: b[:8] + (128).to_bytes(8, "little") + b[16:], "out of place"),
    ("a truncated stream", lambda b: b[:-7], "the chunk carries"),
    ("a stream of another size", lambda b: b[:24] + bytes(b[24:28]) + (16385).to_bytes(4, "little") + b[32:],
     "its stream says"),
    ("no stream", lambda b: b[:24] + b"\x00" * 40, "not a blosc2 stream|its stream says"),
])
def test_a_malformed_segment_is_refused_before_anything_is_written(what, change, match):
    bad = np.frombuffer(bytes(change(_encoded())), dtype=np.uint8)
    out = np.full(4096 * 4, 7, dtype=np.uint8)
    with pytest.raises(CodecError, match=match):
        segment.apply_segment(bad, 4, 64, out)
    assert (out == 7).all(), what


def _magic(payload: np.ndarray) -> bytes:
    return payload[:4].tobytes()


@pytest.mark.parametrize("itemsize", segment.ITEMSIZES)
@pytest.mark.parametrize("delta", [False, True], ids=["full", "delta"])
def test_a_segment_that_does_not_compress_is_stored_as_it_is_and_round_trips(itemsize, delta):
    """A megabyte of noise (the probe decides) and 3000 bytes of it (compressed, then found not worth it) are sent
    as they are: the payload is the header and the bytes, and decoding it gives them back (and takes a delta off)."""
    rng = np.random.default_rng(itemsize)
    for nbytes in (1 << 20, 3000 // itemsize * itemsize):
        cur = rng.integers(0, 256, nbytes, dtype=np.uint8)
        base = rng.integers(0, 256, nbytes, dtype=np.uint8)
        enc = segment.encode_segment(cur, base if delta else None, itemsize, 64)
        assert _magic(enc) == segment.STORED and enc.size == segment.SEGMENT.size + nbytes
        if not delta:
            assert enc[segment.SEGMENT.size:].tobytes() == cur.tobytes()
        out = base.copy() if delta else np.zeros_like(cur)
        segment.apply_segment(enc, itemsize, 64, out, into_zeros=not delta)
        assert out.tobytes() == cur.tobytes()
        if delta:
            segment.apply_segment(enc, itemsize, 64, out, revert=True)
            assert out.tobytes() == base.tobytes()


def test_a_segment_that_compresses_stays_compressed_and_the_probe_decides_from_its_slices():
    """Half zeros: compressed. Zeros everywhere but in the probe's slices (64 KiB spread over the megabyte, noise):
    stored, as the sample says, the compression not tried."""
    rng = np.random.default_rng(3)
    half = rng.integers(0, 256, 1 << 20, dtype=np.uint8)
    half[::2] = 0
    enc = segment.encode_segment(half, None, 4, 0)
    assert _magic(enc) == segment.MAGIC and enc.size < 0.9 * half.size
    count, size = segment.PROBE
    step = ((1 << 20) - size) // (count - 1) // 16 * 16
    zeros_but_probe = np.zeros(1 << 20, dtype=np.uint8)
    for i in range(count):
        zeros_but_probe[i * step : i * step + size] = rng.integers(0, 256, size, dtype=np.uint8)
    enc = segment.encode_segment(zeros_but_probe, None, 4, 0)
    assert _magic(enc) == segment.STORED
    out = np.ones_like(zeros_but_probe)
    segment.apply_segment(enc, 4, 0, out, into_zeros=True)
    assert out.tobytes() == zeros_but_probe.tobytes()


@pytest.mark.parametrize("what, change", [
    ("a byte short", lambda b: b[:-1]),
    ("a byte long", lambda b: b + b"\x00"),
    ("another place", lambda b: b[:8] + (128).to_bytes(8, "little") + b[16:]),
    ("another count", lambda b: b[:16] + (4095).to_bytes(8, "little") + b[24:]),
])
def test_a_malformed_stored_segment_is_refused_before_anything_is_written(what, change):
    noise = np.random.default_rng(4).integers(0, 256, 4096 * 4, dtype=np.uint8)
    good = segment.encode_segment(noise, None, 4, 64)
    assert _magic(good) == segment.STORED
    bad = np.frombuffer(bytes(change(bytearray(good.tobytes()))), dtype=np.uint8)
    out = np.full(4096 * 4, 7, dtype=np.uint8)
    with pytest.raises(CodecError, match="stored as it is|out of place"):
        segment.apply_segment(bad, 4, 64, out)
    assert (out == 7).all(), what


@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.float64])
def test_a_small_move_either_way_leaves_the_delta_s_high_bytes_zero_where_xor_does_not(dtype):
    """The reason the delta is a zigzag difference: a value one unit in the last place away, either way, across a
    carry of its mantissa (1.0 and the float below it) differs by 1 as an integer; its XOR sets every mantissa bit."""
    one = np.array([1.0, 1.0, 1.5, -2.0], dtype=dtype)
    below = np.nextafter(one, np.array(-np.inf, dtype=dtype))  # 0x3F7FFFFF beside 0x3F800000 for fp32's 1.0
    size = one.itemsize
    for cur, base in ((one, below), (below, one)):
        d = segment.delta(cur.view(np.uint8), base.view(np.uint8), size).copy()
        lanes = d.reshape(-1, size)
        assert (lanes[:, 1:] == 0).all() and set(lanes[:, 0].tolist()) <= {1, 2}  # zigzag: +1 -> 2, -1 -> 1
        xor = (cur.view(np.uint8) ^ base.view(np.uint8)).reshape(-1, size)
        assert (xor[:2, 1:] != 0).any()  # 1.0 against the float below it: the carry reaches the high bytes
        out = base.view(np.uint8).copy()
        segment.undelta(d, out, size)
        assert out.tobytes() == cur.tobytes()


def test_blosc2_is_called_below_its_two_gigabyte_limit():
    assert segment.MAX_CALL < 2**31 and blosc2.MAX_BUFFERSIZE >= segment.MAX_CALL - 64


@pytest.mark.parametrize("sum_of", [checksum.checksum, checksum.fingerprint], ids=["checksum", "fingerprint"])
@given(data=st.binary(min_size=1, max_size=300), pos=st.integers(0, 10_000), bit=st.integers(0, 7))
def test_the_checksum_and_the_fingerprint_detect_any_single_bit_flip(sum_of, data, pos, bit):
    a = np.frombuffer(data, dtype=np.uint8)
    b = a.copy()
    b[pos % b.size] ^= 1 << bit
    assert sum_of(a) != sum_of(b)


def test_checksum_depends_on_order_and_length():
    a = np.arange(64, dtype=np.uint8)
    swapped = a.copy()
    swapped[[0, 8]] = swapped[[8, 0]]
    assert checksum.checksum(a) != checksum.checksum(swapped)
    assert checksum.checksum(a[:9]) != checksum.checksum(np.concatenate([a[:9], [0]]).astype(np.uint8))
    assert checksum.checksum(np.zeros(0, dtype=np.uint8)) == 0


def test_checksum_splits_at_piece_boundaries_and_moved_pieces_change_it():
    """A buffer's checksum is the same whole, by pieces on a thread pool, and summed part by part (as a restore sums
    each part while it is in cache from a copy); two pieces swapped, or a piece moved, change it."""
    from concurrent.futures import ThreadPoolExecutor

    piece = checksum.PIECE_BYTES
    data = np.random.default_rng(3).integers(0, 256, 9 * piece + 12345, dtype=np.uint8)
    whole = checksum.checksum(data)
    with ThreadPoolExecutor(3) as pool:
        assert checksum.checksum(data, pool.map) == whole
    cuts = [0, 2 * piece, 3 * piece, 7 * piece, data.size]
    parts = sum(checksum.piece_sum(data[a:b], a // piece) for a, b in zip(cuts, cuts[1:]))
    assert checksum.finish(parts, data.size) == whole
    swapped = data.copy()
    swapped[:piece], swapped[piece:2 * piece] = data[piece:2 * piece], data[:piece]
    assert checksum.checksum(swapped) != whole
    assert checksum.checksum(data[piece:]) != checksum.finish(checksum.piece_sum(data[piece:], 1), data.size - piece)
    assert checksum.checksum(bytes(data[:1000])) == checksum.checksum(data[:1000])  # bytes, memoryviews, arrays

