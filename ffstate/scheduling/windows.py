"""The training's communication as its workers' marks show it: the union of the ranks' intervals, and the next
step's collectives predicted from the last step's (marked) or from a profiled timeline (``profiling.py``).
The scheduler paces replication around them; the watchdog subtracts them from a step to get its compute."""

from __future__ import annotations


def merge_intervals(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The union of the intervals, in order: the ranks of one node mark the same collective each."""
    out: list[tuple[float, float]] = []
    for s, e in sorted(intervals):
        if out and s <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], e))
        else:
            out.append((s, e))
    return out


def predicted_busy_until(start: float, end: float, intervals: list[tuple[float, float]], commits: list[float]
                         ) -> float | None:
    """When the training's predicted communication that overlaps [start, end) ends (None: it does not).

    The last complete step's collectives (the intervals between the two newest commits), at the same
    offsets after the newest commit, are the prediction for the step in progress.
    """
    if len(commits) < 2:
        return None
    prev, last = commits[-2], commits[-1]
    period = last - prev
    if period <= 0:
        return None
    for s, e in intervals:
        if prev <= s < last:
            for base in (last, last + period):  # this step, and the next one for a long chunk
                ps, pe = base + (s - prev), base + (e - prev)
                if ps < end and pe > start:
                    return pe
    return None


def project(intervals: "tuple[tuple[float, float], ...]", period: float, commits: list[float]
            ) -> list[tuple[float, float]]:
    """A profiled timeline (``intervals``: offsets after a step's commit; ``period``: the step's length)
    placed after the newest of ``commits`` and one step later: the predicted collectives of the step in
    progress and of the next. Where two commits are known, the step is the last one's length and the
    offsets are scaled to it: the profiler slowed the profiled steps' compute (by 6-10% for TinyGPT
    under gloo), and a collective at the end of the backward would otherwise be predicted that much
    late (15 ms in a 240 ms step)."""
    if not commits:
        return []
    last = commits[-1]
    step = last - commits[-2] if len(commits) > 1 and last > commits[-2] else period
    scale = step / period
    return [(base + s * scale, base + e * scale) for base in (last, last + step) for s, e in intervals]
