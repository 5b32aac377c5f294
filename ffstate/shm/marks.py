"""Worker side: marks when the training's collectives are on the wire, in the slot header, for the
daemon's scheduler (docs/design.md section 4, step 3). Cheap: a few stores per collective."""

from __future__ import annotations

import threading
import time

from ffstate.shm.header import COMM_RING, Header


class CommMarks:
    """The count of collectives in flight and a ring of the newest (start, end) times, in slot 0's header.

    Made before the slots exist (DDP's hook is registered at entry), attached to them at the first commit,
    detached (``attach(None)``) before they close; marks made meanwhile are counted, not written.
    """

    def __init__(self) -> None:
        self._header: Header | None = None
        self._inflight = 0
        self._count = 0
        self._lock = threading.Lock()

    def attach(self, slots) -> None:
        """``slots``: a ``Slots`` (its first header is written), or None to detach."""
        with self._lock:
            self._header = slots.headers[0] if slots is not None and slots.headers else None
            if self._header is not None:  # a worker that died mid-collective left its count behind: ours replaces it
                self._count = self._header.comm_count
                self._header.comm_inflight = self._inflight

    def start(self) -> int:
        with self._lock:
            self._inflight += 1
            if self._header is not None:
                self._header.comm_inflight = self._inflight
        return time.time_ns()

    def end(self, started: int) -> None:
        with self._lock:
            self._inflight -= 1
            i = self._count % COMM_RING
            self._count += 1
            h = self._header
            if h is not None:
                h.comm_ring[i].start, h.comm_ring[i].end = started, time.time_ns()
                h.comm_inflight, h.comm_count = self._inflight, self._count

    @property
    def count(self) -> int:
        """Collectives marked off the wire so far (the ring's write count once attached)."""
        return self._count
