"""The codec's buffers of either kind (ffstate/codec/host.py): a NumPy array in the daemon, a tensor on the training's
side; the same encoding and decoding on both, bit for bit."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ffstate import codec
from ffstate.codec import host


def _bytes(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


@pytest.mark.parametrize("dst_kind", ["numpy", "tensor"])
@pytest.mark.parametrize("src_kind", ["numpy", "tensor"])
def test_copy_into_and_clone_keep_every_byte_and_the_kind(dst_kind, src_kind):
    make = {"numpy": lambda a: a, "tensor": torch.from_numpy}
    src, dst = make[src_kind](_bytes(1001, 1)), make[dst_kind](np.zeros(1001, dtype=np.uint8))
    host.copy_into(dst, src)
    assert type(dst) is type(make[dst_kind](np.zeros(1, dtype=np.uint8)))
    assert np.array_equal(host.array(dst), host.array(src))
    twin = host.clone(src)
    assert type(twin) is type(src) and host.size(twin) == 1001 and np.array_equal(host.array(twin), host.array(src))
    host.array(twin)[0] ^= 0xFF  # a copy: the source keeps its byte
    assert host.array(twin)[0] != host.array(src)[0]


def test_a_daemon_s_arrays_and_a_worker_s_tensors_encode_to_the_same_chunks_and_decode_alike():
    """The daemon encodes NumPy arrays, the tests and the training tensors: one wire format."""
    state = {"w": torch.randn(3000), "b": torch.randn(77).bfloat16(), "n": torch.arange(5)}
    base_state = {k: v.clone() for k, v in state.items()}
    state["w"][::7] += 1e-3
    snap, base = codec.pack(state), codec.pack(base_state)
    as_array = lambda s: codec.Snapshot(s.manifest, s.buffer.numpy().copy(), s.checksum)  # noqa: E731
    for b_t, b_a in ((None, None), (base, as_array(base))):
        packed_t = codec.encode_snapshot(snap, b_t, chunk_bytes=4096)
        packed_a = codec.encode_snapshot(as_array(snap), b_a, chunk_bytes=4096)
        assert [bytes(c.payload) for c in packed_t.chunks] == [bytes(c.payload) for c in packed_a.chunks]
    full = codec.encode_snapshot(snap, chunk_bytes=4096)
    got = codec.decode_snapshot(full, device=None)
    assert isinstance(got.buffer, np.ndarray) and np.array_equal(got.buffer, snap.buffer.numpy())
    assert isinstance(codec.decode_snapshot(full).buffer, torch.Tensor)
    delta = codec.encode_snapshot(snap, base, chunk_bytes=4096)
    held = as_array(base)
    after = codec.decode_snapshot(delta, held, inplace=True)  # a holder's replica, stepped forward in place
    assert after.buffer is held.buffer and np.array_equal(after.buffer, snap.buffer.numpy())
    back = codec.revert_snapshot(delta, after, base.manifest.scalars)  # and back
    assert back.checksum == base.checksum and np.array_equal(back.buffer, base.buffer.numpy())
