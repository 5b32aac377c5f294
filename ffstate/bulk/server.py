"""The daemon's side of the bulk socket: offers (a fetch's chunks, reserved, under a ticket) and the listening
socket that serves each to the one connection that brings its ticket.

Bounds: at most ``MAX_OFFERS`` transfers at once, from their offer to the end of their connection (a fetch's offer
holds its reservation against the daemon's memory budget until it is served or ``TICKET_TTL`` passes); at most
``max_connections`` connections are served at once, by default every offer's and ``STRANGERS`` more (a connection
shows its ticket only once it has a place, so a transfer's connection finds one unless connections that sent no
ticket hold at least ``STRANGERS``; the next one accepted waits up to ``HELLO_TIMEOUT`` for a place, then is closed,
and the others wait behind it in the listen queue); a connection has ``HELLO_TIMEOUT``
seconds in all to send its ticket; a receiver that stops reading is cut off after ``SEND_TIMEOUT``
seconds without progress. A wrong or expired ticket closes the connection without a byte sent. The listening
socket reuses its address (a daemon restarted on a pinned port binds it again at once).
"""

from __future__ import annotations

import logging
import secrets
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from ffstate.bulk.frames import FRAME, HELLO, MAGIC, TICKET_BYTES, recv_exactly, send_parts
from ffstate.errors import ReplicaError

log = logging.getLogger("ffstate.daemon")

TICKET_TTL = 10.0  # seconds an offer waits for its connection
CLOSE_WAIT = 2.0  # seconds ``close`` waits for the connections it cut off to end
MAX_OFFERS = 64
STRANGERS = 16  # places beyond the offers' for connections whose ticket is not read yet
HELLO_TIMEOUT = 5.0
SEND_TIMEOUT = 60.0
LOG_EVERY = 1.0  # seconds between logged refusals (the rest are counted)
ACCEPT_RETRY = 0.05  # seconds between tries to accept after it failed (out of descriptors: it fails until one is closed)


@dataclass
class _Offer:
    expires: float
    version: int
    chunks: Sequence  # codec.Chunk: index, count, checksum, payload
    reserved: Any  # what the daemon holds for it (``release`` takes it back), once served or expired
    what: str  # whose chunks, for the log
    handler: Callable[[socket.socket, tuple], None] | None = None  # a push: it reads the connection and answers


