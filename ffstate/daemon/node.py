"""The node's replica runtime, free of protobuf and gRPC: its local ranks' slots and their replication,
the replicas it holds for other nodes (the store), and the report of all of it (docs/design.md sections 1, 4).

``Node`` is what the servicer (``servicer.py``) calls and the metrics (``metrics.py``) read through
``report()``. Every refusal is a ``ReplicaError`` (or ``CodecError`` / ``SlotError``) whose message
says what was wrong; the servicer maps it to a gRPC status in one place.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import time
from dataclasses import dataclass
from typing import Iterable, Sequence

from ffstate import persist, shm
from ffstate.client import Client, Tls
from ffstate.codec import Packed
from ffstate.config import DaemonConfig
from ffstate.daemon.drain import Drainer
from ffstate.daemon.memory import default_memory_limit
from ffstate.daemon.persister import Persister
from ffstate.daemon.replicator import Pacer, Replicator
from ffstate.daemon.shard import GONE as _GONE
from ffstate.daemon.shard import LocalShard, serve_from_slots
from ffstate.daemon.held import IncomingChunk
from ffstate.daemon.served import Hold
from ffstate.daemon.store import Store
from ffstate.daemon.watchdog import Watchdog
from ffstate.errors import FFStateError, ReplicaError
from ffstate.ids import ShardKey, check_id
from ffstate.layout import Manifest
from ffstate.reports import (LinkReport, NodeReport, PersistReport, ProfiledReport, RazorReport, RestoreReport,
                             ShardReport, WatchReport)
from ffstate.scheduling.scheduler import Naive, Scheduler
from ffstate.scheduling.windows import merge_intervals, project

log = logging.getLogger("ffstate.daemon")

# A manifest's JSON (7,700 tensors take about 1 MB); within the servicer's message cap, so that this is the
# limit a client meets, with its message, rather than gRPC's.
MAX_MANIFEST_BYTES = 16 << 20


@dataclass
class SlotsInfo:
    """What a worker needs to use its rank's slots (AttachResponse)."""

    slot_paths: list[str]
    node_id: str
    slot_bytes: int
    committed_version: int
    committed_versions: list[int]
    manifest_json: bytes


