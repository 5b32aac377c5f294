"""Byte-plane encoding of segments on the device (format and oracle: ``ffstate.planes``).

Encode fuses the XOR against the base with the plane split: pass 1 counts the non-zero bytes of
each (segment, plane, block) tile; the host picks each plane's tag (ZERO/SPARSE/RAW) and every
tile's output offset from those counts; pass 2 writes bitmaps, compacted bytes and raw planes.
Decode mirrors it: pass 1 counts the bits of each tile of the bitmaps (so compacted bytes can be
found without a serial scan, and so a malformed bitmap is refused before anything is written),
pass 2 expands the planes and XORs them into the output in place.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch
import triton
import triton.language as tl

from ffstate.errors import CodecError
from ffstate.kernels._launch import block
from ffstate.planes import MAGIC, PLANE, SEGMENT, SPARSE, ZERO, parse_segment, plane_cost


@triton.jit
def _plane_bytes(cur, base, off, n, size, p, b, HAS_BASE: tl.constexpr, BLOCK: tl.constexpr):
    """Byte p of elements [b*BLOCK, (b+1)*BLOCK) of the segment at ``off``, XORed with the base."""
    idx = b * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    m = idx < n
    addr = off + idx * size + p
    v = tl.load(cur + addr, mask=m, other=0)
    if HAS_BASE:
        v = v ^ tl.load(base + addr, mask=m, other=0)
    return v, idx, m


@triton.jit
def _count_kernel(cur, base, job_off, job_n, job_size, job_plane, tile_job, tile_block, counts,
                  HAS_BASE: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0)
    j = tl.load(tile_job + t)
    v, idx, m = _plane_bytes(cur, base, tl.load(job_off + j), tl.load(job_n + j), tl.load(job_size + j),
                             tl.load(job_plane + j), tl.load(tile_block + t).to(tl.int64), HAS_BASE, BLOCK)
    tl.store(counts + t, tl.sum((v != 0).to(tl.int32), axis=0))


@triton.jit
def _compact_kernel(cur, base, job_off, job_n, job_size, job_plane, job_tag, job_start, tile_job, tile_block,
                    tile_vbase, out, HAS_BASE: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0)
    j = tl.load(tile_job + t)
    n = tl.load(job_n + j)
    b = tl.load(tile_block + t).to(tl.int64)
    v, idx, m = _plane_bytes(cur, base, tl.load(job_off + j), n, tl.load(job_size + j), tl.load(job_plane + j),
                             b, HAS_BASE, BLOCK)
    tag = tl.load(job_tag + j)
    start = tl.load(job_start + j)
    if tag == 1:  # RAW
        tl.store(out + start + idx, v, mask=m)
    if tag == 2:  # SPARSE: bitmap byte k holds elements 8k..8k+7, low bit first
        nz = ((v != 0) & m).to(tl.int32)
        weights = 1 << tl.arange(0, 8)
        bitmap = tl.sum(tl.reshape(nz, [BLOCK // 8, 8]) * weights[None, :], axis=1).to(tl.uint8)
        bidx = b * (BLOCK // 8) + tl.arange(0, BLOCK // 8).to(tl.int64)
        tl.store(out + start + bidx, bitmap, mask=bidx < (n + 7) // 8)
        pos = tl.cumsum(nz, axis=0) - nz
        tl.store(out + tl.load(tile_vbase + t) + pos, v, mask=nz != 0)


@triton.jit
def _popcount_kernel(pay, job_n, job_start, tile_job, tile_block, counts, BLOCK: tl.constexpr):
    t = tl.program_id(0)
    j = tl.load(tile_job + t)
    idx = tl.load(tile_block + t).to(tl.int64) * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    m = idx < tl.load(job_n + j)
    byte = tl.load(pay + tl.load(job_start + j) + idx // 8, mask=m, other=0)
    bit = (byte >> (idx % 8).to(tl.uint8)) & 1
    tl.store(counts + t, tl.sum(bit.to(tl.int32), axis=0))


@triton.jit
def _apply_kernel(pay, job_off, job_n, job_size, job_plane, job_tag, job_start, tile_job, tile_block, tile_vbase,
                  out, BLOCK: tl.constexpr):
    t = tl.program_id(0)
    j = tl.load(tile_job + t)
    idx = tl.load(tile_block + t).to(tl.int64) * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    m = idx < tl.load(job_n + j)
    start = tl.load(job_start + j)
    if tl.load(job_tag + j) == 1:  # RAW
        v = tl.load(pay + start + idx, mask=m, other=0)
    else:  # SPARSE
        byte = tl.load(pay + start + idx // 8, mask=m, other=0)
        bit = ((byte >> (idx % 8).to(tl.uint8)) & 1).to(tl.int32)
        pos = tl.cumsum(bit, axis=0) - bit
        v = tl.load(pay + tl.load(tile_vbase + t) + pos, mask=m & (bit != 0), other=0)
    addr = tl.load(job_off + j) + idx * tl.load(job_size + j) + tl.load(job_plane + j)
    tl.store(out + addr, tl.load(out + addr, mask=m) ^ v, mask=m)


# 4096 bytes of one plane per program: bitmaps of 512 bytes, and an in-block scan that stays in registers.
def _block() -> int:
    return block(4096)


def _tiles(job_n: np.ndarray, bl: int) -> tuple[np.ndarray, np.ndarray]:
    blocks = (job_n + bl - 1) // bl
    tile_job = np.repeat(np.arange(job_n.size), blocks)
    starts = np.cumsum(blocks) - blocks
    tile_block = np.arange(int(blocks.sum())) - np.repeat(starts, blocks)
    return tile_job, tile_block


def _dev(device: torch.device, *arrays: np.ndarray) -> list[torch.Tensor]:
    return [torch.from_numpy(np.ascontiguousarray(a)).to(device) for a in arrays]


def encode_segments(cur: torch.Tensor, segs: Sequence[tuple[int, int, int]], base: torch.Tensor | None = None
                    ) -> list[np.ndarray]:
    """Encodes each (byte offset, element count, itemsize) segment of ``cur`` XOR ``base``.

    Returns one host array per segment, byte-identical to ``ffstate.planes.encode_segment``.
    """
    if not segs:
        return []
    bl, dev = _block(), cur.device
    seg = np.array(segs, dtype=np.int64).reshape(-1, 3)
    seg_of_job = np.repeat(np.arange(len(segs)), seg[:, 2])
    job_off, job_n, job_size = seg[seg_of_job, 0], seg[seg_of_job, 1], seg[seg_of_job, 2]
    job_plane = np.arange(job_off.size) - np.repeat(np.cumsum(seg[:, 2]) - seg[:, 2], seg[:, 2])
    tile_job, tile_block = _tiles(job_n, bl)
    d_job = _dev(dev, job_off, job_n, job_size, job_plane)
    d_tile = _dev(dev, tile_job.astype(np.int32), tile_block.astype(np.int32))
    has_base = base is not None
    base_arg = base if has_base else cur
    counts = torch.empty(tile_job.size, dtype=torch.int32, device=dev)
    if tile_job.size:
        _count_kernel[(tile_job.size,)](cur, base_arg, *d_job, *d_tile, counts, HAS_BASE=has_base, BLOCK=bl)
    counts_h = counts.cpu().numpy().astype(np.int64)
    nnz = np.zeros(job_off.size, dtype=np.int64)
    np.add.at(nnz, tile_job, counts_h)
    tags, lengths = np.zeros_like(nnz), np.zeros_like(nnz)
    for j in range(nnz.size):
        tags[j], lengths[j] = plane_cost(int(job_n[j]), int(nnz[j]))
    # Output: per segment, its header and plane table, then its planes in order.
    first_job = np.cumsum(seg[:, 2]) - seg[:, 2]
    head = SEGMENT.size + PLANE.size * seg[:, 2]
    seg_len = head + np.add.reduceat(lengths, first_job)
    seg_start = np.cumsum(seg_len) - seg_len
    excl_len = np.cumsum(lengths) - lengths
    job_start = (seg_start + head)[seg_of_job] + excl_len - excl_len[first_job][seg_of_job]
    excl = np.cumsum(counts_h) - counts_h
    first_tile = np.searchsorted(tile_job, np.arange(job_off.size))
    tile_vbase = job_start[tile_job] + (job_n[tile_job] + 7) // 8 + excl - excl[first_tile[tile_job]]
    out = torch.empty(int(seg_len.sum()), dtype=torch.uint8, device=dev)
    if tile_job.size:
        _compact_kernel[(tile_job.size,)](
            cur, base_arg, *d_job, *_dev(dev, tags.astype(np.int32), job_start), *d_tile, *_dev(dev, tile_vbase), out,
            HAS_BASE=has_base, BLOCK=bl,
        )
    host = out.cpu().numpy()
    result = []
    for s in range(len(segs)):
        jobs = range(first_job[s], first_job[s] + seg[s, 2])
        table = b"".join(PLANE.pack(int(tags[j]), int(lengths[j])) for j in jobs)
        hdr = SEGMENT.pack(MAGIC, int(seg[s, 2]), int(seg[s, 0]), int(seg[s, 1])) + table
        view = host[seg_start[s] : seg_start[s] + seg_len[s]]
        view[: len(hdr)] = np.frombuffer(hdr, dtype=np.uint8)
        result.append(view)
    return result


def apply_segments(payloads: Sequence[np.ndarray], segs: Sequence[tuple[int, int, int]], out: torch.Tensor) -> None:
    """XORs each encoded segment into ``out`` (a device buffer holding the base, or zeros), in place.

    Every header, plane table and bitmap is validated before anything is written (CodecError).
    """
    if not segs:
        return
    bl, dev = _block(), out.device
    jobs = []  # (out offset, n, itemsize, plane, tag, payload start)
    pos = 0
    for payload, (off, n, size) in zip(payloads, segs):
        for p, (tag, start, length) in enumerate(parse_segment(payload, size, off, n)):
            if tag == SPARSE and n % 8 and payload[start + (n + 7) // 8 - 1] >> (n % 8):
                raise CodecError(f"segment at byte {off}, plane {p}: bitmap has bits past element {n}")
            if tag != ZERO:
                jobs.append((off, n, size, p, tag, pos + start, length))
        pos += payload.size
    if not jobs:
        return
    pay = torch.from_numpy(np.concatenate([np.asarray(x) for x in payloads])).to(dev)
    job = np.array(jobs, dtype=np.int64)
    job_n, job_tag, job_start, job_len = job[:, 1], job[:, 4], job[:, 5], job[:, 6]
    tile_job, tile_block = _tiles(job_n, bl)
    d_tile = _dev(dev, tile_job.astype(np.int32), tile_block.astype(np.int32))
    counts = torch.zeros(tile_job.size, dtype=torch.int32, device=dev)
    sparse_tiles = job_tag[tile_job] == SPARSE
    if sparse_tiles.any():
        _popcount_kernel[(tile_job.size,)](pay, *_dev(dev, job_n, job_start), *d_tile, counts, BLOCK=bl)
    counts_h = np.where(sparse_tiles, counts.cpu().numpy(), 0).astype(np.int64)
    marked = np.zeros(job_n.size, dtype=np.int64)
    np.add.at(marked, tile_job, counts_h)
    for j in np.flatnonzero(job_tag == SPARSE):
        values = job_len[j] - (job_n[j] + 7) // 8
        if marked[j] != values:
            raise CodecError(
                f"segment at byte {job[j, 0]}, plane {job[j, 3]}: bitmap marks {marked[j]} bytes, {values} follow"
            )
    excl = np.cumsum(counts_h) - counts_h
    first_tile = np.searchsorted(tile_job, np.arange(job_n.size))
    tile_vbase = job_start[tile_job] + (job_n[tile_job] + 7) // 8 + excl - excl[first_tile[tile_job]]
    _apply_kernel[(tile_job.size,)](
        pay, *_dev(dev, job[:, 0], job_n, job[:, 2], job[:, 3], job_tag.astype(np.int32), job_start), *d_tile,
        *_dev(dev, tile_vbase), out, BLOCK=bl,
    )
