"""The caller's side of the bulk socket: a fetch's chunks read from the daemon's bulk port under the ticket its
``FetchBulk`` call gave, or, where that cannot be used, nothing (the caller fetches over gRPC instead).

A received frame is checked before its payload is read: its length is bounded by the client's message limit and
the payload lands in memory allocated unfilled, so a daemon that claims more than it sends costs address space, not
memory. What the chunks hold is checked downstream, as for gRPC's ``Fetch`` (each chunk's checksum, the version's).
"""

from __future__ import annotations

import logging
import socket
import time
from typing import TYPE_CHECKING, Any, Callable

import grpc
import numpy as np

from ffstate._proto import replica_pb2 as pb
from ffstate.bulk.frames import FRAME, HELLO, MAGIC, recv_exactly, recv_into
from ffstate.errors import ReplicaError

if TYPE_CHECKING:
    from ffstate.codec import Chunk

log = logging.getLogger("ffstate.client")

CONNECT_TIMEOUT = 2.0  # seconds to reach the bulk port (a firewall that drops it costs this, once per client)


def host_of(address: str) -> str:
    """The host of a gRPC address (``host:port``, ``[v6]:port``)."""
    return address.rsplit(":", 1)[0].strip("[]")


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
    try:  # the daemon reserves and encodes the chunks before it answers, as it does before Fetch's first
        offer = client._rpc["FetchBulk"](req, **client._kw(client.timeout * 10))
    except grpc.RpcError as e:
        if e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:  # its offers all taken, or no memory for this one:
            return False  # this fetch over gRPC (which refuses it in turn where the memory is what is missing)
        if e.code() != grpc.StatusCode.UNIMPLEMENTED:
            raise
        client.bulk = False  # TLS, --bulk-port -1, or an ffstate before the bulk socket
        return False
    address = (host_of(client.address), offer.port)
    try:
        sock = socket.create_connection(address, timeout=CONNECT_TIMEOUT)
    except OSError as e:
        log.warning("the bulk socket of %s (port %d) cannot be reached (%s): fetching from it over gRPC from now on "
                    "(open the port, or pin it with --bulk-port)", client.address, offer.port, e)
        client.bulk = False
        return False
    from ffstate.codec import Chunk

    what = f"bulk fetch from {client.address} (port {offer.port})"
    with sock:
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
