"""The lossless snapshot codec: pack a state into one flat buffer, encode it (full, or an XOR delta
against a base) into checksummed chunks, and back, bit for bit (DESIGN.md I1, I2, I6).

Two levels:

- state level: ``encode(state, base) -> Packed`` and ``decode(packed, base) -> state``;
- buffer level, for the capture path and the daemon: ``pack``/``pack_into`` a state into a buffer
  the caller owns, ``encode_snapshot``/``decode_snapshot`` on buffers, ``unpack`` a buffer into a
  new state, and ``restore_into`` a live model/optimizer state in place (``copy_``).

CPU buffers use the reference path (``ffstate.planes``); CUDA buffers use the Triton kernels in
``ffstate.kernels``, which produce the same bytes. The wire format is in docs/wire-format.md.
"""

from __future__ import annotations

import functools
import json
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np
import torch

from ffstate import layout, planes
from ffstate.config import Config
from ffstate.errors import CodecError
from ffstate.layout import Manifest

FORMAT = 1
DEFAULT_CHUNK_BYTES = Config.chunk_bytes
MIN_CHUNK_BYTES, MAX_CHUNK_BYTES = 4 << 10, 1 << 30
# Bytes each chunk costs on the wire beside its payload: index, count (u32 each) and checksum (u64).
CHUNK_OVERHEAD = 16
MAX_HEADER_BYTES = 256 << 20


_POOL: ThreadPoolExecutor | None = None
_POOL_LOCK = threading.Lock()


def _pool() -> ThreadPoolExecutor:
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            workers = Config.from_env().codec_threads or min(8, os.cpu_count() or 1)
            _POOL = ThreadPoolExecutor(workers, thread_name_prefix="ffstate-codec")
        return _POOL


def _map(fn, items):
    """``map`` over a thread pool: NumPy releases the GIL, so the CPU path scales with cores."""
    items = list(items)
    if len(items) < 2:
        return [fn(x) for x in items]
    return list(_pool().map(fn, items))


@dataclass(frozen=True)
class Chunk:
    """One unit of an encoded version: ``payload`` is bytes-like, ``checksum`` covers it."""

    index: int
    count: int
    checksum: int
    payload: memoryview

    @staticmethod
    def of(index: int, count: int, payload: np.ndarray | bytes) -> "Chunk":
        arr = np.frombuffer(payload, dtype=np.uint8) if isinstance(payload, bytes) else payload
        return Chunk(index, count, planes.checksum(arr), memoryview(arr).cast("B"))


@dataclass(frozen=True)
class Snapshot:
    """A packed state: its manifest, the flat uint8 buffer, and the buffer's checksum (None: not computed)."""

    manifest: Manifest
    buffer: torch.Tensor
    checksum: int | None


@dataclass
class Packed:
    """An encoded version: chunk 0 is the header (JSON), chunks 1.. are segments of the buffer.

    ``nbytes`` is what goes on the wire; ``raw_nbytes`` is the size of the snapshot it restores.
    """

    chunks: list[Chunk]
    _header: dict | None = field(default=None, repr=False)

    @property
    def header(self) -> dict:
        if self._header is None:
            self._header = _parse_header(self.chunks)
        return self._header

    @property
    def kind(self) -> str:
        return self.header["kind"]

    @property
    def nbytes(self) -> int:
        return sum(len(c.payload) + CHUNK_OVERHEAD for c in self.chunks)

    @property
    def raw_nbytes(self) -> int:
        return int(self.header["nbytes"])

    @property
    def checksum(self) -> int:
        return int(self.header["checksum"], 16)

    @property
    def base_checksum(self) -> int | None:
        b = self.header.get("base_checksum")
        return None if b is None else int(b, 16)

    @property
    def ratio(self) -> float:
        return self.raw_nbytes / max(1, self.nbytes)


# ---------------------------------------------------------------- backend dispatch


def _use_kernels(t: torch.Tensor) -> bool:
    """Triton for CUDA tensors; FFSTATE_KERNELS=triton forces it (CPU tensors need TRITON_INTERPRET=1)."""
    choice = _kernels_choice(os.environ.get("FFSTATE_KERNELS", "auto"))
    return choice == "triton" or (choice == "auto" and t.is_cuda)


