"""The whole encodings a daemon serves (a restore fetching a replica), counted against its memory budget once each,
for as long as they live: from their making until the last reader has sent them and they are no longer cached.

A fetch holds its encoding while its chunks go out (over gRPC, or an offer on the bulk socket waiting for its
connection); the last one made is kept as the cache, so that several readers of one version (striped fetches,
retries, a node's ranks restoring at once from one holder) do not each pay for encoding it. Before, the cache alone
was counted: a new encoding replaced the old in the count while a reader still sent the old one, and a node's N
ranks restoring from one holder held N encodings, one of them counted.
"""

from __future__ import annotations

import threading
from typing import Callable, Protocol

from ffstate.codec import Packed
from ffstate.ids import ShardKey


class Hold(Protocol):
    """What a fetch holds while its chunks go out, given back by ``release()``."""

    def release(self) -> None: ...


class Counted:
    """``nbytes`` counted against the budget, given back by ``release`` once (again is nothing)."""

    def __init__(self, uncount: Callable[[int], None], nbytes: int):
        self._uncount, self.nbytes = uncount, nbytes

    def release(self) -> None:
        nbytes, self.nbytes = self.nbytes, 0
        if nbytes:
            self._uncount(nbytes)


class Lease:
    """A reader's hold on a served encoding: ``release()`` once its chunks are sent or refused (once; again is
    nothing)."""

    def __init__(self, served: "Served", packed: Packed):
        self._served, self.packed = served, packed
        self._released = False

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._served._drop(self.packed)


class Served:
    """The encodings being served or cached. ``reserve(nbytes, what)`` counts bytes against the daemon's budget
    (raising where it has no room), ``uncount(nbytes)`` gives them back."""

    def __init__(self, reserve: Callable[[int, str], None], uncount: Callable[[int], None]):
        self._reserve, self._uncount = reserve, uncount
        self._lock = threading.Lock()
        # id(packed) -> [packed, readers, bytes counted for it]: counted while in here. The count is kept, never read
        # off the encoding: one still being made (``making.py``) is counted at its bound until ``settle``.
        self._readers: dict[int, list] = {}
        self._cache: tuple[ShardKey, int, int, Packed] | None = None  # (shard, version, checksum, encoding)

    def cached(self, key: ShardKey, version: int, checksum: int) -> Lease | None:
        """A lease on the cached encoding of ``key`` at ``version`` (of the copy with ``checksum``), if that is it."""
        with self._lock:
            if self._cache is None or self._cache[:3] != (key, version, checksum):
                return None
            packed = self._cache[3]
            self._readers[id(packed)][1] += 1
            return Lease(self, packed)

    def serve(self, packed: Packed, reserved: int, what: str, cache_as: tuple[ShardKey, int, int] | None = None,
              settled: bool = True) -> Lease:
        """A lease on ``packed``, a new encoding, for which ``reserved`` bytes were counted beforehand (the count made
        its size; ``what`` names it if more is refused); with ``cache_as`` (shard, version, checksum) it becomes the
        cache, the one before it given back once its last reader is done. ``settled=False``: an encoding still being
        made (``making.py``), counted as ``reserved`` (at least its size) until its maker calls ``settle``.

        Raises:
            ReplicaError: RESOURCE_EXHAUSTED, no room for more than was reserved (``reserved`` is given back).
        """
        if settled and packed.nbytes > reserved:
            try:
                self._reserve(packed.nbytes - reserved, what)
            except BaseException:
                self._uncount(reserved)
                raise
        freed = max(0, reserved - packed.nbytes) if settled else 0
        with self._lock:
            self._readers[id(packed)] = [packed, 1, packed.nbytes if settled else reserved]
            if cache_as is not None:
                freed += self._uncache()
                self._cache = (*cache_as, packed)
        if freed:
            self._uncount(freed)
        return Lease(self, packed)

    def settle(self, packed: Packed, nbytes: int) -> int:
        """``packed``, made, counted as ``nbytes`` from now on; returns the bytes no longer counted for it, for the
        caller to give back (none if it is gone already: whoever dropped it gave back all it was counted)."""
        with self._lock:
            entry = self._readers.get(id(packed))
            if entry is None or entry[0] is not packed:
                return 0
            freed, entry[2] = entry[2] - nbytes, nbytes
            return freed

    def forget_this(self, packed: Packed) -> int:
        """Drops the cache if it is ``packed``; returns the bytes no longer counted (as ``forget``)."""
        with self._lock:
            return self._uncache() if self._cache is not None and self._cache[3] is packed else 0

    def forget(self, keys: set[ShardKey] | None = None) -> int:
        """Drops the cache (where it is one of ``keys``; None: whichever it is); returns the bytes that are no longer
        counted, for the caller to give back (none while a reader still sends it: its last reader gives them back)."""
        with self._lock:
            return self._uncache() if self._cache is not None and (keys is None or self._cache[0] in keys) else 0

    def _uncache(self) -> int:
        """Under the lock: the cache dropped; its bytes, if no reader holds it."""
        old, self._cache = self._cache, None
        if old is None or self._readers[id(old[3])][1]:
            return 0
        return self._readers.pop(id(old[3]))[2]

    def _drop(self, packed: Packed) -> None:
        with self._lock:
            entry = self._readers[id(packed)]
            entry[1] -= 1
            gone = not entry[1] and (self._cache is None or self._cache[3] is not packed)
            if gone:
                del self._readers[id(packed)]
        if gone:
            self._uncount(entry[2])
