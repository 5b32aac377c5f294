"""The block policy's holds against a holder that answers but takes nothing, a daemon lost during a hold, and the
exit's wait: the rank's real slots in shared memory, its daemon's answers given by a stand-in for the one RPC the
policy asks (``Inventory``)."""

import logging
import time
from types import SimpleNamespace as NS

import pytest
from helpers import worker_and_daemon_slots

from ffstate.errors import ReplicaUnavailable
from ffstate.lag import ASK_EVERY, PUBLISH_EVERY, LagWatch


class Daemon:
    """The node's daemon as ``LagWatch`` asks it: this rank's replicated version, or gone (``lost``)."""

    address = "127.0.0.1:7700"

    def __init__(self, version: int):
        self.version, self.asked, self.lost = version, 0, False

    def inventory(self, job):
        self.asked += 1
        if self.lost:
            raise ReplicaUnavailable("no daemon answers at 127.0.0.1:7700")
        return NS(shards=[NS(local=True, shard=NS(rank=0, world_size=1), replicated_version=self.version)])


def job(connect_timeout: float) -> NS:
    cfg = NS(max_lag=1, lag_policy="block", connect_timeout=connect_timeout)
    return NS(rank=0, world=1, job="j", cfg=cfg, publish_replicated=lambda version: None)


def holds(daemon_slots) -> list:
    """Each hold the daemon sees in the slot header (``lag_held``), looked at as the rank polls it."""
    seen = []
    real = time.sleep

    def sleep(seconds):
        seen.append(daemon_slots.lag_held() > 0)
        real(seconds)

    return seen, sleep


def test_a_hold_that_gave_up_holds_no_commit_again_until_replication_moves(tmp_path, monkeypatch, caplog):
    """A holder that answers every push with a refusal (its memory budget full) is not down: the hold waited
    connect_timeout and gave up, and so did every commit after it, a step a minute for as long as it lasted.
    One hold gives up; the commits after it are not held, the daemon asked every PUBLISH_EVERY seconds; once
    replication moves past where it stalled, commits are held again past max_lag."""
    with worker_and_daemon_slots(tmp_path, monkeypatch) as (_, worker, daemon_slots):
        daemon = Daemon(5)
        lag = LagWatch(job(connect_timeout=0.3), lambda: daemon, on_lost=pytest.fail)
        lag.settle, lag.replicated = 0, 5
        daemon_slots.set_replicated(5)
        seen, sleep = holds(daemon_slots)
        monkeypatch.setattr("ffstate.lag.time.sleep", sleep)
        with caplog.at_level(logging.INFO, logger="ffstate.lag"):
            lag.after_commit(7, worker, timed_out=False)
            gave_up = len(seen)
            assert gave_up and all(seen) and "policy block gave up" in caplog.text, caplog.text
            asked = daemon.asked
            for step in (8, 9, 10):
                lag.after_commit(step, worker, timed_out=False)
            assert len(seen) == gave_up and daemon.asked == asked  # not held, not asked within PUBLISH_EVERY
            assert caplog.text.count("policy block gave up") == 1
            lag._stalled = (lag._stalled[0], time.monotonic() - PUBLISH_EVERY)  # as PUBLISH_EVERY seconds later
            lag.after_commit(11, worker, timed_out=False)
            assert daemon.asked == asked + 1 and len(seen) == gave_up  # asked, still not held
            daemon.version = 9
            daemon_slots.set_replicated(9)  # the holder takes versions again
            lag.after_commit(12, worker, timed_out=False)
            assert "replication moves again" in caplog.text and len(seen) > gave_up  # 12 - 9 > 1: held again
            assert caplog.text.count("policy block gave up") == 2


def test_a_daemon_lost_during_a_hold_is_brought_back_at_once(tmp_path, monkeypatch, caplog):
    """The hold asks the daemon every ASK_EVERY: a daemon gone meanwhile is replaced then (the hold ended with
    a line meant for a rank leaving, and the next commit went into the dead daemon's slots), and the hold does
    not count as one that gave up."""
    with worker_and_daemon_slots(tmp_path, monkeypatch) as (_, worker, daemon_slots):
        daemon, lost = Daemon(5), []
        lag = LagWatch(job(connect_timeout=30.0), lambda: daemon, on_lost=lost.append)
        lag.settle, lag.replicated = 0, 5
        daemon_slots.set_replicated(5)
        seen, sleep = holds(daemon_slots)

        def dies(seconds):  # the daemon dies once the hold has begun
            daemon.lost = True
            sleep(seconds)

        monkeypatch.setattr("ffstate.lag.time.sleep", dies)
        start = time.monotonic()
        with caplog.at_level(logging.INFO, logger="ffstate.lag"):
            lag.after_commit(7, worker, timed_out=False)
        assert len(lost) == 1 and isinstance(lost[0], ReplicaUnavailable) and seen and all(seen)
        assert time.monotonic() - start < 30.0 and "gave up" not in caplog.text and "not waiting" not in caplog.text


def test_the_exit_s_wait_asks_the_daemon_every_half_second_and_waits_for_a_holder_that_is_down(tmp_path,
                                                                                               monkeypatch):
    """At a job's end every rank waits for its last commit's replicas: it asked the daemon (an RPC, and the job's
    store three calls over every rank's key) every 10 ms, 300,000 store calls a second from 1,000 ranks. It reads
    the slot header and asks every ASK_EVERY; a holder down does not end it (one restarting is re-seeded)."""
    with worker_and_daemon_slots(tmp_path, monkeypatch) as (_, worker, daemon_slots):
        daemon = Daemon(5)
        lag = LagWatch(job(connect_timeout=30.0), lambda: daemon, on_lost=pytest.fail)
        daemon_slots.set_replicated(5, holders_down=1)
        start = time.monotonic()
        assert lag.wait(9, 1.2, slots=worker) == "timeout"
        took = time.monotonic() - start
        assert took >= 1.2 and daemon.asked <= 1 + took / ASK_EVERY, (took, daemon.asked)
        daemon.version = 9
        assert lag.wait(9, 5.0, slots=worker) == "reached" and lag.replicated == 9
