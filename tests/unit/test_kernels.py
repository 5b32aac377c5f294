"""ffstate.kernels: every Triton kernel (gather, scatter, fingerprint) against its reference, bit for bit, on awkward
sizes.

On a machine without a GPU they run under TRITON_INTERPRET=1 on CPU tensors (conftest.py);
with a GPU, natively on CUDA tensors.
"""

import numpy as np
import pytest
import torch

from ffstate import checksum, codec, kernels, layout
from helpers import assert_bitwise_equal, contiguous_bits, cpu_as_device, train_states

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# Around the interpreter's 65536-wide blocks and the GPU's 4096-wide ones; 0 and 1 element.
SIZES = [0, 1, 7, 4095, 4097, 65537]


def rand_bytes(n, density=1.0, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.integers(0, 256, n, dtype=np.uint8)
    x[rng.random(n) >= density] = 0
    return torch.from_numpy(x)


@pytest.mark.parametrize("n", SIZES + [8, 9, 65536 * 8 + 3])
def test_fingerprint_matches_reference(n):
    b = rand_bytes(n, seed=n)
    assert kernels.fingerprint(b.to(DEVICE)) == checksum.fingerprint(b.numpy())


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


@cpu_as_device
def test_codec_through_kernels_produces_the_reference_bytes(monkeypatch):
    s0, s1 = list(train_states(2))
    ref = [codec.encode(s1, chunk_bytes=64 << 10), codec.encode(s1, s0, chunk_bytes=64 << 10)]
    monkeypatch.setenv("FFSTATE_KERNELS", "triton")
    got = [codec.encode(s1, chunk_bytes=64 << 10), codec.encode(s1, s0, chunk_bytes=64 << 10)]
    for r, g in zip(ref, got):
        assert [bytes(c.payload) for c in g.chunks] == [bytes(c.payload) for c in r.chunks]
        assert [c.checksum for c in g.chunks] == [c.checksum for c in r.chunks]
    assert_bitwise_equal(codec.decode(got[1], s0), s1)
