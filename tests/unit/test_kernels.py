"""ffstate.kernels: every Triton kernel against its reference, bit for bit, on awkward sizes.

On a machine without a GPU they run under TRITON_INTERPRET=1 on CPU tensors (conftest.py);
with a GPU, natively on CUDA tensors.
"""

import numpy as np
import pytest
import torch

from ffstate import codec, kernels, layout, planes
from ffstate.errors import CodecError
from helpers import assert_bitwise_equal, contiguous_bits, train_states

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# Around the interpreter's 65536-wide blocks and the GPU's 4096-wide ones; 0 and 1 element.
SIZES = [0, 1, 7, 4095, 4097, 65537]


def rand_bytes(n, density=1.0, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.integers(0, 256, n, dtype=np.uint8)
    x[rng.random(n) >= density] = 0
    return torch.from_numpy(x)


@pytest.mark.parametrize("n", SIZES + [8, 9, 65536 * 8 + 3])
def test_checksum_matches_reference(n):
    b = rand_bytes(n, seed=n)
    assert kernels.checksum(b.to(DEVICE)) == planes.checksum(b.numpy())


@pytest.mark.parametrize("itemsize", planes.ITEMSIZES)
@pytest.mark.parametrize("with_base", [False, True], ids=["full", "delta"])
def test_encode_segments_matches_reference(itemsize, with_base):
    # Several segments of awkward sizes in one call; per-plane densities from all-zero to dense.
    counts = [n for n in SIZES if n * itemsize <= 300_000]
    segs, off = [], 0
    for n in counts:
        segs.append((off, n, itemsize))
        off += n * itemsize
    cur = rand_bytes(off, seed=itemsize)
    delta = rand_bytes(off, density=0.07, seed=itemsize + 1)
    delta.view(-1)[: off // 2] = 0  # some planes entirely unchanged
    base = torch.from_numpy(cur.numpy() ^ delta.numpy()) if with_base else None
    got = kernels.encode_segments(cur.to(DEVICE), segs, None if base is None else base.to(DEVICE))
    d = delta.numpy() if with_base else cur.numpy()
    for (o, n, s), g in zip(segs, got):
        want = planes.encode_segment(d[o : o + n * s], s, o)
        assert np.array_equal(np.asarray(g), want), f"segment at {o}: {n} x {s}"


@pytest.mark.parametrize("itemsize", [1, 2, 4, 8])
@pytest.mark.parametrize("density", [0.0, 0.03, 0.5, 1.0])
def test_apply_segments_inverts_reference_encoding(itemsize, density):
    n = 4097
    cur = rand_bytes(n * itemsize, seed=3)
    base = torch.from_numpy(cur.numpy() ^ rand_bytes(n * itemsize, density=density, seed=4).numpy())
    segs = [(0, 2048, itemsize), (2048 * itemsize, n - 2048, itemsize)]
    d = cur.numpy() ^ base.numpy()
    payloads = [planes.encode_segment(d[o : o + k * s], s, o) for o, k, s in segs]
    out = base.clone().to(DEVICE)
    kernels.apply_segments(payloads, segs, out)
    assert torch.equal(out.cpu(), cur)


def test_apply_segments_refuses_a_bad_bitmap_before_writing():
    n = 4096
    d = rand_bytes(n, density=0.05, seed=5).numpy()
    enc = bytearray(planes.encode_segment(d, 1, 0).tobytes())
    start = planes.SEGMENT.size + planes.PLANE.size
    enc[start] ^= 0x01 if not enc[start] & 1 else 0x02  # the bitmap now marks one byte more or fewer
    out = torch.zeros(n, dtype=torch.uint8, device=DEVICE)
    with pytest.raises(CodecError, match="bitmap marks"):
        kernels.apply_segments([np.frombuffer(bytes(enc), dtype=np.uint8)], [(0, n, 1)], out)
    assert not out.any()


def mixed_state():
    g = torch.Generator().manual_seed(0)
    big = torch.randn(300, 301, generator=g)
    return {
        "big": big,
        "t": big[:, :7].t(),  # non-contiguous: torch copy fallback
        "empty": torch.empty(0, 3),
        "scalar": torch.tensor(3, dtype=torch.int64),
        "bf16": torch.randn(4097, generator=g).to(torch.bfloat16),
        "bool": torch.rand(77, generator=g) > 0.5,
        "c64": torch.randn(5, dtype=torch.complex64, generator=g),
        "np": np.arange(10, dtype=np.uint32),
        "lr": 0.5,
    }


def test_gather_and_scatter_match_reference():
    state = mixed_state()
    ref = codec.pack(state)
    manifest, arrays = layout.analyze(state)
    dev_arrays = [a.to(DEVICE) if isinstance(a, torch.Tensor) else a for a in arrays]
    out = layout.alloc_buffer(manifest, device=DEVICE)
    kernels.gather(list(layout.iter_placed(manifest, dev_arrays)), out)
    assert torch.equal(out.cpu(), ref.buffer)
    live = [torch.zeros_like(a, device=DEVICE) if isinstance(a, torch.Tensor) else a for a in arrays]
    kernels.scatter(ref.buffer, [(s, a) for s, a in layout.iter_placed(manifest, live) if isinstance(a, torch.Tensor)])
    for spec, got, want in zip(manifest.tensors, live, arrays):
        if isinstance(want, torch.Tensor):
            assert torch.equal(got.cpu().reshape(-1).view(torch.uint8) if got.numel() else got.cpu(),
                               contiguous_bits(want).reshape(-1).view(torch.uint8) if want.numel() else want), spec.name


def test_codec_through_kernels_produces_the_reference_bytes(monkeypatch):
    s0, s1 = list(train_states(2))
    ref = [codec.encode(s1, chunk_bytes=64 << 10), codec.encode(s1, s0, chunk_bytes=64 << 10)]
    monkeypatch.setenv("FFSTATE_KERNELS", "triton")
    got = [codec.encode(s1, chunk_bytes=64 << 10), codec.encode(s1, s0, chunk_bytes=64 << 10)]
    for r, g in zip(ref, got):
        assert [bytes(c.payload) for c in g.chunks] == [bytes(c.payload) for c in r.chunks]
        assert [c.checksum for c in g.chunks] == [c.checksum for c in r.chunks]
    assert_bitwise_equal(codec.decode(got[1], s0), s1)