class BulkServer:
    """Listens at ``host:port`` (0: a port the kernel picks) and serves offers; ``release(held)`` gives back what an
    offer holds (the daemon's lease on its chunks; 0 for a push), ``touch()`` marks the daemon active,
    ``refused(status)`` counts a refused connection."""

    def __init__(self, host: str, port: int, release: Callable[[Any], None], touch: Callable[[], None] = lambda: None,
                 refused: Callable[[str], None] = lambda status: None, max_connections: int | None = None):
        host = host.strip("[]")
        if not host and socket.has_dualstack_ipv6():  # every address, as gRPC's ":port" listens: IPv6 and IPv4
            self._sock = socket.create_server(("", port), family=socket.AF_INET6, backlog=64, dualstack_ipv6=True)
        else:
            family, _, _, _, address = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM,
                                                          flags=socket.AI_PASSIVE)[0]
            self._sock = socket.create_server(address, family=family, backlog=64)  # SO_REUSEADDR set
        self.port = self._sock.getsockname()[1]
        self._release, self._touch, self._refused = release, touch, refused
        self._offers: dict[bytes, _Offer] = {}
        self._lock = threading.Lock()
        self._bound = max_connections or MAX_OFFERS + STRANGERS
        self._serving = 0  # offers whose connection came: they count against MAX_OFFERS until it ends
        self._conns = threading.BoundedSemaphore(self._bound)
        self._live: set[socket.socket] = set()  # connections being served: ``close`` shuts them down
        self._closed = False
        self._logged = (0.0, 0)  # (when a refusal was last logged, how many were not since)
        self._thread = threading.Thread(target=self._accept, name="bulk-accept", daemon=True)
        self._thread.start()

    def offer(self, version: int, chunks: Sequence, reserved: Any, what: str = "") -> bytes:
        """A ticket for ``chunks`` (of ``what``, a shard's name for the log); the offer owns ``reserved`` from here on
        (released when served or expired).

        Raises:
            ReplicaError: RESOURCE_EXHAUSTED, ``MAX_OFFERS`` transfers already wait or run (``reserved`` is released
                first).
        """
        return self._add(_Offer(time.monotonic() + TICKET_TTL, version, chunks, reserved, what))

    def _add(self, offer: _Offer) -> bytes:
        ticket = secrets.token_bytes(TICKET_BYTES)
        with self._lock:
            full = len(self._offers) + self._serving >= MAX_OFFERS or self._closed
            if not full:
                self._offers[ticket] = offer
        if full:
            self._release(offer.reserved)
            raise ReplicaError(f"{MAX_OFFERS} bulk transfers wait or run here; retry, or use gRPC",
                               "RESOURCE_EXHAUSTED")
        return ticket

    def offer_push(self, handler: Callable[[socket.socket, tuple], None], what: str = "") -> bytes:
        """A ticket for a push: the connection that brings it goes to ``handler(connection, peer)``, which reads the
        chunks and answers (it holds no reservation: the chunks are reserved as they arrive).

        Raises:
            ReplicaError: RESOURCE_EXHAUSTED, ``MAX_OFFERS`` transfers already wait or run.
        """
        return self._add(_Offer(time.monotonic() + TICKET_TTL, 0, (), 0, what, handler))

    def expire(self) -> int:
        """Drops the offers whose connection did not come within ``TICKET_TTL`` (the daemon's loop calls this)."""
        now = time.monotonic()
        with self._lock:
            gone = [t for t, o in self._offers.items() if o.expires < now]
            offers = [self._offers.pop(t) for t in gone]
        for o in offers:
            self._release(o.reserved)
        if offers:
            log.warning("%d bulk transfer(s) never connected within %gs: their tickets are dropped", len(offers),
                        TICKET_TTL)
        return len(offers)

    def close(self) -> None:
        """Stops listening and releases every offer not yet served (connections being served finish or fail)."""
        with self._lock:
            self._closed = True
            offers, self._offers = list(self._offers.values()), {}
            live = list(self._live)
        for o in offers:
            self._release(o.reserved)
        for sock in [self._sock, *live]:  # a connection being served fails its next send, and releases its offer
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self._sock.close()
        self._thread.join(5.0)
        by = time.monotonic() + CLOSE_WAIT  # the connections cut off end, giving their offers back, before the
        while self._live and time.monotonic() < by:  # daemon counts what it still holds
            time.sleep(0.01)

    # ------------------------------------------------------------ connections

    def _accept(self) -> None:
        while True:
            try:
                conn, peer = self._sock.accept()
            except OSError as e:
                if self._closed:
                    return
                # Out of descriptors or memory (EMFILE, ENFILE, ENOBUFS), or a connection gone before it was taken: the
                # socket serves on (the callers wait in its queue), where ending this thread would leave it deaf.
                self._say(f"the bulk socket could not take a connection ({e}); it tries again")
                time.sleep(ACCEPT_RETRY)
                continue
            if self._closed:
                conn.close()
                return
            if not self._conns.acquire(timeout=HELLO_TIMEOUT):  # the others' tickets are due within it
                conn.close()
                self._refuse(peer, "RESOURCE_EXHAUSTED", f"{self._bound} bulk connections are being served")
                continue
            try:
                threading.Thread(target=self._serve, args=(conn, peer), name="bulk", daemon=True).start()
            except RuntimeError as e:  # no thread to be had: this connection goes, the socket serves on
                conn.close()
                self._conns.release()
                self._refuse(peer, "RESOURCE_EXHAUSTED", f"no thread to serve it ({e})")

    def _serve(self, conn: socket.socket, peer: tuple) -> None:
        offer = None
        with self._lock:
            self._live.add(conn)
        try:
            ticket = recv_exactly(conn, TICKET_BYTES, deadline=time.monotonic() + HELLO_TIMEOUT)
            with self._lock:
                offer = self._offers.pop(ticket, None) if len(ticket) == TICKET_BYTES else None
                self._serving += offer is not None
            if offer is None:
                self._refuse(peer, "UNAUTHENTICATED", "an unknown or expired ticket")
                return
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if offer.handler is not None:  # a push: the handler reads it and answers
                offer.handler(conn, peer)
                return
            conn.settimeout(SEND_TIMEOUT)
            start = time.perf_counter()
            send_parts(conn, [HELLO.pack(MAGIC, offer.version, len(offer.chunks))])
            for c in offer.chunks:
                send_parts(conn, [FRAME.pack(c.index, c.count, c.checksum, len(c.payload)), c.payload])
                self._touch()
            log.info("served version %d of %s to %s over the bulk socket: %d chunk(s), %.1f MB in %.3fs", offer.version,
                     offer.what or "a shard", peer[0], len(offer.chunks),
                     sum(len(c.payload) for c in offer.chunks) / 1e6, time.perf_counter() - start)
        except OSError as e:
            if offer is None:  # no ticket within its time, or the connection reset before one: a stranger's
                self._refuse(peer, "UNAUTHENTICATED", f"no ticket ({e or type(e).__name__})")
            else:  # the caller went away or stalled: it fetches again, from here or elsewhere
                log.warning("bulk transfer of %s with %s cut short: %s", offer.what or "a shard", peer[0], e)
        except ReplicaError as e:  # a chunk still being made could not be (``daemon/making.py``): the caller goes on
            log.warning("bulk transfer of %s with %s cut short: %s", offer.what or "a shard", peer[0], e)
        finally:
            if offer is not None:
                self._release(offer.reserved)
            with self._lock:
                self._live.discard(conn)
                self._serving -= offer is not None
            conn.close()
            self._conns.release()

    def _refuse(self, peer: tuple, status: str, why: str) -> None:
        self._refused(status)
        self._say(f"refused a bulk connection from {peer[0]}: {why}")

    def _say(self, what: str) -> None:
        """Logs ``what`` unless something was logged less than ``LOG_EVERY`` ago (then it is counted)."""
        now = time.monotonic()
        last, quiet = self._logged
        if now - last >= LOG_EVERY:
            log.warning("%s%s", what, f" (and {quiet} more since)" if quiet else "")
            self._logged = (now, 0)
        else:
            self._logged = (last, quiet + 1)
