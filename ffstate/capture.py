"""What a training job's state is, per kind of parallelism, and how it goes back in place.

``capture`` turns a model, optimizer, scheduler, RNG states and extras into one nested state of
plain tensors and values (the codec's input): DTensors (FSDP2's sharded parameters and optimizer
state) become their local shards, a ZeroRedundancyOptimizer becomes its rank's shard plus its own
``param_groups``. ``restore`` puts such a state back: parameters by ``copy_`` (their identity is
kept), DTensor optimizer state rebuilt around the local shards. Also here: the DDP shadow step
(see ``Config.shadow_ddp_step``).
"""

from __future__ import annotations

import logging
import random
from typing import Any

import numpy as np
import torch

from ffstate import layout

log = logging.getLogger("ffstate.capture")


_DTENSOR: type | None = None


def _dtensor_type() -> type:
    global _DTENSOR
    if _DTENSOR is None:
        from torch.distributed.tensor import DTensor

        _DTENSOR = DTensor
    return _DTENSOR


def _is_dtensor(t: Any) -> bool:
    return isinstance(t, _dtensor_type())


def local(tree: Any) -> Any:
    """The same nesting with every DTensor replaced by its local shard (a plain tensor, same storage), and
    every Parameter or tensor that requires grad by its ``detach()``: what ``state_dict()`` gives without
    ``keep_vars``, from a ``state_dict(keep_vars=True)`` (which skips DTensor.detach, 10 us a parameter)."""
    dtensor, tensor, is_parameter = _dtensor_type(), torch.Tensor, layout.is_parameter

    def go(x: Any) -> Any:
        t = type(x)
        if t is dict:  # the common containers first, by exact type: a commit walks every one of them
            return {k: go(v) for k, v in x.items()}
        if isinstance(x, tensor):
            if isinstance(x, dtensor):
                x = x.to_local()
            return x.detach() if x.requires_grad or is_parameter(x) else x
        if t is list:
            return [go(v) for v in x]
        if isinstance(x, dict):
            out = t((k, go(v)) for k, v in x.items())
            if hasattr(x, "_metadata"):
                out._metadata = x._metadata
            return out
        if isinstance(x, (list, tuple)):
            return t(go(v) for v in x)
        return x

    return go(tree)


def capture(model: torch.nn.Module, optimizer: torch.optim.Optimizer, lr_scheduler: Any, extra: dict | None) -> dict:
    # Without grad mode, DTensor.to_local returns the local shard itself instead of going through an autograd
    # Function: the same bits and layout, half the capture's time under FSDP2 (1.1 -> 0.6 ms at 114 tensors).
    # keep_vars: the parameters themselves, detached by `local` (a plain tensor's detach is cheap, a
    # DTensor's goes through DTensor's dispatch): the same dict as state_dict() gives.
    with torch.no_grad():
        state = {"model": local(model.state_dict(keep_vars=True)), "optim": local(optimizer_state(optimizer)),
                 "rng": rng_state()}
    if lr_scheduler is not None:
        state["sched"] = lr_scheduler.state_dict()
    if extra is not None:
        state["extra"] = extra
    return state


@layout.gc_paused()  # load_state_dict builds a dict per module and per parameter
def restore(model: torch.nn.Module, optimizer: torch.optim.Optimizer, lr_scheduler: Any, extra: dict | None,
            state: dict) -> None:
    load_model(model, state["model"])
    load_optimizer(optimizer, state["optim"])
    if lr_scheduler is not None:
        lr_scheduler.load_state_dict(state["sched"])
    if extra is not None:
        extra.clear()
        extra.update(state["extra"])
    set_rng_state(state["rng"])


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
    fut = dist.all_reduce(buf, group=group, async_op=True).get_future()

    def done(f):
        marks.end(started)
        return f.value()[0]

    return fut.then(done)


def _marked(marks, started: int, work):
    """Marks the collective ``work`` off the wire when it completes (or now, if it ran synchronously)."""
    if work is None:
        marks.end(started)
        return work
    try:
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


