"""ffstate/scheduling/scheduler.py: the scheduler's decisions, on a simulated clock (no timing measured here: that is
`ffstate bench overhead`). The marks it reads are tested in test_shm.py, the profiled timeline in
test_profiling.py."""

import pytest

from ffstate.scheduling.scheduler import Naive, Scheduler
from ffstate.scheduling.windows import merge_intervals, predicted_busy_until, project


class FakeClock:
    """Monotonic and wall clock in one; ``sleep`` advances it and records how long was slept."""

    def __init__(self, start: float = 1000.0):
        self.now = start
        self.slept = 0.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds
        self.slept += seconds


def scheduler(busy, clock, **kw) -> Scheduler:
    return Scheduler(busy, clock=clock, wall=clock, sleep=clock.sleep, **kw)


def idle():
    return 0, [], []


def flat(intervals) -> list[float]:
    return [x for pair in intervals for x in pair]


def test_prediction_repeats_the_last_steps_collectives_after_the_newest_commit():
    commits = [10.0, 11.0]  # one step per second
    intervals = [(10.2, 10.4), (10.7, 10.8), (9.5, 9.6)]  # the last one is from an older step
    assert predicted_busy_until(11.1, 11.15, intervals, commits) is None  # a gap
    assert predicted_busy_until(11.1, 11.25, intervals, commits) == pytest.approx(11.4)  # runs into 11.2-11.4
    assert predicted_busy_until(11.75, 11.76, intervals, commits) == pytest.approx(11.8)
    assert predicted_busy_until(11.9, 12.25, intervals, commits) == pytest.approx(12.4)  # the step after
    assert predicted_busy_until(11.1, 11.3, intervals, [11.0]) is None  # one commit: no step length yet


def test_a_profiled_timeline_is_placed_after_the_newest_commit_and_holds_chunks_out_of_it():
    intervals = ((0.2, 0.4),)
    # The last step took 0.5 s, the profiled one 1.0: offsets scaled to it, and the next step 0.5 s on.
    assert flat(project(intervals, 1.0, [10.0, 10.5])) == pytest.approx([10.6, 10.7, 11.1, 11.2])
    assert flat(project(intervals, 1.0, [10.0])) == pytest.approx([10.2, 10.4, 11.2, 11.4])  # one commit: profiled
    assert project(intervals, 1.0, []) == []
    for predicted, released in ((None, 11.15), (lambda: project(intervals, 1.0, [10.0, 11.0]), 11.4)):
        clock = FakeClock(11.05)
        s = scheduler(idle, clock, share=1.0, link_bytes_per_s=1e6, predicted=predicted)
        s.before_chunk("h", 100_000)  # the empty bucket holds it to 11.15; on the wire 0.1 s, into 11.2-11.4
        assert clock.now == pytest.approx(released, abs=0.003)
        assert s.timeline.collectives == 0  # predictions are not counted as the training's collectives


def test_collisions_count_collectives_that_start_while_a_chunk_is_on_the_wire():
    clock = FakeClock(10.0)
    marks = {"intervals": [], "commits": [9.0, 10.0]}
    naive = Naive(lambda: (0, marks["intervals"], marks["commits"]), link_bytes_per_s=1e6, wall=clock)
    naive.before_chunk("h", 100_000)  # on the wire 10.0-10.1
    naive.before_chunk("h", 100_000)  # queued behind it: 10.1-10.2
    marks["intervals"] = [(10.15, 10.3), (10.25, 10.35), (10.5, 10.6)]  # merged: 10.15-10.35 (met one), 10.5
    clock.now = 10.6
    links = naive.links()
    assert (naive.timeline.collectives, naive.timeline.collisions, links["h"].collisions) == (2, 1, 1)
    assert naive.timeline.overlap == pytest.approx(0.05) == links["h"].overlap  # 10.15-10.2 shared the link
    assert naive.links()["h"].collisions == 1  # each collective is counted once
    # Ranks of one node mark the same collective: one collective, not two.
    assert merge_intervals([(1.0, 1.2), (1.05, 1.25), (1.5, 1.6)]) == [(1.0, 1.25), (1.5, 1.6)]
    naive.after_push("h", 200_000, 0.2)
    assert links["h"].estimate == 1e6  # given: kept
    measured = Naive()
    measured.after_push("h", 2_000_000, 0.5)  # unpaced: the push's rate is the link's
    assert measured.links()["h"].estimate == pytest.approx(4e6)
    assert measured.timeline.collectives == 0  # no marks to read


