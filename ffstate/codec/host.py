"""The codec's byte buffers as the daemon holds them, without torch.

A buffer is a flat ``uint8`` array: a NumPy array on the daemon's side (its slots, its replicas: the daemon never
imports torch, a second and 180 MB a process), a torch tensor on the training's (a pinned host buffer, or a GPU's
staging buffer). The encoding runs on NumPy views of either; these helpers are the few operations the codec and
the daemon need on both kinds.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Union

import numpy as np

if TYPE_CHECKING:
    import torch

Buffer = Union[np.ndarray, "torch.Tensor"]


def array(buf: Buffer) -> np.ndarray:
    """A NumPy view of a host buffer, no copy; a GPU tensor is copied to the host first."""
    if isinstance(buf, np.ndarray):
        return buf
    return buf.detach().cpu().numpy() if buf.is_cuda else buf.detach().numpy()


def size(buf: Buffer) -> int:
    """The buffer's length in bytes."""
    return buf.size if isinstance(buf, np.ndarray) else buf.numel()


def clone(buf: Buffer) -> Buffer:
    """A copy of the buffer, of its kind (on the host for a NumPy array, on its device for a tensor)."""
    return buf.copy() if isinstance(buf, np.ndarray) else buf.detach().clone()


def host_copy(buf: Buffer) -> Buffer:
    """A copy of the buffer on the host, of its kind."""
    return buf.copy() if isinstance(buf, np.ndarray) else buf.detach().cpu().clone()


def writable(buf: Buffer) -> np.ndarray:
    """A NumPy view of a host buffer to write into; a GPU tensor is refused (``array`` would give a copy, and the
    writes would be lost)."""
    if is_cuda(buf):
        raise ValueError(f"a host buffer is needed here (the daemon's); this one is on {buf.device}")
    return array(buf)


def copy_into(dst: Buffer, src: Buffer) -> None:
    """``dst``'s bytes made ``src``'s (same length), on ``dst``'s device."""
    if isinstance(dst, np.ndarray):
        np.copyto(dst, array(src))
    else:  # a tensor: torch is loaded
        import torch

        dst.copy_(torch.from_numpy(src) if isinstance(src, np.ndarray) else src)


def is_cuda(buf: Any) -> bool:
    """Whether the buffer lives on a GPU (a NumPy array never does)."""
    return not isinstance(buf, np.ndarray) and bool(buf.is_cuda)
