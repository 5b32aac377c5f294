"""The one bitwise comparison of nested training states, used by the tests, the demo and the benchmarks.

Every tensor is compared by its bit pattern (``torch.equal`` on a uint8 view), so -0.0 vs 0.0 and NaN
payloads count as differences; dtype, shape, device, ``requires_grad`` and container types must match
too, dict keys in the same order and of the same types, floats by their 8 bytes (docs/design.md I1).
"""

from __future__ import annotations

import collections
import struct
from pathlib import Path
from typing import Any

import numpy as np
import torch


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


def differences(got: Any, want: Any, path: str = "") -> list[str]:
    """Every place where ``got`` and ``want`` differ in any bit or type, as '<path>: what differs' (empty: equal)."""
    where = path or "<root>"
    if type(got) is not type(want):
        return [f"{where}: type {type(got).__name__} != {type(want).__name__}"]
    if isinstance(want, torch.Tensor):
        for what, a, b in (("dtype", got.dtype, want.dtype), ("shape", tuple(got.shape), tuple(want.shape)),
                           ("device", got.device, want.device)):
            if a != b:
                return [f"{where}: {what} {a} != {b}"]
        if got.requires_grad != want.requires_grad:
            return [f"{where}: requires_grad differs"]
        return [] if torch.equal(bits(got), bits(want)) else [f"{where}: bits differ"]
    if isinstance(want, np.ndarray):
        if got.dtype != want.dtype or got.shape != want.shape:
            return [f"{where}: {got.dtype}{got.shape} != {want.dtype}{want.shape}"]
        return [] if got.tobytes() == want.tobytes() else [f"{where}: bits differ"]
    if isinstance(want, dict):
        if list(got.keys()) != list(want.keys()):
            return [f"{where}: keys {list(got)[:5]} != {list(want)[:5]}"]
        out = [f"{where}: key {k!r} type differs" for k in want if type(k) is not type(next(kk for kk in got if kk == k))]
        for k in want:
            out += differences(got[k], want[k], f"{path}/{k}")
        if isinstance(want, collections.OrderedDict) and getattr(got, "_metadata", None) != getattr(want, "_metadata", None):
            out.append(f"{where}: _metadata differs")
        return out
    if isinstance(want, (list, tuple)):
        if len(got) != len(want):
            return [f"{where}: length {len(got)} != {len(want)}"]
        return [d for i, (g, w) in enumerate(zip(got, want)) for d in differences(g, w, f"{path}/{i}")]
    if isinstance(want, float):
        return [] if struct.pack("<d", got) == struct.pack("<d", want) else [f"{where}: {got!r} != {want!r} (bitwise)"]
    if isinstance(want, np.generic):
        same = got.dtype == want.dtype and got.tobytes() == want.tobytes()
        return [] if same else [f"{where}: {got!r} != {want!r}"]
    return [] if got == want else [f"{where}: {got!r} != {want!r}"]


def assert_bitwise_equal(got: Any, want: Any, path: str = "") -> None:
    """Raises AssertionError naming the first path where ``got`` and ``want`` differ in any bit or type."""
    diffs = differences(got, want, path)
    assert not diffs, diffs[0] + (f" (and {len(diffs) - 1} more)" if len(diffs) > 1 else "")


def compare_runs(a: Path, b: Path, world: int) -> list[str]:
    """Every difference between two runs' final states (``final-rank{r}.pt`` in each folder), per rank."""
    diffs = []
    for r in range(world):
        x = torch.load(a / f"final-rank{r}.pt", weights_only=True)
        y = torch.load(b / f"final-rank{r}.pt", weights_only=True)
        diffs += [f"rank {r}: {d}" for d in differences(x, y)]
    return diffs


def drop_compared(*folders: Path) -> int:
    """Removes the runs' final states (``final-rank{r}.pt``) once ``compare_runs`` found them equal: the logs beside
    them stay (kilobytes), the states (megabytes a rank) would pile up in the temporary folder run after run. A
    folder left empty goes too (a reference run's logs sit beside it). Returns the bytes freed."""
    freed = 0
    for folder in folders:
        for p in folder.glob("final-rank*.pt"):
            freed += p.stat().st_size
            p.unlink()
        if not any(folder.iterdir()):
            folder.rmdir()
    return freed
