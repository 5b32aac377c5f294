"""The daemon's gRPC edge: the servicer (protobuf <-> ``node.py``), one map from errors to gRPC statuses;
``start_server`` binds it, plain or TLS (I6), behind the token check of ``auth.py``."""

from __future__ import annotations

import itertools
import logging
import socket
import threading
import time
from concurrent import futures
from typing import Any, Callable, Iterator

import grpc
import numpy as np
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from ffstate import wire
from ffstate._proto import replica_pb2 as pb
from ffstate.bulk import frames
from ffstate.bulk.frames import FRAME, recv_exactly, recv_into
from ffstate.bulk.server import BulkServer
from ffstate.config import DaemonConfig
from ffstate.daemon.auth import TokenInterceptor
from ffstate.daemon.node import MAX_MANIFEST_BYTES, Node
from ffstate.daemon.checks import MAX_CHUNKS
from ffstate.daemon.held import IncomingChunk
from ffstate.errors import CodecError, FFStateError, ReplicaError, SlotError
from ffstate.ids import ShardKey, check_id
from ffstate.reports import RazorReport

log = logging.getLogger("ffstate.daemon")


def status_of(e: Exception) -> grpc.StatusCode:
    """The one error -> status map: a ``ReplicaError`` answers with its own code; a malformed state, chunk
    or slot request (``CodecError``, ``SlotError``) is the caller's: INVALID_ARGUMENT."""
    code = e.code if isinstance(e, ReplicaError) else "INVALID_ARGUMENT"
    return getattr(grpc.StatusCode, code, grpc.StatusCode.UNKNOWN)


_REFUSED = (ReplicaError, CodecError, SlotError)
MAX_DETAIL = 1024  # characters of a refusal's message: ids and sizes come from the request
LOG_EVERY = 1.0  # seconds between logged refusals of one method and status (the rest are counted)


def _key(msg: pb.ShardKey) -> ShardKey:
    return ShardKey(msg.job_id, msg.rank, msg.world_size)


def _ascending(wanted: list[int]) -> None:
    """The chunk indices a fetch names (``FetchRequest.chunks``) must ascend: checked in time proportional to the list
    sent, before the daemon copies or encodes anything."""
    for a, b in zip(wanted, wanted[1:]):
        if b <= a:
            raise ReplicaError(f"fetch names chunk {b} after {a}: chunk indices must ascend", "INVALID_ARGUMENT")


