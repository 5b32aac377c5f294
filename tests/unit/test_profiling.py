"""ffstate/scheduling/profiling.py: the timeline a few profiled steps give the scheduler (the median step's collectives as
offsets from its commit), and the profiler in a 1-rank gloo group in this process."""

import time

import pytest

from ffstate.scheduling import profiling


def flat(intervals) -> list[float]:
    return [x for pair in intervals for x in pair]


def test_profiled_timeline_is_the_median_steps_collectives_as_offsets_from_its_commit():
    marks = [0.0, 1.0, 2.2, 3.1]  # steps of 1.0, 1.2 and 0.9 s: the median is the first
    collectives = [(0.1, 0.2), (0.15, 0.3), (0.5, 0.6), (1.1, 1.5), (2.3, 2.4), (3.2, 3.3)]
    t = profiling.timeline_of(marks, collectives)
    assert (t.steps, t.period) == (3, 1.0)
    assert flat(t.intervals) == pytest.approx([0.1, 0.3, 0.5, 0.6])  # overlapping ones merged
    assert t.busy_seconds == pytest.approx(0.3)
    assert profiling.timeline_of([5.0], collectives) is None  # no whole step
    # More than the slot header holds: the smallest gaps are closed, every collective still covered.
    many = [(i * 0.01 + (0.004 if i % 3 else 0.0), i * 0.01 + 0.006) for i in range(90)]
    coarse = profiling.timeline_of([0.0, 1.0], many).intervals
    assert len(coarse) <= profiling.MAX_INTERVALS
    assert all(any(a <= s and e <= b for a, b in coarse) for s, e in many)
    assert profiling.is_collective("gloo:all_reduce", False) and not profiling.is_collective("aten::mm", False)
    assert profiling.is_collective("ncclDevKernel_AllGather_RING_LL", True)
    assert not profiling.is_collective("nccl:all_reduce", False)  # NCCL's CPU side only launches the kernel


def test_profiled_steps_find_the_collectives_and_yield_to_a_users_profiler(tmp_path):
    """In-process: a 1-rank gloo group all-reduces in each step; the profiler finds it between the commits'
    markers. With the user's own profiler running, ffstate does without."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        x = torch.ones(1 << 16)
        p = profiling.StepProfiler(3)
        got = []
        for step in range(6):
            time.sleep(0.01)
            dist.all_reduce(x)
            time.sleep(0.01)
            got.append(p.on_commit())
        assert got[:4] == [None] * 4 and p.done  # commits 2-5: markers; the timeline at the fifth
        t = got[4]
        assert t.steps == 3 and 0.015 < t.period < 1.0 and len(t.intervals) == 1
        s, e = t.intervals[0]
        assert 0.005 < s < e < t.period  # after the step's first sleep, inside the step
        assert got[5] is None  # once
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
            q = profiling.StepProfiler(3)
            assert [q.on_commit() for _ in range(6)] == [None] * 6 and q.done
    finally:
        dist.destroy_process_group()

