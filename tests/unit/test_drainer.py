"""The daemon's side of a drain (``daemon/drain.py``) over a rank's real slots in shared memory, the worker's side
played by hand through the slot header: a drain that stays (``ffstate drain --stay``) and is then asked to leave,
and one whose ranks gave up their hold; the drains' thread ends with its node, and what it cannot do is said."""

import os
import signal
import threading
import time
from types import SimpleNamespace

import pytest
import torch

from ffstate.commit import SlotWriter
from ffstate.daemon.drain import Drainer, agent_of
from ffstate.ids import ShardKey
from helpers import worker_and_daemon_slots

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def rank(tmp_path, monkeypatch):
    """Rank 0 of 2 of job ``j``, committed and replicated at step 7: (its shard as the drainer sees it, its worker's
    view of the slots)."""
    with worker_and_daemon_slots(tmp_path, monkeypatch, {"w": torch.ones(100)}, world=2) as (state, worker, daemon):
        SlotWriter(worker).commit(state, 7)
        worker.set_worker(os.getpid(), "")
        yield SimpleNamespace(key=ShardKey("j", 0, 2), holders=["peer:1"], slots=daemon, replicated_version=7), worker


def until(drainer: Drainer, state: str) -> None:
    deadline = time.monotonic() + 10
    while drainer.report("j").state != state and time.monotonic() < deadline:
        time.sleep(0.01)
    assert drainer.report("j").state == state, drainer.report("j")


def test_a_drain_that_stays_asked_again_to_leave_leaves(rank):
    shard, worker = rank
    kills = []
    drainer = Drainer(lambda: [shard], kill=lambda pid, sig: kills.append((pid, sig)))
    assert drainer.request("j", leave=False).state == "draining"
    assert worker.drain()[0] > 0  # asked in the header
    worker.set_drained(7)  # the worker stopped at its next commit, step 7, which every holder has
    until(drainer, "drained")
    assert kills == []  # --stay: the ranks stay
    drainer.request("j", leave=True)  # `ffstate drain` without --stay, later
    until(drainer, "left")
    assert kills == [(agent_of(os.getpid()), signal.SIGTERM)]


def test_the_thread_following_a_drain_that_stays_ends_when_its_node_closes(rank):
    shard, worker = rank
    done = threading.Event()  # the node's, which Node.close sets
    drainer = Drainer(lambda: [shard], kill=lambda pid, sig: None, done=done)
    drainer.request("j", leave=False)
    worker.set_drained(7)
    until(drainer, "drained")
    thread = drainer._thread
    thread.join(0.5)
    assert thread.is_alive()  # a drain that stays is followed as long as the node runs (its ranks may give it up)
    done.set()
    thread.join(5)
    assert not thread.is_alive()


def test_a_drain_whose_ranks_gave_up_their_hold_is_over_and_a_new_request_drains_again(rank):
    shard, worker = rank
    drainer = Drainer(lambda: [shard], kill=lambda pid, sig: None)
    drainer.request("j", leave=False)
    worker.set_drained(7)
    until(drainer, "drained")
    worker.set_drained(0)  # Config.drain_hold passed: the ranks went on training
    until(drainer, "failed")
    assert "gave the drain up" in drainer.report("j").message
    worker.set_drain(0.0)
    assert drainer.request("j", leave=True).state == "draining" and worker.drain()[0] > 0  # a new drain, asked anew


def test_a_rank_s_agent_not_ours_to_signal_is_said_and_a_failure_to_follow_the_drain_fails_it(rank, caplog):
    shard, worker = rank

    def refuse(pid, sig):
        raise PermissionError(1, "Operation not permitted")

    drainer = Drainer(lambda: [shard], kill=refuse)
    drainer.request("j", leave=True)
    worker.set_drained(7)
    until(drainer, "left")  # the drain goes on to its end
    assert "could not send SIGTERM" in caplog.text and "Operation not permitted" in caplog.text

    class Broken:  # the rank's slots, but for a bug where the drain looks for the worker to signal
        def __getattr__(self, name):
            return getattr(shard.slots, name)

        def worker(self):
            raise ValueError("a bug")

    broken = SimpleNamespace(key=shard.key, holders=shard.holders, replicated_version=7, slots=Broken())
    drainer = Drainer(lambda: [broken], kill=lambda pid, sig: None)
    drainer.request("j", leave=True)
    until(drainer, "failed")  # said in the report, not left "drained" by a thread that died
    assert "following the drain failed" in drainer.report("j").message


def test_a_drain_after_a_resize_ignores_the_old_world_s_copy_and_asks_a_restarted_rank_again(tmp_path, monkeypatch):
    """Two things that held a drain up for good: the copy of the world size the job resized from (kept until the
    new shape's copies are safe; it never commits again, so its step never reaches the others'), and a rank that
    restarted before it stopped (its attach clears its mark: it would never be told to stop)."""
    import subprocess
    import sys
    from contextlib import ExitStack

    with ExitStack() as stack:
        state, worker, daemon = stack.enter_context(worker_and_daemon_slots(tmp_path, monkeypatch,
                                                                            {"w": torch.ones(100)}, world=2))
        _, old_worker, old_daemon = stack.enter_context(worker_and_daemon_slots(tmp_path, monkeypatch,
                                                                                {"w": torch.ones(100)}, world=4))
        SlotWriter(worker).commit(state, 7)
        worker.set_worker(os.getpid(), "")
        SlotWriter(old_worker).commit(state, 5)
        gone = subprocess.Popen([sys.executable, "-c", "pass"])
        gone.wait()
        old_worker.set_worker(gone.pid, "")  # the old world's process, long gone
        shard = SimpleNamespace(key=ShardKey("j", 0, 2), holders=["peer:1"], slots=daemon, replicated_version=7)
        old = SimpleNamespace(key=ShardKey("j", 0, 4), holders=["peer:1"], slots=old_daemon, replicated_version=5)
        drainer = Drainer(lambda: [old, shard], kill=lambda pid, sig: None)
        drainer.request("j", leave=False)
        drainer.forget(shard)  # the rank restarted and attached again before its next commit
        assert worker.drain()[0] == 0
        deadline = time.monotonic() + 10
        while worker.drain()[0] == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert worker.drain()[0] == drainer.report("j").requested_unix  # asked again
        worker.set_drained(7)
        until(drainer, "drained")
        assert drainer.report("j").version == 7


def test_several_daemons_of_one_job_on_a_machine_are_named_and_the_hint_is_one_that_works(monkeypatch):
    """Simulated nodes: two daemons of one job on one machine. The hint said "--daemon or --job", and --job chose
    nothing; it names each daemon, and says so."""
    import pytest

    from ffstate.daemon import running
    from ffstate.elastic.drain import target
    from ffstate.errors import FFStateError

    found = [running.Found("127.0.0.1:7700", "t", "j", "node0", 1),
             running.Found("127.0.0.1:7701", "t", "j", "node1", 2)]
    monkeypatch.setattr(running, "local_daemons", lambda job="": found)
    for job in ("", "j"):
        with pytest.raises(FFStateError, match=r"127\.0\.0\.1:7701 \(job j, node node1\).*--job does not choose"):
            target(None, job, "")
    assert target("127.0.0.1:7701", "j", "") == ("127.0.0.1:7701", "t", "j")
