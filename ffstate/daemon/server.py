"""The replica daemon's gRPC service and process: ``ffstate serve``.

The servicer translates between protobuf and the store/replicator at its edge and maps every
``ReplicaError`` to its gRPC status; an interceptor checks the job token on every call (health
checks excepted). The process owns the node's shared-memory slots and removes them when it exits
(SIGTERM/SIGINT: graceful; ``--idle-exit``: after that long without a request or a commit).
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import struct
import threading
import time
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from ffstate import shm
from ffstate._proto import replica_pb2 as pb
from ffstate._proto import replica_pb2_grpc as pb_grpc
from ffstate.client import DEFAULT_MAX_MESSAGE, TOKEN_KEY, Client, Tls, with_payload
from ffstate.daemon.replicator import LocalShard, Pacer, Replicator
from ffstate.daemon.store import IncomingChunk, ShardKey, Store
from ffstate.errors import CodecError, FFStateError, ReplicaError
from ffstate.layout import Manifest
from ffstate.scheduler import Naive, Scheduler, merge_intervals, project

log = logging.getLogger("ffstate.daemon")

MAX_MANIFEST_BYTES = 64 << 20


@dataclass
class ServeConfig:
    """What ``ffstate serve`` takes (its flags map one to one)."""

    host: str = "127.0.0.1"
    port: int = 0  # 0: any free port (printed and logged)
    node_id: str = field(default_factory=lambda: socket.gethostname().split(".")[0] or "node")
    peers: list[str] = field(default_factory=list)
    memory_limit: int = 0  # bytes; 0: a quarter of the host's RAM
    token: str = ""
    tls_cert: Path | None = None
    tls_key: Path | None = None
    tls_client_ca: Path | None = None  # require client certificates signed by this CA (mutual TLS)
    tls_ca: Path | None = None  # the CA to verify peers' certificates when pushing to them
    idle_exit: float = 0.0  # seconds; 0: never
    exit_when_empty: bool = False  # exit once a Drop leaves nothing attached or held (auto-started daemons)
    pid_file: Path | None = None
    keep_deltas: int = 4  # W: versions a replica can be stepped back
    max_chunk_bytes: int = 32 << 20
    scalars_capacity: int = shm.DEFAULT_SCALARS_CAPACITY
    scheduler: str = "windows"  # windows: into the training's idle windows; naive: as soon as captured
    link_share: float = 0.5  # share of each link's estimated bandwidth replication may use
    link_bandwidth: int = 0  # bytes per second of the links when known; 0: measured from the pushes
    metrics_port: int = 0  # Prometheus /metrics on this port; 0: off
    slot_poll: float = 0.05  # seconds between looks at the slots without a ring of the doorbell
    pacer: Pacer | None = None  # overrides scheduler (tests)


def default_memory_limit() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 4


def _status(code: str) -> grpc.StatusCode:
    return getattr(grpc.StatusCode, code, grpc.StatusCode.UNKNOWN)


def _key(msg: pb.ShardKey) -> ShardKey:
    return ShardKey(msg.job_id, msg.rank, msg.world_size)


class _TokenInterceptor(grpc.ServerInterceptor):
    """UNAUTHENTICATED, before any handler runs, for a call without the job's token."""

    def __init__(self, token: str):
        self._token = token

        def deny(request: Any, context: grpc.ServicerContext) -> None:
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong ffstate token (metadata 'ffstate-token')")

        self._deny = {
            "unary": grpc.unary_unary_rpc_method_handler(deny),
            "Push": grpc.stream_unary_rpc_method_handler(deny),
            "Fetch": grpc.unary_stream_rpc_method_handler(deny),
        }

    def intercept_service(self, continuation: Callable, details: grpc.HandlerCallDetails) -> Any:
        if details.method.startswith("/grpc.health.v1."):
            return continuation(details)
        meta = dict(details.invocation_metadata or ())
        if meta.get(TOKEN_KEY) == self._token:
            return continuation(details)
        log.warning("refused %s: missing or wrong token", details.method)
        return self._deny.get(details.method.rsplit("/", 1)[-1], self._deny["unary"])


