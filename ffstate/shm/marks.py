"""The training's collectives, marked in the slot header: the worker marks when each is on the wire (cheap: a few
stores per collective), the daemon's scheduler reads them (docs/design.md section 4, step 3)."""

from __future__ import annotations

import threading
import time

from ffstate.shm.header import COMM_RING, Header

STALE_MARKS = 10.0  # seconds without a commit after which a worker's in-flight count is ignored


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


class MarksReader:
    """The daemon's side: what a rank's slot headers say of its collectives."""

    def __init__(self) -> None:
        self._stamp: tuple = ()
        self._parsed: tuple[list, list] = ([], [])

    def read(self, headers: list[Header]) -> tuple[int, list[tuple[float, float]], list[float]]:
        """(collectives in flight, recent (start, end) times, the two newest commit times), seconds."""
        if not headers:
            return 0, [], []
        h = headers[0]
        inflight, count = h.comm_inflight, h.comm_count
        # The ring is parsed again only when a collective started (fewer or more in flight) or ended (the count
        # grows: an entry is written before it) or a commit was made since the last look: the pacer looks before
        # every chunk it releases, and parsing the ring each time was a tenth of a daemon's CPU (profiled).
        stamp = (count, inflight, *(x.commit_ns for x in headers))
        if stamp != self._stamp:
            self._parsed = (sorted((iv.start / 1e9, iv.end / 1e9) for iv in h.comm_ring[: min(count, COMM_RING)]
                                   if iv.end), sorted(x.commit_ns / 1e9 for x in headers if x.commit_ns))
            self._stamp = stamp
        intervals, commits = list(self._parsed[0]), list(self._parsed[1])
        if inflight and commits and time.time() - commits[-1] > STALE_MARKS:
            inflight = 0  # no commit for that long: the worker is gone or stuck, its count means nothing
        return max(inflight, 0), intervals, commits
