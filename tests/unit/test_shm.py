"""ffstate/shm/: the slot header as the worker writes it and the daemon reads it (the same files mapped twice,
in one process), and the doorbell's best effort."""

import ctypes
import threading
import time

import pytest

from ffstate import layout, shm
from ffstate.scheduling import profiling
from ffstate.commit import SlotWriter
from ffstate.scheduling.scheduler import Timeline
from helpers import worker_and_daemon_slots


def test_worker_marks_reach_the_daemon_through_the_slot_header(tmp_path, monkeypatch):
    with worker_and_daemon_slots(tmp_path, monkeypatch) as (state, worker, daemon):
        marks = shm.CommMarks()
        early = marks.start()  # before attach (no slots yet): counted, written at attach
        marks.attach(worker)
        assert daemon.comm_marks()[0] == 1
        t = marks.start()
        assert daemon.comm_marks()[0] == 2  # both on the wire now
        marks.end(early)
        marks.end(t)
        SlotWriter(worker).commit(state, 1)
        SlotWriter(worker).commit(state, 2)
        inflight, intervals, commits = daemon.comm_marks()
        assert inflight == 0 and len(intervals) == 2 and all(a <= b <= time.time() for a, b in intervals)
        assert len(commits) == 2 and commits[0] <= commits[1]
        timeline = Timeline(daemon.comm_marks)
        timeline.observe()
        assert timeline.collectives == 1  # the two overlapped: one collective (the ranks of a node mark each)
        for _ in range(shm.COMM_RING + 5):  # the ring keeps the newest
            marks.end(marks.start())
        assert len(daemon.comm_marks()[1]) == shm.COMM_RING
        marks.start()  # a worker dies in the middle of an all-reduce: its count stays in the header...
        assert daemon.comm_marks()[0] == 1
        monkeypatch.setattr(shm.marks, "STALE_MARKS", 0.0)  # ...until no commit came for STALE_MARKS seconds
        assert daemon.comm_marks()[0] == 0


def test_a_profiled_timeline_reaches_the_daemon_through_the_slot_header(tmp_path, monkeypatch):
    with worker_and_daemon_slots(tmp_path, monkeypatch) as (state, worker, daemon):
        assert daemon.profiled_timeline() is None
        t = profiling.ProfiledTimeline(3, 0.25, ((0.01, 0.02), (0.1, 0.15)))
        worker.set_profiled_timeline(t)
        assert daemon.profiled_timeline() == t
        SlotWriter(worker).commit(state, 1)  # commits leave it
        assert daemon.profiled_timeline() == t
        full = profiling.ProfiledTimeline(3, 1.0, tuple((i / 100, i / 100 + 0.005) for i in range(shm.TIMELINE_MAX)))
        worker.set_profiled_timeline(full)
        assert daemon.profiled_timeline() == full
        worker.set_profiled_timeline(profiling.ProfiledTimeline(3, 0.2, ()))  # profiled, no collectives found
        assert daemon.profiled_timeline().intervals == ()
        assert ctypes.sizeof(shm.Header) <= shm.PAGE and shm.Header.timeline.offset + 16 * shm.TIMELINE_MAX \
            <= ctypes.sizeof(shm.Header)  # inside the header


@pytest.mark.parametrize("bell", [("ffstate-gone-1-0", 7), None], ids=["gone", "none"])
def test_a_commit_whose_daemon_is_gone_or_has_no_doorbell_does_not_fail(tmp_path, bell):
    """The doorbell is best effort: ringing a daemon that no longer exists is not an error, and slots made
    without one (a daemon that could not open it) are committed all the same, found by its look."""
    from helpers import train_states

    state = next(iter(train_states(1)))
    manifest = layout.describe(state)
    paths = [tmp_path / "slot-0", tmp_path / "slot-1"]
    shm.create_slots(paths, manifest, shm.DEFAULT_SCALARS_CAPACITY, bell=bell)
    slots = shm.Slots(paths, manifest)
    try:
        assert ((slots._bell.address, slots._bell.ring_bytes) if slots._bell else None) == (
            ("\0" + bell[0], bell[1].to_bytes(8, "little")) if bell else None)
        SlotWriter(slots).commit(state, 1)
        SlotWriter(slots).commit(state, 2)
        assert [v for v, _ in slots.committed()] == [2, 1]
    finally:
        slots.close()


def _patch_sleep(monkeypatch, fake):
    """Patch time.sleep, which is the time module's, for this thread only: a thread left running by an earlier
    test in the same worker would otherwise call the fake (and spin on it, not sleeping)."""
    real, mine = time.sleep, threading.current_thread()
    monkeypatch.setattr("ffstate.lag.time.sleep", lambda s: fake(s) if threading.current_thread() is mine else real(s))


def test_a_commit_held_by_the_lag_policy_shows_in_the_header_until_it_is_released(tmp_path, monkeypatch):
    from ffstate.lag import LagWatch

    with worker_and_daemon_slots(tmp_path, monkeypatch) as (state, worker, daemon):
        seen = []

        class Job:  # what LagWatch reads of the job; the daemon is never asked (the header answers)
            rank, world = 0, 1

            def publish_replicated(self, version):
                pass

        def sleep(_):  # the daemon, while the commit is held: sees it, then replicates version 3
            seen.append(daemon.lag_held())
            daemon.set_replicated(3)

        _patch_sleep(monkeypatch, sleep)
        lag = LagWatch(Job(), daemon=lambda: None, on_lost=lambda e: None)
        lag.replicated = 1
        assert daemon.lag_held() == 0.0
        lag.wait(4, timeout=5.0, within=1, slots=worker, hold=True)
        assert seen and seen[0] > 0.0 and lag.replicated == 3
        assert daemon.lag_held() == 0.0  # released


def test_the_block_policy_does_not_hold_a_commit_for_a_holder_that_is_down(tmp_path, monkeypatch):
    """A holder whose daemon is gone cannot catch up until its node's ranks restart it, and they may be waiting
    for this rank in a collective: the daemon counts such holders in the header, and the hold ends on it."""
    from ffstate.lag import LagWatch

    with worker_and_daemon_slots(tmp_path, monkeypatch) as (state, worker, daemon):
        polls = []

        class Job:
            rank, world = 0, 1

            def publish_replicated(self, version):
                pass

        def sleep(_):  # the daemon's third push to the lagging holder finds it unreachable
            polls.append(daemon.lag_held())
            if len(polls) == 3:
                daemon.set_replicated(1, holders_down=1)

        _patch_sleep(monkeypatch, sleep)
        lag = LagWatch(Job(), daemon=lambda: None, on_lost=lambda e: None)
        lag.replicated = 1
        assert lag.wait(9, timeout=60.0, within=4, slots=worker, hold=True) == "down"
        assert len(polls) == 3 and lag.replicated == 1  # released at once, still lagging
        assert daemon.lag_held() == 0.0 and worker.holders_down() == 1
        daemon.set_replicated(9)  # a push went through: the count clears with the version
        assert worker.holders_down() == 0 and worker.replicated() == 9
