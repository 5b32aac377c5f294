"""What a daemon's persister writes as the daemon stops with ranks still attached (``Persister.close(attached)``):
real slots in shared memory, a real flushing process, the versions read back from disk bit for bit."""

import contextlib
import logging
import os
import signal
import threading
import time
from types import SimpleNamespace

import pytest
import torch

from ffstate import persist
from ffstate.commit import SlotWriter
from ffstate.daemon import persister as persister_module
from ffstate.daemon.persister import Persister, _one_world
from ffstate.errors import ReplicaError
from ffstate.ids import ShardKey
from helpers import assert_bitwise_equal, worker_and_daemon_slots

pytestmark = pytest.mark.timeout(180)


def states(n: int) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    return [{"w": torch.randn(1000, generator=g), "step": torch.tensor(v)} for v in range(1, n + 1)]


@pytest.fixture
def rank_slots(tmp_path, monkeypatch):
    """Rank 0 of 1 of job ``j`` after 3 commits: its slots hold versions 3 and 2; yields (shard, states)."""
    got = states(3)
    with worker_and_daemon_slots(tmp_path, monkeypatch, got[0]) as (_, worker, daemon):
        writer = SlotWriter(worker)
        for v, state in enumerate(got, 1):
            writer.commit(state, v)
        writer.flush()
        yield SimpleNamespace(key=ShardKey("j", 0, 1), slots=daemon, persist_keys=None), got


class Budget:
    """A daemon's memory budget as the persister sees it (``Store.reserve``/``release``): refuses past ``room``."""

    def __init__(self, room: int):
        self.room, self.used, self.peak = room, 0, 0

    def reserve(self, n: int, what: str) -> None:
        if self.used + n > self.room:
            raise ReplicaError(f"no room for {what}: {n} bytes, {self.room - self.used} free", "RESOURCE_EXHAUSTED")
        self.used += n
        self.peak = max(self.peak, self.used)

    def release(self, n: int) -> None:
        self.used -= n
        assert self.used >= 0


def persister(root, budget: Budget | None = None, every: int = 100) -> Persister:
    budget = budget or Budget(1 << 40)
    p = Persister(root, every=every, keep=5, reserve=budget.reserve, release=budget.release, node_id="n0", nice=0)
    deadline = time.monotonic() + 90
    while not p._flusher.ready and time.monotonic() < deadline:  # it imports torch and DCP
        time.sleep(0.05)
    assert p._flusher.ready
    return p


def test_a_stop_writes_both_versions_the_slots_hold_and_a_later_stop_never_rewrites_a_complete_one(
        rank_slots, tmp_path, caplog):
    shard, got = rank_slots
    root = tmp_path / "store"
    with caplog.at_level(logging.INFO, logger="ffstate.daemon.persist"):
        persister(root).close([shard])  # every=100: nothing was due
    job_dir = root / "j"
    assert persist.complete_versions(job_dir) == [2, 3], caplog.text
    for v in (2, 3):
        shard_state, _ = persist.read_shard(persist.version_dir(job_dir, v), 0)
        assert_bitwise_equal(shard_state, got[v - 1])
    files = {p: p.stat().st_mtime_ns for p in job_dir.rglob("*") if p.is_file() and p.parent != job_dir}

    caplog.clear()
    with caplog.at_level(logging.INFO, logger="ffstate.daemon.persist"):
        persister(root).close([shard])  # a daemon started again on the node, stopping under the same ranks
    assert "version 2 is complete on disk already" in caplog.text and "version 3 is complete on disk already" in \
        caplog.text, caplog.text
    assert {p: p.stat().st_mtime_ns for p in files} == files  # not one file written again


def test_a_job_attached_at_two_world_sizes_is_not_written_at_a_stop():
    """A resize under way: the old world's rank 1 of 2 and the new world's rank 1 of 3 would write the same files."""
    old, new = (SimpleNamespace(key=ShardKey("j", 1, w)) for w in (2, 3))
    other = SimpleNamespace(key=ShardKey("k", 0, 1))
    said: list[str] = []
    assert _one_world([old, new, other], said) == [other]
    assert said == ["job j: not written, its ranks are attached at world sizes [2, 3] (a resize)"]


def flush_memfds() -> int:
    """The persister's in-memory copies open in this process (``flusher.Copy``: memfds named ffstate-flush)."""
    fds = "/proc/self/fd"
    return sum(os.readlink(f"{fds}/{fd}").startswith("/memfd:ffstate-flush") for fd in os.listdir(fds)
               if os.path.exists(f"{fds}/{fd}"))