class Node:
    """The replica daemon's state: the store, the local ranks' slots and their replicator."""

    def __init__(self, cfg: DaemonConfig, pacer: Pacer | None = None, done: threading.Event | None = None):
        self.cfg = cfg
        check_id(cfg.node_id, "node id")
        self.store = Store(cfg.memory_limit or default_memory_limit(), cfg.keep_deltas, cfg.max_chunk_bytes)
        # TLS peers: verified with --tls-ca, and shown this daemon's own certificate (mutual TLS asks for one).
        tls = Tls(cfg.tls_ca, cert=cfg.tls_cert, key=cfg.tls_key) if cfg.tls_ca else None
        # No retries in a push: a holder that does not answer is marked down (lag.py), retried on the replicator's backoff.
        self.persister = Persister(cfg.persist_dir, cfg.persist_every, cfg.persist_keep, self.store.reserve,
                                   self.store.release, cfg.node_id, cfg.persist_nice) if cfg.persist_dir else None
        taken = (lambda s, v, m, d, c, u: self.persister.offer(s.key, v, m, d, c, s.persist_keys, u)) if self.persister else None
        self.replicator = Replicator(lambda addr: Client(addr, cfg.token, tls=tls, timeout=30.0, retries=0),
                                     list(cfg.peers), pacer or self._pacer(), poll_interval=cfg.slot_poll,
                                     keep=cfg.keep_deltas, taken=taken, budget=self.store)
        self.local: dict[ShardKey, LocalShard] = {}
        self._lock = threading.Lock()
        self.last_activity = time.monotonic()
        self.refusals: collections.Counter[str] = collections.Counter()  # by gRPC status name
        for path in shm.reclaim(cfg.node_id):  # a killed daemon of this node left them in /dev/shm (memory)
            log.warning("removed %s, left by a daemon of node %s that is gone", path, cfg.node_id)
        self.watchdog = Watchdog(cfg, lambda: [(s.key, s.slots) for s in self._shards()])
        self.watchdog.start()
        self.done = done if done is not None else threading.Event()  # --exit-when-empty, or a stop signal
        self.drainer = Drainer(self._shards, done=self.done)
        try:  # rung by the workers after each commit
            self.doorbell: shm.Doorbell | None = shm.Doorbell(cfg.node_id, self.touch)
        except OSError as e:  # no abstract Unix sockets here: the replicator's look at the slots still finds commits
            log.warning("no doorbell for the workers (%s): commits are taken within --slot-poll %.3fs", e,
                        cfg.slot_poll)
            self.doorbell = None

    # ------------------------------------------------------------ pacing

    def _pacer(self) -> Pacer:
        cfg = self.cfg
        if cfg.scheduler == "naive":  # paces nothing; counts the collisions all the same
            return Naive(self._comm_marks, cfg.link_bandwidth)
        if cfg.scheduler != "windows":
            raise FFStateError(f"scheduler must be windows or naive, got {cfg.scheduler!r}")
        # Past W - 1 versions behind (keep_deltas is W + 1), a sender must not wait for windows: the lag bound is near.
        return Scheduler(self._comm_marks, cfg.link_share, cfg.link_bandwidth, deadline=max(1, cfg.keep_deltas - 2),
                         predicted=self._predicted, held=self._lag_held)

    def _shards(self) -> list[LocalShard]:
        with self._lock:
            return list(self.local.values())

    def _comm_marks(self) -> tuple[int, list[tuple[float, float]], list[float]]:
        """The training's collectives as this node's workers mark them (for the scheduler)."""
        inflight, intervals, commits = 0, [], []
        for shard in self._shards():
            try:
                n, iv, c = shard.slots.comm_marks()
            except _GONE:
                continue
            inflight += n
            intervals += iv
            if len(c) > len(commits) or (c and commits and c[-1] > commits[-1]):
                commits = c
        return inflight, intervals, commits

    def _lag_held(self) -> bool:
        """Whether a local worker's commit is held until its replication catches up (its lag policy)."""
        for shard in self._shards():
            try:
                if shard.slots.lag_held():
                    return True
            except _GONE:
                continue
        return False

    def _predicted(self) -> list[tuple[float, float]]:
        """The collectives of the workers that profiled their steps (no marks), placed after their newest commits."""
        out: list[tuple[float, float]] = []
        for shard in self._shards():
            try:
                timeline = shard.slots.profiled_timeline()
                if timeline is not None:
                    out += project(timeline.intervals, timeline.period, shard.slots.comm_marks()[2])
            except _GONE:
                continue
        return merge_intervals(out)

    # ------------------------------------------------------------ activity

    def touch(self) -> None:
        self.last_activity = time.monotonic()

    def refused(self, status: str) -> None:
        """Counts a refused request (the servicer's), for the metrics."""
        self.refusals[status] += 1

    def idle_seconds(self) -> float:
        """Seconds since the last request or the last commit into an attached rank's slots (a worker with no
        replicas commits without ever calling the daemon: it is not idle while its job trains)."""
        since = time.monotonic() - self.last_activity
        for shard in list(self.local.values()):
            try:
                since = min(since, time.time() - shard.slots.committed_at())
            except _GONE:
                continue
        return since

    # ------------------------------------------------------------ local workers

    def attach(self, key: ShardKey, manifest_json: bytes, scalars_capacity: int, holders: list[str] | None,
               razor: RazorReport | None, discard_after: int | None, persist_keys: bytes = b"") -> SlotsInfo:
        """Creates the rank's slots (or finds them, and resets its replication: a worker re-attached)."""
        if len(manifest_json) > MAX_MANIFEST_BYTES:
            raise ReplicaError(f"manifest of {len(manifest_json)} bytes exceeds {MAX_MANIFEST_BYTES}",
                               "INVALID_ARGUMENT")
        manifest = Manifest.from_json(manifest_json)
        try:
            keys = persist.check_keys(persist_keys) if persist_keys else None
        except FFStateError as e:
            raise ReplicaError(f"persist_keys: {e}", "INVALID_ARGUMENT") from None
        cap = scalars_capacity or self.cfg.scalars_capacity
        with self._lock:
            if self.done.is_set():  # close() cleared the ranks under this lock: slots made now would outlive it
                raise ReplicaError(f"node {self.cfg.node_id}'s daemon is stopping", "UNAVAILABLE")
            shard = self.local.get(key)
            if shard is not None:
                if shard.manifest.layout_id != manifest.layout_id:
                    raise ReplicaError(
                        f"{key} is attached with layout {shard.manifest.layout_id}; this worker's state has layout "
                        f"{manifest.layout_id} (a different model?). Drop the job first or use another job id",
                        "FAILED_PRECONDITION")
                self.replicator.reset(shard, holders, discard_after=discard_after)
                self.drainer.forget(shard)
                if self.persister is not None and discard_after is not None:  # a restore: the steps past v* are redone
                    self.persister.forget_after(key, discard_after)
                log.info("worker re-attached to %s (slots %s), replicating to %s", key, [str(p) for p in shard.paths],
                         [h.address for h in shard.holders])
            else:
                shard = self._create_local(key, manifest, cap, holders)
                for h in shard.holders if discard_after else ():  # a restored worker on a new daemon: the
                    h.resume = discard_after  # holders drop the dead run's versions past v* before the full version
            shard.razor, shard.persist_keys = razor, keys
        return _describe(self.cfg.node_id, shard)

    def lookup(self, key: ShardKey) -> SlotsInfo:
        shard = self.local.get(key)
        if shard is None:
            raise ReplicaError(f"{key} is not attached to node {self.cfg.node_id}", "NOT_FOUND")
        return _describe(self.cfg.node_id, shard)

    def notify_commit(self, key: ShardKey) -> None:
        shard = self.local.get(key)
        if shard is None:
            raise ReplicaError(f"{key} is not attached here", "NOT_FOUND")
        shard.wake.set()

    def _create_local(self, key: ShardKey, manifest: Manifest, cap: int, holders: list[str] | None) -> LocalShard:
        size = 2 * shm.slot_size(manifest, cap) + manifest.nbytes  # two slots and the base copy
        self.store.reserve(size, f"the slots of {key}")
        paths = shm.slot_paths(self.cfg.node_id, key.job_id, key.rank, key.world_size)
        wake = threading.Event()
        bell = self.doorbell.add(wake) if self.doorbell is not None else None
        try:
            shm.remove_slots(paths)  # left over by an earlier daemon of this node that was killed
            shm.create_slots(paths, manifest, cap, bell)
            slots = shm.Slots(paths, manifest, tensors=False)
        except BaseException:
            self._forget_bell(bell and bell[1])
            shm.remove_slots(paths)
            self.store.release(size)
            raise
        shard = LocalShard(key, manifest, slots, self.replicator.holders(holders), size, wake=wake,
                           bell=bell[1] if bell else 0)
        self.local[key] = shard
        self.replicator.start(shard)
        log.info("attached %s: %d-byte state, slots %s, replicating to %s", key, manifest.nbytes,
                 [str(p) for p in paths], [h.address for h in shard.holders] or "nobody")
        return shard

    # ------------------------------------------------------------ replicas

    def stage(self, chunks: Iterable[IncomingChunk], source: str) -> tuple[ShardKey, int, int]:
        """Stages a pushed version (``Store.stage``): (key, version, bytes received)."""
        key, version, nbytes = self.store.stage(chunks, source)
        log.debug("staged %s version %d from %s (%d bytes)", key, version, source, nbytes)
        return key, version, nbytes

    def commit(self, key: ShardKey, version: int) -> tuple[int, int]:
        return self.store.commit(key, version)

    def step_back(self, key: ShardKey, version: int) -> tuple[int, int]:
        return self.store.step_back(key, version)

    def fetch(self, key: ShardKey, version: int, only: Sequence[int] = ()) -> tuple[int, Packed, Hold]:
        """(version, full encoding or the chunks ``only``, what to ``release`` once streamed) of a rank or replica."""
        shard = self.local.get(key)
        if shard is None:
            return self.store.fetch(key, version, only)  # counted while it is read (or cached)
        return serve_from_slots(shard, self.store, version, only)

    def release(self, held: Hold | int) -> None:
        held and held.release()  # 0: nothing held (a push's offer on the bulk socket)

    def drop(self, job_id: str, rank: int | None, world: int | None = None) -> int:
        """Drops a job's shard (``rank``) or all (None) of world size ``world`` (None: any), replicas and slots."""
        job = check_id(job_id, "job id")
        if rank is None and world is None and self.persister is not None:  # the job's end: its last steps to disk
            if said := self.persister.final([s for s in self._shards() if s.key.job_id == job]):
                log.info("job %s ended: %s", job, "; ".join(said))
        n = self.store.drop(job, rank, world)
        with self._lock:
            gone = [k for k in self.local if k.job_id == job and (rank is None or k.rank == rank)
                    and (world is None or k.world_size == world)]
            shards = [self.local.pop(k) for k in gone]
        for s in shards:
            self._close_local(s)
        # Only the job's end empties an auto-started daemon (a relayout re-attaches; a resized job trains on).
        if self.cfg.exit_when_empty and rank is None and world is None and not self.local and not self.store.inventory():
            log.info("nothing attached or held after the job's drop (--exit-when-empty): exiting")
            self.done.set()
        return n + len(shards)

    def _forget_bell(self, bell: int | None) -> None:
        if self.doorbell is not None and bell:
            self.doorbell.remove(bell)

    def _close_local(self, shard: LocalShard) -> None:
        self._forget_bell(shard.bell)
        self.replicator.stop(shard)
        shard.slots.close()
        shm.remove_slots(shard.paths)
        self.store.release(shard.reserved)
        log.info("removed the slots of %s", shard.key)

    # ------------------------------------------------------------ report

    def report(self, job_id: str = "") -> NodeReport:
        """Everything this daemon holds (of one job, or all), its links and its memory: one walk of its state,
        read by ``Inventory``, the metrics and ``ffstate status``."""
        shards = []
        with self._lock:
            local = sorted(self.local.items())
        for key, s in local:
            if job_id and key.job_id != job_id:
                continue
            shards.append(_local_report(key, s, self.watchdog.report(key)))
        for r in self.store.inventory(job_id):
            shards.append(ShardReport(r["key"], False, r["version"], list(r["versions"]), r["bytes"], r["updated"],
                                      r["source"], staged_version=r.get("staged_version", 0),
                                      staged_bytes=r.get("staged_bytes", 0)))
        pacer = self.replicator.pacer
        share = getattr(pacer, "share", 1.0)
        links = [LinkReport(h, link.estimate, share, link.waited, link.overrides, link.catch_ups, pacer.name,
                            link.collisions, link.overlap, getattr(link, "rushes", 0))
                 for h, link in pacer.links().items()]
        timeline = getattr(pacer, "timeline", None)
        seen = {} if timeline is None else {"collectives": timeline.collectives, "collisions": timeline.collisions,
                                            "overlap_seconds": timeline.overlap}
        flushed = None if self.persister is None else PersistReport(
            str(self.persister.root), self.persister.every, **dataclasses.asdict(self.persister.report()))
        return NodeReport(self.cfg.node_id, shards, self.store.used, self.store.budget, links, pacer.name, **seen,
                          persist=flushed, link_share=share, refusals=dict(self.refusals))

    def expire_staged(self) -> None:
        """Discards pushed versions never committed within ``staged_timeout`` (the daemon's loop calls this)."""
        for key, version in self.store.expire_staged(self.cfg.staged_timeout):
            log.warning("discarded %s version %d: pushed and not committed within %gs (--staged-timeout)", key,
                        version, self.cfg.staged_timeout)

    def close(self) -> None:
        self.done.set()  # the threads that wait on it end (the servicer's push watchdog)
        self.watchdog.close()
        if self.persister is not None:  # the versions of ranks still attached, and what is queued (bounded)
            self.persister.close(self._shards())
        with self._lock:
            shards = list(self.local.values())
            self.local.clear()
        for s in shards:  # every replication told to stop first: each stop then waits for its own alone
            s.stop.set(), s.wake.set()
        for s in shards:
            self._close_local(s)
        if self.doorbell is not None:
            self.doorbell.close()
        self.replicator.shutdown()