def test_token_bucket_holds_replication_to_its_share_of_the_link():
    clock = FakeClock()
    s = scheduler(idle, clock, share=0.5, link_bytes_per_s=10e6)  # 5 MB/s for replication
    for _ in range(50):
        s.before_chunk("h", 100_000)  # 5 MB in all
    # The bucket starts empty and holds 0.05 s of the rate: 5 MB at 5 MB/s is a second, less that burst.
    assert clock.slept == pytest.approx(1.0, abs=0.06)
    assert s.links()["h"].sent_bytes == 5_000_000


def test_chunks_wait_while_the_training_is_on_the_wire_unless_the_lag_bound_is_near():
    clock = FakeClock()
    state = {"inflight": 1}

    def busy():
        if clock.slept > 0.1:  # the all-reduce finishes after 0.1 s
            state["inflight"] = 0
        return state["inflight"], [], []

    s = scheduler(busy, clock, share=1.0, link_bytes_per_s=1e9)
    s.before_chunk("h", 1000)
    assert 0.1 <= clock.slept < 0.11
    state["inflight"], clock.slept = 1, 0.0
    clock.now += 100  # the bucket refills
    s.before_chunk("h", 1000, behind=3)  # three versions behind: the deadline, no waiting for windows
    assert clock.slept == 0.0 and s.links()["h"].overrides == 1


def test_a_commit_held_for_replication_is_not_waited_for_in_the_collectives_that_wait_for_it():
    """A worker whose commit the lag policy holds leaves the other ranks in their next collective, which never ends
    while the chunk waits for it: the chunk goes at once (this once cost 2 s a step under FSDP2 with max_lag 1)."""
    clock = FakeClock()
    held = {"on": True}

    def busy():  # the others' all-gather, waiting for the held rank, for ever
        return 1, [], []

    s = Scheduler(busy, clock=clock, wall=clock, sleep=clock.sleep, share=1.0, link_bytes_per_s=1e9,
                  held=lambda: held["on"])
    s.before_chunk("h", 1000)
    assert clock.slept == 0.0 and s.links()["h"].rushes == 1
    held["on"] = False
    s.before_chunk("h", 1000)  # not held: it waits for the collective (here, until the stale-prediction give-up)
    assert clock.slept >= 1.9


def test_replication_that_falls_behind_takes_the_whole_link_in_windows():
    clock = FakeClock()
    s = scheduler(idle, clock, share=0.5, link_bytes_per_s=1e6)
    s.before_chunk("h", 100_000, behind=1)  # keeping up: the share, 0.5 MB/s
    assert clock.slept == pytest.approx(0.2, abs=0.002)
    clock.slept = 0.0
    s.before_chunk("h", 100_000, behind=2)  # a newer version waits behind this one: the whole link
    assert clock.slept == pytest.approx(0.1, abs=0.002)
    assert (s.links()["h"].catch_ups, s.links()["h"].overrides) == (1, 0)  # counted (metrics, status)


def test_the_newest_version_is_due_before_the_next_commit():
    """One step a second (commits at 999 and 1000), 1 MB/s: with 0.1 MB of the newest version left, the share
    (0.5 MB/s) and the windows still get it through in time; with 0.225 MB left (counted four times: 0.9 s at the
    link's rate; the node's other ranks share it) and the training on the wire it goes at once, past the windows."""
    clock = FakeClock()
    marks = {"inflight": 1}
    s = scheduler(lambda: (marks["inflight"], [], [999.0, 1000.0]), clock, share=0.5, link_bytes_per_s=1e6)
    clock.now = 1000.0
    marks["inflight"] = 0
    s.before_chunk("h", 100_000, behind=1, remaining=100_000)  # 0.4 s needed of 0.99: the share's 0.2 s wait
    assert clock.slept == pytest.approx(0.2, abs=0.002) and s.links()["h"].rushes == 0
    clock.now, clock.slept, marks["inflight"] = 1000.2, 0.0, 1
    s._link("h").tokens = 100_000
    s.before_chunk("h", 100_000, behind=1, remaining=225_000)  # 0.9 s needed of 0.79 left: past the windows
    assert clock.slept == 0.0 and s.links()["h"].rushes == 1 and s.links()["h"].overrides == 0
    clock.now, clock.slept, marks["inflight"] = 1000.25, 0.0, 0
    s.before_chunk("h", 100_000, behind=1, remaining=150_000)  # 0.6 s of 0.74: faster than the share (0.81 MB/s)
    assert clock.slept == pytest.approx(0.06 / 0.81, abs=0.003)  # the bucket refilled 0.05 s at 0.81, not 0.5 MB/s


