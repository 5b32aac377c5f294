"""The watchdog: a local rank that stops committing is hung; its daemon writes its stacks and kills it.

A crash ends a process and torchrun restarts the group; a hang does not: a rank stuck before a collective
(a deadlocked data loader, a wedged device, a bug) leaves every other rank waiting inside that collective
until the process group's timeout (30 minutes for gloo, 10 for NCCL), and torchrun waits with them. The
daemon already sees each local rank's commits in its slots' headers (the version and its wall-clock time),
so it watches them, with no thread in the training process and no code in the user's loop:

- **Step time.** Each look (twice a second) reads the two committed slots; two consecutive versions give
  one step's length. Its median over the recent steps is the rank's step time; the same steps less the time
  the rank's collectives were in flight (its marks, ``shm.CommMarks``) are its **compute** time.
- **Deadline.** ``hang_multiple`` (10) median steps, at least ``hang_floor`` (60 s) and at most
  ``hang_ceiling`` (600 s, below NCCL's default timeout); ``hang_startup`` (600 s) until the rank's third
  commit after it attached (the worker counts its commits in its slot header: steps much shorter than a look
  end the warm-up as surely as long ones) (compilation, the DDP shadow step and a restore take their own time). It counts
  from the rank's newest commit, or its newest sign of life: its attach, the end of an ``ff.pause()``
  (inside one the rank is not watched: an evaluation or a checkpoint between commits is not a hang), the
  end of a commit held by the lag policy on any of the job's local ranks (``lag.py``: bounded on its own, and
  the node's other ranks wait for the held one in their collectives). A worker that left ``ffstate.replicate``
  and lives on (an in-process restart, ``ffstate/inprocess/``) has the startup allowance again from its leave.
- **Evidence, then action.** Past the deadline (a worker that is alive: a dead one is torchrun's; with it every
  local rank of the job silent for half as long and for two of its steps, since the job's ranks stall together
  and their deadlines and last signs of life differ by how their medians were sampled and by milliseconds, not by
  what they do), the
  daemon sends SIGUSR1 to every local rank of that job whose record names a stacks file (each worker registered
  ``faulthandler`` for it at entry, writing every thread's stack to ``stacks-rank<R>.txt`` in the job's run
  folder, and clears the name before it unregisters: without the handler the signal ends the process), waits a second,
  logs where each one's main thread is (its innermost frame, and the innermost outside torch: the rank that
  never reached the collective shows its own code, the others torch's collective), then, under
  ``hang_action=kill``, SIGKILLs the ones past their deadline that wait in no collective: the hang's, not those
  waiting for it. A rank waits if its marks say a collective is on the wire (DDP's and FSDP2's, ffstate's), or, with
  none marked, if its stacks, asked for first (once a silence), show its main thread inside torch.distributed (the
  loop's own ``dist.all_reduce``, a barrier), unless no stuck local rank is in its own code and some wait in a
  marked one: then it is in a call the others are not in (a receive no rank answers, a mismatched collective) and
  is the hang's. torchrun restarts the
  group (the in-process engine keeps the others in their processes); the restart restores from the slots as after
  any crash: a hang costs the deadline and a restart, and no step. Each daemon acts for its own node's ranks only;
  every node's ranks stall together, and one node's restart restarts the job. A node whose ranks all wait leaves
  the act to the node they wait for, and kills them all one deadline later if no restart came (a hang inside the
  collectives themselves).
- **Stragglers.** A rank whose compute time stays above ``straggler_ratio`` (1.5) times the median of its
  node's other ranks for ``STRAGGLER_LOOKS`` looks is warned about (rate-limited); ``ffstate status`` also
  compares each rank with the whole job's. Reported, never acted on.
"""

from __future__ import annotations

import collections
import logging
import os
import signal
import statistics
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from ffstate.config import DaemonConfig
from ffstate.daemon.stacks import in_collective, read_from, size, where
from ffstate.ids import ShardKey
from ffstate.reports import WatchReport
from ffstate.scheduling.windows import merge_intervals

