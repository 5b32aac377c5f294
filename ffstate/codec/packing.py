"""State <-> buffer: every tensor of a state packed into one flat buffer (a new one, or one the caller owns
such as a shared-memory slot), and back: into new tensors (``unpack``, ``unpack_verified`` summing as it
copies) or into the training's own tensors in place (``restore_into``). One copy each way."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch

from ffstate import checksum, layout, staging
from ffstate.codec.backend import _map, _use_kernels, buffer_checksum
from ffstate.codec.chunks import Snapshot
from ffstate.errors import CodecError, LayoutChanged
from ffstate.layout import Manifest


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
            raise LayoutChanged(f"the state's layout changed since it was described: "
                                f"{layout.diff_layouts(current, manifest)}")
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


# Bytes of a tensor copied out at a time by ``unpack_verified``; and of the buffer a task of the codec's threads
# copies out and then hashes while it is in cache (whole checksum pieces: the sum splits at piece boundaries).
_PIECE_BYTES = 1 << 20
TASK_BYTES = 4 * checksum.PIECE_BYTES
assert _PIECE_BYTES <= TASK_BYTES  # a piece runs past its task's end by less than a task (the decoder's plan needs it)
_SMALL_BYTES = 64 << 10  # pieces below this are copied together, by one call per task


@layout.gc_paused()
def unpack_verified(manifest: Manifest, buf: torch.Tensor, leaves: list[Any] | None = None,
                    map_location: Any = None) -> tuple[Any, int]:
    """``unpack`` (into new tensors, each its own storage) and ``buffer_checksum`` of a CPU buffer, in one pass.

    One pass over ``buf`` instead of two (a restore reads a slot or a decoded buffer once), on the codec's
    threads: each task copies out the pieces of the tensors that start in its 4 MiB of the buffer (up to 1 MiB of
    a tensor at a time; small ones together, one call), then hashes those 4 MiB while they are in cache. A slot's
    reader checks afterwards that the worker did not rewrite the slot meanwhile (``shm.Slots.read``); the caller
    compares the checksum with the one it trusts before using the state. ``leaves``: ``layout.empty_leaves`` of
    the manifest, made beforehand; else made here, placed by ``map_location`` (``layout.empty_leaves``).
    """
    plan = Unpacking(manifest, buf, leaves if leaves is not None else layout.empty_leaves(manifest, map_location))
    return plan.finish(sum(_map(plan.run, range(plan.count))))


class Unpacking:
    """``unpack_verified`` as tasks: ``run(i)`` copies out and hashes task i's part of the buffer (the bytes
    ``span(i)`` says it reads) and returns its share of the sum; ``finish`` of the shares' sum gives the state and
    the checksum. A streamed restore runs each task as soon as the segments under its span are decoded."""

    def __init__(self, manifest: Manifest, buf: torch.Tensor, leaves: list[Any] | None = None):
        self.manifest, self.buf = manifest, buf
        self.leaves = layout.empty_leaves(manifest) if leaves is None else leaves
        self._host = buf.numpy()
        self.count = -(-self._host.size // TASK_BYTES)
        self._tasks: list[list[tuple[int, torch.Tensor]]] = [[] for _ in range(self.count)]
        self._ends = [min((i + 1) * TASK_BYTES, self._host.size) for i in range(self.count)]
        self._device: list[tuple[Any, torch.Tensor]] = []  # tensors restored onto a GPU: by ``finish``, at once
        for spec, leaf in zip(manifest.tensors, self.leaves):
            if spec.nbytes and staging.on_gpu(leaf):
                self._device.append((spec, leaf))
                continue
            for a in range(0, spec.nbytes, _PIECE_BYTES):
                pos, n = spec.offset + a, min(_PIECE_BYTES, spec.nbytes - a)
                i = pos // TASK_BYTES
                self._tasks[i].append((pos, layout.leaf_bytes(leaf)[a : a + n]))
                self._ends[i] = max(self._ends[i], pos + n)

    def span(self, i: int) -> tuple[int, int]:
        """The bytes of the buffer task ``i`` reads: its 4 MiB, and the rest of a piece that starts in them."""
        return i * TASK_BYTES, self._ends[i]

    def run(self, i: int) -> int:
        buf = self.buf
        dsts, srcs = [], []
        for pos, dst in self._tasks[i]:
            n = dst.numel()
            if n >= _SMALL_BYTES and dst.device.type == "cpu":
                dst.copy_(buf[pos : pos + n])
            else:
                dsts.append(dst)
                srcs.append(buf[pos : pos + n])
        if dsts:
            _copy_pieces(dsts, srcs)
        lo = i * TASK_BYTES
        return checksum.piece_sum(self._host[lo : lo + TASK_BYTES], lo // checksum.PIECE_BYTES)

    def finish(self, total: int) -> tuple[Any, int]:
        """The state and the checksum, once every task ran: the tensors that live on a GPU go there now, from the
        buffer in one copy per device and the scatter kernel (``staging.scatter``)."""
        devices: dict[torch.device, list] = {}
        for spec, leaf in self._device:
            devices.setdefault(leaf.device, []).append((spec, leaf))
        for placed in devices.values():
            staging.scatter(self.buf, placed)
        return layout.finish_leaves(self.manifest, self.leaves), checksum.finish(total, self._host.size)


def _copy_pieces(dsts: list[torch.Tensor], srcs: list[torch.Tensor]) -> None:
    """Copies pieces of a CPU buffer into the leaves' bytes: one call for those on the CPU."""
    if all(d.device.type == "cpu" for d in dsts):
        torch._foreach_copy_(dsts, srcs)
        return
    for d, s in zip(dsts, srcs):
        d.copy_(s)  # a tensor on a device that ``staging.on_gpu`` leaves to these copies


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
    cuda = [(s, a) for s, a in placed if isinstance(a, torch.Tensor) and a.is_cuda and a.is_contiguous()]
    if cuda:  # by device: each in windows through the scatter kernel, synchronized before this returns
        from ffstate import staging

        for device in dict.fromkeys(a.device for _, a in cuda):
            staging.scatter(snapshot.buffer, [(s, a) for s, a in cuda if a.device == device])
    with torch.no_grad():
        for spec, a in placed:
            if spec.kind == "ndarray":
                a[...] = np.frombuffer(
                    snapshot.buffer[spec.offset : spec.offset + spec.nbytes].numpy(), dtype=np.dtype(spec.np_dtype)
                ).reshape(spec.shape)
            elif not a.is_cuda or not a.is_contiguous():  # a strided device tensor: its own copy
                layout.copy_bits(a, layout.tensor_view(snapshot.buffer, spec))
    return layout.unflatten(snapshot.manifest, arrays)
