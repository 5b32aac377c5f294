"""A worker's record of itself in its first slot's header, for its node's watchdog (``daemon/watchdog.py``): its
process, its signs of life besides commits, a declared pause, where its stacks go; and its commits' times. And,
for the daemon's pacer, whether its commit is held until replication catches up (the lag policy); and a drain of
its node (``daemon/drain.py``): the daemon's request, the step the worker stopped at."""

from __future__ import annotations

import time
from dataclasses import dataclass

from ffstate.shm.header import STACKS_PATH_MAX, Header


@dataclass(frozen=True)
class WorkerRecord:
    """What a worker wrote of itself in its first slot's header."""

    pid: int
    alive: float  # wall-clock seconds of its last sign of life other than a commit
    paused_until: float  # wall-clock seconds; 0: not paused
    stacks_path: str
    commit_seconds: float = 0.0  # how long its newest commit held the training loop


class WorkerFields:
    """The watchdog's and the pacer's worker fields of ``Slots`` (``self.headers``: the slots' headers, the first
    one the rank's)."""

    headers: list[Header]

    def worker(self) -> "WorkerRecord | None":
        """What the attached worker wrote of itself (``set_worker``, ``set_alive``, ``set_paused``); None before."""
        if not self.headers or not self.headers[0].worker_pid:
            return None
        h = self.headers[0]
        n = min(h.stacks_len, STACKS_PATH_MAX)
        return WorkerRecord(h.worker_pid, h.alive_ns / 1e9, h.paused_until_ns / 1e9,
                            bytes(h.stacks_path[:n]).decode(errors="replace"), h.commit_seconds)

    _held_since: int = 0  # worker side: time.time_ns() when the current hold began
    held_pending: int = 0  # worker side: ns held since the last commit, written with the next one (``publish``)

    def take_held(self) -> int:
        """The ns held since the last commit (``held_pending``), handed to the next ``publish``, and reset."""
        held, self.held_pending = self.held_pending, 0
        return held

    def commits(self) -> list[tuple[int, float, float]]:
        """(version, wall-clock seconds, seconds its step was held by the lag policy) of each committed slot's
        commit, oldest first."""
        return sorted((h.version, h.commit_ns / 1e9, h.held_ns / 1e9) for h in self.headers
                      if h.seq and h.seq % 2 == 0 and h.commit_ns)

    def set_worker(self, pid: int, stacks_path: str) -> None:
        """The worker that attached: its process and where its stacks go (for its daemon's watchdog)."""
        h = self.headers[0]
        raw = stacks_path.encode()[:STACKS_PATH_MAX]
        h.stacks_len = 0
        h.stacks_path = raw
        h.stacks_len = len(raw)
        h.paused_until_ns = 0
        h.alive_ns = time.time_ns()
        h.commit_count = 0
        h.worker_pid = pid

    def set_left(self, watched: bool = True) -> None:
        """The worker left ``ffstate.replicate`` (its ``faulthandler`` for SIGUSR1 unregistered after this): no
        stacks to ask it for. ``watched``: until it attaches again (an in-process restart enters again in the same
        process; under torchrun it exits) its deadline is the startup allowance, counted from now. Not ``watched``
        (no launcher starts it again: the process goes on with other work), the watchdog forgets its process."""
        if not self.headers:  # closed already
            return
        h = self.headers[0]
        h.stacks_len = 0
        h.alive_ns = time.time_ns()
        h.commit_count = 0
        h.comm_inflight = 0  # a collective the abort ended after the marks were detached: not a wait (the watchdog)
        if not watched:
            h.worker_pid = 0

    def set_commit_seconds(self, seconds: float) -> None:
        """How long the worker's newest commit held its training loop (the daemon's metrics report it)."""
        self.headers[0].commit_seconds = seconds

    def commit_count(self) -> int:
        """The worker's commits since it attached (``set_worker``)."""
        return self.headers[0].commit_count if self.headers else 0

    def set_alive(self) -> None:
        """A sign of life other than a commit: the watchdog counts the deadline from it."""
        self.headers[0].alive_ns = time.time_ns()

    def set_paused(self, until: float) -> None:
        """Not a hang until wall-clock ``until`` (0: the pause is over, and counts as a sign of life)."""
        h = self.headers[0]
        if not until:
            h.alive_ns = time.time_ns()
        h.paused_until_ns = int(until * 1e9)

    def set_lag_held(self, held: bool) -> None:
        """The worker's commit is held until replication catches up (policy block), or no longer."""
        now = time.time_ns()
        if held:
            self._held_since = now
        elif self._held_since:
            self.held_pending += now - self._held_since
            self._held_since = 0
        try:
            self.headers[0].lag_held_ns = now if held else 0
        except IndexError:
            pass

    def lag_held(self) -> float:
        """Wall-clock seconds since the worker's commit is held by the lag policy; 0.0 when it is not."""
        try:
            since = self.headers[0].lag_held_ns
        except IndexError:
            return 0.0
        return max(time.time_ns() - since, 1) / 1e9 if since else 0.0

    def drain(self) -> tuple[float, int]:
        """(wall-clock seconds the daemon asked this rank's node to drain, 0.0: not asked; the step the worker
        stopped at, 0: not stopped)."""
        if not self.headers:
            return 0.0, 0
        return self.headers[0].drain_ns / 1e9, self.headers[0].drained_version

    def set_drain(self, when: float) -> None:
        """Daemon side: asks the worker to stop at its next commit (``when``: wall-clock seconds; 0.0: cancelled)."""
        try:
            self.headers[0].drain_ns = int(when * 1e9)
        except IndexError:
            pass

    def set_drained(self, version: int) -> None:
        """Worker side: it stopped at ``version`` for a drain (0: it went on)."""
        self.headers[0].drained_version = version