def test_a_stop_counts_each_copy_against_the_budget_before_it_reads_a_byte_and_leaks_none(rank_slots, tmp_path,
                                                                                           monkeypatch):
    """Each version is read from its slot straight into the copy the flushing process writes, reserved first: the
    budget holds every byte read (it once held only the second of two copies). A read the worker's rewrite spoilt is
    read again and its copy closed."""
    shard, got = rank_slots
    budget, seen = Budget(1 << 40), []
    read, unchanged = shard.slots.read, shard.slots.unchanged

    def counted_read(version, take):
        seen.append(budget.used)
        return read(version, take)

    before = flush_memfds()
    spoilt, open_then = iter([False] * 3), []  # the first version's first 3 tries: as if the worker rewrote the slot

    def checked(view) -> bool:
        if (first := next(spoilt, None)) is not None:
            open_then.append(flush_memfds() - before)
        return first if first is not None else unchanged(view)

    monkeypatch.setattr(shard.slots, "read", counted_read)
    monkeypatch.setattr(shard.slots, "unchanged", checked)
    persister(tmp_path / "store", budget).close([shard])
    assert open_then == [1, 1, 1]  # a spoilt try's copy closed before the next is made: one copy, the one counted
    nbytes = shard.slots.manifest.nbytes
    # each version's bytes counted before its read (the older one's copy may still be queued for writing)
    assert len(seen) == 2 and nbytes <= seen[0] and nbytes <= seen[1] <= 2 * nbytes, seen
    assert budget.used == 0 and budget.peak <= 2 * nbytes
    assert flush_memfds() == before  # the spoilt try's copy closed, and the written ones
    job_dir = tmp_path / "store" / "j"
    assert persist.complete_versions(job_dir) == [2, 3]
    for v in (2, 3):
        assert_bitwise_equal(persist.read_shard(persist.version_dir(job_dir, v), 0)[0], got[v - 1])


def test_a_stop_without_room_in_the_budget_reads_nothing_and_says_so(rank_slots, tmp_path, monkeypatch, caplog):
    shard, _ = rank_slots
    budget = Budget(shard.slots.manifest.nbytes - 1)
    monkeypatch.setattr(shard.slots, "read", lambda *a: pytest.fail("read a slot with no room for its copy"))
    with caplog.at_level(logging.INFO, logger="ffstate.daemon.persist"):
        persister(tmp_path / "store", budget).close([shard])
    assert budget.used == 0 and budget.peak == 0
    for v in (2, 3):
        assert f"j/rank 0 of 1: version {v} cannot be flushed: no room for the copy of" in caplog.text, caplog.text
    assert persist.complete_versions(tmp_path / "store" / "j") == []


def test_a_job_s_end_names_its_newest_version_before_it_counts_or_copies_anything(rank_slots, tmp_path, monkeypatch):
    """The job's end (``final`` of the newest version): asked twice, the second says the version was flushed and
    reserves nothing (a tight budget would otherwise log the last version as not flushed)."""
    shard, _ = rank_slots
    budget = Budget(1 << 40)
    asked = []
    monkeypatch.setattr(budget, "reserve", lambda n, what, reserve=budget.reserve: (asked.append(what), reserve(n, what)))
    p = persister(tmp_path / "store", budget)
    try:
        assert p.final([shard]) == ["j/rank 0 of 1: version 3 flushed"]
        again = p.final([shard])
        assert again in (["j/rank 0 of 1: version 3 was flushed already"],
                         ["j/rank 0 of 1: version 3 is complete on disk already"]), again
        assert len(asked) == 1, asked
    finally:
        p.close()
    assert budget.used == 0


def test_an_unexpected_error_reading_a_version_gives_back_its_budget_and_its_copy(rank_slots, tmp_path, monkeypatch):
    shard, _ = rank_slots
    budget = Budget(1 << 40)
    p = persister(tmp_path / "store", budget)
    before = flush_memfds()

    def broken(data):
        raise RuntimeError("a checksum that failed")

    monkeypatch.setattr(persister_module.codec, "buffer_checksum", broken)
    try:
        with pytest.raises(RuntimeError, match="a checksum that failed"):
            p.final([shard])
        assert budget.used == 0 and flush_memfds() == before
    finally:
        monkeypatch.undo()
        p.close()