def load_model(model: torch.nn.Module, saved: dict) -> None:
    """Copies ``saved`` into the model's parameters and buffers in place (DTensors: into their local shards)."""
    live = model.state_dict()
    if not any(_is_dtensor(v) for v in live.values()):
        model.load_state_dict(saved)
        return
    if list(live) != list(saved):
        raise KeyError(f"the model's state keys differ from the restored ones: {sorted(set(live) ^ set(saved))[:5]}")
    with torch.no_grad():
        for k, t in live.items():
            (t.to_local() if _is_dtensor(t) else t).copy_(saved[k])


def optimizer_state(opt: torch.optim.Optimizer) -> dict:
    from torch.distributed.optim import ZeroRedundancyOptimizer

    if isinstance(opt, ZeroRedundancyOptimizer):
        # The rank's shard, and ZeRO's own param_groups (LR schedulers write the learning rate there).
        groups = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
        return {"shard": opt.optim.state_dict(), "groups": groups}
    return opt.state_dict()


def load_optimizer(opt: torch.optim.Optimizer, state: dict) -> None:
    from torch.distributed.optim import ZeroRedundancyOptimizer

    if isinstance(opt, ZeroRedundancyOptimizer):
        opt.optim.load_state_dict(state["shard"])
        for group, saved in zip(opt.param_groups, state["groups"]):
            group.update(saved)
        return
    opt.load_state_dict(_as_dtensors(opt, state))


def _as_dtensors(opt: torch.optim.Optimizer, state: dict) -> dict:
    """Wraps restored local shards back into DTensors where the optimizer's parameters are DTensors."""
    from torch.distributed.tensor import DTensor

    params = [p for g in opt.param_groups for p in g["params"]]
    if not any(_is_dtensor(p) for p in params):
        return state
    out = dict(state)
    out["state"] = {}
    for idx, entry in state["state"].items():
        p = params[idx]
        if not _is_dtensor(p):
            out["state"][idx] = entry
            continue
        shard = p.to_local()
        out["state"][idx] = {
            k: DTensor.from_local(v, p.device_mesh, p.placements, shape=p.shape, stride=p.stride())
            if isinstance(v, torch.Tensor) and v.dim() and v.shape == shard.shape else v
            for k, v in entry.items()
        }
    return out


def rng_state() -> dict:
    """The RNG states of torch (and CUDA where initialised), numpy and Python's ``random``.

    Python's Mersenne Twister state, a tuple of 625 ints, is kept as one uint32 array: as 625
    scalars it was most of a commit's layout walk and of every delta's scalars (0.5 ms a commit).
    """
    version, words, gauss = random.getstate()
    state = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(),
             "python": (version, np.array(words, dtype=np.uint32), gauss)}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    version, words, gauss = state["python"]
    random.setstate((version, tuple(int(w) for w in words), gauss))
    if "cuda" in state:
        torch.cuda.set_rng_state_all(state["cuda"])


def shadow_step_on_first_forward(ddp: torch.nn.parallel.DistributedDataParallel) -> None:
    """Makes the first forward after a restore run one shadow forward/backward first (see Config).

    DDP buckets gradients in a provisional layout until its first backward, then rebuilds them in
    the order the gradients became ready; the layout decides how the all-reduce sums. A run that
    never stopped has rebuilt buckets at every step after its first. The shadow step (same batch,
    RNG and buffers put back, gradients dropped) gives the restored run the same layout.
    """

    def hook(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        handle.remove()
        rng = rng_state()
        buffers = [b.detach().clone() for b in module.buffers()]
        with torch.enable_grad():
            out = module(*args, **kwargs)
            leaves = [t for t in _tensors(out) if t.requires_grad]
            if leaves:
                torch.stack([t.float().sum() for t in leaves]).sum().backward()
        for p in module.parameters():
            p.grad = None
        with torch.no_grad():
            for b, saved in zip(module.buffers(), buffers):
                b.copy_(saved)
        set_rng_state(rng)
        log.info("ran the shadow DDP step: gradient buckets now have their rebuilt layout")

    handle = ddp.register_forward_pre_hook(hook, with_kwargs=True)


def _tensors(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in _tensors(v)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in _tensors(v)]
    return []
