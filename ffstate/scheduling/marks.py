"""The pacing marks of a training's collectives (docs/design.md section 4, step 3): DDP's gradient all-reduce as a
communication hook and its buffer broadcast wrapped, and FSDP2's all-gathers and reduce-scatters wrapped, each
marking in the slot header (``shm.CommMarks``) when it is on the wire. The arithmetic and the calls are the
frameworks' own, so a run with the marks is bit for bit the run without them."""

from __future__ import annotations

import torch

from ffstate import inflight


def marked_allreduce(state, bucket):  # no annotations: DDP checks them, and this module's are strings
    """DDP's default gradient all-reduce, as a communication hook that marks when it is on the wire.

    ``state`` is (``shm.CommMarks``, the DDP process group). The arithmetic is the built-in
    reducer's: gradients times 1/world size, then a SUM all-reduce, so a run with the hook is bit
    for bit the run without it.
    """
    import torch.distributed as dist

    marks, group = state
    group = group or dist.group.WORLD
    started = marks.start()
    buf = bucket.buffer()
    buf.mul_(1.0 / group.size())
    return ended(marks, started, dist.all_reduce(buf, group=group, async_op=True).get_future(), lambda v: v[0])


def ended(marks, started: int, fut, value=lambda v: v):
    """A hook's future ``fut``, continued by marking its collective off the wire; resolves to ``value`` of its value
    (DDP expects the bucket's tensor). Under the in-process engine, a future an abort of the group ends
    (``ffstate/inflight.py``)."""
    if inflight.enabled():
        try:
            return inflight.track(fut, value, lambda: marks.end(started))
        except inflight.Aborted:  # issued into an aborted group: off the wire already
            marks.end(started)
            raise

    def done(f):
        marks.end(started)
        return value(f.value())

    return fut.then(done)


def mark_ddp_buffer_broadcast(model: torch.nn.Module, marks) -> bool:
    """Marks DDP's broadcast of its buffers at the start of each forward (``broadcast_buffers``): a collective
    like the gradient all-reduce, on the wire and waited in by every rank that reached it before the slowest;
    the same call, wrapped on the instance. False where the installed torch lacks the seam."""
    inner = getattr(model, "_distributed_broadcast_coalesced", None)
    if inner is None:
        return False
    # The wrapper lives on the model and holds it (a reference cycle: the DDP goes at a collection, not when the loop
    # drops it). Without the cycle, a DDP dropped right after its backward, its group destroyed already, can hang in
    # ProcessGroupGloo's destructor: it joins a worker thread that waits for the GIL to release a hook's Python
    # callback (seen in the suite, torch 2.13).

    def marked(tensors, buffer_size, authoritative_rank=0):
        started = marks.start()
        try:
            if inflight.enabled():
                return broadcast_coalesced(model.process_group, tensors, buffer_size, authoritative_rank)
            return inner(tensors, buffer_size, authoritative_rank)
        finally:
            marks.end(started)

    model._distributed_broadcast_coalesced = marked
    return True


def broadcast_coalesced(group, tensors: list, buffer_size: int, src: int) -> None:
    """``tensors`` of group rank ``src`` into every rank's, as DDP's ``_broadcast_coalesced``: the same buckets (one
    dtype and device each, up to ``buffer_size`` bytes, torch's own assignment), each flattened and broadcast; all
    issued, then waited on in order through ``inflight``, so that an abort of the group ends the wait. The bytes are
    ``src``'s either way."""
    import torch.distributed as dist
    from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

    if not tensors:
        return
    buckets = [[tensors[i] for i in b] for b in dist._compute_bucket_assignment_by_size(tensors, [buffer_size])[0]]
    flats = [_flatten_dense_tensors(b) for b in buckets]
    works = [dist.broadcast(f, group=group, group_src=src, async_op=True).get_future() for f in flats]
    mine = dist.get_rank(group) == src
    for bucket, flat, work in zip(buckets, flats, works):
        inflight.wait(work)
        if not mine:
            for t, got in zip(bucket, _unflatten_dense_tensors(flat, bucket)):
                t.copy_(got)


def _marked(marks, started: int, work):
    """Marks the collective ``work`` off the wire when it completes (or now, if it ran synchronously)."""
    if work is None:
        marks.end(started)
        return work
    try:
        if inflight.enabled():  # no callback of ffstate's on the training's thread (ffstate/inflight.py)
            inflight.track(work.get_future(), on_end=lambda: marks.end(started))
        else:
            work.get_future().then(lambda _: marks.end(started))
    except RuntimeError:  # a backend whose work has no future: marked as issued only
        marks.end(started)
    return work


def mark_fsdp_collectives(model: torch.nn.Module, marks) -> int:
    """Marks FSDP2's all-gathers and reduce-scatters on the wire for the scheduler; returns how many
    FSDP modules were marked (0: none, or the installed torch lacks the seam).

    Uses ``FSDPModule.set_custom_all_gather`` / ``set_custom_reduce_scatter`` with FSDP's own
    default collectives wrapped: the same calls with the same arguments, so the bits do not change
    (the FSDP2 recovery test compares against a run without ffstate). A module whose collectives a
    user replaced is left alone.
    """
    try:
        from torch.distributed.fsdp import FSDPModule
        from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather, DefaultReduceScatter
    except ImportError:
        return 0

    class MarkedAllGather(DefaultAllGather):
        def __call__(self, output_tensor, input_tensor, group, async_op=False):
            started = marks.start()
            return _marked(marks, started, super().__call__(output_tensor, input_tensor, group, async_op))

    class MarkedReduceScatter(DefaultReduceScatter):
        def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
            started = marks.start()
            return _marked(marks, started, super().__call__(output_tensor, input_tensor, group, op, async_op))

    marked = 0
    for module in model.modules():
        if not isinstance(module, FSDPModule):
            continue
        try:
            groups = module._get_fsdp_state()._fsdp_param_groups
            mine = len(groups) == 1 and type(groups[0]._all_gather_comm) is DefaultAllGather \
                and type(groups[0]._reduce_scatter_comm) is DefaultReduceScatter
        except AttributeError:  # FSDP's internals moved in another torch: no marks rather than no training
            return marked
        if not mine:
            continue  # no parameters of its own, several meshes, or the user's own collectives
        module.set_custom_all_gather(MarkedAllGather())
        module.set_custom_reduce_scatter(MarkedReduceScatter())
        marked += 1
    return marked