@functools.lru_cache(maxsize=4)
def _kernels_choice(raw: str) -> str:
    """``FFSTATE_KERNELS`` checked as ``Config`` checks it, once per value: every commit and checksum asks
    (``Config.from_env()`` reads every variable: 60 us, 4% of a commit)."""
    return Config(kernels=raw).kernels


def buffer_checksum(buf: torch.Tensor) -> int:
    """The checksum of a uint8 buffer (``planes.checksum``), on the buffer's device."""
    if _use_kernels(buf):
        from ffstate import kernels

        return kernels.checksum(buf)
    return planes.checksum(buf.numpy(), _map)


# ---------------------------------------------------------------- state <-> buffer


def pack(state: Any, out: torch.Tensor | None = None) -> Snapshot:
    """Packs every tensor of ``state`` into one flat buffer (a new zeroed one unless ``out`` is given)."""
    manifest = layout.describe(state)
    if out is None:
        # On a CUDA device when any tensor is there (packing then runs in the kernels), else on the CPU.
        device = next((t.device for t in manifest.tensors if t.device.startswith("cuda")), "cpu")
        out = layout.alloc_buffer(manifest, device=device)
    return pack_into(state, out, manifest)


def pack_into(state: Any, out: torch.Tensor, manifest: Manifest | None = None, checksum: bool = True,
              targets: Sequence[torch.Tensor] | None = None) -> Snapshot:
    """Packs ``state`` into ``out``, a uint8 buffer the caller owns (e.g. a shared-memory slot).

    ``out`` must hold ``manifest.nbytes`` bytes and be zero in the padding (``layout.alloc_buffer``
    gives such a buffer; later packs of the same layout keep it so). Passing the cached
    ``manifest`` of an earlier pack checks that the layout has not changed. With ``checksum=False``
    the snapshot's checksum is None: the caller leaves it to whoever reads the buffer (a commit
    leaves it to the daemon, off the training path). ``targets`` are ``pack_targets(out,
    manifest)``, kept by a caller that packs into the same buffer again and again.

    Raises:
        CodecError: the state changed layout, or ``out`` is too small or not a flat uint8 tensor.
    """
    if manifest is not None:
        current, arrays = layout.analyze_known(state, manifest)
        if manifest.layout_id != current.layout_id:
            raise CodecError(f"the state's layout changed since it was described: {layout.diff_layouts(current, manifest)}")
    else:
        current, arrays = layout.analyze(state)
    if out.dtype != torch.uint8 or out.dim() != 1 or not out.is_contiguous():
        raise CodecError(f"pack_into needs a flat contiguous uint8 buffer, got {out.dtype} of shape {list(out.shape)}")
    if out.numel() < current.nbytes:
        raise CodecError(f"buffer of {out.numel()} bytes is too small for this state ({current.nbytes} bytes)")
    if _use_kernels(out):
        from ffstate import kernels

        kernels.gather(list(layout.iter_placed(current, arrays)), out)
    else:
        if targets is None:
            targets = pack_targets(out, current)
        plan = _pack_plan(current)
        if len(targets) != len(plan.arrays) + len(plan.bools) + len(plan.plain):
            raise CodecError(f"{len(targets)} targets for a layout of {len(plan.arrays) + len(plan.bools) + len(plan.plain)} "
                             "tensors with bytes: pass pack_targets(out, manifest) of this manifest")
        with torch.no_grad():
            for j, i in plan.arrays:
                targets[j].copy_(layout.array_bytes(arrays[i]))
            for j, i in plan.bools:  # as bytes: a bool copy may normalise them to 0/1
                targets[j].view(torch.uint8).copy_(arrays[i].view(torch.uint8))
            # One call for all the other tensors (same dtypes pairwise; a loop of copy_ where devices
            # differ): a third of the per-tensor copy_ calls' cost at 114 tensors.
            if plan.plain:
                torch._foreach_copy_([targets[j] for j, _ in plan.plain], [arrays[i] for _, i in plan.plain])
    buf = out[: current.nbytes]
    return Snapshot(current, buf, buffer_checksum(buf) if checksum else None)


