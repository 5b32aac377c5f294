"""The replica store: per job and shard, the applied version, the staged next version, and the last
W applied deltas, under a memory budget that is never exceeded.

A pushed version is staged chunk by chunk (each checksum verified) and becomes the held version
only at commit, when the whole version's checksum matches (docs/design.md I2): a push that breaks off,
or a commit that fails, leaves the replica exactly at its previous version. A delta taken off
again gives its base back, so the kept deltas step a replica back without a second copy (I3). Every byte held is
reserved against the budget before it is allocated; a request that would exceed it is refused
(I5). Errors are ``ReplicaError`` with the gRPC status name the servicer answers with; this module
never sees protobuf types.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable, Iterable, Sequence

from ffstate import codec
from ffstate.codec import Chunk, Packed, Snapshot, host
from ffstate.daemon.checks import check_first, check_next, verify_one
from ffstate.daemon.held import Delta, IncomingChunk, Replica, Staging
from ffstate.daemon.making import stream
from ffstate.daemon.served import Lease, Served
from ffstate.errors import CodecError, ReplicaError
from ffstate.ids import ShardKey

log = logging.getLogger("ffstate.daemon.store")

# Bytes a staged chunk costs the daemon beside its payload (its message, Chunk, memoryview and list slot;
# measured: 200,000 empty chunks took about 200 MB), counted against the budget with the payload.
CHUNK_BOOKKEEPING = 1 << 10
SERVE_WAIT = 60.0  # seconds a fetch waits for the encodings being served to be sent, where the budget has no room


class Store:
    """What one daemon holds of other nodes' ranks. Thread-safe."""

    def __init__(self, budget_bytes: int, keep_deltas: int = 4, max_chunk_bytes: int = 32 << 20):
        self.budget = budget_bytes
        self.keep_deltas = keep_deltas
        self.max_chunk_bytes = max_chunk_bytes
        self._used = 0
        self._lock = threading.Lock()
        self._room = threading.Condition(self._lock)  # notified as bytes are given back
        self._replicas: dict[ShardKey, Replica] = {}
        self._staged: dict[ShardKey, Staging] = {}
        self._committing: dict[ShardKey, list[Staging]] = {}  # popped from _staged, being decoded: a drop marks them
        # The encodings being served, and the last one kept: counted while they live (``served.py``).
        self.served = Served(self.reserve, self.release)

    # ------------------------------------------------------------ budget

    @property
    def used(self) -> int:
        return self._used

    def reserve(self, nbytes: int, what: str, wait: float = 0.0) -> None:
        """Counts ``nbytes`` against the budget, or raises RESOURCE_EXHAUSTED without counting anything; the cached
        encoding goes first, and with ``wait`` the bytes being served have that many seconds to come back."""
        deadline = time.monotonic() + wait
        with self._room:
            while self._used + nbytes > self.budget:
                self._used -= self.served.forget()
                left = deadline - time.monotonic()
                if self._used + nbytes <= self.budget or left <= 0:
                    break
                self._room.wait(left)
            if self._used + nbytes > self.budget:
                raise ReplicaError(
                    f"{what} needs {nbytes} more bytes; this daemon holds {self._used} of its {self.budget}-byte "
                    "memory budget (raise --memory-limit, or drop old jobs)", "RESOURCE_EXHAUSTED")
            self._used += nbytes

    def release(self, nbytes: int) -> None:
        with self._room:
            self._used -= nbytes
            self._room.notify_all()

    # ------------------------------------------------------------ push and commit

    def stage(self, chunks: Iterable[IncomingChunk], source: str) -> tuple[ShardKey, int, int]:
        """Receives one version's chunks, in order, and stages it. Returns (shard, version, payload bytes).

        Nothing held changes; on any error (or a stream that ends early) the staging is discarded.
        """
        it = iter(chunks)
        reserved = 0
        received: list[Chunk] = []
        first: IncomingChunk | None = None
        head: Packed | None = None  # chunk 0, its header parsed once: the staged version and its commit reuse it
        try:
            for c in it:
                if first is None:
                    with self._lock:
                        held = self._replicas.get(c.key)
                    first = check_first(c, held)
                check_next(first, c, len(received), self.max_chunk_bytes)
                self.reserve(len(c.payload) + CHUNK_BOOKKEEPING, f"chunk {c.index} of {c.key} version {c.version}")
                reserved += len(c.payload) + CHUNK_BOOKKEEPING
                chunk = Chunk(c.index, c.count, c.checksum, memoryview(c.payload))
                verify_one(chunk)
                received.append(chunk)
                if c.index == 0:
                    head = Packed([chunk])
                    reserved += self._check_header(first, head)
            if first is None:
                raise ReplicaError("empty push: no chunk arrived", "INVALID_ARGUMENT")
            if len(received) != first.count:
                raise ReplicaError(f"push of {first.key} version {first.version} ended after {len(received)} of "
                                   f"{first.count} chunks", "INVALID_ARGUMENT")
        except BaseException:
            self.release(reserved)
            raise
        staging = Staging(first.key, first.version, first.base_version,
                          Packed(received, head.header if head is not None else None), reserved, source)
        with self._lock:
            old = self._staged.pop(first.key, None)
            self._staged[first.key] = staging
        if old is not None:
            self.release(old.reserved)
        return first.key, first.version, sum(len(c.payload) for c in received)

    def _check_header(self, first: IncomingChunk, head: Packed) -> int:
        """Validates chunk 0 against what is held; returns the bytes reserved for a full version's buffer."""
        try:
            header = head.header
        except CodecError as e:
            raise ReplicaError(f"malformed header chunk: {e}", "INVALID_ARGUMENT") from None
        limit = max(self.max_chunk_bytes, codec.DEFAULT_CHUNK_BYTES)  # the encoders' segments: 1 MiB at most
        if header["chunk_bytes"] > limit:  # a segment's size: what decoding one allocates
            raise ReplicaError(f"segments of {header['chunk_bytes']} bytes: more than the limit {limit}",
                               "RESOURCE_EXHAUSTED")
        if (header["kind"] == "full") != (first.base_version == 0):
            raise ReplicaError(f"header says {header['kind']} but base_version is {first.base_version}",
                               "INVALID_ARGUMENT")
        if header["kind"] == "full":
            self.reserve(int(header["nbytes"]), f"full version {first.version} of {first.key}")
            return int(header["nbytes"])
        with self._lock:
            held = self._replicas.get(first.key)
        assert held is not None  # checked by check_first
        if header["layout_id"] != held.snapshot.manifest.layout_id:
            raise ReplicaError(f"the delta is for layout {header['layout_id']}, {first.key} here has layout "
                               f"{held.snapshot.manifest.layout_id}: the model changed; push a full version",
                               "FAILED_PRECONDITION")
        if int(header["base_checksum"], 16) != held.snapshot.checksum:
            raise ReplicaError(f"wrong base: the delta applies to checksum {header['base_checksum']}, version "
                               f"{held.version} here has {held.snapshot.checksum:016x}", "FAILED_PRECONDITION")
        return 0

    def commit(self, key: ShardKey, version: int) -> tuple[int, int]:
        """Applies the staged version; returns (version, checksum). Nothing changes on failure."""
        with self._lock:
            staging = self._staged.get(key)
            if staging is None or staging.version != version:
                have = "nothing" if staging is None else f"version {staging.version}"
                raise ReplicaError(f"cannot commit {key} version {version}: {have} is staged", "FAILED_PRECONDITION")
            del self._staged[key]
            held = self._replicas.get(key)
            self._committing.setdefault(key, []).append(staging)
        try:
            if staging.base_version == 0:
                return self._commit_full(staging, held)
            return self._commit_delta(staging, held)
        except CodecError as e:
            self.release(staging.reserved)
            raise ReplicaError(f"version {version} of {key} failed verification and was discarded: {e}",
                               "DATA_LOSS") from None
        except BaseException:  # refused (the base moved on) or a bug: the staged bytes are released either way
            self.release(staging.reserved)
            raise
        finally:
            with self._lock:
                self._committing[key].remove(staging)
                if not self._committing[key]:
                    del self._committing[key]

    def _commit_full(self, staging: Staging, held: Replica | None) -> tuple[int, int]:
        snap = codec.decode_snapshot(staging.packed, max_nbytes=staging.reserved, device=None)
        new = Replica(staging.key, snap, staging.version, staging.source, time.time())
        with self._lock:
            _still(staging, held, self._replicas)
            self._replicas[staging.key] = new
            if held is not None:
                held.gone = True
        if held is not None:
            with held.lock:  # after a step-back under way on it, which gives back its own deltas
                old = held.nbytes
        # The buffer stays reserved (it is now held); the chunks are freed; so is the old replica.
        self.release(staging.reserved - host.size(snap.buffer) + (old if held is not None else 0))
        log.info("committed full version %d of %s from %s (%d bytes)", staging.version, staging.key,
                 staging.source, host.size(snap.buffer))
        return new.version, snap.checksum

    def _commit_delta(self, staging: Staging, held: Replica | None) -> tuple[int, int]:
        if held is None or held.version != staging.base_version:
            raise ReplicaError(f"{staging.key} moved on while version {staging.version} was staged",
                               "FAILED_PRECONDITION")
        with held.lock:
            _still(staging, held, self._replicas)  # read without the store's lock: a drop sets ``gone`` under it
            before = held.snapshot.manifest.scalars
            held.snapshot = codec.decode_snapshot(staging.packed, held.snapshot, inplace=True)
            with self._lock:
                _still(staging, held, self._replicas)  # else the replica changed was dropped: nothing is kept
            held.history.append(Delta(staging.version, held.version, staging.packed, before))
            held.version, held.source, held.updated = staging.version, staging.source, time.time()
            freed = 0
            while len(held.history) > self.keep_deltas:
                freed += held.history.popleft().packed.nbytes
        # The staged chunks are now the kept delta: their reservation carries over.
        self.release(freed + staging.reserved - staging.packed.nbytes)
        log.debug("committed version %d of %s from %s (delta of %d bytes on version %d)", staging.version,
                  staging.key, staging.source, staging.packed.nbytes, staging.base_version)
        return held.version, held.snapshot.checksum

    # ------------------------------------------------------------ serving

    def _get(self, key: ShardKey) -> Replica:
        with self._lock:
            held = self._replicas.get(key)
        if held is None:
            raise ReplicaError(f"no replica of {key} is held here", "NOT_FOUND")
        return held

    def fetch(self, key: ShardKey, version: int = 0, only: Sequence[int] = ()) -> tuple[int, Packed, Lease]:
        """(version, its full encoding, a lease on it) of ``key`` at ``version`` (0: the newest), stepping a copy back if
        needed; ``only``: just those chunks where no whole encoding is at hand (the newest version, not cached): a
        fetch by name encodes what it asks for. Release the lease once the chunks are sent.

        The encoding is counted against the budget before it is made, as large as the bytes it encodes (waiting up to
        ``SERVE_WAIT`` for others being served to be sent), and for as long as it is read or cached (``served.py``).
        """
        held = self._get(key)
        with held.lock:
            version = version or held.version
            if (lease := self.served.cached(key, version, held.snapshot.checksum)) is not None:
                return version, lease.packed, lease
            if version not in held.versions:
                raise ReplicaError(f"{key} version {version} is not held here (held: {held.versions})", "NOT_FOUND")
            part = only and version == held.version
            manifest = held.snapshot.manifest
        segs = codec.segments(manifest, codec.DEFAULT_CHUNK_BYTES)
        if part and only[-1] > len(segs):
            raise ReplicaError(f"fetch names chunk {only[-1]}: the version has {len(segs) + 1}", "INVALID_ARGUMENT")
        bound = sum(segs[i - 1][1] * segs[i - 1][2] for i in only if 0 < i <= len(segs)) if part else manifest.nbytes
        what = f"the encoding of {key} version {version} being served"
        self.reserve(bound, what, SERVE_WAIT)  # off the replica's lock: a push to it goes on meanwhile
        held.lock.acquire()
        try:
            if held.gone or version not in held.versions:  # stepped back, replaced or dropped meanwhile
                raise ReplicaError(f"{key} version {version} is no longer held here", "NOT_FOUND")
            checksum = held.snapshot.checksum
            if part and version == held.version:
                packed = codec.encode_chunks(held.snapshot, only)
            elif version == held.version:  # the newest, whole: its chunks go out as they are made
                return version, *stream(self, held, (key, version, checksum), len(segs), bound, what)
            else:
                packed = _encode(held, version, self.reserve, self.release)
        except BaseException:  # ``stream`` hands the lock on only when it returns
            held.lock.release()
            self.release(bound)
            raise
        held.lock.release()
        return version, packed, self.served.serve(packed, bound, what, None if part else (key, version, checksum))

    def step_back(self, key: ShardKey, version: int) -> tuple[int, int]:
        """Reverts the replica in place to ``version``, dropping the newer deltas."""
        held = self._get(key)
        with held.lock:
            if held.gone:  # dropped or replaced meanwhile: its bytes are given back already
                raise ReplicaError(f"no replica of {key} is held here any more", "NOT_FOUND")
            if version not in held.versions:
                raise ReplicaError(f"cannot step {key} back to version {version}: it can go back to "
                                   f"{held.versions}", "NOT_FOUND")
            freed = 0
            while held.version != version:
                d = held.history[-1]
                held.snapshot = codec.revert_snapshot(d.packed, held.snapshot, d.scalars_before)
                held.history.pop()
                held.version = d.version_before
                freed += d.packed.nbytes
            held.updated = time.time()
        self.release(freed)
        log.info("stepped %s back to version %d", key, version)
        return held.version, held.snapshot.checksum

    def drop(self, job_id: str, rank: int | None = None, world: int | None = None) -> int:
        with self._lock:
            keys = [k for k in set(self._replicas) | set(self._staged) | set(self._committing) if k.job_id == job_id
                    and (rank is None or k.rank == rank) and (world is None or k.world_size == world)]
            gone = [self._replicas.pop(k, None) for k in keys]
            staged = [self._staged.pop(k, None) for k in keys]
            for c in [c for k in keys for c in self._committing.get(k, [])]:
                c.dropped = True  # its commit gives its bytes back and keeps nothing
            for r in filter(None, gone):
                r.gone = True  # a fetch, a step-back or a delta's commit that has it already stops
            self._used -= self.served.forget(set(keys))
        freed = 0
        for r in filter(None, gone):
            with r.lock:  # after a step-back or a delta's commit under way on it
                freed += r.nbytes
        self.release(freed + sum(s.reserved for s in staged if s))
        if keys:
            log.info("dropped %d shard(s) of job %s", len(keys), job_id)
        return len(keys)

    def inventory(self, job_id: str = "") -> list[dict[str, Any]]:
        """What is held per shard, a version staged and not committed included (with its bytes)."""
        with self._lock:
            keys = sorted(k for k in set(self._replicas) | set(self._staged) if not job_id or k.job_id == job_id)
            rows = [(k, self._replicas.get(k), self._staged.get(k)) for k in keys]
        return [_row(*row) for row in rows]

    def expire_staged(self, timeout: float) -> list[tuple[ShardKey, int]]:
        """Discards the versions staged longer than ``timeout`` seconds ago and not committed (a pusher that died
        between Push and Commit), giving their memory back; returns (shard, version) of each."""
        now = time.monotonic()
        with self._lock:
            old = [k for k, s in self._staged.items() if now - s.at > timeout]
            gone = [self._staged.pop(k) for k in old]
        for s in gone:
            self.release(s.reserved)
        return [(s.key, s.version) for s in gone]


