"""ffstate/planes.py: the segment format's reference implementation and the checksum."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ffstate import planes
from ffstate.errors import CodecError


@settings(max_examples=200, deadline=None)
@given(data=st.binary(max_size=300), itemsize=st.sampled_from(planes.ITEMSIZES), density=st.floats(0, 1))
def test_segment_roundtrip_any_bytes(data, itemsize, density):
    rng = np.random.default_rng(len(data))
    d = np.frombuffer(data, dtype=np.uint8)[: len(data) // itemsize * itemsize].copy()
    d[rng.random(d.size) > density] = 0
    enc = planes.encode_segment(d, itemsize, 128)
    out = np.zeros_like(d)
    planes.apply_segment(enc, itemsize, 128, out)
    assert out.tobytes() == d.tobytes()


def test_plane_tags_follow_the_cost_rule():
    n = 4096
    d = np.zeros((n, 4), dtype=np.uint8)
    d[:, 0] = 1  # dense plane -> RAW
    d[::20, 1] = 7  # 5% -> SPARSE
    enc = planes.encode_segment(d.reshape(-1), 4, 0)
    tags = [planes.PLANE.unpack_from(enc.tobytes(), planes.SEGMENT.size + planes.PLANE.size * p)[0] for p in range(4)]
    assert tags == [planes.RAW, planes.SPARSE, planes.ZERO, planes.ZERO]
    assert enc.size < n * 4 * 0.45


def test_bitmap_bits_past_the_last_element_are_refused():
    d = np.zeros(13, dtype=np.uint8)
    d[3] = 5
    enc = bytearray(planes.encode_segment(d, 1, 0).tobytes())
    start = planes.SEGMENT.size + planes.PLANE.size
    enc[start + 1] |= 0x80  # element 15 of a 13-element plane
    with pytest.raises(CodecError, match="past element"):
        planes.apply_segment(np.frombuffer(bytes(enc), dtype=np.uint8), 1, 0, np.zeros(13, dtype=np.uint8))


@given(data=st.binary(min_size=1, max_size=200), pos=st.integers(0, 10_000), bit=st.integers(0, 7))
def test_checksum_detects_any_single_bit_flip(data, pos, bit):
    a = np.frombuffer(data, dtype=np.uint8)
    b = a.copy()
    b[pos % b.size] ^= 1 << bit
    assert planes.checksum(a) != planes.checksum(b)


def test_checksum_depends_on_order_and_length():
    a = np.arange(64, dtype=np.uint8)
    swapped = a.copy()
    swapped[[0, 8]] = swapped[[8, 0]]
    assert planes.checksum(a) != planes.checksum(swapped)
    assert planes.checksum(a[:9]) != planes.checksum(np.concatenate([a[:9], [0]]).astype(np.uint8))
    assert planes.checksum(np.zeros(0, dtype=np.uint8)) == 0