@dataclass(frozen=True)
class _PackPlan:
    """How ``pack_into`` copies a layout's tensors, as (target position, leaf index) pairs: numpy arrays,
    bool tensors (copied as bytes), and the rest (one ``_foreach_copy_``). Targets are the tensors with
    bytes, in manifest order (``pack_targets``)."""

    arrays: tuple[tuple[int, int], ...]
    bools: tuple[tuple[int, int], ...]
    plain: tuple[tuple[int, int], ...]


_PLANS: dict[str, _PackPlan] = {}  # by layout id (layout.per_layout)


def _pack_plan(manifest: Manifest) -> _PackPlan:
    def build(m: Manifest) -> _PackPlan:
        placed = [(i, s) for i, s in enumerate(m.tensors) if s.nbytes]
        return _PackPlan(
            tuple((j, i) for j, (i, s) in enumerate(placed) if s.kind == "ndarray"),
            tuple((j, i) for j, (i, s) in enumerate(placed) if s.kind != "ndarray" and s.dtype == "bool"),
            tuple((j, i) for j, (i, s) in enumerate(placed) if s.kind != "ndarray" and s.dtype != "bool"))

    return layout.per_layout(_PLANS, manifest, build)


def pack_targets(out: torch.Tensor, manifest: Manifest) -> list[torch.Tensor]:
    """Where ``pack_into`` copies each tensor of the manifest in ``out``: views of ``out``, no copy."""
    return [out[s.offset : s.offset + s.nbytes] if s.kind == "ndarray" else layout.tensor_view(out, s)
            for s in manifest.tensors if s.nbytes]


def unpack(snapshot: Snapshot, map_location: Any = None) -> Any:
    """A new state from a snapshot: every tensor copied out into its own storage, on its device (or ``map_location``)."""
    return layout.materialize(snapshot.manifest, snapshot.buffer, map_location)


# Bytes of the buffer copied out, then summed while in cache, at a time by ``unpack_verified``; a task
# of the codec's threads takes about four such spans.
_PIECE_BYTES = 1 << 20
_SMALL_BYTES = 64 << 10  # pieces below this are copied together and summed from the buffer, by span


