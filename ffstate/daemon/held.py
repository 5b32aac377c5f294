"""What a daemon's store holds per shard (``store.py``): a replica with its kept deltas, a version staged until its
commit, and a pushed chunk as the servicer hands it over."""

from __future__ import annotations

import collections
import threading
import time
from dataclasses import dataclass, field

from ffstate.codec import Packed, Snapshot, host
from ffstate.ids import ShardKey


@dataclass
class Delta:
    """An applied delta, kept for step-back: it produced ``version`` from ``version_before``."""

    version: int
    version_before: int
    packed: Packed
    scalars_before: tuple


@dataclass
class Replica:
    key: ShardKey
    snapshot: Snapshot
    version: int
    source: str
    updated: float
    history: collections.deque = field(default_factory=collections.deque)
    lock: threading.Lock = field(default_factory=threading.Lock)
    gone: bool = False  # dropped or replaced, under the store's lock: whoever holds it stops

    @property
    def nbytes(self) -> int:
        return host.size(self.snapshot.buffer) + sum(d.packed.nbytes for d in self.history)

    @property
    def versions(self) -> list[int]:
        return [self.version] + [d.version_before for d in reversed(self.history)]


@dataclass
class Staging:
    key: ShardKey
    version: int
    base_version: int
    packed: Packed
    reserved: int
    source: str
    at: float = field(default_factory=time.monotonic)  # when it was staged: it expires (``expire_staged``)
    dropped: bool = False  # the job was dropped while it was committed


@dataclass(frozen=True)
class IncomingChunk:
    """A pushed chunk as the servicer hands it over (plain values, not protobuf)."""

    key: ShardKey
    version: int
    base_version: int
    index: int
    count: int
    checksum: int
    payload: bytes | memoryview