def test_a_version_the_stop_queued_is_not_copied_again_when_the_replicator_offers_it(rank_slots, tmp_path,
                                                                                    monkeypatch):
    """A daemon stopping under a running job: its ``final`` and the replicator's ``offer`` of the same version (due
    by ``persist_every``) write that rank's files once."""
    shard, _ = rank_slots
    budget = Budget(1 << 40)
    asked = []
    monkeypatch.setattr(budget, "reserve", lambda n, what, reserve=budget.reserve: (asked.append(what), reserve(n, what)))
    p = persister(tmp_path / "store", budget, every=1)
    try:
        assert p.final([shard]) == ["j/rank 0 of 1: version 3 flushed"]
        view, data = shard.slots.read(3, lambda v: (v.data.copy(), 0))
        p.offer(shard.key, 3, shard.slots.manifest.with_scalars(view.scalars), data, 0, None, lambda: True)
        assert len(asked) == 1, asked
    finally:
        p.close()
    assert budget.used == 0


def test_a_job_s_end_waits_for_the_replicator_s_copy_of_its_last_version(rank_slots, tmp_path, monkeypatch):
    """The replicator's offer claims the job's last version and copies it (slowly, here); the job's end finds it
    claimed and must wait for it to be written, not return at once (its daemon may exit right after)."""
    shard, _ = rank_slots
    p = persister(tmp_path / "store", every=1)
    real = persister_module.Copy

    def slow(*args, **kwargs):
        time.sleep(1.0)
        return real(*args, **kwargs)

    monkeypatch.setattr(persister_module, "Copy", slow)
    view, data = shard.slots.read(3, lambda v: (v.data.copy(), 0))
    offer = threading.Thread(target=p.offer, args=(shard.key, 3, shard.slots.manifest.with_scalars(view.scalars), data,
                                                   persister_module.codec.buffer_checksum(data), None, lambda: True))
    offer.start()
    deadline = time.monotonic() + 30
    while not p._copying and time.monotonic() < deadline:  # claimed, copying (the copy takes 1 s more)
        time.sleep(0.005)
    assert p._copying == 1
    try:
        assert p.final([shard]) == ["j/rank 0 of 1: version 3 was flushed already"]
        assert persist.complete_versions(tmp_path / "store" / "j") == [3]  # written before the job's end returned
    finally:
        offer.join()
        p.close()


def test_a_restore_recounts_the_newest_complete_version_of_its_job_only(rank_slots, tmp_path):
    shard, _ = rank_slots
    p = persister(tmp_path / "store")
    try:
        p._complete.update({"other": 500, "j": 3})  # as two jobs' completions left them
        p.stats.newest_complete = 500
        p.forget_after(shard.key, 2)  # j restored to 2: its version 3 was removed (none on disk here)
        deadline = time.monotonic() + 10
        while p._complete["j"] and time.monotonic() < deadline:
            time.sleep(0.02)
        assert p._complete["j"] == 0 and p.stats.newest_complete == 500
    finally:
        p.close()


def test_a_recount_that_fails_is_said_tried_again_and_the_thread_goes_on_writing(rank_slots, tmp_path, monkeypatch,
                                                                                 caplog):
    shard, _ = rank_slots
    p = persister(tmp_path / "store", every=1)
    real, fails = persist.complete_versions, []

    def complete_versions(job_dir, world=None):  # the first two recounts meet a filesystem error
        if len(fails) < 2 and job_dir.name == "j" and world is None and p._complete.get("j"):
            fails.append(job_dir)
            raise PermissionError(13, "Permission denied", str(job_dir))
        return real(job_dir, world)

    monkeypatch.setattr(persister_module.persist, "complete_versions", complete_versions)
    try:
        p._complete["j"] = 3
        p.forget_after(shard.key, 2)
        deadline = time.monotonic() + 20
        while p._complete["j"] and time.monotonic() < deadline:
            time.sleep(0.02)
        assert len(fails) == 2 and p._complete["j"] == 0  # tried again until it could count
        assert "counting the complete versions failed" in caplog.text and "Permission denied" in caplog.text
        view, data = shard.slots.read(3, lambda v: (v.data.copy(), 0))  # the thread still writes versions
        p.offer(shard.key, 3, shard.slots.manifest.with_scalars(view.scalars), data,
                persister_module.codec.buffer_checksum(data), None, lambda: True)
        deadline = time.monotonic() + 60
        while real(tmp_path / "store" / "j") != [3] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert real(tmp_path / "store" / "j") == [3]
    finally:
        p.close()


