"""Gather many tensors into one flat buffer (capture) and scatter it back into live tensors (restore).

One launch moves every tensor: a table gives each tensor's address, its offset in the buffer and
its size, and a tile table splits tensors into blocks.
"""

from __future__ import annotations

import threading
from typing import Any, Sequence

import torch
import triton
import triton.language as tl

from ffstate.kernels._launch import block, device_of


@triton.jit
def _copy_tiles_kernel(addr, offset, nbytes, tile_tensor, tile_block, buf, TO_BUFFER: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0)
    i = tl.load(tile_tensor + t)
    b = tl.load(tile_block + t).to(tl.int64)
    ptr = tl.load(addr + i).to(tl.pointer_type(tl.uint8))
    off = tl.load(offset + i)
    n = tl.load(nbytes + i)
    idx = b * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    m = idx < n
    if TO_BUFFER:
        tl.store(buf + off + idx, tl.load(ptr + idx, mask=m), mask=m)
    else:
        tl.store(ptr + idx, tl.load(buf + off + idx, mask=m), mask=m)


_TABLES: dict[tuple, tuple[tuple, list[torch.Tensor]]] = {}  # a gather's tables, per device and stream
_LAUNCH = threading.Lock()  # Triton's first compile and launch of a kernel is not safe from several threads at once


def _tables(dev: torch.device, pairs: Sequence[tuple[int, int, int]], bl: int, keep: bool) -> list[torch.Tensor]:
    """The launch's tables on ``dev``: the tensors' addresses, offsets and sizes (int64), and each program's tensor
    and block (int32). They go to a GPU from pinned memory, without blocking the host (a pageable copy waits for
    the stream: for the whole step the training queued before a commit). ``keep``: a gather, which moves the
    same tensors at every commit, keeps them for the next one with the same tensors (on the same stream: it is
    ordered after the copy that filled them); a restore's are used once."""
    stream = torch.cuda.current_stream(dev) if dev.type == "cuda" else None
    key = (dev, stream)
    ident = tuple(pairs)
    cached = _TABLES.get(key) if keep else None
    if cached is not None and cached[0] == ident:
        return cached[1]
    nbytes = torch.tensor([p[2] for p in pairs], dtype=torch.int64)
    blocks = (nbytes + bl - 1) // bl
    tile_tensor = torch.repeat_interleave(torch.arange(len(pairs), dtype=torch.int32), blocks)
    starts = torch.cumsum(blocks, 0) - blocks
    tile_block = (torch.arange(int(blocks.sum())) - torch.repeat_interleave(starts, blocks)).to(torch.int32)
    wide = torch.tensor([p[0] for p in pairs] + [p[1] for p in pairs], dtype=torch.int64)  # addresses, then offsets
    host = [torch.cat([wide, nbytes]), torch.cat([tile_tensor, tile_block])]
    if dev.type == "cuda":
        host = [h.pin_memory() for h in host]
    n, t = len(pairs), tile_tensor.numel()
    wide_d, tiles_d = (h.to(dev, non_blocking=True) for h in host)
    out = [wide_d[:n], wide_d[n : 2 * n], wide_d[2 * n :], tiles_d[:t], tiles_d[t:]]
    if keep:
        _TABLES[key] = (ident, out)
    return out


def _launch(buf: torch.Tensor, pairs: Sequence[tuple[int, int, int]], to_buffer: bool) -> None:
    if not pairs:
        return
    # 4096 bytes per program: a tensor smaller than that is one program; large ones spread over all SMs.
    bl = block(4096)
    # Triton launches on the current device's current stream: the tensors' device made current, or a process that
    # never called set_device (a model moved to cuda:1) would run the kernel in another device's context.
    with device_of(buf):
        args = _tables(buf.device, pairs, bl, keep=to_buffer)
        with _LAUNCH:
            _copy_tiles_kernel[(args[3].numel(),)](*args, buf, TO_BUFFER=to_buffer, BLOCK=bl)


def _split(buf: torch.Tensor, placed: Sequence[tuple[Any, Any]]):
    """(address, offset, nbytes) for tensors the kernel can move; the rest for a torch copy."""
    fast, slow = [], []
    for spec, t in placed:
        if isinstance(t, torch.Tensor) and t.device == buf.device and t.is_contiguous() and t.data_ptr() != 0:
            fast.append((t.data_ptr(), spec.offset, spec.nbytes))
        else:
            slow.append((spec, t))
    return fast, slow


def gather(placed: Sequence[tuple[Any, Any]], out: torch.Tensor) -> None:
    """Copies each (spec, tensor) into ``out[spec.offset:][:spec.nbytes]`` in one launch.

    Non-contiguous tensors, tensors on another device and numpy arrays take a torch copy.
    """
    from ffstate import layout

    fast, slow = _split(out, placed)
    _launch(out, fast, to_buffer=True)
    for spec, a in slow:
        if spec.kind == "ndarray":
            out[spec.offset : spec.offset + spec.nbytes].copy_(layout.array_bytes(a))
        else:
            layout.copy_bits(layout.tensor_view(out, spec), a)


def scatter(buf: torch.Tensor, placed: Sequence[tuple[Any, torch.Tensor]]) -> None:
    """Copies the bytes of each spec out of ``buf`` into its live tensor, in place, in one launch.

    ``buf`` may be on the host: it is copied to the tensors' device once first.
    """
    from ffstate import layout

    if not placed:
        return
    device = placed[0][1].device
    if buf.device != device:
        buf = buf.to(device, non_blocking=True)
    fast, slow = _split(buf, placed)
    _launch(buf, fast, to_buffer=False)
    for spec, t in slow:
        layout.copy_bits(t, layout.tensor_view(buf, spec))
