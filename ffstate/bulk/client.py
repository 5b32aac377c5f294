"""The caller's side of the bulk socket: a fetch's chunks read from the daemon's bulk port under the ticket its
``FetchBulk`` call gave, or, where that cannot be used, nothing (the caller fetches over gRPC instead).

A received frame is checked before its payload is read: its length is bounded by the client's message limit and
the payload lands in memory allocated unfilled, so a daemon that claims more than it sends costs address space, not
memory. What the chunks hold is checked downstream, as for gRPC's ``Fetch`` (each chunk's checksum, the version's).
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time
import weakref
from typing import TYPE_CHECKING, Any, Callable, Sequence

import grpc
import numpy as np

from ffstate._proto import replica_pb2 as pb
from ffstate.bulk.frames import FRAME, HELLO, MAGIC, MAX_MESSAGE, RESULT, recv_exactly, recv_into, send_parts
from ffstate.errors import ReplicaError, ReplicaUnavailable

if TYPE_CHECKING:
    from ffstate.codec import Chunk

log = logging.getLogger("ffstate.client")

CONNECT_TIMEOUT = 2.0  # seconds to reach the bulk port (a firewall that drops it costs this, once per client)


# The bulk connections each client has open: its ``close`` cuts them off (``cut_off``), where a push in flight
# would go on for up to its deadline (ten times the client's timeout) after the replication it served stopped.
_OPEN: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_OPEN_LOCK = threading.Lock()


@contextlib.contextmanager
def _tracked(client: Any, sock: socket.socket):
    with _OPEN_LOCK:
        _OPEN.setdefault(client, set()).add(sock)
    try:
        with sock:
            yield
    finally:
        with _OPEN_LOCK:
            _OPEN.get(client, set()).discard(sock)


def cut_off(client: Any) -> None:
    """Shuts down the bulk connections ``client`` has open: a push or fetch on one fails at once (UNAVAILABLE)."""
    with _OPEN_LOCK:
        socks = list(_OPEN.pop(client, ()))
    for sock in socks:
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)


def host_of(address: str) -> str:
    """The host of a gRPC address (``host:port``, ``[v6]:port``)."""
    return address.rsplit(":", 1)[0].strip("[]")


def _offer(client: Any, method: str, req: Any) -> pb.BulkTicket | None:
    """The daemon's ticket for ``req`` (``FetchBulk``, ``PushBulk``); None where it has no bulk socket (then
    ``client.bulk`` is False) or no room for the offer now."""
    try:
        return client._rpc[method](req, **client._kw(client.timeout * 10))
    except grpc.RpcError as e:
        if e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:  # its offers all taken, or no memory for this one:
            return None  # over gRPC this time (which refuses it in turn where the memory is what is missing)
        if e.code() != grpc.StatusCode.UNIMPLEMENTED:
            raise
        client.bulk = False  # TLS, --bulk-port -1, or an ffstate before the bulk socket
        return None


def _connect(client: Any, offer: pb.BulkTicket) -> socket.socket | None:
    """A connection to the daemon's bulk socket; None where it cannot be reached (``client.bulk`` is then False)."""
    try:
        sock = socket.create_connection((host_of(client.address), offer.port), timeout=CONNECT_TIMEOUT)
    except OSError as e:
        log.warning("the bulk socket of %s (port %d) cannot be reached (%s): using gRPC with it from now on "
                    "(open the port, or pin it with --bulk-port)", client.address, offer.port, e)
        client.bulk = False
        return None
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def _open(client: Any, method: str, req: Any) -> tuple[pb.BulkTicket, socket.socket] | None:
    """The ticket and the connection for ``req``; None where there is no bulk socket to use now (``_offer``,
    ``_connect``)."""
    offer = _offer(client, method, req)
    sock = None if offer is None else _connect(client, offer)
    return None if sock is None else (offer, sock)