def test_a_version_is_recorded_as_reached_before_its_files_are_written(rank_slots, tmp_path):
    """A whole job lost right after the flushing process completed a version (it finalizes the last rank's part)
    must not leave that version newer than every ``reached-<node>.json``: each version is noted before its flush.
    (Noted only after it, a suite's run once found versions 4, 6, 8 complete and 7 reached.)"""
    shard, _ = rank_slots
    p = persister(tmp_path / "store", every=1)
    job_dir = tmp_path / "store" / "j"
    seen: list[tuple[int, int]] = []
    real = p._flusher.flush

    def flush(copy, job, idle=None):  # the real flush, with what the disk says was reached as it starts
        seen.append((job["version"], persist.reached(job_dir)))
        return real(copy, job, idle=idle)

    p._flusher.flush = flush
    try:
        for v in (2, 3):
            view, data = shard.slots.read(v, lambda v: (v.data.copy(), 0))
            p.offer(shard.key, v, shard.slots.manifest.with_scalars(view.scalars), data,
                    persister_module.codec.buffer_checksum(data), None, lambda: True)
            deadline = time.monotonic() + 60
            while persist.complete_versions(job_dir)[-1:] != [v] and time.monotonic() < deadline:
                time.sleep(0.05)
    finally:
        p.close()
    assert persist.complete_versions(job_dir) == [2, 3]
    assert [v for v, _ in seen] == [2, 3], seen
    assert all(reached >= v for v, reached in seen), seen


def test_a_version_offered_while_the_thread_takes_another_off_its_queue_is_skipped(tmp_path, monkeypatch):
    """Between the thread taking a version off its queue and marking it as being written, a version offered is
    skipped as one offered while a version is written (it had been queued beside it: CI waited for one version
    pending and found two)."""
    p = persister(tmp_path / "store", every=1)
    taken, go = threading.Event(), threading.Event()
    real = p._note_reached

    def note() -> None:  # what the thread does right after it takes a version, held there
        if p._queue.unfinished_tasks > len(p._queue.queue) and p._writing is None:
            taken.set()
            go.wait(30)
        real()

    monkeypatch.setattr(p, "_note_reached", note)
    monkeypatch.setattr(p, "_flush", lambda job: None)
    try:
        p._queue.put(persister_module._Job(ShardKey("j", 0, 1), 1, SimpleNamespace(nbytes=0, close=lambda: None), 0))
        assert taken.wait(30)
        assert p._decide("j", 2) is False
    finally:
        go.set()
        p.close()


def test_a_stop_during_a_slow_flush_waits_for_its_answer_and_leaves_the_version_it_completed(rank_slots, tmp_path,
                                                                                             caplog):
    """The daemon stops while its flushing process is still writing (held here with SIGSTOP for 2 s: a large state
    on a slow disk): the stop waits for the flush's answer before it closes the socket. It closed it at once, took
    the child's clean exit for a death and removed the rank's files of the version the child had just made complete:
    a version marked complete without its data, which a relaunch refused (and older ones already pruned)."""
    shard, got = rank_slots
    p = persister(tmp_path / "store")
    child = p._flusher._proc.pid
    os.kill(child, signal.SIGSTOP)
    resume = threading.Timer(2.0, os.kill, (child, signal.SIGCONT))
    resume.start()
    try:
        with caplog.at_level(logging.INFO, logger="ffstate.daemon"):
            p.close([shard], wait=0.5)  # the stop's 0.5 s and the thread's 1 s run out while the child is stopped
    finally:
        resume.cancel()
        with contextlib.suppress(ProcessLookupError):
            os.kill(child, signal.SIGCONT)
    job_dir = tmp_path / "store" / "j"
    assert "died while writing" not in caplog.text, caplog.text
    assert 2 in persist.complete_versions(job_dir), caplog.text  # the one the child was writing, answered
    for v in persist.complete_versions(job_dir):
        persist.check(persist.version_dir(job_dir, v), [0])
        assert_bitwise_equal(persist.read_shard(persist.version_dir(job_dir, v), 0)[0], got[v - 1])
    assert p._flusher._proc.poll() is not None  # ended with the daemon's stop (its persisting thread's end)
