"""A state's bytes in and out of the flat buffer: zeroed buffers, views of one tensor's bytes, bit-keeping
copies, and new leaves filled from a buffer and put back into the state's nesting."""

from __future__ import annotations

from typing import Any, Iterator, Sequence

import numpy as np
import torch

from ffstate.layout.gc import gc_paused
from ffstate.layout.host import empty_array
from ffstate.layout.dtypes import DTYPES
from ffstate.layout.manifest import Manifest, TensorSpec
from ffstate.layout.tree import unflatten


def alloc_buffer(manifest: Manifest, device: str | torch.device = "cpu", pin_memory: bool = False) -> torch.Tensor:
    """A zeroed uint8 buffer of the manifest's size (padding must be zero: the checksum covers it)."""
    return torch.zeros(manifest.nbytes, dtype=torch.uint8, device=device, pin_memory=pin_memory)


def empty_buffer(nbytes: int) -> torch.Tensor:
    """An uninitialised uint8 buffer for a decoded version (``host.empty_array``: a large one in huge pages)."""
    return torch.from_numpy(empty_array(nbytes))


def tensor_view(buf: torch.Tensor, spec: TensorSpec) -> torch.Tensor:
    """The bytes of one tensor in ``buf`` viewed as that tensor (no copy)."""
    raw = buf[spec.offset : spec.offset + spec.nbytes]
    if spec.kind == "ndarray":
        return raw
    return raw.view(DTYPES[spec.dtype]).view(spec.shape)


def copy_bits(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)`` that keeps every bit: bools go as bytes (a bool copy may normalise them to 0/1)."""
    with torch.no_grad():
        if src.dtype == torch.bool:
            dst.view(torch.uint8).copy_(src.detach().view(torch.uint8))
        else:
            dst.copy_(src.detach())


def array_bytes(a: Any) -> torch.Tensor:
    """A numpy array's bytes as a flat uint8 tensor."""
    return torch.from_numpy(np.ascontiguousarray(a).reshape(-1).view(np.uint8))


def iter_placed(manifest: Manifest, arrays: Sequence[Any]) -> Iterator[tuple[TensorSpec, Any]]:
    for spec, a in zip(manifest.tensors, arrays):
        if spec.nbytes:
            yield spec, a


@gc_paused()
def materialize(manifest: Manifest, buf: torch.Tensor, map_location: Any = None) -> Any:
    """The state held by ``buf``, as new tensors (on their recorded device, or ``map_location``).

    Each tensor gets its own storage: some consumers ignore a view's storage offset
    (``torch.set_rng_state`` does), and one tensor kept alive should not pin the whole buffer.
    """
    leaves = empty_leaves(manifest, map_location)
    for spec, leaf in zip(manifest.tensors, leaves):
        if spec.nbytes and not (isinstance(leaf, torch.Tensor) and leaf.is_meta):
            leaf_bytes(leaf).copy_(buf[spec.offset : spec.offset + spec.nbytes])
    return finish_leaves(manifest, leaves)


def empty_leaves(manifest: Manifest, map_location: Any = None) -> list[Any]:
    """New, uninitialised leaves for the manifest's tensors: tensors on their recorded device, or ``map_location``'s
    (one device for all, or a function of the recorded device's name, e.g. ``"cuda:5"``, giving the one to use),
    numpy arrays; ``leaf_bytes`` gives the bytes to fill, ``finish_leaves`` the state."""
    leaves: list[Any] = []
    for spec in manifest.tensors:
        if spec.kind == "ndarray":
            leaves.append(np.empty(spec.shape, dtype=np.dtype(spec.np_dtype)))
        else:
            leaves.append(torch.empty(spec.shape, dtype=DTYPES[spec.dtype], device=placed(spec.device, map_location)))
    return leaves


def placed(device: str, map_location: Any = None) -> torch.device:
    """Where a tensor recorded on ``device`` goes under ``map_location`` (see ``empty_leaves``)."""
    if map_location is None:
        return torch.device(device)
    return torch.device(map_location(device) if callable(map_location) else map_location)


def leaf_bytes(leaf: Any) -> torch.Tensor:
    """The bytes of a leaf from ``empty_leaves`` as a flat uint8 tensor (a view: writing it fills the leaf)."""
    if isinstance(leaf, np.ndarray):
        return torch.from_numpy(leaf.reshape(-1).view(np.uint8))
    return leaf.reshape(-1).view(torch.uint8)


def finish_leaves(manifest: Manifest, leaves: list[Any]) -> Any:
    """The nested state from filled leaves: parameters wrapped, gradients required as recorded."""
    out = []
    for spec, leaf in zip(manifest.tensors, leaves):
        if spec.kind == "param":
            leaf = torch.nn.Parameter(leaf, requires_grad=spec.requires_grad)
        elif spec.kind != "ndarray" and spec.requires_grad:
            leaf.requires_grad_(True)
        out.append(leaf)
    return unflatten(manifest, out)
