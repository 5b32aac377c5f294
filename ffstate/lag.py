"""How far replication lags behind this rank's commits, and what the lag policy does about it (docs/design.md I4).

The daemon writes the newest version every holder of the rank that answers has into the slot header (a holder
found unreachable is not counted, where another answers: ``daemon/shard.py``); a commit reads it
there (one load). Only past ``max_lag`` versions behind does the rank ask its daemon, which is also how a
dead daemon is found (the header stops moving): then ``block`` holds the commit until replication is
within ``max_lag`` (bounded by ``connect_timeout``), and ``skip`` goes on and says so. ``block`` never holds
for a holder that is down (the daemon counts them in the header): its node is lost or its daemon restarting,
and the ranks that would restart it may be waiting for this one in a collective. A hold that gave up (a holder
that answers but takes nothing: its memory budget full) holds no commit again until replication moves past the
version it stalled at; the daemon is still asked every ``PUBLISH_EVERY`` seconds meanwhile. Every
``PUBLISH_EVERY`` seconds at a commit, when it lags, and on exit, the rank publishes its replicated version
through the job's store (``Job.publish_replicated``: the job's global committed version)."""

from __future__ import annotations

import logging
import time
from typing import Callable

from ffstate.client import Client
from ffstate.errors import ReplicaUnavailable
from ffstate.job import Job
from ffstate.shm import Slots

log = logging.getLogger("ffstate.lag")

# Seconds between a rank's publications of its replicated version through the job's store (three store
# calls; at every lag check they cost a commit 2-13 ms on a 2-core node). Also published on lag and exit.
PUBLISH_EVERY = 5.0
# A held commit (policy block) reads the slot header every HEADER_POLL seconds, and asks the daemon (an
# Inventory RPC, which also finds a dead daemon) every ASK_EVERY.
HEADER_POLL, ASK_EVERY = 0.002, 0.5
# A hold that long is logged at once; shorter ones are summed up at most every SUMMARY_EVERY seconds.
HOLD_LOG, SUMMARY_EVERY = 0.5, 30.0
# Commits after a start, a restore or a new daemon during which the block policy holds a commit at one version
# behind instead of max_lag. Re-seeding a holder with full versions, on a link estimate started over, lets
# replication fall 2 versions behind for a few steps (chaos runs here: a node lost 4 and 8 steps after a
# restart cost 2 steps where one in a steady run costs 1); a failure right after another is what a flaky node
# does. The holds cost a few tens of milliseconds each, once per restart.
SETTLE_COMMITS = 10


