"""Bitwise comparison of nested states, and the small training jobs the tests replay.

Every tensor is compared by its bit pattern (``torch.equal`` on a uint8 view), so -0.0 vs 0.0 and
NaN payloads count as differences; dtype, shape, device and container types must match too.
"""

from __future__ import annotations

import collections
import random
import struct
from typing import Any

import numpy as np
import torch

from ffstate.models import TinyGPT


def bits(t: torch.Tensor) -> torch.Tensor:
    """The bytes of a tensor as a flat uint8 tensor (on CPU)."""
    t = t.detach().cpu()
    if t.dtype == torch.bool:  # a bool copy normalises bytes to 0/1; compare the bytes as stored
        t = t.view(torch.uint8)
    t = t.contiguous()
    return t.reshape(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)


def contiguous_bits(t: torch.Tensor) -> torch.Tensor:
    """A contiguous copy with every byte as stored (``.contiguous()`` normalises bool bytes to 0/1)."""
    out = torch.empty(t.shape, dtype=t.dtype, device=t.device)
    if t.dtype == torch.bool:
        out.view(torch.uint8).copy_(t.view(torch.uint8))
    else:
        out.copy_(t)
    return out


def assert_bitwise_equal(got: Any, want: Any, path: str = "") -> None:
    """Raises AssertionError naming the first path where ``got`` and ``want`` differ in any bit or type."""
    where = path or "<root>"
    assert type(got) is type(want), f"{where}: type {type(got).__name__} != {type(want).__name__}"
    if isinstance(want, torch.Tensor):
        assert got.dtype == want.dtype, f"{where}: dtype {got.dtype} != {want.dtype}"
        assert got.shape == want.shape, f"{where}: shape {tuple(got.shape)} != {tuple(want.shape)}"
        assert got.device == want.device, f"{where}: device {got.device} != {want.device}"
        assert got.requires_grad == want.requires_grad, f"{where}: requires_grad differs"
        assert torch.equal(bits(got), bits(want)), f"{where}: bits differ"
    elif isinstance(want, np.ndarray):
        assert got.dtype == want.dtype and got.shape == want.shape, f"{where}: {got.dtype}{got.shape} != {want.dtype}{want.shape}"
        assert got.tobytes() == want.tobytes(), f"{where}: bits differ"
    elif isinstance(want, dict):
        assert list(got.keys()) == list(want.keys()), f"{where}: keys {list(got)[:5]} != {list(want)[:5]}"
        for k in want:
            assert type(k) is type(next(kk for kk in got if kk == k)), f"{where}: key {k!r} type differs"
            assert_bitwise_equal(got[k], want[k], f"{path}/{k}")
        if isinstance(want, collections.OrderedDict):
            assert getattr(got, "_metadata", None) == getattr(want, "_metadata", None), f"{where}: _metadata differs"
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), f"{where}: length {len(got)} != {len(want)}"
        for i, (g, w) in enumerate(zip(got, want)):
            assert_bitwise_equal(g, w, f"{path}/{i}")
    elif isinstance(want, float):
        assert struct.pack("<d", got) == struct.pack("<d", want), f"{where}: {got!r} != {want!r} (bitwise)"
    elif isinstance(want, np.generic):
        assert got.dtype == want.dtype and got.tobytes() == want.tobytes(), f"{where}: {got!r} != {want!r}"
    else:
        assert got == want, f"{where}: {got!r} != {want!r}"


def train_states(steps: int, seed: int = 0, **model_kw: Any):
    """Trains TinyGPT with AdamW + a cosine schedule and yields the full training state after each step.

    The state holds model, optimizer, scheduler, the three RNG states and a data-loader position,
    i.e. what a trainer snapshots. Yielded states are deep copies (safe to keep).
    """
    import copy

    torch.manual_seed(seed)
    np.random.seed(seed)
    random.seed(seed)
    model = TinyGPT(**model_kw)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=max(1, steps))
    vocab = model.tok.num_embeddings
    for step in range(steps):
        loss = model.loss(torch.randint(0, vocab, (8, model.seq + 1)))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        random.random()
        np.random.rand()
        yield copy.deepcopy(
            {
                "model": model.state_dict(),
                "optim": opt.state_dict(),
                "sched": sched.state_dict(),
                "rng": {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()},
                "extra": {"step": step + 1, "loss": loss.item(), "loader": {"epoch": 0, "offset": (step + 1) * 8}},
            }
        )
