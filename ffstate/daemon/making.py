"""An encoding a holder serves while it is still being made.

A restore fetches the newest version of a replica as a full encoding, which the holder makes for that fetch (then
keeps as its cache). Made whole before the first chunk went out, it held the restore for a pass over the state (41 MB:
14-18 ms here; a 10 GB state at memory speed, seconds) before its transfer began. Now the header chunk is made at
once and each segment's chunk on the codec's threads (``codec.encode_started``), and a reader sends chunk i as soon as
it is made: the transfer and the encoding overlap. The replica's lock is held until the last chunk is made, as it was
held while the whole encoding was made (a push to it waits, no longer than before).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from concurrent.futures import CancelledError, Future, wait
from typing import TYPE_CHECKING, Any, Callable

from ffstate import codec
from ffstate.codec import CHUNK_OVERHEAD, Chunk, Packed
from ffstate.errors import ReplicaError

if TYPE_CHECKING:
    from ffstate.daemon.held import Replica
    from ffstate.daemon.served import Lease
    from ffstate.ids import ShardKey

log = logging.getLogger("ffstate.daemon")


class Making(Sequence):
    """The chunks of an encoding being made: the header at once, chunk i once it is made (``[i]`` waits for it;
    ``[a:b:c]`` is a view that waits as it is read). ``watch(done)`` calls ``done()`` once every chunk is made or
    failed, from the thread that made the last (at once if none is left); ``settled`` is set once it returned."""

    def __init__(self, head: Chunk, futures: list[Future]):
        self._head, self._futures = head, futures
        self._left = len(futures)
        self._lock = threading.Lock()
        self._done: Callable[[], None] | None = None
        self._nbytes: int | None = None
        self.settled = threading.Event()

    def watch(self, done: Callable[[], None]) -> None:
        self._done = done
        if not self._futures:
            self._finish()
        for f in self._futures:
            f.add_done_callback(self._landed)

    def _landed(self, _: Future) -> None:
        with self._lock:
            self._left -= 1
            last = not self._left
        if last:
            self._finish()

    def _finish(self) -> None:
        try:
            self._done()
        except Exception:  # a callback's: nobody to raise it to (the fetch may have answered long ago)
            log.exception("settling an encoding once it was made failed")
        finally:
            self.settled.set()

    def __len__(self) -> int:
        return 1 + len(self._futures)

    def __getitem__(self, i):  # noqa: ANN001 (an int or a slice, as a list's)
        if isinstance(i, slice):
            return _View(self, range(len(self))[i])
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(i)
        if i == 0:
            return self._head
        try:
            return self._futures[i - 1].result()
        except (Exception, CancelledError) as e:  # a bug, or the codec's pool shut down with the daemon
            raise ReplicaError(f"chunk {i} of the encoding could not be made: {type(e).__name__}: {e}", "INTERNAL"
                               ) from None

    @property
    def failed(self) -> bool:
        """Whether a chunk could not be made (once every one is done)."""
        return any(f.cancelled() or f.exception() is not None for f in self._futures)

    def nbytes(self) -> int:
        """Bytes on the wire of the chunks made (a failed one counts nothing); waits until every one is done."""
        if self._nbytes is None:
            wait(self._futures)
            made = [f.result() for f in self._futures if not f.cancelled() and f.exception() is None]
            self._nbytes = sum(len(c.payload) + CHUNK_OVERHEAD for c in (self._head, *made))
        return self._nbytes


class _View(Sequence):
    def __init__(self, of: Making, indices: range):
        self._of, self._indices = of, indices

    def __len__(self) -> int:
        return len(self._indices)

    def __getitem__(self, k):  # noqa: ANN001
        if isinstance(k, slice):
            return _View(self._of, self._indices[k])
        return self._of[self._indices[k]]


class Streamed(Packed):
    """A ``Packed`` whose chunks are still being made (``Making``): its size is known once they are."""

    @property
    def nbytes(self) -> int:
        return self.chunks.nbytes()


def most_bytes(nbytes: int, segments: int, header: int) -> int:
    """The most bytes a full encoding of ``nbytes`` in ``segments`` segments takes on the wire, its header chunk
    ``header`` bytes: a segment's chunk is at most its bytes and a segment header (one that does not compress is
    stored), and each chunk's index, count and checksum."""
    from ffstate.codec.segment import SEGMENT

    return nbytes + segments * (SEGMENT.size + CHUNK_OVERHEAD) + header + CHUNK_OVERHEAD


def stream(store: Any, held: "Replica", cache_as: tuple["ShardKey", int, int], segments: int, reserved: int,
           what: str) -> tuple[Streamed, "Lease"]:
    """The newest version of ``held`` encoded while it is read, for ``store.fetch`` (``store``: the ``Store``),
    which holds the replica's lock and hands it on when this returns: it is released once the last chunk is made.
    ``reserved`` (the state's raw bytes, counted) is topped up to the most the encoding can take (``most_bytes``)
    and settled to what it took once it is made; the encoding is served (and cached as ``cache_as``: shard,
    version, checksum) from the start.

    Raises:
        ReplicaError: RESOURCE_EXHAUSTED, no room for the top-up (the lock is still the caller's, nothing is
            counted beyond ``reserved``).
    """
    head, header, futures = codec.encode_started(held.snapshot)
    extra = most_bytes(held.snapshot.manifest.nbytes, segments, len(head.payload)) - reserved
    making = Making(head, futures)
    packed = Streamed(making, header)
    try:
        store.reserve(extra, what)  # no wait: the replica's lock is held
        try:
            lease = store.served.serve(packed, reserved + extra, what, cache_as, settled=False)
        except BaseException:
            store.release(extra)
            raise
    except BaseException:
        for f in futures:
            f.cancel()
        wait(futures)  # none reads the snapshot once the lock goes back
        raise

    def made() -> None:  # never waits for an encoding: it runs on the codec's threads, which make them
        try:
            freed = store.served.settle(packed, packed.nbytes)
            if making.failed:
                log.error("%s: a chunk could not be made; it is no longer kept to serve again", what)
                freed += store.served.forget_this(packed)  # before the lock goes: no fetch finds it cached
            store.release(freed)
        finally:
            held.lock.release()

    making.watch(made)
    return packed, lease
