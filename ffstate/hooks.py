"""A user's DDP communication hook (gradient compression: PowerSGD, fp16/bf16, their own) beside ffstate.

DDP takes one communication hook per model, ever, and ffstate uses one to mark when the gradient all-reduce is on
the wire (``scheduling/marks.py``, for the scheduler). ``register_comm_hook`` registers the user's hook *wrapped*: the user's
hook does the communication, ffstate marks when its work starts and ends. The hook's state then belongs to the
training's state: PowerSGD keeps error feedback, its low-rank factors, a random generator and an iteration count,
and a restored run is bit-identical only if they come back too. ``state_of`` says what of a registered hook's state
ffstate captures at each commit and restores (``capture.py``), and a DDP shadow step after a restore leaves it as it
was (it runs the hook too).

A hook registered with ``ddp.register_comm_hook`` before ``replicate`` is left alone: ffstate cannot register beside
it, learns the training's collectives from a few profiled steps instead, and cannot see the hook's state (say
``extra={"hook": state}`` for a state with ``state_dict``).
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np
import torch

from ffstate import shm
from ffstate.scheduling import marks


def register_comm_hook(ddp: torch.nn.parallel.DistributedDataParallel, state: Any, hook: Callable) -> None:
    """``ddp.register_comm_hook(state, hook)``, with ffstate's marks around the hook's work (and around DDP's
    broadcast of the module's buffers, as without a hook); call it where the loop would call DDP's, before
    ``ffstate.replicate(...)``.

    Raises:
        RuntimeError: DDP's own error when the model has a communication hook already.
    """
    comm = shm.CommMarks()
    ddp.register_comm_hook((comm, state, hook), _marked_hook)
    marks.mark_ddp_buffer_broadcast(ddp, comm)  # as pacing.py marks them beside its own hook
    ddp._ffstate_marks = comm  # pacing.py takes these marks: no hook of its own
    ddp._ffstate_hook_state = state


def _marked_hook(packed, bucket):  # no annotations: DDP checks them, and this module's are strings
    """The user's hook on ``bucket``; its work marked on the wire from the call to the end of its future."""
    comm, state, hook = packed
    return marks.ended(comm, comm.start(), hook(state, bucket))


class PowerSGDState:
    """What a ``PowerSGDState`` keeps between steps, as an object with state (``state_dict``/``load_state_dict``):
    the iteration, the generator, the error feedback and the low-rank factors by bucket, the compression counters.
    Its process group and hyperparameters are the job's, not state."""

    FIELDS = ("iter", "total_numel_before_compression", "total_numel_after_compression", "next_stats_report")
    DICTS = ("error_dict", "p_memory_dict", "q_memory_dict")

    def __init__(self, state: Any):
        self.state = state

    def state_dict(self) -> dict:
        s = self.state
        name, keys, pos, has_gauss, cached = s.rng.get_state()
        return {**{f: getattr(s, f) for f in self.FIELDS},
                "rng": {"name": name, "keys": keys, "pos": pos, "has_gauss": has_gauss, "cached": cached},
                **{d: {int(k): v for k, v in getattr(s, d).items()} for d in self.DICTS}}

    def load_state_dict(self, saved: dict) -> None:
        s = self.state
        for f in self.FIELDS:
            setattr(s, f, saved[f])
        r = saved["rng"]
        s.rng.set_state((r["name"], np.asarray(r["keys"], dtype=np.uint32), int(r["pos"]), int(r["has_gauss"]),
                         float(r["cached"])))
        for d in self.DICTS:  # in place: the hook holds these dicts
            live = getattr(s, d)
            live.clear()
            live.update({int(k): v for k, v in saved[d].items()})


def state_of(model: Any) -> Any | None:
    """The state of the hook registered through ``register_comm_hook`` that ffstate captures with the model's: a
    PowerSGD state, or any state with ``state_dict``/``load_state_dict``; None for a hook with no state of its own
    (a process group, None)."""
    state = getattr(model, "_ffstate_hook_state", None)
    if state is None:
        return None
    from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState as Torch

    if isinstance(state, Torch):
        return PowerSGDState(state)
    if callable(getattr(state, "state_dict", None)) and callable(getattr(state, "load_state_dict", None)):
        return state
    return None
