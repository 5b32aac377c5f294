"""The daemon's flush of its local ranks' committed versions to the persistent tier, off the training path
(docs/design.md section 6; the format is ``ffstate/persist/``).

The replicator offers each version it takes from
a rank's slots (``offer``, in its own thread, while the slot cannot change); a version whose step is a multiple
of ``persist_every`` is copied once (the copy counted against the daemon's memory budget) into an anonymous
in-memory file and queued. One thread hands the queue to the daemon's flushing process (``flusher.py``: the writing
is Python, and out of the daemon's interpreter it cannot hold up the replicator): each rank's files, then the
version made complete once every rank of the job has its record, then the old versions removed. One version is
written at a time: a version offered while an older one is still being written is skipped, for every local rank
alike (counted, logged), so that the disk sets the pace and never the training. When the job ends, its last
committed version is flushed whatever its step (``final``), so that a job relaunched later resumes where it
ended. Whatever the filesystem does (full, read-only, gone, slow) is logged, rate-limited, and counted; the
daemon goes on and the training never sees it."""

from __future__ import annotations

import collections
import logging
import queue
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from ffstate import codec, persist
from ffstate.codec import host
from ffstate.daemon.flusher import Copy, Flusher
from ffstate.daemon.shard import GONE
from ffstate.errors import ReplicaError, SlotError
from ffstate.ids import ShardKey
from ffstate.layout import Manifest
from ffstate.reports import NO_FLUSHER, PersistStats

log = logging.getLogger("ffstate.daemon.persist")

ERROR_LOG_EVERY = 30.0  # seconds between two logs of the same kind of flush failure
DECIDED = 16  # versions whose flush-or-skip decision is remembered (so that a node's ranks decide alike)
REACHED_EVERY = 0.1  # seconds between writes of the newest version taken (reached-<node>.json), when it moved
FINAL_WAIT = 120.0  # seconds a job's end waits for its last versions to be written


@dataclass
class _Job:
    key: ShardKey
    version: int
    copy: Copy
    checksum: int


