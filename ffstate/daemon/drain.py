"""Draining a node out of a job, losing no step (``ffstate drain``: a node about to go for maintenance).

1. The daemon marks each of the job's local ranks' slot headers (``drain_ns``). Each worker stops at its next
   commit (``trainer.py``) and waits there: none of them starts the next step, so no rank anywhere can finish it
   (every step has a collective), and the step they stopped at, T, is the newest step of the whole job. A local
   rank that had already passed its commit when the mark came is blocked in the next step's collective: it
   stopped at T too, without saying so.
2. The daemon waits until every local rank's newest commit is T and every holder that answers has T (its
   replication goes on meanwhile): the node's ranks can then be restored elsewhere from their replicas at T, and
   every other rank from its own node's slots at T. The drain is *drained*.
3. With ``leave``, the daemon sends SIGTERM to the ranks' torchrun agent (to a worker without one): an agent
   stopped by a signal leaves the rendezvous open (torchrun closes it only when an agent ends normally), the
   other nodes' workers fail in their collective, their agents restart them, and the job re-forms without this
   node (shrinking, ``ffstate/elastic/``) or with a standby node that joins in its place. 0 steps are lost.

A rank that was not taken out within its ``Config.drain_hold`` gives the drain up and trains on (the daemon
reports the drain *failed*); ``cancel`` gives it up at once. A rank without a replica on another node is refused
at the request: draining its node would lose its state.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from ffstate.daemon.watchdog import alive
from ffstate.errors import ReplicaError
from ffstate.reports import DrainRankReport, DrainReport

log = logging.getLogger("ffstate.daemon.drain")

LOOK = 0.02  # seconds between looks while a drain is in progress
AGENTS = ("torch.distributed.run", "torchrun", "torchelastic")  # a worker's parent that is a torchrun agent


@dataclass
class Drain:
    job: str
    leave: bool
    requested: float
    state: str = "draining"
    version: int = 0
    drained: float = 0.0
    left: float = 0.0
    stopped_seen: bool = False
    signalled: list[int] = field(default_factory=list)
    message: str = ""


def agent_of(pid: int) -> int:
    """The torchrun agent that started worker ``pid`` (its parent), or ``pid`` itself when its parent is not one."""
    try:
        parent = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        cmdline = Path(f"/proc/{parent}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except (OSError, IndexError, ValueError):
        return pid
    return parent if any(a in cmdline for a in AGENTS) else pid


class Drainer:
    """The drains of this node's jobs. ``shards()`` returns the local shards (``LocalShard``: key, slots, holders,
    replicated_version); ``kill`` is replaceable for tests."""

    def __init__(self, shards: Callable[[], list], kill: Callable[[int, int], None] = os.kill,
                 done: threading.Event | None = None):
        self.shards, self.kill = shards, kill
        self._done = done if done is not None else threading.Event()  # the node's, set as it closes: the thread ends
        self.drains: dict[str, Drain] = {}
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def handle(self, job: str, leave: bool, cancel: bool = False, query: bool = False) -> DrainReport:
        """A Drain request: start a drain, cancel it, or (``query``) report it."""
        if query:
            return self.report(job)
        return self.cancel(job) if cancel else self.request(job, leave)

    def _of(self, job: str) -> list:
        return [s for s in self.shards() if s.key.job_id == job]

    def _job(self, job: str) -> str:
        if job:
            return job
        jobs = sorted({s.key.job_id for s in self.shards()})
        if len(jobs) != 1:
            raise ReplicaError(f"name the job to drain: this node has local ranks of {jobs or 'no job'}", "NOT_FOUND")
        return jobs[0]

    def request(self, job: str, leave: bool) -> DrainReport:
        """Starts draining ``job``'s local ranks (see the module docstring); a drain in progress is left as it is, but
        for ``leave``: a drain that stays (``ffstate drain --stay``) asked again to leave does, once drained.

        Raises:
            ReplicaError: no local rank of the job (NOT_FOUND), or one without a replica on another node
                (FAILED_PRECONDITION).
        """
        job = self._job(job)
        shards = self._of(job)
        if not shards:
            raise ReplicaError(f"no local rank of job {job} is attached to this node", "NOT_FOUND")
        alone = [s.key.rank for s in shards if not s.holders]
        if alone:
            raise ReplicaError(f"ranks {alone} of job {job} have no replica on another node (a single node, or "
                               "Config.replicas 0): draining this node would lose their state", "FAILED_PRECONDITION")
        with self._lock:
            d = self.drains.get(job)
            if d is None or d.state not in ("draining", "drained"):
                d = self.drains[job] = Drain(job, leave, time.time())
                for s in shards:
                    s.slots.set_drain(d.requested)
                log.warning("draining job %s out of this node: %d local ranks stop at their next commit%s", job,
                            len(shards), "; they leave the job once replicated there" if leave else "")
            elif leave and not d.leave:
                d.leave = True
                log.warning("drain of job %s (%s): its ranks now leave the job once drained", job, d.state)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="ffstate-drain", daemon=True)
                self._thread.start()
        return self.report(job)

    def cancel(self, job: str) -> DrainReport:
        job = self._job(job)
        with self._lock:
            d = self.drains.get(job)
            if d is not None and d.state in ("draining", "drained"):
                d.state, d.message = "cancelled", "cancelled: the ranks go on training"
                for s in self._of(job):
                    s.slots.set_drain(0.0)
                log.warning("drain of job %s cancelled", job)
        return self.report(job)

    def forget(self, shard) -> None:
        """A worker (re-)attached to ``shard``: whatever it finds in the header is not for it."""
        shard.slots.set_drain(0.0)
        shard.slots.set_drained(0)

    def report(self, job: str) -> DrainReport:
        d = self.drains.get(job or self._job(job))
        if d is None:
            return DrainReport()
        return DrainReport(d.state, d.version, d.requested, d.drained, d.left,
                           [DrainRankReport(s.key, *_progress(s)) for s in self._of(job)], list(d.signalled), d.message)

    def _run(self) -> None:
        while True:
            with self._lock:
                active = [d for d in self.drains.values() if d.state in ("draining", "drained")]
                for d in active:
                    try:
                        self._look(d)
                    except Exception as e:  # noqa: BLE001 (a bug must not end the watch silently, the drain left "draining")
                        d.state, d.message = "failed", f"following the drain failed: {e!r}"
                        log.exception("drain of job %s", d.job)
                if not active:
                    return
            if self._done.wait(LOOK):
                return

    def _look(self, d: Drain) -> None:
        shards = _current(self._of(d.job))
        if d.state == "draining":  # a rank restarted before it stopped re-attached, which cleared its mark: again
            for s in shards:
                if s.slots.drain()[0] != d.requested:
                    s.slots.set_drain(d.requested)
        rows = [(s, *_progress(s)) for s in shards]
        if not rows:
            return
        stopped = [r for r in rows if r[3]]
        if d.stopped_seen and not stopped:  # draining, or drained and staying: a later request starts anew
            d.state, d.message = "failed", ("the ranks went on training (they gave the drain up after "
                                            "Config.drain_hold, or were restarted)")
            log.error("drain of job %s: %s", d.job, d.message)
            return
        d.stopped_seen = d.stopped_seen or bool(stopped)
        if d.state == "draining" and stopped:
            top = max(r[1] for r in rows)
            # (a stopped rank's step published: a commit staged on a GPU is published after it returns)
            if all(r[1] == top and r[1] >= r[3] for r in rows) and all(r[2] >= top for r in rows):
                d.state, d.version, d.drained = "drained", top, time.time()
                log.warning("drain of job %s: every local rank stopped at step %d and every holder has it (%.2fs "
                            "after the request)", d.job, top, d.drained - d.requested)
        if d.state == "drained" and d.leave:
            pids = sorted({agent_of(w.pid) for s, *_ in rows if (w := s.slots.worker()) is not None})
            for pid in pids:
                try:
                    self.kill(pid, signal.SIGTERM)
                    d.signalled.append(pid)
                except ProcessLookupError:
                    continue
                except OSError as e:  # not this daemon's to signal (another user's): said; the others still are
                    log.error("drain of job %s: could not send SIGTERM to pid %d: %s", d.job, pid, e)
            d.state, d.left = "left", time.time()
            d.message = f"sent SIGTERM to {d.signalled} (the ranks' torchrun agent, or the workers)"
            log.warning("drain of job %s: %s; the job goes on without this node from step %d", d.job, d.message,
                        d.version)


def _current(shards: list) -> list:
    """The shards of the world size this node's live workers train at: a copy made at another world size, kept after
    a resize until the new shape's copies are safe, never commits again and must not hold a drain up."""
    live = set()
    for s in shards:
        w = s.slots.worker()
        if w is not None and alive(w.pid):
            live.add(s.key.world_size)
    return [s for s in shards if not live or s.key.world_size in live]


def _progress(shard) -> tuple[int, int, int]:
    """(newest committed version, replicated version, the step its worker said it stopped at) of a local shard."""
    done = shard.slots.committed()
    return done[0][0] if done else 0, shard.replicated_version, shard.slots.drain()[1]