log = logging.getLogger("ffstate.daemon.watchdog")

LOOK = 0.5  # seconds between looks
WARMUP_COMMITS = 3  # commits after an attach before the step-based deadline applies
STACKS_WAIT = 1.0  # seconds the workers get to write their stacks
STRAGGLER_LOOKS = 10  # consecutive looks with a new step above the ratio before a straggler is warned about
STRAGGLER_WARN_EVERY = 60.0  # seconds between warnings about one rank
HISTORY = 32  # steps kept per rank for the medians
STACKS_SIGNAL = signal.SIGUSR1


@dataclass
class RankWatch:
    """One local rank's worker, as the watchdog has seen it since it attached."""

    pid: int
    attached: float  # wall-clock seconds of its attach
    newest: tuple[int, float] = (0, 0.0)  # (version, commit time) of its newest commit since the attach
    commits: int = 0  # commits since the attach (the worker counts them in its slot header)
    steps: collections.deque = field(default_factory=lambda: collections.deque(maxlen=HISTORY))
    computes: collections.deque = field(default_factory=lambda: collections.deque(maxlen=HISTORY))
    acted: bool = False  # declared hung (once a silence: its next sign of life, an attach or a pause's end, clears it)
    inflight: int = 0  # its collectives on the wire (its marks), as the last look read them
    alive: float = 0.0  # its newest sign of life in its record (its attach, a pause's end), as the last look read it
    waits: bool = False  # its stacks show it inside torch.distributed (a collective ffstate does not mark)
    classified: tuple = ()  # ``newest`` when ``waits`` was read from its stacks (a commit since makes it stale)
    slow_looks: int = 0
    warned: float = 0.0
    report: WatchReport | None = None


def _inflight(slots) -> int:
    """The collectives a rank has on the wire, as its header says now (the pacer's reading, ``comm_marks``, takes an
    old count for 0: a hang is older than that)."""
    headers = getattr(slots, "headers", None)
    return max(int(headers[0].comm_inflight), 0) if headers else 0


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie (exited, not yet reaped by torchrun) is not alive
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