class Daemon(pb_grpc.ReplicaServicer):
    """The replica daemon: the store, the local ranks' slots and their replicator."""

    def __init__(self, cfg: ServeConfig):
        self.cfg = cfg
        shm.check_id(cfg.node_id, "node id")
        self.store = Store(cfg.memory_limit or default_memory_limit(), cfg.keep_deltas, cfg.max_chunk_bytes)
        # Pushing to TLS peers: verify them with --tls-ca, and present this daemon's own certificate
        # (peers that run mutual TLS ask for one).
        tls = Tls(cfg.tls_ca, cert=cfg.tls_cert, key=cfg.tls_key) if cfg.tls_ca else None
        self.replicator = Replicator(lambda addr: Client(addr, cfg.token, tls=tls, timeout=30.0), cfg.peers,
                                     cfg.pacer or self._pacer(), poll_interval=cfg.slot_poll, keep=cfg.keep_deltas)
        self.local: dict[ShardKey, LocalShard] = {}
        self._lock = threading.Lock()
        self.last_activity = time.monotonic()
        self.server: grpc.Server | None = None
        self.port = 0
        self.done = threading.Event()
        self.metrics = None  # the Prometheus HTTP server, with --metrics-port
        try:  # rung by the workers after each commit
            self.doorbell: shm.Doorbell | None = shm.Doorbell(cfg.node_id, self._touch)
        except OSError as e:  # no abstract Unix sockets here: the replicator's look at the slots still finds commits
            log.warning("no doorbell for the workers (%s): commits are taken within --slot-poll %.3fs", e,
                        cfg.slot_poll)
            self.doorbell = None

    # ------------------------------------------------------------ helpers

    def _pacer(self) -> Pacer:
        cfg = self.cfg
        if cfg.scheduler == "naive":  # paces nothing; counts the collisions all the same
            return Naive(self._comm_marks, cfg.link_bandwidth)
        if cfg.scheduler != "windows":
            raise FFStateError(f"scheduler must be windows or naive, got {cfg.scheduler!r}")
        # Past keep_deltas - 1 versions behind, a sender must not wait for windows: the worker's lag bound is near.
        return Scheduler(self._comm_marks, cfg.link_share, cfg.link_bandwidth, deadline=max(1, cfg.keep_deltas - 1),
                         predicted=self._predicted)

    def _comm_marks(self) -> tuple[int, list[tuple[float, float]], list[float]]:
        """The training's collectives as this node's workers mark them (for the scheduler)."""
        inflight, intervals, commits = 0, [], []
        with self._lock:
            shards = list(self.local.values())
        for shard in shards:
            try:
                n, iv, c = shard.slots.comm_marks()
            except (ValueError, IndexError, struct.error):  # dropped (its mappings closed) while we looked
                continue
            inflight += n
            intervals += iv
            if len(c) > len(commits) or (c and commits and c[-1] > commits[-1]):
                commits = c
        return inflight, intervals, commits

    def _predicted(self) -> list[tuple[float, float]]:
        """The collectives of the workers that profiled their steps (no marks), placed after their newest commits."""
        out: list[tuple[float, float]] = []
        with self._lock:
            shards = list(self.local.values())
        for shard in shards:
            try:
                timeline = shard.slots.profiled_timeline()
                if timeline is not None:
                    out += project(timeline.intervals, timeline.period, shard.slots.comm_marks()[2])
            except (ValueError, IndexError, struct.error):  # dropped (its mappings closed) while we looked
                continue
        return merge_intervals(out)

    def idle_seconds(self) -> float:
        """Seconds since the last request or the last commit into an attached rank's slots (a worker with no
        replicas commits without ever calling the daemon: it is not idle while its job trains)."""
        since = time.monotonic() - self.last_activity
        for shard in list(self.local.values()):
            try:
                since = min(since, time.time() - shard.slots.committed_at())
            except (ValueError, IndexError, struct.error):  # dropped (its mappings closed) while we looked
                continue
        return since

    def _abort(self, context: grpc.ServicerContext, e: Exception) -> None:
        code = e.code if isinstance(e, ReplicaError) else "INVALID_ARGUMENT"
        context.abort(_status(code), str(e))

    def _touch(self) -> None:
        self.last_activity = time.monotonic()

    def _guard(self, context: grpc.ServicerContext, fn: Callable[[], Any]) -> Any:
        self._touch()
        try:
            return fn()
        except (ReplicaError, CodecError, shm.SlotError) as e:
            self._abort(context, e)

    # ------------------------------------------------------------ local workers

    def Attach(self, request: pb.AttachRequest, context: grpc.ServicerContext) -> pb.AttachResponse:
        return self._guard(context, lambda: self._attach(request))

    def _attach(self, request: pb.AttachRequest) -> pb.AttachResponse:
        key = _key(request.shard)
        if len(request.manifest_json) > MAX_MANIFEST_BYTES:
            raise ReplicaError(f"manifest of {len(request.manifest_json)} bytes exceeds {MAX_MANIFEST_BYTES}",
                               "INVALID_ARGUMENT")
        manifest = Manifest.from_json(request.manifest_json)
        cap = request.scalars_capacity or self.cfg.scalars_capacity
        holders = list(request.holders) or None
        with self._lock:
            shard = self.local.get(key)
            if shard is not None:
                if shard.manifest.layout_id != manifest.layout_id:
                    raise ReplicaError(
                        f"{key} is attached with layout {shard.manifest.layout_id}; this worker's state has layout "
                        f"{manifest.layout_id} (a different model?). Drop the job first or use another job id",
                        "FAILED_PRECONDITION")
                discard = request.discard_after if request.HasField("discard_after") else None
                self.replicator.reset(shard, holders, discard_after=discard)
                log.info("worker re-attached to %s (slots %s), replicating to %s", key, [str(p) for p in shard.paths],
                         [h.address for h in shard.holders])
            else:
                shard = self._create_local(key, manifest, cap, holders)
            shard.razor = request.razor if request.HasField("razor") else None
        return self._describe(shard)

    def _describe(self, shard: LocalShard) -> pb.AttachResponse:
        done = shard.slots.committed()
        return pb.AttachResponse(slot_paths=[str(p) for p in shard.paths], node_id=self.cfg.node_id,
                                 slot_bytes=shm.slot_size(shard.manifest, shard.slots.scalars_capacity),
                                 committed_version=done[0][0] if done else 0,
                                 committed_versions=[v for v, _ in done], manifest_json=shard.manifest.to_json())

    def Lookup(self, request: pb.ShardKey, context: grpc.ServicerContext) -> pb.AttachResponse:
        def run() -> pb.AttachResponse:
            shard = self.local.get(_key(request))
            if shard is None:
                raise ReplicaError(f"{_key(request)} is not attached to node {self.cfg.node_id}", "NOT_FOUND")
            return self._describe(shard)

        return self._guard(context, run)

    def _create_local(self, key: ShardKey, manifest: Manifest, cap: int, holders: list[str] | None) -> LocalShard:
        size = 2 * shm.slot_size(manifest, cap) + manifest.nbytes  # two slots and the base copy
        self.store.reserve(size, f"the slots of {key}")
        paths = shm.slot_paths(self.cfg.node_id, key.job_id, key.rank, key.world_size)
        wake = threading.Event()
        bell = self.doorbell.add(wake) if self.doorbell is not None else None
        try:
            shm.remove_slots(paths)  # left over by an earlier daemon of this node that was killed
            shm.create_slots(paths, manifest, cap, bell)
            slots = shm.Slots(paths, manifest)
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

    def NotifyCommit(self, request: pb.CommitNotice, context: grpc.ServicerContext) -> pb.CommitNoticeAck:
        def run() -> pb.CommitNoticeAck:
            shard = self.local.get(_key(request.shard))
            if shard is None:
                raise ReplicaError(f"{_key(request.shard)} is not attached here", "NOT_FOUND")
            shard.wake.set()
            return pb.CommitNoticeAck()

        return self._guard(context, run)

    # ------------------------------------------------------------ replicas

    def Push(self, request_iterator: Iterator[pb.PushChunk], context: grpc.ServicerContext) -> pb.PushResult:
        source = context.peer()

        def chunks() -> Iterator[IncomingChunk]:
            for m in request_iterator:
                self._touch()
                yield IncomingChunk(_key(m.shard), m.version, m.base_version, m.chunk_index, m.chunk_count,
                                    m.checksum, m.payload)

        def run() -> pb.PushResult:
            key, version, nbytes = self.store.stage(chunks(), source)
            log.debug("staged %s version %d from %s (%d bytes)", key, version, source, nbytes)
            return pb.PushResult(staged_version=version, bytes_received=nbytes)

        return self._guard(context, run)

    def Commit(self, request: pb.CommitRequest, context: grpc.ServicerContext) -> pb.CommitResult:
        def run() -> pb.CommitResult:
            version, checksum = self.store.commit(_key(request.shard), request.version)
            return pb.CommitResult(version=version, checksum=checksum)

        return self._guard(context, run)

    def Fetch(self, request: pb.FetchRequest, context: grpc.ServicerContext) -> Iterator[bytes]:
        version, packed, reserved = self._guard(context, lambda: self._fetch(_key(request.shard), request.version))
        try:
            for c in packed.chunks[request.first_chunk :: request.chunk_step or 1]:
                head = pb.FetchChunk(version=version, chunk_index=c.index, chunk_count=c.count,
                                     checksum=c.checksum).SerializeToString()
                yield with_payload(head, 5, c.payload)
                self._touch()
        finally:
            self.store.release(reserved)

    def _fetch(self, key: ShardKey, version: int) -> tuple[int, Any, int]:
        """(version, full encoding, bytes to release after streaming) of a local rank or a replica held here."""
        from ffstate import codec

        shard = self.local.get(key)
        if shard is None:
            return (*self.store.fetch(key, version), 0)  # the store keeps (and counts) what it serves
        nbytes = shard.manifest.nbytes
        self.store.reserve(2 * nbytes, f"serving {key} from its slots")  # a copy and its encoding
        try:
            got = shard.slots.copy_latest(version)
            if got is None and version:  # older than the slots: step the daemon's copy back (DESIGN.md I3)
                with shard.lock:
                    snap = shard.stepped_back(version)
                got = (version, snap) if snap is not None else None
            if got is None:
                raise ReplicaError(f"{key} version {version or 'newest'} is not in this node's slots (committed: "
                                   f"{[v for v, _ in shard.slots.committed()]}) nor within the deltas kept "
                                   f"({shard.versions_back()})", "NOT_FOUND")
            return got[0], codec.encode_snapshot(got[1]), 2 * nbytes
        except BaseException:
            self.store.release(2 * nbytes)
            raise

    def Inventory(self, request: pb.InventoryRequest, context: grpc.ServicerContext) -> pb.InventoryResponse:
        def run() -> pb.InventoryResponse:
            shards = []
            with self._lock:
                local = sorted(self.local.items())
            for key, s in local:
                if request.job_id and key.job_id != request.job_id:
                    continue
                done = s.slots.committed()
                razor = None
                if s.razor is not None:
                    razor = pb.RazorInfo()
                    razor.CopyFrom(s.razor)
                    razor.verifications, razor.mismatches = s.slots.razor_counters()
                back = s.versions_back()  # no lock: advisory, and a round may hold it for a while
                restores, version, lost, seconds, entry = s.slots.restore_record()
                restore = pb.RestoreInfo(restores=restores, version=version, steps_lost=lost, seconds=seconds,
                                         entry_seconds=entry) if restores else None
                timeline = s.slots.profiled_timeline()
                profiled = pb.ProfiledInfo(steps=timeline.steps, collectives=len(timeline.intervals),
                                           period_seconds=timeline.period,
                                           busy_seconds=timeline.busy_seconds) if timeline else None
                shards.append(pb.ShardInfo(
                    shard=pb.ShardKey(job_id=key.job_id, rank=key.rank, world_size=key.world_size), local=True,
                    version=done[0][0] if done else 0, bytes=s.reserved,
                    versions=sorted({v for v, _ in done} | set(back), reverse=True),
                    last_update_unix=s.last_push, source=str(s.paths[0].parent),
                    replicated_version=s.replicated_version, razor=razor, pushed_bytes=s.pushed_bytes,
                    pushed_versions=s.pushed_versions, restore=restore, profiled=profiled))
            for r in self.store.inventory(request.job_id):
                k = r["key"]
                shards.append(pb.ShardInfo(
                    shard=pb.ShardKey(job_id=k.job_id, rank=k.rank, world_size=k.world_size), local=False,
                    version=r["version"], versions=r["versions"], bytes=r["bytes"], last_update_unix=r["updated"],
                    source=r["source"]))
            pacer = self.replicator.pacer
            links = [pb.LinkInfo(holder=h, estimate_bytes_per_second=link.estimate, share=getattr(pacer, "share", 1.0),
                                 waited_seconds=link.waited, deadline_overrides=link.overrides, catch_ups=link.catch_ups,
                                 scheduler=pacer.name, collisions=link.collisions, overlap_seconds=link.overlap)
                     for h, link in pacer.links().items()]
            timeline = getattr(pacer, "timeline", None)
            seen = {} if timeline is None else {"collectives": timeline.collectives, "collisions": timeline.collisions,
                                                "overlap_seconds": timeline.overlap}
            return pb.InventoryResponse(node_id=self.cfg.node_id, shards=shards, bytes_used=self.store.used,
                                        bytes_budget=self.store.budget, links=links, scheduler=pacer.name, **seen)

        return self._guard(context, run)

    def StepBack(self, request: pb.StepBackRequest, context: grpc.ServicerContext) -> pb.StepBackResult:
        def run() -> pb.StepBackResult:
            version, checksum = self.store.step_back(_key(request.shard), request.version)
            return pb.StepBackResult(version=version, checksum=checksum)

        return self._guard(context, run)

    def Drop(self, request: pb.DropRequest, context: grpc.ServicerContext) -> pb.DropResult:
        def run() -> pb.DropResult:
            job = shm.check_id(request.shard.job_id, "job id")
            rank = None if request.shard.rank < 0 else request.shard.rank
            n = self.store.drop(job, rank)
            with self._lock:
                gone = [k for k in self.local if k.job_id == job and (rank is None or k.rank == rank)]
                shards = [self.local.pop(k) for k in gone]
            for s in shards:
                self._close_local(s)
            if self.cfg.exit_when_empty and not self.local and not self.store.inventory():
                log.info("nothing attached or held after the drop (--exit-when-empty): exiting")
                self.done.set()
            return pb.DropResult(dropped=n + len(shards))

        return self._guard(context, run)

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

    # ------------------------------------------------------------ process

    def start(self) -> int:
        cfg = self.cfg
        # No SO_REUSEPORT (gRPC's default): a second daemon on a port in use would share it, the kernel spreading
        # RPCs over both; it must fail instead.
        opts = [("grpc.max_receive_message_length", cfg.max_chunk_bytes + (1 << 20)),
                ("grpc.max_send_message_length", DEFAULT_MAX_MESSAGE), ("grpc.so_reuseport", 0)]
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=32, thread_name_prefix="ffstate-rpc"),
                                  interceptors=[_TokenInterceptor(cfg.token)], options=opts)
        self.server.add_generic_rpc_handlers([self._handlers()])
        health_servicer = health.HealthServicer()
        health_servicer.set("ffstate.v1.Replica", health_pb2.HealthCheckResponse.SERVING)
        health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, self.server)
        address = f"{cfg.host}:{cfg.port}"
        try:
            if cfg.tls_cert and cfg.tls_key:
                creds = grpc.ssl_server_credentials(
                    [(cfg.tls_key.read_bytes(), cfg.tls_cert.read_bytes())],
                    root_certificates=cfg.tls_client_ca.read_bytes() if cfg.tls_client_ca else None,
                    require_client_auth=cfg.tls_client_ca is not None)
                self.port = self.server.add_secure_port(address, creds)
            else:
                self.port = self.server.add_insecure_port(address)
        except RuntimeError:  # grpcio raises where it once returned 0
            self.port = 0
        if not self.port:
            raise FFStateError(f"cannot listen on {address}: the address is in use (another daemon?) or not this host's")
        self.server.start()
        if cfg.metrics_port:
            from ffstate.daemon.metrics import serve_metrics

            try:
                self.metrics = serve_metrics(self, cfg.host, cfg.metrics_port)
            except OSError as e:
                raise FFStateError(f"cannot serve metrics on {cfg.host}:{cfg.metrics_port}: {e}") from e
        log.info("scheduler: %s, link share %.2f, link bandwidth %s", self.replicator.pacer.name, cfg.link_share,
                 f"{cfg.link_bandwidth / 1e6:.1f} MB/s" if cfg.link_bandwidth else "measured")
        log.info("ffstate daemon %s serving on %s:%d (%s), budget %d bytes, peers %s", cfg.node_id, cfg.host,
                 self.port, "TLS" if cfg.tls_cert else "plaintext", self.store.budget, cfg.peers or "none")
        return self.port

    def _handlers(self) -> grpc.GenericRpcHandler:
        """The generated handlers, except Fetch, whose responses are serialized with one copy."""
        handlers = {
            "Attach": grpc.unary_unary_rpc_method_handler(self.Attach, pb.AttachRequest.FromString,
                                                          pb.AttachResponse.SerializeToString),
            "Lookup": grpc.unary_unary_rpc_method_handler(self.Lookup, pb.ShardKey.FromString,
                                                          pb.AttachResponse.SerializeToString),
            "NotifyCommit": grpc.unary_unary_rpc_method_handler(self.NotifyCommit, pb.CommitNotice.FromString,
                                                                pb.CommitNoticeAck.SerializeToString),
            "Push": grpc.stream_unary_rpc_method_handler(self.Push, pb.PushChunk.FromString,
                                                         pb.PushResult.SerializeToString),
            "Commit": grpc.unary_unary_rpc_method_handler(self.Commit, pb.CommitRequest.FromString,
                                                          pb.CommitResult.SerializeToString),
            "Fetch": grpc.unary_stream_rpc_method_handler(self.Fetch, pb.FetchRequest.FromString, lambda b: b),
            "Inventory": grpc.unary_unary_rpc_method_handler(self.Inventory, pb.InventoryRequest.FromString,
                                                             pb.InventoryResponse.SerializeToString),
            "StepBack": grpc.unary_unary_rpc_method_handler(self.StepBack, pb.StepBackRequest.FromString,
                                                            pb.StepBackResult.SerializeToString),
            "Drop": grpc.unary_unary_rpc_method_handler(self.Drop, pb.DropRequest.FromString,
                                                        pb.DropResult.SerializeToString),
        }
        return grpc.method_handlers_generic_handler("ffstate.v1.Replica", handlers)

    def stop(self, grace: float = 5.0) -> None:
        if self.server is not None:
            self.server.stop(grace).wait(grace + 1)
        if self.metrics is not None:
            self.metrics.shutdown()
            self.metrics.server_close()
        with self._lock:
            shards = list(self.local.values())
            self.local.clear()
        for s in shards:
            self._close_local(s)
        if self.doorbell is not None:
            self.doorbell.close()
        self.replicator.shutdown()
        log.info("ffstate daemon %s stopped", self.cfg.node_id)


def serve(cfg: ServeConfig, ready: Callable[[int], None] | None = None) -> int:
    """Runs a daemon until SIGTERM/SIGINT or the idle timeout; returns the exit code."""
    daemon = Daemon(cfg)
    port = daemon.start()
    if cfg.pid_file:
        cfg.pid_file.write_text(f"{os.getpid()}\n")
    if ready is not None:
        ready(port)
    done = daemon.done
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: done.set())
    while not done.wait(0.5):
        if cfg.idle_exit and daemon.idle_seconds() > cfg.idle_exit:
            log.info("idle for %.0fs (--idle-exit): exiting", cfg.idle_exit)
            break
    daemon.stop()
    if cfg.pid_file:
        cfg.pid_file.unlink(missing_ok=True)
    return 0