def fetch(client: Any, req: pb.FetchRequest, deliver: Callable[[int, "Chunk"], None]) -> bool:
    """Fetches ``req``'s chunks over the bulk socket of ``client``'s daemon (an ``ffstate.client.Client``) into
    ``deliver(version, chunk)``; False, having delivered nothing, where the daemon has none or it cannot be reached
    (``client.bulk`` is then False: later fetches go straight to gRPC) or has no room for the offer now.

    Raises:
        grpc.RpcError: the daemon refused the request (as ``Fetch`` would have; RESOURCE_EXHAUSTED returns False:
            ``Fetch`` gets its chance, and its own answer).
        ReplicaError: UNAVAILABLE, the connection failed or broke off after the ticket was sent (some chunks may
            have been delivered); DATA_LOSS, the daemon sent something that is not the framing.
    """
    deadline = time.monotonic() + client.timeout * 10  # the whole fetch's, as gRPC's Fetch has
    opened = _open(client, "FetchBulk", req)  # the daemon reserves and encodes the chunks before it answers
    if opened is None:
        return False
    offer, sock = opened
    from ffstate.codec import Chunk

    what = f"bulk fetch from {client.address} (port {offer.port})"
    with _tracked(client, sock):
        try:
            sock.settimeout(client.timeout)
            sock.sendall(offer.ticket)
            hello = recv_exactly(sock, HELLO.size, deadline, client.timeout)
            if len(hello) < HELLO.size:
                raise ReplicaError(f"{what}: the daemon closed the connection before any chunk (ticket refused or "
                                   "expired)", "UNAVAILABLE")
            magic, version, count = HELLO.unpack(hello)
            if magic != MAGIC or version != offer.version or count != offer.chunks:
                raise ReplicaError(f"{what}: the connection opened with {magic!r}, version {version}, {count} chunks; "
                                   f"expected {MAGIC!r}, {offer.version}, {offer.chunks}", "DATA_LOSS")
            for _ in range(count):
                head = recv_exactly(sock, FRAME.size, deadline, client.timeout)
                if len(head) < FRAME.size:
                    raise ReplicaError(f"{what}: the connection ended inside the chunks", "UNAVAILABLE")
                index, total, checksum, nbytes = FRAME.unpack(head)
                if nbytes > client.max_message_bytes:
                    raise ReplicaError(f"{what}: chunk {index} claims {nbytes} bytes, more than the "
                                       f"{client.max_message_bytes} a message may carry", "DATA_LOSS")
                payload = np.empty(nbytes, dtype=np.uint8)  # unfilled: what is not sent is not touched
                if recv_into(sock, memoryview(payload), deadline, client.timeout) < nbytes:
                    raise ReplicaError(f"{what}: the connection ended inside chunk {index}", "UNAVAILABLE")
                deliver(version, Chunk(index, total, checksum, memoryview(payload)))
        except OSError as e:
            raise ReplicaError(f"{what}: {e}", "UNAVAILABLE") from None
    return True


def push(client: Any, req: pb.PushOpen, chunks: Sequence, before_chunk: Callable[[int], None] | None
         ) -> pb.PushResult | None:
    """Pushes ``chunks`` (every chunk of ``req``'s version, in order) over the bulk socket of ``client``'s daemon,
    ``before_chunk(nbytes)`` called before each goes out (the scheduler's pacing); the push's result, or None, having
    sent nothing, where the daemon has none or it cannot be reached (``client.bulk`` is then False) or has no room
    for the offer now: the caller pushes over gRPC.

    Raises:
        grpc.RpcError: the daemon refused the push's opening (as ``Push`` would have refused its first chunk).
        ReplicaError: the daemon refused the version (its status, as ``Push`` answers it).
        ReplicaUnavailable: the connection failed or broke off once chunks were on their way.
    """
    deadline = time.monotonic() + client.timeout * 10  # the whole push's, as gRPC's Push has
    opened = _open(client, "PushBulk", req)
    if opened is None:
        return None
    offer, sock = opened
    what = f"bulk push to {client.address} (port {offer.port})"
    with _tracked(client, sock):
        try:
            sock.settimeout(client.timeout)
            sock.sendall(offer.ticket)
            try:
                for c in chunks:  # a daemon that refuses the version answers at once: no more is sent then
                    if _answered(sock):
                        break
                    if before_chunk is not None:
                        before_chunk(len(c.payload))
                    if time.monotonic() > deadline:  # the rest unsent: the daemon discards a short push
                        raise ReplicaUnavailable(f"{what}: its deadline passed before its last chunk")
                    if _answered(sock):
                        break
                    send_parts(sock, [FRAME.pack(c.index, c.count, c.checksum, len(c.payload)), c.payload])
            except OSError:  # the daemon stopped reading: its answer may be here already
                pass
            head = recv_exactly(sock, RESULT.size, deadline)  # staging and applying it may take a while
            if len(head) < RESULT.size:
                raise OSError("the daemon closed the connection before its answer")
            status, staged, held, checksum, nbytes, length = RESULT.unpack(head)
            if length > MAX_MESSAGE:
                raise ReplicaError(f"{what}: an answer of {length} bytes, more than {MAX_MESSAGE}", "DATA_LOSS")
            message = recv_exactly(sock, length, deadline, client.timeout).decode(errors="replace")
        except OSError as e:
            raise ReplicaUnavailable(f"{what}: {e}") from None
    status = status.rstrip(b"\0").decode(errors="replace")
    if status != "OK":
        raise ReplicaError(f"{what}: {status}: {message}", status)
    return pb.PushResult(staged_version=staged, committed_version=held, checksum=checksum, bytes_received=nbytes)


def _answered(sock: socket.socket) -> bool:
    """Whether the daemon has answered (or closed) before the push's last chunk: a refusal, read next."""
    timeout = sock.gettimeout()
    sock.settimeout(0.0)  # a socket with a timeout waits for data before it reads, MSG_DONTWAIT or not
    try:
        sock.recv(1, socket.MSG_PEEK)
    except (BlockingIOError, InterruptedError):
        return False
    except OSError:  # reset: what is there is read next, and says so
        return True
    finally:
        sock.settimeout(timeout)
    return True