@layout.gc_paused()
def unpack_verified(manifest: Manifest, buf: torch.Tensor) -> tuple[Any, int]:
    """``unpack`` (into new tensors, each its own storage) and ``buffer_checksum`` of a CPU buffer, in one pass.

    One pass over ``buf`` instead of two (a restore reads a slot or a decoded buffer once), on the
    codec's threads, in buffer order: a piece of up to 1 MiB of a large tensor is copied out and
    summed from its copy while that is in cache; small tensors are copied together and the span of
    ``buf`` they fill (padding included) is summed once it reaches 1 MiB, a few NumPy calls
    however many tensors it holds (7,700 small tensors took 350 ms summed one by one, against 5 ms
    for the whole buffer). A slot's reader checks afterwards that the worker did not rewrite the
    slot meanwhile (``shm.Slots.read``); the caller compares the checksum with the one it trusts
    before using the state.
    """
    leaves = layout.empty_leaves(manifest)
    pieces = sorted(((spec.offset + a, layout.leaf_bytes(leaf)[a : min(spec.nbytes, a + _PIECE_BYTES)])
                     for spec, leaf in zip(manifest.tensors, leaves) for a in range(0, spec.nbytes, _PIECE_BYTES)),
                    key=lambda p: p[0])
    host = buf.numpy()
    words = host[: host.size // 8 * 8].view(np.uint64)
    # Tasks of about 4 MiB that tile the buffer's whole words: each sums from where the one before stopped
    # (a piece starts 8-byte aligned: tensors are 64-byte aligned, pieces 1 MiB), the last to the end.
    tasks: list[tuple[int, list]] = []
    size = 0
    for p in pieces:
        if not tasks or size >= 4 * _PIECE_BYTES:
            tasks.append((0 if not tasks else p[0], []))
            size = 0
        tasks[-1][1].append(p)
        size += p[1].numel()
    if not tasks:
        tasks.append((0, []))
    bounds = [lo for lo, _ in tasks[1:]] + [words.size * 8]

    def run(task: tuple[int, list], hi: int) -> int:
        lo, items = task
        total, summed_to, dsts, srcs = 0, lo, [], []

        def flush(to: int) -> None:  # copies the pending small pieces, then sums buf's words up to ``to``
            nonlocal total, summed_to, dsts, srcs
            if dsts:
                _copy_pieces(dsts, srcs)
                dsts, srcs = [], []
            if to > summed_to:
                total += planes.word_sum(words[summed_to // 8 : to // 8], summed_to // 8)
                summed_to = to

        for pos, dst in items:
            n = dst.numel()
            if n >= _SMALL_BYTES and dst.device.type == "cpu":  # summed from its copy, the freshest in cache
                flush(pos)
                dst.copy_(buf[pos : pos + n])
                whole = n // 8 * 8
                total += planes.word_sum(dst[:whole].numpy().view(np.uint64), pos // 8)
                summed_to = pos + whole
            else:
                dsts.append(dst)
                srcs.append(buf[pos : pos + n])
                if pos + n - summed_to >= _PIECE_BYTES:
                    flush((pos + n) // 8 * 8)
        flush(hi)
        return total

    total = sum(_map(lambda i: run(tasks[i], bounds[i]), range(len(tasks))))
    return layout.finish_leaves(manifest, leaves), planes.finish_checksum(total, host)


def _copy_pieces(dsts: list[torch.Tensor], srcs: list[torch.Tensor]) -> None:
    """Copies pieces of a CPU buffer into the leaves' bytes: one call for those on the CPU."""
    if all(d.device.type == "cpu" for d in dsts):
        torch._foreach_copy_(dsts, srcs)
        return
    for d, s in zip(dsts, srcs):
        d.copy_(s)  # a tensor restored onto a GPU


def restore_into(snapshot: Snapshot, live: Any) -> Any:
    """Copies a snapshot into the tensors of ``live`` in place and returns the restored state.

    ``live`` is a state of the same layout whose tensors are the training's own (e.g.
    ``{"model": model.state_dict(), "optim": optimizer.state_dict()}``: both share storage with the
    parameters and optimizer state), so a DDP/FSDP-wrapped model keeps its parameters' identity.
    Tensors in the returned state are ``live``'s tensors; scalars (learning rates, step counts held
    as Python numbers) are the snapshot's, for the caller to apply.

    Raises:
        CodecError: ``live`` does not have the snapshot's layout.
    """
    current, arrays = layout.analyze(live)
    if current.layout_id != snapshot.manifest.layout_id:
        raise CodecError(f"cannot restore into a state of another layout: {layout.diff_layouts(snapshot.manifest, current)}")
    placed = list(layout.iter_placed(snapshot.manifest, arrays))
    cuda = [(s, a) for s, a in placed if isinstance(a, torch.Tensor) and a.is_cuda]
    if cuda:
        from ffstate import kernels

        kernels.scatter(snapshot.buffer, cuda)
    with torch.no_grad():
        for spec, a in placed:
            if spec.kind == "ndarray":
                a[...] = np.frombuffer(
                    snapshot.buffer[spec.offset : spec.offset + spec.nbytes].numpy(), dtype=np.dtype(spec.np_dtype)
                ).reshape(spec.shape)
            elif not a.is_cuda:
                layout.copy_bits(a, layout.tensor_view(snapshot.buffer, spec))
    return layout.unflatten(snapshot.manifest, arrays)


# ---------------------------------------------------------------- buffer <-> chunks


def encode_snapshot(snapshot: Snapshot, base: Snapshot | None = None, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> Packed:
    """Encodes a snapshot as a full version, or as an XOR delta against ``base`` (same layout).

    Raises:
        CodecError: ``base`` has another layout, or ``chunk_bytes`` is out of range.
    """
    if not MIN_CHUNK_BYTES <= chunk_bytes <= MAX_CHUNK_BYTES:
        raise CodecError(f"chunk_bytes must be in [{MIN_CHUNK_BYTES}, {MAX_CHUNK_BYTES}], got {chunk_bytes}")
    m = snapshot.manifest
    checksum = buffer_checksum(snapshot.buffer) if snapshot.checksum is None else snapshot.checksum
    header: dict[str, Any] = {
        "format": FORMAT,
        "layout_id": m.layout_id,
        "nbytes": m.nbytes,
        "checksum": f"{checksum:016x}",
        "chunk_bytes": chunk_bytes,
    }
    buf = snapshot.buffer
    if base is None:
        header.update(kind="full", manifest=json.loads(m.to_json()))
    else:
        if base.manifest.layout_id != m.layout_id:
            raise CodecError(f"base has another layout than the state: {layout.diff_layouts(m, base.manifest)}")
        header.update(kind="delta", base_checksum=f"{base.checksum:016x}", scalars=list(m.scalars))
    bodies = _encode_groups(buf, None if base is None else base.buffer.to(buf.device), m, chunk_bytes)
    count = 1 + len(bodies)
    head = json.dumps(header, separators=(",", ":")).encode()
    chunks = _map(lambda ib: Chunk.of(ib[0], count, ib[1]), enumerate([head] + bodies))
    return Packed(chunks, header)


def decode_snapshot(
    packed: Packed,
    base: Snapshot | None = None,
    max_nbytes: int | None = None,
    device: Any = "cpu",
    inplace: bool = False,
) -> Snapshot:
    """The snapshot an encoded version restores, verified end to end; ``base`` is required for a delta.

    The result's buffer is on ``device`` for a full version, on the base's device for a delta (a
    CUDA buffer is decoded by the Triton kernels). With ``inplace``, a delta is applied to
    ``base.buffer`` itself (no copy of the base); if anything fails the buffer is left exactly
    as it was, since an XOR delta applied twice is undone (DESIGN.md I2).
    ``max_nbytes`` bounds the buffer a full version may ask for (a daemon passes what its memory
    budget allows); the chunk count is checked against the manifest before anything is allocated.

    Raises:
        CodecError: a chunk is corrupted, missing, reordered or foreign; the base is missing or wrong;
            or the decoded buffer does not match the version's checksum.
    """
    verify_chunks(packed.chunks)
    header = packed.header
    if header["kind"] == "full":
        manifest = Manifest.from_json(json.dumps(header["manifest"]).encode())
        _check_segment_count(packed.chunks, manifest, header["chunk_bytes"])
        if max_nbytes is not None and manifest.nbytes > max_nbytes:
            raise CodecError(f"version needs {manifest.nbytes} bytes, more than the {max_nbytes} allowed")
        if inplace:
            raise CodecError("in-place decoding applies a delta onto its base; a full version has no base")
        out = layout.alloc_buffer(manifest, device=device)
    else:
        if base is None:
            raise CodecError("this version is a delta: decoding it needs the base it was encoded against")
        if base.manifest.layout_id != header["layout_id"]:
            raise CodecError(
                f"wrong base: the delta is for layout {header['layout_id']}, the base has {base.manifest.layout_id}"
            )
        if base.checksum != packed.base_checksum:
            raise CodecError(
                f"wrong base: the delta was encoded against a base with checksum {header['base_checksum']}, "
                f"the given base has {base.checksum:016x}"
            )
        manifest = base.manifest.with_scalars(header["scalars"])
        _check_segment_count(packed.chunks, manifest, header["chunk_bytes"])
        out = base.buffer.detach() if inplace else base.buffer.detach().clone()
    if manifest.layout_id != header["layout_id"] or manifest.nbytes != header["nbytes"]:
        raise CodecError("the header's layout id or size does not match its manifest")
    _apply_groups(packed.chunks[1:], manifest, header["chunk_bytes"], out)
    got = buffer_checksum(out)
    if got != packed.checksum:
        if inplace:
            _apply_groups(packed.chunks[1:], manifest, header["chunk_bytes"], out)  # undo
        raise CodecError(
            f"decoded snapshot has checksum {got:016x}, the version says {header['checksum']}: "
            "the chunks do not belong to this version or its base"
        )
    return Snapshot(manifest, out, got)


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
        self._segments = segments(manifest, header["chunk_bytes"])
        if head.count - 1 != len(self._segments):
            raise CodecError(f"version has {head.count - 1} segment chunks, its manifest needs {len(self._segments)}")
        if self._max_nbytes is not None and manifest.nbytes > self._max_nbytes:
            raise CodecError(f"version needs {manifest.nbytes} bytes, more than the {self._max_nbytes} allowed")
        self._manifest, self._count = manifest, head.count
        self._out = layout.alloc_buffer(manifest)
        self.header = header

    def _apply(self, chunk: Chunk) -> None:
        _verify_chunk(chunk)
        off, n, size = self._segments[chunk.index - 1]
        planes.apply_segment(np.frombuffer(chunk.payload, dtype=np.uint8), size, off,
                             self._out.numpy()[off : off + n * size])

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


def _verify_chunk(c: Chunk) -> None:
    got = planes.checksum(np.frombuffer(c.payload, dtype=np.uint8))
    if got != c.checksum:
        raise CodecError(f"chunk {c.index} of {c.count} is corrupted: checksum {got:016x}, expected {c.checksum:016x}")


def revert_snapshot(packed: Packed, snapshot: Snapshot, base_scalars: Sequence[Any]) -> Snapshot:
    """Steps ``snapshot`` (the version a delta produced) back to the delta's base, in place.

    XOR deltas are their own inverse, so a replica keeps its last deltas instead of old copies
    (DESIGN.md I3). The delta carries only the new version's scalars: ``base_scalars`` are the
    base's. On any failure the buffer is left as it was.

    Raises:
        CodecError: ``packed`` is not a delta that produced ``snapshot``.
    """
    verify_chunks(packed.chunks)
    header = packed.header
    if header["kind"] != "delta":
        raise CodecError("only a delta can be reverted")
    if header["layout_id"] != snapshot.manifest.layout_id or snapshot.checksum != packed.checksum:
        raise CodecError(f"this delta produced the snapshot with checksum {header['checksum']}, "
                         f"not the given one ({snapshot.checksum:016x})")
    manifest = snapshot.manifest.with_scalars(base_scalars)
    _check_segment_count(packed.chunks, manifest, header["chunk_bytes"])
    out = snapshot.buffer
    _apply_groups(packed.chunks[1:], manifest, header["chunk_bytes"], out)
    got = buffer_checksum(out)
    if got != packed.base_checksum:
        _apply_groups(packed.chunks[1:], manifest, header["chunk_bytes"], out)  # undo
        raise CodecError(f"reverting gave checksum {got:016x}, the delta's base has {header['base_checksum']}")
    return Snapshot(manifest, out, got)


def segments(manifest: Manifest, chunk_bytes: int) -> list[tuple[int, int, int]]:
    """(byte offset, element count, itemsize) of every segment, in chunk order."""
    out = []
    for g in manifest.groups:
        step = max(1, chunk_bytes // g.itemsize) * g.itemsize
        for start in range(g.offset, g.offset + g.nbytes, step):
            nbytes = min(step, g.offset + g.nbytes - start)
            out.append((start, nbytes // g.itemsize, g.itemsize))
    return out


def _encode_groups(buf: torch.Tensor, base: torch.Tensor | None, manifest: Manifest, chunk_bytes: int
                   ) -> list[np.ndarray]:
    """Encoded segments of ``buf`` (XOR ``base``), in chunk order."""
    segs = segments(manifest, chunk_bytes)
    if _use_kernels(buf):
        from ffstate import kernels

        return kernels.encode_segments(buf, segs, base)
    host = buf.numpy()
    base_host = None if base is None else base.numpy()

    def encode_one(seg: tuple[int, int, int]) -> np.ndarray:
        off, n, size = seg
        d = host[off : off + n * size]
        if base_host is not None:
            d = np.bitwise_xor(d, base_host[off : off + n * size])
        return planes.encode_segment(d, size, off)

    return _map(encode_one, segs)


def _check_segment_count(chunks: Sequence[Chunk], manifest: Manifest, chunk_bytes: int) -> None:
    need = len(segments(manifest, chunk_bytes))
    if len(chunks) - 1 != need:
        raise CodecError(f"version has {len(chunks) - 1} segment chunks, its manifest needs {need}")


def _apply_groups(chunks: Sequence[Chunk], manifest: Manifest, chunk_bytes: int, out: torch.Tensor) -> None:
    """XORs every segment into ``out``; if one is malformed, the others are undone and CodecError raised."""
    segs = segments(manifest, chunk_bytes)
    payloads = [np.frombuffer(c.payload, dtype=np.uint8) for c in chunks]
    if _use_kernels(out):
        from ffstate import kernels

        kernels.apply_segments(payloads, segs, out)
        return
    host = out.numpy()

    def apply(item: tuple[np.ndarray, tuple[int, int, int]]) -> CodecError | None:
        payload, (off, n, size) = item
        try:
            planes.apply_segment(payload, size, off, host[off : off + n * size])
        except CodecError as e:  # apply_segment validates before it writes: this segment is untouched
            return e
        return None

    items = list(zip(payloads, segs))
    errors = _map(apply, items)
    failed = [e for e in errors if e is not None]
    if failed:
        _map(apply, [item for item, e in zip(items, errors) if e is None])  # XOR again: undone
        raise failed[0]


def verify_chunks(chunks: Sequence[Chunk]) -> None:
    """Checks a received chunk list: complete, in order, one version's, every checksum right.

    Raises:
        CodecError: naming the first chunk that is missing, out of place or corrupted.
    """
    if not chunks:
        raise CodecError("empty chunk list: a version has at least its header chunk")
    count = chunks[0].count
    if len(chunks) != count:
        raise CodecError(f"truncated or padded chunk list: {len(chunks)} chunks, the version has {count}")
    for i, c in enumerate(chunks):
        if c.index != i or c.count != count:
            raise CodecError(f"chunk {i} of {count} claims to be chunk {c.index} of {c.count}: reordered or foreign")
    _map(_verify_chunk, chunks)


def _parse_header(chunks: Sequence[Chunk]) -> dict:
    """Parses and validates chunk 0, the JSON header (``verify_chunks`` checks the list itself)."""
    if not chunks:
        raise CodecError("empty chunk list: a version has at least its header chunk")
    if len(chunks[0].payload) > MAX_HEADER_BYTES:
        raise CodecError(f"header chunk of {len(chunks[0].payload)} bytes exceeds {MAX_HEADER_BYTES}")
    try:
        header = json.loads(bytes(chunks[0].payload))
        kind = header["kind"]
        fmt = header["format"]
        int(header["checksum"], 16)
        nbytes, chunk_bytes = int(header["nbytes"]), int(header["chunk_bytes"])
    except (ValueError, KeyError, TypeError) as e:
        raise CodecError(f"malformed header chunk: {e!r}") from e
    if fmt != FORMAT:
        raise CodecError(f"format {fmt} is not supported by this ffstate (format {FORMAT})")
    if kind not in ("full", "delta") or ("manifest" if kind == "full" else "scalars") not in header:
        raise CodecError(f"malformed header: kind {kind!r}")
    if kind == "delta" and "base_checksum" not in header:
        raise CodecError("malformed header: a delta without its base checksum")
    if not MIN_CHUNK_BYTES <= chunk_bytes <= MAX_CHUNK_BYTES or nbytes < 0:
        raise CodecError(f"malformed header: chunk_bytes {chunk_bytes}, nbytes {nbytes}")
    return header


# ---------------------------------------------------------------- state-level API


def encode(state: Any, base: Any = None, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> Packed:
    """Encodes a state: in full when ``base`` is None, else as a delta against ``base`` (same structure).

    Raises:
        CodecError: the state holds an unsupported value, or ``base`` has another structure.
    """
    snapshot = pack(state)
    return encode_snapshot(snapshot, None if base is None else pack(base), chunk_bytes)


def decode(packed: Packed, base: Any = None, map_location: Any = None) -> Any:
    """The exact state an encoded version holds (same nesting and types, bitwise-equal tensors).

    Raises:
        CodecError: see ``decode_snapshot``.
    """
    snapshot = decode_snapshot(packed, None if base is None else pack(base))
    return unpack(snapshot, map_location)
