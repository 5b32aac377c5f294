"""The bulk socket's framing (docs/wire-format.md, "The bulk socket"), shared by the daemon and its callers.

A fetch: caller -> daemon, the ticket (``TICKET_BYTES``), nothing else; daemon -> caller, ``HELLO`` (magic, the
version, the number of chunks that follow), then each chunk as ``FRAME`` (its index and count in the version's
encoding, its checksum, its payload's length) and its payload; then the daemon closes the connection. A push: caller
-> daemon, the ticket, then each chunk as ``FRAME`` and its payload (as many as its ``PushBulk`` call said); daemon ->
caller, ``RESULT`` and its message, then the daemon closes the connection.
"""

from __future__ import annotations

import socket
import struct
import time

TICKET_BYTES = 32
MAGIC = b"FFB1"
HELLO = struct.Struct("<4sQI")  # magic, version, chunks on this connection
FRAME = struct.Struct("<IIQQ")  # chunk index, chunk count, checksum, payload bytes
# A push's result, daemon -> caller: its status ("OK" or a gRPC status name, NUL-padded), the version staged, the
# version held after it and that version's checksum (a push that committed), the payload bytes received, and the
# length of a message (UTF-8, at most MAX_MESSAGE bytes) that follows.
RESULT = struct.Struct("<24sQQQQH")
MAX_MESSAGE = 1024


def result(status: str, message: str = "", staged: int = 0, held: int = 0, checksum: int = 0, nbytes: int = 0
           ) -> bytes:
    """A push's result frame."""
    text = message.encode()[:MAX_MESSAGE]
    return RESULT.pack(status.encode()[:24], staged, held, checksum, nbytes, len(text)) + text


def _before(sock: socket.socket, deadline: float | None, per_read: float | None) -> None:
    """The socket's timeout for its next read: ``per_read``, cut to what is left until ``deadline`` (monotonic)."""
    if deadline is None:
        return
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("the deadline passed")
    sock.settimeout(left if per_read is None else min(per_read, left))


def recv_exactly(sock: socket.socket, nbytes: int, deadline: float | None = None, per_read: float | None = None
                 ) -> bytes:
    """``nbytes`` from ``sock`` (small reads: a ticket, a header); fewer only where the peer closed first. With
    ``deadline`` (monotonic), all of it by then (a peer that sends a byte at a time cannot stretch it), each read
    waiting at most ``per_read``; TimeoutError (an OSError) past either."""
    parts, got = [], 0
    while got < nbytes:
        _before(sock, deadline, per_read)
        part = sock.recv(nbytes - got)
        if not part:
            break
        parts.append(part)
        got += len(part)
    return b"".join(parts)


def recv_into(sock: socket.socket, view: memoryview, deadline: float | None = None, per_read: float | None = None
              ) -> int:
    """Fills ``view`` from ``sock``; returns the bytes received (fewer than asked only where the peer closed).
    ``deadline`` and ``per_read`` as for ``recv_exactly``."""
    got = 0
    while got < len(view):
        _before(sock, deadline, per_read)
        n = sock.recv_into(view[got:])
        if not n:
            break
        got += n
    return got


def send_parts(sock: socket.socket, parts: list) -> None:
    """Sends ``parts`` (bytes-like) in order, gathered by the kernel (``sendmsg``), resuming after partial sends."""
    views = [memoryview(p).cast("B") for p in parts if len(p)]
    while views:
        sent = sock.sendmsg(views)
        while views and sent >= len(views[0]):
            sent -= len(views[0])
            views.pop(0)
        if views and sent:
            views[0] = views[0][sent:]


def drain(sock: socket.socket, seconds: float = 5.0) -> None:
    """After an answer that ends a connection early: what the peer still sends is read and dropped until it closes
    (or stops for a second, or ``seconds`` pass), so that closing does not reset the connection under the answer."""
    try:
        sock.shutdown(socket.SHUT_WR)
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            sock.settimeout(min(1.0, max(0.01, end - time.monotonic())))
            if not sock.recv(1 << 20):
                return
    except OSError:
        return