class Servicer:
    """``ffstate.v1.Replica`` over a ``Node``: each method unpacks its request, calls the node, packs the answer."""

    def __init__(self, node: Node, bulk: BulkServer | None = None):
        self.node = node
        self.bulk = bulk  # the bulk socket, where the daemon has one
        cfg = node.cfg
        self._pushes = threading.BoundedSemaphore(cfg.max_pushes)
        self._idle = cfg.push_idle_timeout
        # Open push streams: id -> [context, monotonic time of its last chunk]; the watchdog cancels stalled ones
        # (gRPC's sync server has no per-message deadline, and a handler blocked on its stream cannot look).
        self._streams: dict[int, list] = {}
        self._ids = itertools.count()
        threading.Thread(target=self._watch_pushes, name="ffstate-push-watchdog", daemon=True).start()
        self._logged: dict[tuple[str, str], tuple[float, int]] = {}  # (method, status) -> (last logged, since)

    def _guard(self, method: str, context: grpc.ServicerContext, fn: Callable[[], Any]) -> Any:
        self.node.touch()
        try:
            return fn()
        except _REFUSED as e:
            self._refuse(context, method, status_of(e), str(e))

    def _refuse(self, context: grpc.ServicerContext, method: str, code: grpc.StatusCode, message: str) -> None:
        """Counts the refusal, logs it (``_note``), and answers with its status and a message of bounded length."""
        context.abort(code, self._note(method, code, message))

    def _note(self, method: str, code: grpc.StatusCode, message: str) -> str:
        """Counts a refusal and logs it (one line per method and status a second, with how many were not); returns
        its message, bounded."""
        message = message if len(message) <= MAX_DETAIL else message[: MAX_DETAIL - 15] + " ... (truncated)"
        self.node.refused(code.name)
        now = time.monotonic()
        last, quiet = self._logged.get((method, code.name), (0.0, 0))
        if now - last >= LOG_EVERY:
            more = f" (and {quiet} more since)" if quiet else ""
            normal = (method, code) == ("Lookup", grpc.StatusCode.NOT_FOUND)  # a rank's entry asks before it attaches
            (log.info if normal else log.warning)("refused %s: %s: %s%s", method or "a call", code.name, message[:300], more)
            self._logged[(method, code.name)] = (now, 0)
        else:
            self._logged[(method, code.name)] = (last, quiet + 1)
        return message

    # ------------------------------------------------------------ local workers

    def Attach(self, request: pb.AttachRequest, context: grpc.ServicerContext) -> pb.AttachResponse:
        razor = wire.from_proto(request.razor, RazorReport) if request.HasField("razor") else None
        discard = request.discard_after if request.HasField("discard_after") else None
        return self._guard("Attach", context, lambda: pb.AttachResponse(**vars(self.node.attach(
            _key(request.shard), request.manifest_json, request.scalars_capacity, list(request.holders) or None,
            razor, discard, request.persist_keys))))

    def Lookup(self, request: pb.ShardKey, context: grpc.ServicerContext) -> pb.AttachResponse:
        return self._guard("Lookup", context, lambda: pb.AttachResponse(**vars(self.node.lookup(_key(request)))))

    def NotifyCommit(self, request: pb.CommitNotice, context: grpc.ServicerContext) -> pb.CommitNoticeAck:
        return self._guard("NotifyCommit", context, lambda: self.node.notify_commit(_key(request.shard)) or pb.CommitNoticeAck())

    # ------------------------------------------------------------ replicas

    def Push(self, request_iterator: Iterator[bytes], context: grpc.ServicerContext) -> pb.PushResult:
        ident = next(self._ids)
        seen = [context, time.monotonic()]

        def messages() -> Iterator[bytes]:
            for raw in request_iterator:
                seen[1] = time.monotonic()
                self.node.touch()
                yield raw

        def run() -> pb.PushResult:
            self._streams[ident] = seen
            try:
                return self._push(messages(), context)
            finally:
                self._streams.pop(ident, None)

        return self._guard("Push", context, run)

    def PushVersion(self, request: bytes, context: grpc.ServicerContext) -> pb.PushResult:
        """Push's work on one message that holds every chunk (a small version): no stream to watch, the message
        is whole before this runs (bounded by the server's message limit)."""
        # The chunks stay views of the one received message, read one at a time: staging refuses the first that is
        # out of place (its chunk count bounds them), before the rest is scanned.
        return self._guard("PushVersion", context, lambda: self._push(wire.split_entries(request, 1), context))

    def _push(self, messages: Iterator[bytes | memoryview], context: grpc.ServicerContext) -> pb.PushResult:
        """Stages the version that ``messages`` (serialized PushChunks, in order) carry, and applies it when its
        last chunk says commit."""
        commit = [False]  # what the last chunk said: apply the version once staged, in this call

        def chunks() -> Iterator[IncomingChunk]:
            for raw in messages:
                # The payload stays a view of the received bytes: protobuf's parse and its field access each
                # copied it (bench bandwidth, 4 MiB chunks: 2.0-2.3 s of the holder's CPU per GB, now 1.1-1.3).
                m, payload = wire.parse_with_payload(raw, pb.PushChunk, 7)
                if len(raw) - len(payload) > wire.MAX_CHUNK_FIELDS:  # held with the payload's view: bounded
                    raise ReplicaError(f"a push chunk of {len(raw)} bytes carries {len(payload)} of payload; its other "
                                       f"fields take at most {wire.MAX_CHUNK_FIELDS}", "INVALID_ARGUMENT")
                commit[0] = m.commit
                yield IncomingChunk(_key(m.shard), m.version, m.base_version, m.chunk_index, m.chunk_count,
                                    m.checksum, payload)

        if not self._pushes.acquire(blocking=False):
            raise ReplicaError(f"{self.node.cfg.max_pushes} pushes are in flight here (--max-pushes); retry",
                               "RESOURCE_EXHAUSTED")
        try:
            key, version, nbytes = self.node.stage(chunks(), context.peer())
        finally:
            self._pushes.release()
        if commit[0]:  # one call a version instead of two (Push, then Commit): a unary call is ~0.6 ms of CPU
            held, checksum = self.node.commit(key, version)
            return pb.PushResult(bytes_received=nbytes, committed_version=held, checksum=checksum)
        return pb.PushResult(staged_version=version, bytes_received=nbytes)

    def _watch_pushes(self) -> None:
        """Cancels each push stream that sent nothing for ``push_idle_timeout``: its thread and staged bytes come
        back (the stream's reader raises, the staging is discarded), and the sender sees CANCELLED."""
        while not self.node.done.wait(min(1.0, self._idle / 4)):  # until the node stops (signal, empty, close)
            now = time.monotonic()
            for ident, (context, last) in list(self._streams.items()):
                if now - last > self._idle and self._streams.pop(ident, None) is not None:
                    log.warning("push stalled: no chunk for %gs (--push-idle-timeout) from %s; cut off", self._idle,
                                context.peer())
                    self.node.refused("CANCELLED")
                    context.cancel()

    def Commit(self, request: pb.CommitRequest, context: grpc.ServicerContext) -> pb.CommitResult:
        def run() -> pb.CommitResult:
            version, checksum = self.node.commit(_key(request.shard), request.version)
            return pb.CommitResult(version=version, checksum=checksum)

        return self._guard("Commit", context, run)

    def _fetched(self, request: pb.FetchRequest) -> tuple[int, list, int]:
        """(version, the chunks ``request`` asks for, what is held until they are sent): Fetch's and FetchBulk's
        checks and work, before anything is sent."""
        if len(request.chunks) > MAX_CHUNKS:  # before the list is made: a message's indices are 15x its size as ints
            raise ReplicaError(f"fetch names {len(request.chunks)} chunks; a version has at most {MAX_CHUNKS}",
                               "INVALID_ARGUMENT")
        wanted = list(request.chunks)
        _ascending(wanted)  # before anything is copied or encoded
        version, packed, reserved = self.node.fetch(_key(request.shard), request.version, wanted)
        try:
            if request.checksum and packed.checksum != request.checksum:
                raise ReplicaError(f"version {version} of {_key(request.shard)} here has checksum "
                                   f"{packed.checksum:016x}, not the {request.checksum:016x} asked for: another "
                                   "copy of that version", "FAILED_PRECONDITION")
            count = packed.chunks[0].count if packed.chunks else 0
            if not wanted or len(packed.chunks) != count:  # everything, or the chunks named alone
                chunks = packed.chunks
            elif wanted[-1] >= count:  # a whole encoding at hand (cached): the chunks named, from it
                raise ReplicaError(f"fetch names chunk {wanted[-1]}: the version has {count} chunks (indices "
                                   "must stay below it)", "INVALID_ARGUMENT")
            else:
                chunks = [packed.chunks[i] for i in wanted]
            return version, chunks[request.first_chunk :: request.chunk_step or 1], reserved
        except BaseException:  # refused (or a bug): nothing is sent, the copies go back
            self.node.release(reserved)
            raise

    def Fetch(self, request: pb.FetchRequest, context: grpc.ServicerContext) -> Iterator[bytes]:
        version, chunks, reserved = self._guard("Fetch", context, lambda: self._fetched(request))
        start = time.perf_counter()
        try:
            for i in range(len(chunks)):  # a chunk still being made (``making.py``) that cannot be is refused
                c = self._guard("Fetch", context, lambda: chunks[i])  # noqa: B023 (called at once)
                head = pb.FetchChunk(version=version, chunk_index=c.index, chunk_count=c.count,
                                     checksum=c.checksum).SerializeToString()
                yield wire.with_payload(head, 5, c.payload)
                self.node.touch()
        finally:
            self.node.release(reserved)
        log.info("served version %d of %s to %s over gRPC: %d chunk(s), %.1f MB in %.3fs", version, _key(request.shard),
                 context.peer(), len(chunks), sum(len(c.payload) for c in chunks) / 1e6, time.perf_counter() - start)

    def FetchBulk(self, request: pb.FetchRequest, context: grpc.ServicerContext) -> pb.BulkTicket:
        """Fetch's chunks offered on the bulk socket (``ffstate/bulk/``): the answer's ticket claims them there."""
        def offer() -> pb.BulkTicket:
            if self.bulk is None:
                raise ReplicaError("this daemon has no bulk socket (TLS, or --bulk-port -1): use Fetch", "UNIMPLEMENTED")
            version, chunks, reserved = self._fetched(request)
            if not context.is_active() or context.time_remaining() <= 0:  # the caller went (killed, or its deadline
                self.node.release(reserved)  # passed) while this was encoded: no offer holding the memory for 10 s
                raise ReplicaError("the caller is gone", "CANCELLED")
            ticket = self.bulk.offer(version, chunks, reserved, str(_key(request.shard)))  # it owns the reservation
            return pb.BulkTicket(ticket=ticket, port=self.bulk.port, version=version, chunks=len(chunks))

        return self._guard("FetchBulk", context, offer)

    def PushBulk(self, request: pb.PushOpen, context: grpc.ServicerContext) -> pb.BulkTicket:
        """A push whose chunks come on the bulk socket (``ffstate/bulk/``): the answer's ticket opens it there."""
        def offer() -> pb.BulkTicket:
            if self.bulk is None:
                raise ReplicaError("this daemon has no bulk socket (TLS, or --bulk-port -1): use Push", "UNIMPLEMENTED")
            key = _key(request.shard)
            ticket = self.bulk.offer_push(lambda conn, peer: self._bulk_push(conn, peer, key, request), str(key))
            return pb.BulkTicket(ticket=ticket, port=self.bulk.port, version=request.version, chunks=request.chunk_count)

        return self._guard("PushBulk", context, offer)

    def _bulk_push(self, conn: socket.socket, peer: tuple, key: ShardKey, req: pb.PushOpen) -> None:
        """Push's work on the bulk socket: the chunks read (each frame checked before its payload is read, a stall
        cut off after ``push_idle_timeout``), staged, applied when ``req.commit``; the result written back."""
        cfg = self.node.cfg
        conn.settimeout(cfg.push_idle_timeout)

        def chunks() -> Iterator[IncomingChunk]:
            for got in range(req.chunk_count):  # each chunk within push_idle_timeout, however it trickles
                by = time.monotonic() + cfg.push_idle_timeout
                head = recv_exactly(conn, FRAME.size, by)
                index, count, checksum, nbytes = FRAME.unpack(head) if len(head) == FRAME.size else (0, 0, 0, -1)
                if nbytes < 0 or nbytes > cfg.max_chunk_bytes:
                    raise ReplicaError(f"the push ended after {got} of {req.chunk_count} chunks" if nbytes < 0 else
                                       f"chunk {index} has {nbytes} bytes, more than the limit {cfg.max_chunk_bytes}",
                                       "INVALID_ARGUMENT" if nbytes < 0 else "RESOURCE_EXHAUSTED")
                payload = np.empty(nbytes, dtype=np.uint8)  # unfilled: what is not sent is not touched
                if recv_into(conn, memoryview(payload), by) < nbytes:
                    raise ReplicaError(f"the push ended inside chunk {index}", "INVALID_ARGUMENT")
                self.node.touch()
                yield IncomingChunk(key, req.version, req.base_version, index, count, checksum, memoryview(payload))

        answer = frames.result("OK")
        try:
            if not self._pushes.acquire(blocking=False):
                raise ReplicaError(f"{cfg.max_pushes} pushes are in flight here (--max-pushes); retry",
                                   "RESOURCE_EXHAUSTED")
            try:
                staged, version, nbytes = self.node.stage(chunks(), peer[0])
            finally:
                self._pushes.release()
            if req.commit:
                held, checksum = self.node.commit(staged, version)
                answer = frames.result("OK", held=held, checksum=checksum, nbytes=nbytes)
            else:
                answer = frames.result("OK", staged=version, nbytes=nbytes)
        except _REFUSED as e:  # answered at once; the sender, which looks before each chunk, stops
            conn.sendall(frames.result(status_of(e).name, self._note("PushBulk", status_of(e), str(e))))
            frames.drain(conn)
            return
        except OSError as e:  # a stall past push_idle_timeout, or the sender gone: the staging is discarded
            self._note("PushBulk", grpc.StatusCode.CANCELLED, f"the push's connection from {peer[0]}: {e}")
            return
        except Exception as e:  # noqa: BLE001 (a bug: answered as gRPC answers one, UNKNOWN, not a silent close)
            log.exception("PushBulk of %s from %s failed", key, peer[0])
            conn.sendall(frames.result("UNKNOWN", f"{type(e).__name__}: {e}"))
            frames.drain(conn)
            return
        conn.sendall(answer)

    def Inventory(self, request: pb.InventoryRequest, context: grpc.ServicerContext) -> pb.InventoryResponse:
        return self._guard("Inventory", context, lambda: wire.to_proto(self.node.report(request.job_id)))

    def StepBack(self, request: pb.StepBackRequest, context: grpc.ServicerContext) -> pb.StepBackResult:
        def run() -> pb.StepBackResult:
            version, checksum = self.node.step_back(_key(request.shard), request.version)
            return pb.StepBackResult(version=version, checksum=checksum)

        return self._guard("StepBack", context, run)

    def Drop(self, request: pb.DropRequest, context: grpc.ServicerContext) -> pb.DropResult:
        rank = None if request.shard.rank < 0 else request.shard.rank
        world = request.shard.world_size if request.only_world or rank is not None else None
        return self._guard("Drop", context,
                           lambda: pb.DropResult(dropped=self.node.drop(request.shard.job_id, rank, world)))

    def Drain(self, request: pb.DrainRequest, context: grpc.ServicerContext) -> pb.DrainResult:
        def drain() -> pb.DrainResult:
            job = check_id(request.job_id, "job id") if request.job_id else ""
            return wire.to_proto(self.node.drainer.handle(job, request.leave, request.cancel, request.query))

        return self._guard("Drain", context, drain)

    # ------------------------------------------------------------ wiring

    def handlers(self) -> grpc.GenericRpcHandler:
        """One handler per method of the wire's table; Push's requests are parsed and Fetch's responses framed by
        hand (the payload never copied by protobuf)."""
        handlers = {}
        for name, m in wire.METHODS.items():
            make = getattr(grpc, f"{m.kind}_rpc_method_handler")
            handlers[name] = make(getattr(self, name), (lambda b: b) if m.raw_request else m.request.FromString,
                                  (lambda b: b) if m.raw_response else m.response.SerializeToString)
        return grpc.method_handlers_generic_handler(wire.SERVICE, handlers)