class Watchdog:
    """Watches the local ranks that ``shards()`` returns (see the module docstring).

    ``shards`` returns (key, slots) for each local rank; ``kill``, ``clock`` and ``sleep`` are replaceable for
    tests.
    """

    def __init__(self, cfg: DaemonConfig, shards: Callable[[], list], kill: Callable[[int, int], None] = os.kill,
                 clock: Callable[[], float] = time.time, sleep: Callable[[float], None] = time.sleep):
        self.cfg, self.shards, self.kill, self.clock, self.sleep = cfg, shards, kill, clock, sleep
        self.ranks: dict[ShardKey, RankWatch] = {}
        self.hangs: collections.Counter[ShardKey] = collections.Counter()
        self.held_seen: dict[str, float] = {}  # job -> the last look at which one of its local ranks was lag-held
        self.deferred: dict[str, float] = {}  # job -> since when every local rank past its deadline waits on the wire
        self.stop = threading.Event()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self.cfg.hang_action == "off":
            log.info("watchdog: off (--hang-action off)")
        self._thread = threading.Thread(target=self._run, name="ffstate-watchdog", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self.stop.set()
        if self._thread is not None:
            self._thread.join(5.0)

    def _run(self) -> None:
        while not self.stop.wait(LOOK):
            try:
                self.look()
            except Exception:  # a bug here must not stop the watch
                log.exception("watchdog: a look failed")

    def report(self, key: ShardKey) -> WatchReport | None:
        with self._lock:
            w = self.ranks.get(key)
            return w.report if w is not None else None

    # ------------------------------------------------------------ one look

    def look(self) -> None:
        now = self.clock()
        seen: dict[ShardKey, tuple] = {}
        for key, slots in self.shards():
            try:
                seen[key] = (slots.worker(), slots.commits(), slots.comm_marks()[1], slots.commit_count(),
                             _inflight(slots))
                if slots.lag_held():
                    self.held_seen[key.job_id] = now
            except (ValueError, OSError, TypeError):  # slots closed meanwhile
                continue
        silent: dict[str, list[tuple[ShardKey, float, float, float]]] = collections.defaultdict(list)
        with self._lock:
            for key in [k for k in self.ranks if k not in seen]:
                del self.ranks[key]
            for job in set(self.held_seen) - {k.job_id for k in seen}:
                del self.held_seen[job]
            for key, (worker, commits, intervals, count, inflight) in seen.items():
                if worker is None:  # none attached yet, or it left unwatched: nothing of a process it had is kept
                    self.ranks.pop(key, None)
                    continue
                w = self.ranks.get(key)
                if w is None or w.pid != worker.pid:  # a new worker attached (a restart): watched afresh
                    w = self.ranks[key] = RankWatch(worker.pid, worker.alive)
                elif worker.alive != w.alive:  # a sign of life (the same process's next entry in-process, a pause's
                    w.acted, w.waits, w.classified = False, False, ()  # end): a later silence is a new one
                w.alive = worker.alive
                self._observe(w, commits, intervals)
                w.inflight = inflight
                w.commits = count  # every commit since the attach, however many came between two looks
                since = now - max(w.newest[1], worker.alive, w.attached, self.held_seen.get(key.job_id, 0.0))
                paused = worker.paused_until > now
                deadline = self._deadline(w)
                w.report = WatchReport(_median(w.steps), _median(w.computes), 0.0 if paused else since, deadline,
                                       paused, self.hangs[key], 0.0, w.pid, worker.commit_seconds)
                if not paused and not w.acted and self.cfg.hang_action != "off" and alive(w.pid):
                    silent[key.job_id].append((key, since, deadline, _median(w.steps)))
            self._stragglers(now)
        # A job's ranks wait for each other: when one is past its deadline, every local rank of the job silent for
        # half as long is named with it. They stall together; their deadlines differ by the sampling of their
        # medians, their silences by when each last showed a sign of life (the rank that never reached the collective
        # may have ended a commit the lag policy held a moment after the others committed), not by what they do. A
        # rank still committing is silent for less than two of its steps (a fifth of a deadline, unless the ceiling
        # or a small hang_multiple cut it): it is not named. The stacks then show which one is in its own code and
        # which wait in a collective.
        crossing = {job: [d for _, since, d, _ in ranks if since > d] for job, ranks in silent.items()}
        for job in [j for j in self.deferred if not crossing.get(j)]:
            del self.deferred[job]  # out of their wait: a restart came
        for job, ranks in silent.items():
            if crossed := crossing[job]:
                self._act(job, [key for key, since, deadline, step in ranks
                                if since > deadline or since > max(min(crossed) / 2, 2 * step)], now, max(crossed))

    def _observe(self, w: RankWatch, commits: list[tuple[int, float, float]],
                 intervals: list[tuple[float, float]]) -> None:
        mine = [(v, t, h) for v, t, h in commits if t >= w.attached]
        if not mine or mine[-1][:2] == w.newest:
            return
        w.newest = mine[-1][:2]
        # The two slots hold the worker's two newest commits: one step between them, or several when it commits
        # every few steps (its deadline is then a multiple of that interval).
        if len(mine) == 2 and mine[1][1] > mine[0][1]:
            (_, a, _), (_, b, held) = mine
            w.steps.append(b - a)
            # Its compute: the step less its waits in the collectives and in a commit held by the lag policy.
            waited = sum(min(e, b) - max(s, a) for s, e in merge_intervals(intervals) if e > a and s < b)
            w.computes.append(max(b - a - waited - held, 0.0))

    def _deadline(self, w: RankWatch) -> float:
        cfg = self.cfg
        if w.commits < WARMUP_COMMITS or not w.steps:
            return cfg.hang_startup
        return min(max(cfg.hang_multiple * _median(w.steps), cfg.hang_floor), cfg.hang_ceiling)

    def _stragglers(self, now: float) -> None:
        """Each rank's compute against the median of its node's other ranks (under the lock)."""
        for key, w in self.ranks.items():
            others = [_median(o.computes) for k, o in self.ranks.items()
                      if k != key and k.job_id == key.job_id and o.computes]
            mine = _median(w.computes)
            ref = statistics.median(others) if others else 0.0
            ratio = mine / ref if ref > 0 and mine > 0 else 0.0
            if w.report is not None:
                w.report.straggler_ratio = ratio
            w.slow_looks = w.slow_looks + 1 if ratio > self.cfg.straggler_ratio else 0
            if w.slow_looks >= STRAGGLER_LOOKS and now - w.warned > STRAGGLER_WARN_EVERY:
                w.warned = now
                log.warning("%s straggles: %.3fs of compute a step, %.1fx the median of its node's other ranks "
                            "(%.3fs); they wait for it in every collective", key, mine, ratio, ref)

    # ------------------------------------------------------------ a hang

    def _act(self, job: str, stuck: list[ShardKey], now: float, deadline: float) -> None:
        """The ranks past their deadline (``stuck``) and the job's other local ranks: stacks from every one, and
        under ``hang_action=kill`` the stuck ones not waiting in a collective are killed (``_victims``). A stuck rank
        with no collective marked is asked for its stacks first, once a silence: inside torch.distributed, it waits
        for another rank in a collective ffstate does not mark (the loop's own ``dist.all_reduce``)."""
        with self._lock:
            local = {k: w for k, w in self.ranks.items() if k.job_id == job and not w.acted and alive(w.pid)}
            unmarked = [k for k in stuck if k in local and not local[k].inflight]
            unread = [k for k in unmarked if local[k].classified != local[k].newest]
            # One unmarked beside marked ones is the hang's whatever its stacks say (``_suspects``): not asked first.
            needed = len(unmarked) > 1 or len(unmarked) == len([k for k in stuck if k in local])
        read: dict[ShardKey, tuple[Path, str]] = {}
        if unread and needed and self.cfg.hang_action == "kill":
            read = self._stacks(unread, local)
            with self._lock:
                for k in unread:
                    local[k].waits, local[k].classified = in_collective(read.get(k, (None, ""))[1]), local[k].newest
        with self._lock:
            victims = self._victims(job, [k for k in stuck if k in local], local, now, deadline)
            if not victims:
                return
            for k in victims:
                local[k].acted = True
                self.hangs[k] += 1
                if local[k].report is not None:
                    local[k].report.hangs = self.hangs[k]
            reports = {k: self.ranks[k].report for k in stuck}
        for key in stuck:
            r = reports[key]
            log.error("%s is silent: no commit for %.0fs (deadline %.0fs: %s); asking the job's %d local ranks for "
                      "their stacks", key, r.since_seconds, r.deadline_seconds,
                      f"{self.cfg.hang_multiple:g} x its {r.step_seconds:.3f}s median step, within "
                      f"[{self.cfg.hang_floor:g}, {self.cfg.hang_ceiling:g}]s" if r.step_seconds and
                      self.local_warm(key) else "its first steps' allowance, --hang-startup", len(local))
        asked = set(read)
        read.update(self._stacks([k for k in local if k not in asked], local))
        with self._lock:  # the stacks just read say which unmarked ones wait (under log, or where not asked first)
            for k in [k for k in local if k not in asked and k in read and not local[k].inflight]:
                local[k].waits, local[k].classified = in_collective(read[k][1]), local[k].newest
        suspects = _suspects([k for k in stuck if k in local], local)
        for key in sorted(local):
            (path, text), w = read.get(key, (None, "")), local[key]
            waits = key not in suspects and (w.inflight or w.waits)
            log.error("%s (pid %d) %s: %s%s", key, w.pid, "waits" if waits else "is hung",
                      where(text) if text else "no stack written", f" (all threads: {path})" if text else "")
        if self.cfg.hang_action == "kill":
            for key in sorted(victims):
                self._signal(local[key].pid, signal.SIGKILL)
            log.error("killed %s of job %s (%s): the launcher, or the in-process engine, restarts the group, which "
                      "restores from the slots", "the local ranks" if len(victims) == len(local) else "ranks", job,
                      ", ".join(str(k.rank) for k in sorted(victims)))

    def _stacks(self, keys: list[ShardKey], local: dict[ShardKey, RankWatch]) -> dict[ShardKey, tuple[Path, str]]:
        """Asks ``keys``' workers for their stacks (those whose record names a stacks file: one that has left ffstate
        since has no handler for the signal); (its file, what it wrote there within ``STACKS_WAIT``) for each."""
        paths = {}
        for key, slots in self.shards():
            if key in keys:  # read again: a worker that has left ffstate since has no handler for the signal
                record = slots.worker()
                if record is not None and record.pid == local[key].pid and record.stacks_path:
                    paths[key] = Path(record.stacks_path)
        if not paths:
            return {}
        sizes = {k: size(p) for k, p in paths.items()}
        for key in paths:
            self._signal(local[key].pid, STACKS_SIGNAL)
        self.sleep(STACKS_WAIT)
        return {k: (p, read_from(p, sizes[k])) for k, p in paths.items()}

    def _victims(self, job: str, stuck: list[ShardKey], local: dict[ShardKey, RankWatch], now: float,
                 deadline: float) -> list[ShardKey]:
        """Under the lock: which of the job's local ranks a hang kills. A hang stops every rank of the job together,
        the one that never reached a collective and the others waiting in it for that one; their marks and stacks
        say which wait (``_suspects``). The others are the hang's (a launcher restarts every rank whichever dies; the
        in-process engine keeps the others in their processes). If every one waits, the rank they wait for is on
        another node, whose daemon acts for it; past one more ``deadline`` with no restart, every local rank of the
        job is killed (a hang inside the collectives themselves), at once where the job has no other node. Under
        ``hang_action=log``, every local rank (their stacks, once). [] while it waits."""
        if not stuck:
            return []
        own = _suspects(stuck, local)
        alone = sum(k.job_id == job for k in self.ranks) >= stuck[0].world_size  # no rank of the job on another node
        if own or alone or self.cfg.hang_action != "kill":  # under "log", the stacks of every rank, once
            self.deferred.pop(job, None)
            return own if own and self.cfg.hang_action == "kill" else list(local)
        since = self.deferred.setdefault(job, now)
        if now - since < deadline:
            if since == now:
                log.warning("job %s: every local rank past its deadline waits in a collective (%s): the rank they "
                            "wait for is on another node, whose daemon acts for it; these are killed in %.0fs if no "
                            "restart comes", job, ", ".join(str(k.rank) for k in sorted(stuck)), deadline)
            return []
        self.deferred.pop(job, None)
        return list(local)

    def local_warm(self, key: ShardKey) -> bool:
        w = self.ranks.get(key)
        return w is not None and w.commits >= WARMUP_COMMITS and bool(w.steps)

    def _signal(self, pid: int, sig: int) -> None:
        try:
            self.kill(pid, sig)
        except ProcessLookupError:
            pass
        except PermissionError as e:
            log.error("cannot signal worker %d: %s", pid, e)


def _suspects(stuck: list[ShardKey], local: dict[ShardKey, RankWatch]) -> list[ShardKey]:
    """The stuck ranks that are the hang's, as far as this node can tell: those in no collective (their own code);
    else, beside ranks waiting in a marked collective, those inside another torch.distributed call (a receive or a
    collective the others are not in). [] when every one waits alike: the rank they wait for is elsewhere."""
    own = [k for k in stuck if not local[k].inflight and not local[k].waits]
    if own or not any(local[k].inflight for k in stuck):
        return own
    return [k for k in stuck if not local[k].inflight]


def _median(values) -> float:
    return statistics.median(values) if values else 0.0