def _describe(node_id: str, shard: LocalShard) -> SlotsInfo:
    """What an attach or a lookup answers: the rank's slots and their committed versions."""
    done = shard.slots.committed()
    return SlotsInfo([str(p) for p in shard.paths], node_id, shm.slot_size(shard.manifest, shard.slots.scalars_capacity),
                     done[0][0] if done else 0, [v for v, _ in done], shard.manifest.to_json())


def _local_report(key: ShardKey, s: LocalShard, watch: WatchReport | None = None) -> ShardReport:
    done = s.slots.committed()
    razor = None
    if s.razor is not None:  # what the worker said at attach, with the counters it keeps in its slots
        v, m = s.slots.razor_counters()
        razor = dataclasses.replace(s.razor, verifications=v, mismatches=m)
    back = s.versions_back()  # no lock: advisory, and a round may hold it for a while
    restores, version, lost, seconds, entry, from_world = s.slots.restore_record()
    restore = RestoreReport(restores, version, lost, seconds, entry, from_world) if restores else None
    timeline = s.slots.profiled_timeline()
    profiled = ProfiledReport(timeline.steps, len(timeline.intervals), timeline.period,
                              timeline.busy_seconds) if timeline else None
    return ShardReport(key, True, done[0][0] if done else 0, sorted({v for v, _ in done} | set(back), reverse=True),
                       s.reserved, s.last_push, str(s.paths[0].parent), s.replicated_version, razor, s.pushed_bytes,
                       s.pushed_versions, restore, profiled, queue_versions=max(0, s.base_version - s.replicated_version),
                       pushed_raw_bytes=s.pushed_raw_bytes, watch=watch, holders_down=s.holders_down,
                       holders_seeding=s.holders_seeding)