def test_a_chunk_queued_behind_others_must_clear_the_predicted_collective_too():
    clock = FakeClock(11.0)
    s = scheduler(idle, clock, share=1.0, link_bytes_per_s=1e6, predicted=lambda: [(11.25, 11.3)])
    link = s._link("h")
    link.tokens, link.wire_until = 1e9, 11.1  # released chunks are on the wire until 11.1
    s.before_chunk("h", 100_000)  # alone it would be through at 11.1; queued, at 11.2 + guard: still clear
    assert clock.now == pytest.approx(11.0)
    s.before_chunk("h", 100_000)  # queued behind that one it would end at 11.3: waits the collective out
    assert clock.now == pytest.approx(11.3, abs=0.003)


def test_the_rate_cap_waits_first_so_a_chunk_never_runs_into_a_collective_meanwhile():
    clock = FakeClock()
    start = clock.now

    def busy():  # the training is on the wire from 0.02 s to 0.1 s
        return int(start + 0.02 <= clock.now < start + 0.1), [], []

    s = scheduler(busy, clock, share=1.0, link_bytes_per_s=1e6)
    s.before_chunk("h", 50_000)  # the empty bucket holds it 0.05 s, into the collective: it then waits it out
    assert clock.now - start >= 0.1


def test_paced_chunks_are_small_enough_to_fit_between_collectives():
    assert Naive().chunk_bytes() == 1 << 20
    assert scheduler(idle, FakeClock()).chunk_bytes() == 1 << 20  # nothing measured yet: the probe's size
    assert scheduler(idle, FakeClock(), link_bytes_per_s=1e9).chunk_bytes() == 1 << 20  # fast link: the default
    assert scheduler(idle, FakeClock(), link_bytes_per_s=100e6).chunk_bytes() == 256 << 10  # 300 KB in 3 ms
    assert scheduler(idle, FakeClock(), link_bytes_per_s=6.25e6).chunk_bytes() == 32 << 10  # 50 Mbit/s: the floor
    clock = FakeClock()
    s = scheduler(idle, clock)
    s.after_push("fast", 100_000_000, 1.0)
    s.after_push("slow", 25_000_000, 1.0)
    # the slowest holder's link decides, but a measured rate counts the per-chunk costs: 75 KB -> 256 KiB, not 64
    assert s.chunk_bytes() == 256 << 10
    assert scheduler(idle, FakeClock(), link_bytes_per_s=25e6).chunk_bytes() == 64 << 10  # given: cut to fit


def test_first_push_is_the_probe_then_the_estimate_follows_real_pushes():
    clock = FakeClock()
    s = scheduler(idle, clock, share=0.5)
    s.before_chunk("h", 1 << 20)  # nothing known yet: not paced
    assert clock.slept == 0
    s.after_push("h", 10_000_000, 1.0)
    assert s.links()["h"].estimate == pytest.approx(10e6)
    s.after_push("h", 10_000_000, 0.5)  # faster now: the running estimate moves towards 20 MB/s
    assert 10e6 < s.links()["h"].estimate < 20e6
    before = s.links()["h"].estimate
    s.after_push("h", 10_000_000, 1.5, held=1.0)  # held a second by the pacing: 10 MB in the other 0.5 s
    assert s.links()["h"].estimate > before
    assert Naive().links() == {} and Naive().before_chunk("h", 1) == 0.0