class LagWatch:
    """This rank's replicated version, as last seen. ``daemon()`` is the node's daemon (it may be replaced);
    ``on_lost(error)`` brings a lost daemon back and re-attaches."""

    def __init__(self, job: Job, daemon: Callable[[], Client], on_lost: Callable[[Exception], None]):
        self.job, self._daemon, self._on_lost = job, daemon, on_lost
        self.replicated = 0
        self._published = 0.0  # time.monotonic() of the last publication
        self._short = (0, 0.0, time.monotonic())  # commits held less than HOLD_LOG: count, seconds, since
        self._down_said = False  # "not holding for a holder that is down" logged, until replication catches up
        self._stalled = (-1, 0.0)  # the replicated version a hold gave up at (-1: none), and when last asked since
        # For SETTLE_COMMITS commits after a start, a restore or a new daemon, the block policy holds at 1 version
        # behind, not max_lag: the holders are being seeded with full versions (or a new node with everything),
        # the link estimate starts over, and failures come in clusters; see SETTLE_COMMITS.
        self.settle = SETTLE_COMMITS
        self._settle_held = 0.0

    def after_commit(self, step: int, slots: Slots, timed_out: bool) -> None:
        """The lag check of a commit of ``step`` into ``slots`` (``timed_out``: it overwrote an unread version)."""
        if timed_out:
            try:
                self.replicated = self.from_daemon(attached=True)
            except ReplicaUnavailable as e:
                self._on_lost(e)
                return
        else:
            # What the daemon wrote in the slot header; asked of the daemon itself only when lagging. 0 says
            # nothing yet (replication was reset at attach, or a holder is being re-seeded): keep what we knew
            # (v* after a restore), so that a full version's push overlaps the next commits instead of holding
            # the first; if the header stays at 0, the lag passes max_lag and the daemon is asked.
            header = slots.replicated()
            if 0 < header <= step:
                self.replicated = header
        if 0 <= self._stalled[0] < self.replicated:
            log.warning("rank %d: replication moves again (step %d replicated, stalled at %d): commits are held again "
                        "past max_lag %d", self.job.rank, self.replicated, self._stalled[0], self.job.cfg.max_lag)
            self._stalled = (-1, 0.0)
        settling = self.settle > 0
        if step - self.replicated > self.limit:
            self._lag(step, slots)  # also how a dead daemon is found: its header stops moving
        if settling:
            self.settle -= 1
            if not self.settle:
                log.info("rank %d: the %d commits after the start, restore or new daemon held %.3fs in all until "
                         "replication was within 1 version (up to step %d); from now on within max_lag %d",
                         self.job.rank, SETTLE_COMMITS, self._settle_held, step, self.job.cfg.max_lag)
        if step - self.replicated <= self.job.cfg.max_lag:
            self._down_said = False
            if time.monotonic() - self._published > PUBLISH_EVERY:
                self.publish(self.replicated)

    def restart(self) -> None:
        """A new daemon: its holders get full versions again, from nothing replicated; it settles as at a start."""
        self.replicated, self.settle, self._stalled = 0, SETTLE_COMMITS, (-1, 0.0)

    @property
    def limit(self) -> int:
        """Versions a commit may run ahead of replication before the block policy holds it."""
        max_lag = self.job.cfg.max_lag
        return min(1, max_lag) if self.settle > 0 and self.job.cfg.lag_policy == "block" else max_lag

    def _lag(self, step: int, slots: Slots) -> None:
        cfg, rank, limit = self.job.cfg, self.job.rank, self.limit
        stalled, asked = self._stalled
        if stalled >= 0:  # a hold gave up at that version: none again until replication moves past it
            if time.monotonic() - asked < PUBLISH_EVERY:
                return
            self._stalled = (stalled, time.monotonic())
        try:
            self.replicated = self.from_daemon(attached=True)
        except ReplicaUnavailable as e:
            self._on_lost(e)
            return
        behind = step - self.replicated
        if behind <= limit:
            return
        if cfg.lag_policy == "skip":
            log.warning("rank %d: replication is %d versions behind (max_lag %d); policy skip: the daemon jumps to "
                        "the newest version", rank, behind, cfg.max_lag)
            return
        if slots.holders_down():
            self._holder_down(step)
            return
        if stalled >= 0:
            return
        start = time.perf_counter()
        ended = self.wait(step, timeout=cfg.connect_timeout, within=limit, attached=True, slots=slots, hold=True)
        held = time.perf_counter() - start
        if ended in ("down", "lost"):  # said already, or the daemon is being replaced
            return
        if ended == "timeout":
            self._stalled = (self.replicated, time.monotonic())
            log.error("rank %d: replication is stalled %d versions behind (a holder that takes nothing: its memory "
                      "budget full, or a link that carries nothing?); policy block gave up after %.0fs and holds no "
                      "commit until replication moves past step %d; training goes on", rank, step - self.replicated,
                      held, self.replicated)
        elif limit < cfg.max_lag:
            self._settle_held += held
        else:
            self._held(step, held)

    def _holder_down(self, step: int) -> None:
        if not self._down_said:
            self._down_said = True
            log.warning("rank %d: replication is %d versions behind at step %d and a holder is down: policy block "
                        "does not hold commits for it (its node is lost or its daemon restarting); it gets a full "
                        "version when it is back", self.job.rank, step - self.replicated, step)

    def _held(self, step: int, held: float) -> None:
        """Says that a commit was held (policy block): each hold of HOLD_LOG seconds or more, the shorter ones
        summed up at most every SUMMARY_EVERY seconds (with a small ``max_lag`` they come every few steps)."""
        cfg, now = self.job.cfg, time.monotonic()
        if held >= HOLD_LOG:
            log.warning("rank %d: commit of step %d held %.2fs until replication was within %d versions "
                        "(policy block)", self.job.rank, step, held, cfg.max_lag)
            return
        count, total, since = self._short
        count, total = count + 1, total + held
        if now - since >= SUMMARY_EVERY:
            log.warning("rank %d: %d commits held %.2fs in all in the last %.0fs until replication was within %d "
                        "versions (policy block; up to step %d)", self.job.rank, count, total, now - since,
                        cfg.max_lag, step)
            count, total, since = 0, 0.0, now
        self._short = (count, total, since)

    def wait(self, last: int, timeout: float | None, within: int = 0, attached: bool = True,
             slots: Slots | None = None, hold: bool = False) -> str:
        """Waits until replication is within ``within`` versions of ``last`` (at most ``timeout`` seconds; None:
        for ever, bringing a lost daemon back meanwhile). With the rank's ``slots``, it reads their header every
        ``HEADER_POLL`` seconds and asks the daemon only every ``ASK_EVERY`` (a held commit, or the exit's wait
        of every rank of a large job, then costs the wait, not an RPC and the store's calls every poll); the daemon
        is still how a dead one is found. ``hold``: a commit's hold (``_lag`` has just asked the daemon): it ends
        for a holder that is down, and a lost daemon is brought back at once; otherwise (the exit's wait,
        ``stats``) a lost daemon ends the wait. Returns how it ended: ``reached``, ``timeout``, ``down`` (a
        holder down ended a hold) or ``lost`` (the daemon is gone)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        held = slots is not None and hold  # the exit's and stats' waits are no commit's hold (the watchdog, held_ns)
        if held:  # the daemon's pacer stops yielding to collectives that wait for this rank
            slots.set_lag_held(True)
        try:
            return self._wait(last, deadline, within, attached, slots, hold)
        finally:
            if held:
                slots.set_lag_held(False)

    def _wait(self, last: int, deadline: float | None, within: int, attached: bool, slots: Slots | None,
              hold: bool) -> str:
        asked = time.monotonic() if hold else float("-inf")  # a hold: _lag has just asked
        while True:
            now = time.monotonic()
            header = slots.replicated() if slots is not None else 0
            if 0 < header <= last and header > self.replicated:
                self.replicated = header
            elif now - asked >= (ASK_EVERY if slots is not None else 0.0):
                asked = now
                try:
                    self.replicated = self.from_daemon(attached)
                except ReplicaUnavailable as e:
                    if hold:  # its replicas went with it: a new daemon (the slots' next commit) ends the hold
                        self._on_lost(e)
                        return "lost"
                    if deadline is not None:  # leaving: nothing more to wait for
                        log.warning("rank %d: the node's daemon is gone (%s); not waiting for the replicas",
                                    self.job.rank, e)
                        return "lost"
                    self._on_lost(e)
                    continue
            if last - self.replicated <= within:
                return "reached"
            if deadline is not None and now > deadline:
                return "timeout"
            if hold and slots is not None and slots.holders_down():  # holding for a holder that is down helps nobody
                self._holder_down(last)
                return "down"
            time.sleep(HEADER_POLL if slots is not None else 0.01)

    def from_daemon(self, attached: bool) -> int:
        """The replicated version as the node's daemon reports it (and published).

        Raises:
            ReplicaUnavailable: the daemon is gone, or (``attached``) another daemon answers that does not know
                this rank: a node-mate restarted it, and our slots went with the old one.
        """
        job, daemon = self.job, self._daemon()
        resp = daemon.inventory(job.job)
        mine = [s for s in resp.shards if s.local and s.shard.rank == job.rank and s.shard.world_size == job.world]
        if not mine and attached:
            raise ReplicaUnavailable(f"the daemon at {daemon.address} does not know rank {job.rank}: it was restarted")
        version = mine[0].replicated_version if mine else 0
        self.publish(version)
        return version

    def publish(self, version: int) -> None:
        self._published = time.monotonic()
        self.job.publish_replicated(version)