def start_server(node: Node, cfg: DaemonConfig, bulk: BulkServer | None = None) -> tuple[grpc.Server, int]:
    """Serves ``node`` at ``cfg.host:cfg.port`` (TLS with ``tls_cert``/``tls_key``), FetchBulk's chunks on ``bulk``;
    returns the server and its port.

    Raises:
        FFStateError: the address cannot be bound (in use, or not this host's).
    """
    # No SO_REUSEPORT (gRPC's default): a second daemon on a port in use would share it, the kernel spreading
    # RPCs over both; it must fail instead.
    opts = [("grpc.max_receive_message_length", max(cfg.max_chunk_bytes, MAX_MANIFEST_BYTES) + (1 << 20)),
            ("grpc.max_send_message_length", wire.DEFAULT_MAX_MESSAGE), ("grpc.so_reuseport", 0)]
    # Pushes take at most max_pushes threads; the rest answer health checks, Inventory, Commit, Fetch...
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=cfg.max_pushes + 16, thread_name_prefix="ffstate-rpc"),
                         interceptors=[TokenInterceptor(cfg.token, node.refused)], options=opts)
    server.add_generic_rpc_handlers([Servicer(node, bulk).handlers()])
    health_servicer = health.HealthServicer()
    health_servicer.set(wire.SERVICE, health_pb2.HealthCheckResponse.SERVING)
    health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    address = f"{cfg.host}:{cfg.port}"
    try:
        if cfg.tls_cert and cfg.tls_key:
            creds = grpc.ssl_server_credentials(
                [(cfg.tls_key.read_bytes(), cfg.tls_cert.read_bytes())],
                root_certificates=cfg.tls_client_ca.read_bytes() if cfg.tls_client_ca else None,
                require_client_auth=cfg.tls_client_ca is not None)
            port = server.add_secure_port(address, creds)
        else:
            port = server.add_insecure_port(address)
    except RuntimeError:  # grpcio raises where it once returned 0
        port = 0
    if not port:
        raise FFStateError(f"cannot listen on {address}: the address is in use (another daemon?) or not this host's")
    server.start()
    return server, port
