"""A full version decoded while it streams in (a restore from remote holders): chunks in any order, from
several threads, each verified and applied as it arrives; the result verified end to end. Or only some of its
tensors (``want``): the header first, then just the segments that hold them (``needed``)."""

from __future__ import annotations

import bisect
import json
import threading
from dataclasses import replace
from typing import Any, Callable

import numpy as np
import torch

from ffstate import layout
from ffstate.codec.segment import apply_segment
from ffstate.codec.backend import _pool, buffer_checksum
from ffstate.codec.chunks import Chunk, Snapshot, _parse_header, _verify_chunk, segment_count, segments
from ffstate.codec.packing import TASK_BYTES, Unpacking
from ffstate.errors import CodecError
from ffstate.layout import Manifest


class Decoder:
    """Decodes a full version while it arrives: chunks in any order, from several threads.

    Each segment chunk is verified and applied on the codec's thread pool as soon as it and the
    header are in, so decoding overlaps the transfer; chunks that come before the header wait for
    it. ``add`` every chunk (a repeat of an index already added is ignored: a retried stream may
    resend some), then ``finish`` for the snapshot, verified end to end like ``decode_snapshot``'s.
    ``max_nbytes`` bounds the buffer the header may ask for; ``map_location`` places the tensors
    (``layout.empty_leaves``: a rank's peers' shards go to the CPU, not onto the devices their ranks recorded).

    With ``want`` (a test on tensor names, e.g. ``razor/part/...``), only the tensors it accepts are
    decoded: once the header is in, ``needed`` lists the chunks that hold them (the header and the
    segments overlapping their bytes; other chunks are ignored), and ``state`` gives the whole
    structure with those tensors filled and every other tensor on the ``meta`` device (no memory).
    The version's end-to-end checksum needs every byte, so a part is verified chunk by chunk (each
    chunk's checksum, each segment's place and size) and by the version it was asked for.

    Raises (from ``add`` or ``finish``):
        CodecError: a chunk is corrupted, foreign, out of range or missing; the header is malformed
            or a delta's; or the decoded buffer does not match the version's checksum.
    """

    def __init__(self, max_nbytes: int | None = None, want: Callable[[str], bool] | None = None,
                 map_location: Any = None):
        self._max_nbytes = max_nbytes
        self._map_location = map_location
        self._want = want
        self.needed: list[int] | None = None  # with ``want``: the chunks to fetch, once the header is in
        self._lock = threading.Lock()
        self._seen: set[int] = set()
        self._early: list[Chunk] = []  # before the header
        self._futures: list = []
        self._count: int | None = None
        self.header: dict | None = None
        self._segments: list[tuple[int, int, int]] = []
        self._manifest: Manifest | None = None
        self._out: torch.Tensor | None = None
        self._needed: set[int] | None = None
        self._unpacking: Unpacking | None = None  # a whole version's copy-out, run as its segments land
        self._deps: list[int] = []  # per task of it: segments under its bytes still to land
        self._seg_tasks: list[list[int]] = []  # per segment: the tasks whose bytes it holds
        self._tasks: list = []  # the futures of the tasks started

    def add(self, chunk: Chunk) -> None:
        with self._lock:
            if chunk.index in self._seen:
                return
            if self._count is not None:
                self._check_place(chunk)
                if self._needed is not None and chunk.index not in self._needed:
                    return  # a chunk a part does not need (a daemon that ignored the request's list)
            self._seen.add(chunk.index)
            if chunk.index != 0:
                if self.header is None:
                    self._early.append(chunk)
                else:
                    self._futures.append(_pool().submit(self._apply, chunk))
                return
            self._start(chunk)
            early = [c for c in self._early if self._needed is None or c.index in self._needed]
            for c in early:
                self._check_place(c)
            self._futures += [_pool().submit(self._apply, c) for c in early]
            self._early = []

    def _check_place(self, chunk: Chunk) -> None:
        if chunk.count != self._count or not 0 <= chunk.index < self._count:
            raise CodecError(f"chunk {chunk.index} of {chunk.count} does not belong to a version of {self._count} "
                             "chunks: foreign")

    def _start(self, head: Chunk) -> None:
        _verify_chunk(head)
        header = _parse_header([head])
        if header["kind"] != "full":
            raise CodecError("a streamed version must be a full one; this is a delta")
        manifest = Manifest.from_json(json.dumps(header["manifest"]).encode())
        if manifest.layout_id != header["layout_id"] or manifest.nbytes != header["nbytes"]:
            raise CodecError("the header's layout id or size does not match its manifest")
        if self._max_nbytes is not None and manifest.nbytes > self._max_nbytes:
            raise CodecError(f"version needs {manifest.nbytes} bytes, more than the {self._max_nbytes} allowed")
        need = segment_count(manifest, header["chunk_bytes"])  # before a list of that many segments is built
        if head.count - 1 != need:
            raise CodecError(f"version has {head.count - 1} segment chunks, its manifest needs {need}")
        self._segments = segments(manifest, header["chunk_bytes"])
        self._manifest, self._count = manifest, head.count
        # Not zeroed: a full version's segments cover every byte (the dtype groups tile the buffer, padding included;
        # zeroing it first held a 40 MB restore's start 8 ms), and a part reads only the bytes its segments write.
        self._out = layout.empty_buffer(manifest.nbytes)
        if self._want is not None:
            spans = sorted((t.offset, t.offset + t.nbytes) for t in manifest.tensors if t.nbytes and self._want(t.name))
            self._needed = {0} | {i + 1 for i, (off, n, size) in enumerate(self._segments)
                                  if _overlaps(spans, off, off + n * size)}
            self.needed = sorted(self._needed)
        else:
            self._plan_unpacking(manifest)
        self.header = header

    def _plan_unpacking(self, manifest: Manifest) -> None:
        """The copy-out into new tensors and the version's sum (``Unpacking``), task by task as the segments under
        each task's bytes land: on a link slower than the decoding, done while the rest is on the wire."""
        self._unpacking = plan = Unpacking(manifest, self._out, layout.empty_leaves(manifest, self._map_location))
        self._deps = [0] * plan.count
        self._seg_tasks = []
        for off, n, size in self._segments:
            end = off + n * size
            tasks = [i for i in range(max(0, off // TASK_BYTES - 1), min(plan.count, (end - 1) // TASK_BYTES + 1))
                     if off < plan.span(i)[1] and end > plan.span(i)[0]]
            for i in tasks:
                self._deps[i] += 1
            self._seg_tasks.append(tasks)
        self._tasks += [_pool().submit(plan.run, i) for i in range(plan.count) if not self._deps[i]]

    def _apply(self, chunk: Chunk) -> None:
        _verify_chunk(chunk)
        off, n, size = self._segments[chunk.index - 1]
        apply_segment(np.frombuffer(chunk.payload, dtype=np.uint8), size, off,
                      self._out.numpy()[off : off + n * size], into_zeros=True)
        if self._unpacking is not None:
            with self._lock:
                ready = []
                for i in self._seg_tasks[chunk.index - 1]:
                    self._deps[i] -= 1
                    if not self._deps[i]:
                        ready.append(i)
                self._tasks += [_pool().submit(self._unpacking.run, i) for i in ready]

    def finish(self) -> Snapshot:
        """The decoded snapshot, verified; waits for the chunks still being applied."""
        self._wait()
        return Snapshot(self._manifest, self._out, self._check(buffer_checksum(self._out)))

    def state(self) -> Any:
        """The decoded state in new tensors (``unpack_verified``: summed as it is copied out), verified; with
        ``want``, the wanted tensors only (the others on the ``meta`` device), verified chunk by chunk."""
        self._wait()
        if self._want is not None:
            return self._part()
        with self._lock:
            tasks = list(self._tasks)
        assert len(tasks) == self._unpacking.count  # every segment landed: every task was started
        state, got = self._unpacking.finish(sum(t.result() for t in tasks))
        self._check(got)
        return state

    def _part(self) -> Any:
        leaves = []
        for spec in self._manifest.tensors:
            if not self._want(spec.name):
                leaves.append(torch.empty(spec.shape, dtype=layout.DTYPES[spec.dtype], device="meta"))
                continue
            leaf = layout.empty_leaves(replace(self._manifest, tensors=(spec,)), self._map_location)[0]  # it alone
            if spec.nbytes:
                layout.leaf_bytes(leaf).copy_(self._out[spec.offset : spec.offset + spec.nbytes])
            leaves.append(leaf)
        return layout.finish_leaves(self._manifest, leaves)

    @property
    def part_nbytes(self) -> int:
        """Bytes of the wanted tensors (all of them without ``want``)."""
        if self._want is None:
            return self._manifest.nbytes
        return sum(t.nbytes for t in self._manifest.tensors if self._want(t.name))

    def _wait(self) -> None:
        with self._lock:
            if self.header is None:
                raise CodecError(f"truncated version: its header (chunk 0) never came ({len(self._seen)} chunks did)")
            missing = sorted((set(range(self._count)) if self._needed is None else self._needed) - self._seen)
            futures = list(self._futures)
        for f in futures:
            f.result()  # a chunk's CodecError
        if missing:
            raise CodecError(f"truncated version: {len(missing)} of its {self._count} chunks are missing "
                             f"(first: chunk {missing[0]})")

    def _check(self, got: int) -> int:
        if got != int(self.header["checksum"], 16):
            raise CodecError(f"decoded snapshot has checksum {got:016x}, the version says {self.header['checksum']}: "
                             "the chunks do not belong to this version")
        return got


def _overlaps(spans: list[tuple[int, int]], lo: int, hi: int) -> bool:
    """Whether ``[lo, hi)`` meets one of ``spans`` (sorted, disjoint byte ranges)."""
    i = bisect.bisect_right(spans, (hi,))  # the spans starting before hi
    return i > 0 and spans[i - 1][1] > lo
