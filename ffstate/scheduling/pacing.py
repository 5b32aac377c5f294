"""The signals a worker gives its daemon's scheduler (docs/design.md section 4, step 3): marks of DDP's or
FSDP2's collectives in the slot header (``marks.py``), or, where nothing marks them, the timeline of a
few profiled steps (``profiling.py``). Chosen once per model: a DDP model takes one communication hook,
ever, and a timeline found stays with the model across ``replicate`` contexts."""

from __future__ import annotations

import logging

import torch

from ffstate import inflight, shm
from ffstate.scheduling import marks, profiling
from ffstate.config import Config

log = logging.getLogger("ffstate.pacing")


class PacingSignals:
    """A model's collective marks and, where there are none, its step profiler; attached to its rank's slots."""

    def __init__(self, model: torch.nn.Module, cfg: Config, rank: int, world: int, replicated: bool):
        self.model, self.rank = model, rank
        self.marks = _comm_marks(model, cfg, rank)
        self.timeline: profiling.ProfiledTimeline | None = None
        self.profiler: profiling.StepProfiler | None = None
        # Profiled steps only where the daemon paces into windows, replicates, and nothing marks the collectives.
        if (cfg.scheduler == "windows" and cfg.profile_steps and replicated and world > 1
                and getattr(model, "_ffstate_marks", None) is None):
            self.timeline = getattr(model, "_ffstate_timeline", None)
            if self.timeline is None:
                self.profiler = profiling.StepProfiler(cfg.profile_steps,
                                                       cuda=any(p.is_cuda for p in model.parameters()))
        self._slots: shm.Slots | None = None

    def attach(self, slots: shm.Slots | None) -> None:
        """Writes the marks (and a timeline) into ``slots``' header from now on; None detaches."""
        self._slots = slots
        self.marks.attach(slots)
        if slots is None:
            return
        if self.timeline is not None:
            slots.set_profiled_timeline(self.timeline)
        elif self.profiler is not None and (kept := slots.profiled_timeline()) is not None:
            self.profiler = None  # a restarted worker: its slots hold what its previous attempt profiled
            self.timeline = self.model._ffstate_timeline = kept
            log.info("rank %d: the scheduler keeps the timeline profiled before the restart (collectives a step: %d)",
                     self.rank, len(kept.intervals))

    def on_commit(self) -> None:
        """After each commit: the profiler's steps, and its timeline into the slot header once found."""
        if self.profiler is None:
            return
        timeline = self.profiler.on_commit()
        if timeline is None:
            if self.profiler.done:  # it could not run
                self.profiler = None
            return
        self.profiler = None
        self.timeline = self.model._ffstate_timeline = timeline
        if self._slots is not None:
            self._slots.set_profiled_timeline(timeline)
        if timeline.intervals:
            log.info("rank %d: profiled %d steps for the scheduler (nothing marks this training's collectives): "
                     "collectives a step: %d, on the wire %.0f ms of its %.0f ms", self.rank, timeline.steps,
                     len(timeline.intervals), timeline.busy_seconds * 1e3, timeline.period * 1e3)
        else:
            log.info("rank %d: profiled %d steps for the scheduler and found no gloo or NCCL collectives in them: "
                     "replication is paced by rate only", self.rank, timeline.steps)

    def close(self) -> None:
        if self.profiler is not None:
            self.profiler.close()
        self.attach(None)


def _comm_marks(model: torch.nn.Module, cfg: Config, rank: int) -> shm.CommMarks:
    """The marks of this model's collectives: DDP's gradient all-reduces, or FSDP2's all-gathers and
    reduce-scatters; kept on the model (DDP takes one communication hook per model, ever)."""
    found = getattr(model, "_ffstate_marks", None)
    if found is not None:
        return found
    made = shm.CommMarks()
    # Under the in-process engine, with any scheduler: the hook's waits are the ones an abort ends (inflight.py).
    if (cfg.scheduler == "windows" or inflight.enabled()) and isinstance(model, torch.nn.parallel.DistributedDataParallel):
        try:  # the scheduler's timeline: when DDP's gradient buckets are on the wire
            model.register_comm_hook((made, model.process_group), marks.marked_allreduce)
            marks.mark_ddp_buffer_broadcast(model, made)
            model._ffstate_marks = made
        except (RuntimeError, ValueError) as e:  # the loop registered a hook of its own with DDP
            log.info("rank %d: DDP has a communication hook of the loop's (%s): the scheduler learns the training's "
                     "collectives from profiled steps; ffstate.register_comm_hook keeps both, and replicates the "
                     "hook's state", rank, str(e).splitlines()[0][:120])
    elif cfg.scheduler == "windows":  # FSDP2: its all-gathers and reduce-scatters
        if n := marks.mark_fsdp_collectives(model, made):
            model._ffstate_marks = made
            log.info("rank %d: the scheduler sees the all-gathers and reduce-scatters of %d FSDP2 modules", rank, n)
    return made
