"""A full version decoded while it streams in (a restore from remote holders): chunks in any order, from
several threads, each verified and applied as it arrives; the result verified end to end."""

from __future__ import annotations

import json
import threading
from typing import Any

import numpy as np
import torch

from ffstate import layout
from ffstate.codec.segment import apply_segment
from ffstate.codec.backend import _pool, buffer_checksum
from ffstate.codec.chunks import Chunk, Snapshot, _parse_header, _verify_chunk, segment_count, segments
from ffstate.codec.pack import unpack_verified
from ffstate.errors import CodecError
from ffstate.layout import Manifest


class Decoder:
    """Decodes a full version while it arrives: chunks in any order, from several threads.

    Each segment chunk is verified and applied on the codec's thread pool as soon as it and the
    header are in, so decoding overlaps the transfer; chunks that come before the header wait for
    it. ``add`` every chunk (a repeat of an index already added is ignored: a retried stream may
    resend some), then ``finish`` for the snapshot, verified end to end like ``decode_snapshot``'s.
    ``max_nbytes`` bounds the buffer the header may ask for.

    Raises (from ``add`` or ``finish``):
        CodecError: a chunk is corrupted, foreign, out of range or missing; the header is malformed
            or a delta's; or the decoded buffer does not match the version's checksum.
    """

    def __init__(self, max_nbytes: int | None = None):
        self._max_nbytes = max_nbytes
        self._lock = threading.Lock()
        self._seen: set[int] = set()
        self._early: list[Chunk] = []  # before the header
        self._futures: list = []
        self._count: int | None = None
        self.header: dict | None = None
        self._segments: list[tuple[int, int, int]] = []
        self._manifest: Manifest | None = None
        self._out: torch.Tensor | None = None

    def add(self, chunk: Chunk) -> None:
        with self._lock:
            if chunk.index in self._seen:
                return
            if self._count is not None:
                self._check_place(chunk)
            self._seen.add(chunk.index)
            if chunk.index != 0:
                if self.header is None:
                    self._early.append(chunk)
                else:
                    self._futures.append(_pool().submit(self._apply, chunk))
                return
            self._start(chunk)
            for c in self._early:
                self._check_place(c)
            self._futures += [_pool().submit(self._apply, c) for c in self._early]
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
        self._out = layout.alloc_buffer(manifest)
        self.header = header

    def _apply(self, chunk: Chunk) -> None:
        _verify_chunk(chunk)
        off, n, size = self._segments[chunk.index - 1]
        apply_segment(np.frombuffer(chunk.payload, dtype=np.uint8), size, off,
                      self._out.numpy()[off : off + n * size], into_zeros=True)

    def finish(self) -> Snapshot:
        """The decoded snapshot, verified; waits for the chunks still being applied."""
        self._wait()
        return Snapshot(self._manifest, self._out, self._check(buffer_checksum(self._out)))

    def state(self) -> Any:
        """The decoded state in new tensors (``unpack_verified``: summed as it is copied out), verified."""
        self._wait()
        state, got = unpack_verified(self._manifest, self._out)
        self._check(got)
        return state

    def _wait(self) -> None:
        with self._lock:
            if self.header is None:
                raise CodecError(f"truncated version: its header (chunk 0) never came ({len(self._seen)} chunks did)")
            missing = sorted(set(range(self._count)) - self._seen)
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