class Persister:
    """See the module docstring. ``reserve(n, what)`` / ``release(n)`` count the copies against the budget."""

    def __init__(self, root: Path, every: int, keep: int, reserve: Callable[[int, str], None],
                 release: Callable[[int], None], node_id: str = "node", nice: int | str = "idle"):
        self.root, self.every, self.keep, self.node_id = Path(root), every, keep, node_id
        self._reached: dict[str, int] = {}  # job -> the newest version taken (the replicator's threads write it)
        self._noted: dict[str, int] = {}  # job -> the version written to its reached file
        self.reserve, self.release = reserve, release
        self.stats = PersistStats()
        self._queue: queue.Queue[_Job | None] = queue.Queue()
        self._lock = threading.Lock()
        self._writing: tuple[str, int] | None = None  # (job, version) being written
        self._decided: collections.OrderedDict[tuple[str, int], bool] = collections.OrderedDict()
        # (job, rank, world, version) of each rank's copy queued for writing: what final() need not flush again
        self._queued: collections.OrderedDict[tuple[str, int, int, int], bool] = collections.OrderedDict()
        self._logged: dict[str, float] = {}
        self._flusher = Flusher(nice)
        self._closing = False
        self._copying = 0  # offers claimed and still copying (a job's end waits for them as for the queue)
        self._complete: dict[str, int] = {}  # job -> its newest complete version (stats.newest_complete: the max)
        self._recount: set[str] = set()  # jobs whose newest complete version is read again from disk (its thread)
        self._thread = threading.Thread(target=self._run, name="ffstate-persist", daemon=True)
        self._thread.start()
        log.info("persistent tier: %s, every %d steps, keeping %d complete versions", self.root, every, keep)

    def close(self, attached: list = (), wait: float = 30.0) -> None:
        """Flushes the versions the slots of the ``attached`` ranks hold (``final``: the daemon stops under a job, as
        when a preempted job's every process is signalled), finishes what is queued (``wait`` seconds in all, and
        10 more for a flush still being written: ``Flusher.close``; nothing if it is still starting), then stops."""
        deadline = time.monotonic() + wait
        if attached and self._flusher.ready:
            if said := self.final(attached, wait, every_committed=True):
                log.info("stopping with ranks attached: %s", "; ".join(said))
        elif attached:
            log.warning("stopping with ranks attached, and no flushing process ready: their last versions are not "
                        "written to the persistent tier")
        wait = max(1.0, deadline - time.monotonic())
        self._closing = True
        self._flusher.stop_starting()
        self._queue.put(None)
        self._thread.join(wait)
        self._flusher.close()

    def report(self) -> PersistStats:
        """The stats, with the copies not yet written and the flushing process's pid and starts."""
        self.stats.pending = self._queue.unfinished_tasks  # put, and not yet done: queued or being written
        self.stats.flusher_pid, self.stats.flusher_starts = self._flusher.pid, self._flusher.starts
        return self.stats

    def offer(self, key: ShardKey, version: int, manifest: Manifest, data: host.Buffer, checksum: int,
              keys: dict | None, unchanged: Callable[[], bool]) -> None:
        """A version the replicator took from ``key``'s slot: ``data`` its bytes, valid while ``unchanged()``."""
        if version > self._reached.get(key.job_id, 0):  # written by the thread within REACHED_EVERY
            self._reached[key.job_id] = version
        if version % self.every:
            return
        if not self._decide(key.job_id, version):
            self.stats.skipped += 1
            log.info("%s: version %d not flushed: %s is still being written (the disk sets the pace)", key, version,
                     "version %d of job %s" % self._writing[::-1] if self._writing else "an older version")
            return
        claim = (key.job_id, key.rank, key.world_size, version)
        with self._lock:  # a daemon stopping under the job (``final``) may have queued this rank's copy already
            if claim in self._queued:
                return
            self._queued[claim] = True
            self._copying += 1
        try:
            try:
                self.reserve(host.size(data), f"the copy of {key} version {version} for the persistent tier")
            except ReplicaError as e:
                return self._skip(claim, f"{key}: version {version} not flushed: {e}")
            try:
                copy = Copy(data, {"manifest": manifest.to_json().decode(), "keys": keys or {}})
            except OSError as e:  # no memory for an in-memory file
                self.release(host.size(data))
                return self._skip(claim, f"{key}: version {version} not flushed: {e}")
            if not unchanged():  # the worker rewrote the slot meanwhile (policy skip): nothing consistent to write
                copy.close()
                self.release(host.size(data))
                return self._skip(claim)
            self._queue_copy(key, version, copy, checksum)
        finally:
            with self._lock:
                self._copying -= 1

    def forget_after(self, key: ShardKey, version: int) -> None:
        """``key``'s worker attached again after a restore to ``version`` (0: from the start): the steps past it are
        redone and written anew. Forgets this rank's claims and the node's decisions past it; recounts what is complete."""
        job, rank, world = key.job_id, key.rank, key.world_size
        with self._lock:
            for claim in [c for c in self._queued if c[:3] == (job, rank, world) and c[3] > version]:
                del self._queued[claim]
            for decided in [d for d in self._decided if d[0] == job and d[1] > version]:
                del self._decided[decided]
            if self._complete.get(job, 0) > version:  # removed by the restore: read again, off this (the attach's) path
                self._recount.add(job)

    def _skip(self, claim: tuple, why: str = "") -> None:
        """An offered version not queued after all: unclaimed (a job's end may write it), counted, ``why`` logged."""
        with self._lock:
            self._queued.pop(claim, None)
        self.stats.skipped += 1
        if why:
            self._failed("memory", why, count=False)

    def _queue_copy(self, key: ShardKey, version: int, copy: Copy, checksum: int) -> None:
        with self._lock:
            self._queued[(key.job_id, key.rank, key.world_size, version)] = True
            _trim(self._queued, DECIDED * 64)
        self._queue.put(_Job(key, version, copy, checksum))

    def final(self, shards: list, wait: float = FINAL_WAIT, every_committed: bool = False) -> list[str]:
        """The job ended: the last committed version of each of its local ``shards`` (``LocalShard``) is flushed
        whatever its step (unless it was already), and the flushes (and offers copying) waited for, at most ``wait``
        seconds. With ``every_committed``, each version their slots hold (the newest two), the older first: a job
        stopped by a signal to every process has its ranks at most a step apart, so the newest version every rank
        reached is in each rank's slots (on the CPU; a GPU's staged commit is published a step late). Returns what
        happened, a line per rank and version (for the daemon's log)."""
        said = []
        if every_committed:  # the older versions first (likelier every rank's), of jobs at one world size
            shards = _one_world(shards, said)
            todo = sorted((v, i) for i, s in enumerate(shards) for v in _committed(s))
        else:
            todo = [(0, i) for i in range(len(shards))]
        for want, i in todo:
            if line := self._final_copy(shards[i], want):
                said.append(line)
        deadline = time.monotonic() + wait
        while (self._queue.unfinished_tasks or self._copying) and time.monotonic() < deadline:
            time.sleep(0.02)
        if self._queue.unfinished_tasks or self._copying:
            said.append(f"not all written within {wait:.0f}s")
        return said

    def _final_copy(self, shard, want: int) -> str:
        """Queues version ``want`` (0: the newest) of ``shard``, unless complete on disk or queued: read from its slot
        straight into the flushing process's copy, counted against the budget first. Returns what happened, or ""."""
        key = shard.key
        if not want:  # the newest, named first: one written or queued already is said so, and not copied again
            committed = _committed(shard)
            if not committed:
                return ""
            want = committed[0]
        if done := self._flushed_already(key, want):
            return done
        nbytes = shard.slots.manifest.nbytes
        try:
            self.reserve(nbytes, f"the copy of {key}'s version {want} for the persistent tier")
        except ReplicaError as e:
            return f"{key}: version {want} cannot be flushed: {e}"
        made: list[Copy] = []  # the try in hand (one the worker's rewrite spoilt is closed before the next)

        def take(view) -> tuple[Copy, int]:
            while made:  # a spoilt try's
                made.pop().close()
            manifest = shard.slots.manifest.with_scalars(view.scalars)
            made.append(Copy(view.data, {"manifest": manifest.to_json().decode(), "keys": shard.persist_keys or {}}))
            return made[-1], codec.buffer_checksum(view.data)

        try:
            got = shard.slots.read(want, take)
            if got is None:
                raise SlotError("no longer in the slots (the worker committed past it)")
        except BaseException as e:
            for c in made:
                c.close()
            self.release(nbytes)
            if isinstance(e, (SlotError, OSError, *GONE)):  # torn, rewritten all along, dropped meanwhile; no memory
                return f"{key}: version {want} cannot be read: {type(e).__name__}: {e}"
            raise
        view, copy = got  # view.version is want
        claim = (key.job_id, key.rank, key.world_size, want)
        with self._lock:  # this rank's copy (not the node's decision): unless an offer claimed it meanwhile
            done = claim in self._queued
            if not done:  # claimed: a job's end and the daemon's stop never both write it
                self._queued[claim] = True
                self._decided[(key.job_id, want)] = True
        if done:
            copy.close()
            self.release(nbytes)
            return f"{key}: version {want} was flushed already"
        self._queue_copy(key, want, copy, view.checksum)
        return f"{key}: version {want} flushed"

    def _flushed_already(self, key: ShardKey, version: int) -> str:
        if (persist.version_dir(self.root / key.job_id, version) / persist.COMPLETE).exists():  # never rewritten
            return f"{key}: version {version} is complete on disk already"
        with self._lock:
            if (key.job_id, key.rank, key.world_size, version) in self._queued:
                return f"{key}: version {version} was flushed already"
        return ""

    def _decide(self, job: str, version: int) -> bool:
        """Flush or skip ``version`` of ``job``: decided once for all the node's ranks (skipped when another version
        is being written or waits to be)."""
        with self._lock:
            got = self._decided.get((job, version))
            if got is None:
                with self._queue.mutex:
                    busy = {(j.key.job_id, j.version) for j in self._queue.queue if j is not None}
                    if self._queue.unfinished_tasks > len(self._queue.queue):  # one taken off it and not done yet:
                        busy.add(self._writing or ("", -1))  # being written, or about to be (set under our lock)
                got = not busy - {(job, version)}
                self._decided[(job, version)] = got
                _trim(self._decided, DECIDED)
            return got

    def _note_reached(self) -> None:
        """The newest version taken per job, to ``reached-<node>.json`` (a resume from disk counts its steps lost from
        it); the newest complete version of a job a restore stepped back, read again. Never raises (it says why)."""
        with self._lock:
            recount, self._recount = self._recount, set()
        try:
            for job in recount:
                self._complete[job] = max(persist.complete_versions(self.root / job), default=0)
                self.stats.newest_complete = max(self._complete.values(), default=0)
            _note(self.root, self.node_id, self._reached, self._noted)
        except Exception as e:  # noqa: BLE001 (a failing filesystem, or a bug: the flushes go on)
            with self._lock:
                self._recount |= recount  # counted again at the next look
            self._failed("reached", f"counting the complete versions failed: {e!r}", count=False)

    def _run(self) -> None:
        try:  # it imports torch and torch.distributed.checkpoint (seconds of CPU) while the job starts
            self._flusher.start(idle=self._note_reached)
        except OSError as e:  # it is tried again at each flush, and fails each with its error
            if not self._closing:
                self._failed("start", f"{NO_FLUSHER}: {e}", count=False)
        while True:
            try:
                job = self._queue.get(timeout=REACHED_EVERY)
            except queue.Empty:
                self._note_reached()
                continue
            self._note_reached()  # before its files: a kill just after they complete leaves no newer version
            if job is None:
                return
            with self._lock:
                self._writing = (job.key.job_id, job.version)
            try:
                self._flush(job)
            except Exception as e:  # a bug must not stop the daemon, nor later flushes
                self._failed("bug", f"{job.key}: flushing version {job.version} failed: {e!r}")
                log.exception("flush of %s version %d", job.key, job.version)
            finally:
                self.release(job.copy.nbytes)
                job.copy.close()
                self._queue.task_done()  # what `pending` counts
                with self._lock:
                    self._writing = None
            self._note_reached()

    def _flush(self, job: _Job) -> None:
        key = job.key
        if self._closing and not self._flusher.ready:  # the daemon stops before its flushing process was ready
            self.stats.skipped += 1
            return
        try:
            got = self._flusher.flush(job.copy, {
                "job": key.job_id, "rank": key.rank, "world": key.world_size, "version": job.version,
                "checksum": job.checksum, "job_dir": str(self.root / key.job_id), "keep": self.keep},
                idle=self._note_reached)
        except OSError as e:  # the flushing process could not be started
            self._failed("start", f"{key}: version {job.version} not flushed: {NO_FLUSHER}: {e}")
            return
        if not got["ok"]:
            if got.get("died"):  # what it wrote of the version is not a rank's files: removed, as a failed write's
                persist.remove_rank(persist.version_dir(self.root / key.job_id, job.version), key.rank)
            if got["kind"] == "stopped":  # the daemon's stop, not a failure of the tier's
                self.stats.skipped += 1
                return log.warning("%s: %s", key, got["message"])
            return self._failed(got["kind"], f"{key}: {got['message']}")
        already = got.get("already")  # complete on disk (a step redone after a restart): not written again
        if not already:
            self.stats.flushed += 1
            self.stats.bytes += job.copy.nbytes
            self.stats.seconds = got["seconds"]
        log.info("%s: version %d %s", key, job.version, f"is complete in {got['vdir']} already: not written again"
                 if already else f"flushed to {got['vdir']} ({job.copy.nbytes / 1e6:.1f} MB in {got['seconds']:.3f}s)")
        if "complete_error" in got:
            self._failed(got["complete_kind"], f"job {key.job_id}: {got['complete_error']}")
        elif got.get("complete"):
            if job.version > self._complete.get(key.job_id, 0):
                self._complete[key.job_id] = job.version
                self.stats.newest_complete = max(self._complete.values())
                self.stats.completed += not already  # made complete by this daemon
                log.info("job %s: version %d is complete in %s", key.job_id, job.version, got["vdir"])
            for gone in got.get("pruned", []):
                log.info("job %s: removed %s (keeping the newest %d complete versions)", key.job_id, gone, self.keep)

    def _failed(self, kind: str, message: str, count: bool = True) -> None:
        if count:
            self.stats.failed += 1
        self.stats.error = message[:1024]
        now = time.monotonic()
        if now - self._logged.get(kind, -ERROR_LOG_EVERY) >= ERROR_LOG_EVERY:
            self._logged[kind] = now
            log.error("%s (training goes on; such failures logged at most every %.0fs)", message, ERROR_LOG_EVERY)