def _row(k: ShardKey, r: Replica | None, s: Staging | None) -> dict[str, Any]:
    """One shard's row of ``Store.inventory``."""
    staged = {"staged_version": s.version, "staged_bytes": s.reserved} if s else {}
    return {"key": k, "version": r.version if r else 0, "versions": r.versions if r else [],
            "bytes": (r.nbytes if r else 0) + (s.reserved if s else 0), "updated": r.updated if r else 0.0,
            "source": r.source if r else s.source, **staged}


def _still(staging: Staging, held: Replica | None, replicas: dict[ShardKey, Replica]) -> None:
    """Under the store's lock: the shard was neither dropped nor replaced while ``staging`` was decoded (else its
    bytes would be counted, or given back, twice)."""
    if staging.dropped or replicas.get(staging.key) is not held:
        raise ReplicaError(f"{staging.key} was dropped or replaced while version {staging.version} was committed",
                           "FAILED_PRECONDITION")


def _encode(held: Replica, version: int, reserve: Callable[[int, str], None], release: Callable[[int], None]) -> Packed:
    """A full encoding of ``held`` at ``version`` (one it holds), under its lock; a copy stepped back to it is
    counted (``reserve``, ``release``) while it lives."""
    if version == held.version:
        return codec.encode_snapshot(held.snapshot)
    size = host.size(held.snapshot.buffer)
    reserve(size, f"a copy of {held.key} stepped back to version {version}")
    try:
        snap = Snapshot(held.snapshot.manifest, host.clone(held.snapshot.buffer), held.snapshot.checksum)
        for d in reversed(held.history):
            if d.version <= version:
                break
            snap = codec.revert_snapshot(d.packed, snap, d.scalars_before)
        return codec.encode_snapshot(snap)
    finally:
        release(size)
