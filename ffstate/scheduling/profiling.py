"""A few profiled steps give the scheduler the training's communication timeline where nothing marks it
(docs/design.md section 4, step 3).

DDP (its communication hook) and FSDP2 (its collectives' seams) mark each collective as it runs
(``shm.CommMarks``). A training loop with neither (gradients all-reduced by hand, tensor parallelism,
pipeline sends) has no seam to mark. For it the worker runs ``torch.profiler`` over a few steps after
its first commits (``StepProfiler``), with a marker at the end of each commit, and takes from the
trace when its collectives were on the wire: gloo's ``gloo:*`` events, which gloo's threads record
for the whole transfer, and NCCL's kernels on the GPU. The offsets from the commit of one profiled
step (the one of median length), merged, are the **profiled timeline** (``ProfiledTimeline``). The
worker writes it once into its slot header; the daemon's scheduler places it after each newest
commit as its prediction of the step in progress (``windows.project``), as it does with the last
step's marks where there are marks.

The profiler slows the profiled steps' compute (it records every operator: 6-10% a step for TinyGPT
under gloo, which the daemon scales away, ``windows.project``); it is stopped after
them and not run again in the process (the timeline stays with the model, and a restarted worker
takes the one its slots hold). A profiler the user already runs takes precedence: ffstate then logs
that it does without.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ffstate.scheduling.windows import merge_intervals

if TYPE_CHECKING:
    import torch

log = logging.getLogger("ffstate.profiling")

MARKER = "ffstate.commit"  # the record_function each profiled commit ends with
WARMUP_COMMITS = 2  # the first steps create optimizer state and caches: not what later steps look like
MAX_INTERVALS = 64  # what the slot header holds; more are merged across their smallest gaps


@dataclass(frozen=True)
class ProfiledTimeline:
    """One step's collectives, as (start, end) seconds after the step's commit; ``period``: the step's
    length from commit to commit; ``steps``: how many steps were profiled."""

    steps: int
    period: float
    intervals: tuple[tuple[float, float], ...]

    @property
    def busy_seconds(self) -> float:
        return sum(e - s for s, e in self.intervals)


def timeline_of(marks: list[float], collectives: list[tuple[float, float]],
                limit: int = MAX_INTERVALS) -> ProfiledTimeline | None:
    """The timeline of the median-length step between consecutive ``marks`` (commit times), from
    ``collectives`` ((start, end), on the marks' clock); None without a whole step."""
    steps = [(a, b) for a, b in zip(marks, marks[1:]) if b > a]
    if not steps:
        return None
    a, b = sorted(steps, key=lambda ab: ab[1] - ab[0])[len(steps) // 2]
    offsets = merge_intervals([(s - a, e - a) for s, e in collectives if a <= s < b])
    return ProfiledTimeline(len(steps), b - a, tuple(coarsen(offsets, limit)))


def coarsen(intervals: list[tuple[float, float]], limit: int) -> list[tuple[float, float]]:
    """At most ``limit`` intervals covering ``intervals`` (sorted, disjoint): the smallest gaps are closed."""
    if len(intervals) <= limit:
        return intervals
    gaps = sorted(b[0] - a[1] for a, b in zip(intervals, intervals[1:]))
    close = gaps[len(intervals) - limit - 1]  # closing every gap up to this one leaves at most `limit`
    out = [intervals[0]]
    for s, e in intervals[1:]:
        if s - out[-1][1] <= close:
            out[-1] = (out[-1][0], e)
        else:
            out.append((s, e))
    return out


def is_collective(name: str, on_gpu: bool) -> bool:
    """gloo's collectives (CPU events on its threads, spanning the transfer) and NCCL's kernels; NCCL's
    CPU-side events only launch the kernels."""
    return name.startswith("gloo:") or (on_gpu and "nccl" in name.lower())


class StepProfiler:
    """Worker side: profiles ``steps`` steps from the ``WARMUP_COMMITS``-th commit on; the trainer calls
    ``on_commit`` at the end of each commit, and it returns the timeline once, when the steps are done."""

    def __init__(self, steps: int, cuda: bool = False):
        self.steps, self.cuda = steps, cuda
        self.done = False
        self._commits = 0
        self._prof: torch.profiler.profile | None = None
        self._started = 0.0

    def on_commit(self) -> ProfiledTimeline | None:
        if self.done:
            return None
        self._commits += 1
        if self._prof is None:
            if self._commits < WARMUP_COMMITS or not self._start():
                return None
        import torch  # the worker's side: the timeline's readers (the daemon) run without torch

        with torch.profiler.record_function(MARKER):
            pass
        if self._commits < WARMUP_COMMITS + self.steps:
            return None
        return self._finish()

    def _start(self) -> bool:
        import torch

        if torch.autograd._profiler_enabled():
            log.info("a profiler is already running: no profiled timeline (the scheduler paces by rate only)")
            self.done = True
            return False
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.cuda:
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        try:
            prof = torch.profiler.profile(activities=activities)
            prof.start()
        except Exception as e:  # noqa: BLE001 (the profiler's failures are its own: training goes on)
            log.warning("could not start the profiler (%s): no profiled timeline; the scheduler paces by rate only", e)
            self.done = True
            return False
        self._prof, self._started = prof, time.perf_counter()
        return True

    def _finish(self) -> ProfiledTimeline | None:
        prof, self._prof, self.done = self._prof, None, True
        try:
            prof.stop()
            marks, collectives = _events(prof)
        except Exception as e:  # noqa: BLE001
            log.warning("profiling the steps failed (%s): no profiled timeline; the scheduler paces by rate only", e)
            return None
        timeline = timeline_of(marks, collectives)
        log.debug("profiled %d steps in %.2fs: %d markers, %d collective events", self.steps,
                  time.perf_counter() - self._started, len(marks), len(collectives))
        return timeline

    def close(self) -> None:
        """Stops a profiler still running (the context left mid-profile); the trace is dropped."""
        prof, self._prof, self.done = self._prof, None, True
        if prof is not None:
            try:
                prof.stop()
            except Exception:  # noqa: BLE001, S110
                pass


def _events(prof: torch.profiler.profile) -> tuple[list[float], list[tuple[float, float]]]:
    """The markers' times and the collectives' (start, end), in seconds on the trace's clock."""
    import torch

    gpu = torch.autograd.DeviceType.CUDA
    results = getattr(prof.profiler, "kineto_results", None)
    if results is not None:  # the raw events: a hundred times faster than building prof.events()
        raw = [(e.name(), e.start_ns() / 1e9, (e.start_ns() + e.duration_ns()) / 1e9, e.device_type() == gpu)
               for e in results.events()]
    else:
        raw = [(e.name, e.time_range.start / 1e6, e.time_range.end / 1e6, e.device_type == gpu) for e in prof.events()]
    marks = sorted(s for name, s, _, _ in raw if name == MARKER)
    collectives = sorted((s, e) for name, s, e, on_gpu in raw if is_collective(name, on_gpu))
    return marks, collectives