def _note(root: Path, node_id: str, reached: dict[str, int], noted: dict[str, int]) -> None:
    """Each job's newest version taken (``reached``), to its ``reached-<node>.json`` where not written yet (``noted``)."""
    for job, version in list(reached.items()):
        if noted.get(job) != version:
            try:
                persist.note_reached(root / job, node_id, version)
                noted[job] = version
            except OSError:  # best effort: a failing filesystem shows in the flushes
                pass


def _one_world(shards: list, said: list[str]) -> list:
    """The shards of the jobs whose attached ranks share one world size: a job caught in a resize (its old world's
    slots still attached beside the new one's) is not written as the daemon stops (the two worlds' ranks would
    write the same files of a version's folder)."""
    worlds: dict[str, set[int]] = collections.defaultdict(set)
    for s in shards:
        worlds[s.key.job_id].add(s.key.world_size)
    for job, sizes in worlds.items():
        if len(sizes) > 1:
            said.append(f"job {job}: not written, its ranks are attached at world sizes {sorted(sizes)} (a resize)")
    return [s for s in shards if len(worlds[s.key.job_id]) == 1]


def _committed(shard) -> list[int]:
    try:
        return [v for v, _ in shard.slots.committed()]
    except GONE:  # dropped meanwhile
        return []


def _trim(d: collections.OrderedDict, n: int) -> None:
    """Forgets the oldest entries of ``d`` past its first ``n``."""
    while len(d) > n:
        d.popitem(last=False)
