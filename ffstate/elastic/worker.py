"""The training process's side of a job that changes shape, after each commit: the old world's copies dropped once
the new shape's are safe, and a drain of this rank's node (``ffstate drain``) obeyed at the step it reached."""

from __future__ import annotations

import logging
import time
from typing import Callable, ContextManager

from ffstate.client import Client
from ffstate.errors import ReplicaError
from ffstate.job import Job
from ffstate.shm import Slots

log = logging.getLogger("ffstate.elastic")

DROP_RETRY_MAX = 60.0  # seconds at most between two tries of a drop the daemon failed (a deadline under load)
DROP_TIMEOUT = 5.0  # seconds each of its calls may take: it runs inside a commit, which the other ranks wait for


class ShapeWatch:
    """``daemon()`` is this node's daemon (it may be replaced); ``pause(seconds)`` declares a wait that is not a
    hang to the node's watchdog (``Replicated.pause``); ``flush()`` returns once the last commit is published (a
    commit staged on a GPU is published after it returns)."""

    def __init__(self, job: Job, daemon: Callable[[], Client], pause: Callable[[float], ContextManager],
                 flush: Callable[[], None] = lambda: None):
        self.job, self.daemon, self.pause, self.flush = job, daemon, pause, flush
        self.old_world = 0  # after a resize: the old world size, until its copies are dropped
        self.others = False  # after any restore: other shapes' copies may be left, until dropped
        self.start_step = 0
        self._marked = False  # after a restore: this rank has a copy of a version past v*
        self._given_up = 0.0  # the drain request this rank stopped for and then gave up (Config.drain_hold)
        self._drop_failed, self._drop_again = 0, 0.0  # drops the daemon failed in a row; when to try again

    def resized(self, old_world: int, version: int) -> None:
        """This rank resumed at ``version`` from copies made at ``old_world`` ranks (0: its own world size). Either
        way the copies of every other world size go once this shape's are safe: after a resize the old shape's,
        after a restore at this size any other shape's whose copies no rank could restore from (``resize.py``)."""
        self.old_world, self.start_step, self.others = old_world, version, True

    def after_commit(self, step: int, slots: Slots | None, copied: int) -> None:
        """After the commit of ``step``: ``copied`` is the newest version of this rank that survives its node (its
        replicated version; its last commit where it has no holders)."""
        if self.others:
            self._drop_old_world(copied)
        asked = slots.drain()[0] if slots is not None else 0.0  # None: its daemon was lost just now
        if asked and asked != self._given_up:
            self._stop_for_drain(step, asked, slots)

    def _drop_old_world(self, copied: int) -> None:
        """The old world's copies are kept until every rank of this one has a copy of a version past v* (a failure
        until then resizes from them again); then each node's first rank drops from its daemon the copies of every
        world size but this one (not only the last: 4 -> 2, a failure before 2's copies were safe, then 2 -> 3,
        leaves 4's copies too; after a restore at this size, a newer shape's that no rank could restore from)."""
        job = self.job
        if not self._marked and copied > self.start_step:
            job.mark("resized-copy")
            self._marked = True
        if not self._marked:
            return
        if job.topology.first_on_node:
            if time.monotonic() < self._drop_again or not job.all_marked("resized-copy"):
                return
            try:
                daemon = self.daemon()
                held = daemon.inventory(job.job, DROP_TIMEOUT).shards
                worlds = sorted({s.shard.world_size for s in held} - {job.world})
                n = sum(daemon.drop(job.job, -1, w, only_world=True, timeout=DROP_TIMEOUT) for w in worlds)
                if worlds:
                    log.info("rank %d: every rank has a copy at world size %d: dropped %d copies of world size(s) %s "
                             "from node %s's daemon", job.rank, job.world, n, worlds, job.topology.node_id)
            except ReplicaError as e:  # kept, they would hold the daemon's memory until the job ends: tried again
                self._drop_failed += 1
                wait = min(DROP_RETRY_MAX, 2.0 ** self._drop_failed)
                self._drop_again = time.monotonic() + wait
                log.warning("rank %d: could not drop the copies of world sizes other than %d (try %d): %s; trying "
                            "again after a commit %.0fs from now", job.rank, job.world, self._drop_failed, e, wait)
                return
        self.old_world, self.others, self._drop_failed = 0, False, 0

    def _stop_for_drain(self, step: int, asked: float, slots: Slots) -> None:
        """This node is being drained: stay at this step, which no rank can pass without this one, until the daemon
        has it on every holder and takes the node's ranks out of the job (a SIGTERM); past ``Config.drain_hold``
        seconds (or when the drain is cancelled) give it up and train on."""
        job, hold = self.job, self.job.cfg.drain_hold
        log.warning("rank %d: node %s is being drained: stopping at step %d until it leaves the job", job.rank,
                    job.topology.node_id, step)
        job.record({"event": "drain-stopped", "step": step, "requested_unix": asked, "time": time.time()})
        self.flush()  # the step it stops at is published before the daemon reads that it stopped there
        slots.set_drained(step)
        deadline = time.monotonic() + hold
        with self.pause(hold + 60):  # the watchdog does not take the wait for a hang
            while time.monotonic() < deadline and slots.drain()[0] == asked:
                time.sleep(0.05)
        slots.set_drained(0)
        self._given_up = asked
        log.warning("rank %d: the drain of node %s %s; training goes on from step %d", job.rank, job.topology.node_id,
                    "was cancelled" if slots.drain()[0] != asked else
                    f"did not take this rank out within {hold:.0f}s (Config.drain_hold)", step)
        job.record({"event": "drain-given-up", "step": step})
