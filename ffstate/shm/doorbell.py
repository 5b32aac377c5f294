"""The daemon's doorbell: a datagram socket its workers ring after each commit, so that it takes the
new version at once instead of at its next look at the slots (a lost ring costs only that wait)."""

from __future__ import annotations

import itertools
import logging
import os
import socket
import struct
import threading
from typing import Callable

from ffstate.ids import check_id

log = logging.getLogger("ffstate.shm")

RING = struct.Struct("<Q")  # a ring: the id the daemon gave the rank


class Doorbell:
    """Daemon side: the socket its workers ring after each commit (``Bell.ring``), one per daemon.

    A Unix datagram socket in the abstract namespace (nothing to clean up after a SIGKILL); a ring is
    the 8-byte id the daemon gave the rank when it created its slots, and sets that rank's ``wake``
    event. Anything else (an unknown id, a malformed datagram) is ignored: a ring only makes the
    daemon look at slots it would look at anyway. ``on_ring`` is called for every valid ring.
    """

    _made = itertools.count()  # daemons made in this process (tests make several)

    def __init__(self, node_id: str, on_ring: Callable[[], None] = lambda: None):
        # Unique among live daemons, and short: an abstract address has room for 107 bytes.
        self.name = f"ffstate-{check_id(node_id, 'node id')[:64]}-{os.getpid()}-{next(Doorbell._made)}"
        self._on_ring = on_ring
        self._wakes: dict[int, threading.Event] = {}
        self._ids = itertools.count(1)
        self._closed = threading.Event()
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._sock.bind("\0" + self.name)
        self._sock.settimeout(0.5)  # how soon close() is noticed
        self._thread = threading.Thread(target=self._run, name="ffstate-doorbell", daemon=True)
        self._thread.start()

    def add(self, wake: threading.Event) -> tuple[str, int]:
        """Registers a rank's wake event; returns (name, id), what ``create_slots`` writes for its worker."""
        ident = next(self._ids)
        self._wakes[ident] = wake
        return self.name, ident

    def remove(self, ident: int) -> None:
        self._wakes.pop(ident, None)

    def _run(self) -> None:
        while not self._closed.is_set():
            try:
                data = self._sock.recv(64)
            except TimeoutError:
                continue
            except OSError:  # closed
                return
            wake = self._wakes.get(RING.unpack(data)[0]) if len(data) == RING.size else None
            if wake is None:
                log.debug("doorbell %s: ignored a %d-byte ring that names no attached rank", self.name, len(data))
                continue
            wake.set()
            self._on_ring()

    def close(self) -> None:
        self._closed.set()
        try:  # an empty ring wakes the thread's receive now, not at its timeout (a daemon's exit waited for it)
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
                s.sendto(b"", "\0" + self.name)
        except OSError:
            pass
        self._thread.join(2)
        self._sock.close()


class Bell:
    """Worker side: rings the doorbell named in its slot header (a few microseconds). Best effort: a
    daemon gone or too busy to read its rings finds the slot at its next look."""

    def __init__(self, name: str, ident: int):
        self.address, self.ring_bytes = "\0" + name, RING.pack(ident)
        self._socket: socket.socket | None = None

    def ring(self) -> None:
        if self._socket is None:
            self._socket = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            self._socket.setblocking(False)
        try:
            self._socket.sendto(self.ring_bytes, self.address)
        except OSError:  # no such socket (the daemon died), or its queue is full
            pass

    def close(self) -> None:
        if self._socket is not None:
            self._socket.close()
            self._socket = None
