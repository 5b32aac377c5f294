"""The replicator: sends each local rank's newly committed snapshots to the remote holders.

Per local rank, one thread watches the rank's shared-memory slots. When a newer version is
committed, it encodes it straight from the slot (no copy) as a delta against the version the
holders have, checks that the worker did not rewrite the slot meanwhile (else the newest version
wins and the encoding is dropped), pushes it to every holder in parallel and commits it there.
A holder that is down, or answers that it lacks the base, gets a full version at its next turn,
after a backoff. The daemon's own copy of the pushed version (the base of the next delta) is
advanced by applying the same delta, so the slot is never copied. ``Pacer.before_chunk`` is the
seam where the scheduler will pace the sender (DESIGN.md section 4, step 3).
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Protocol

from ffstate import codec
from ffstate.client import Client
from ffstate.codec import Packed, Snapshot
from ffstate.daemon.store import ShardKey
from ffstate.errors import CodecError, FFStateError, ReplicaError, ReplicaUnavailable
from ffstate.layout import Manifest
from ffstate.shm import Slots

log = logging.getLogger("ffstate.daemon.replicator")


class Pacer(Protocol):
    """Decides when the next chunk may go out (the scheduler issue fills this in)."""

    def before_chunk(self, holder: str, nbytes: int) -> None: ...


class Unpaced:
    """Sends as soon as a snapshot is captured."""

    def before_chunk(self, holder: str, nbytes: int) -> None:
        return None


@dataclass
class Holder:
    """A remote daemon holding replicas of this node's ranks, as seen by one local rank."""

    address: str
    client: Client
    acked: int = 0  # newest version the holder committed (0: none, send a full version)
    failures: int = 0
    next_try: float = 0.0
    last_error: str = ""

    def backoff(self, error: Exception) -> None:
        self.failures += 1
        self.next_try = time.monotonic() + min(0.1 * 2 ** (self.failures - 1), 5.0)
        self.last_error = str(error)


@dataclass
class LocalShard:
    """One rank of this node: its slots, and the state of its replication."""

    key: ShardKey
    manifest: Manifest
    slots: Slots
    holders: list[Holder]
    reserved: int
    base: Snapshot | None = None  # the daemon's copy of the newest pushed version
    base_version: int = 0
    wake: threading.Event = field(default_factory=threading.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)  # a round, or a reset, at a time
    stop: threading.Event = field(default_factory=threading.Event)
    thread: threading.Thread | None = None
    pushed_bytes: int = 0
    last_push: float = 0.0

    @property
    def replicated_version(self) -> int:
        return min((h.acked for h in self.holders), default=0)

    @property
    def paths(self) -> list[Path]:
        return self.slots.paths


class Replicator:
    """Runs one sender thread per local rank."""

    def __init__(self, make_client: Callable[[str], Client], peers: list[str], pacer: Pacer | None = None,
                 poll_interval: float = 0.005):
        self.make_client = make_client
        self.peers = list(peers)
        self.pacer = pacer or Unpaced()
        self.poll_interval = poll_interval
        self._pool = ThreadPoolExecutor(max(1, len(self.peers)) * 4, thread_name_prefix="ffstate-push")

    def start(self, shard: LocalShard) -> None:
        shard.thread = threading.Thread(target=self._run, args=(shard,), name=f"ffstate-repl-{shard.key.rank}",
                                        daemon=True)
        shard.thread.start()

    def holders(self, addresses: list[str] | None = None) -> list[Holder]:
        return [Holder(p, self.make_client(p)) for p in (self.peers if addresses is None else addresses)]

    def reset(self, shard: LocalShard, addresses: list[str] | None = None) -> None:
        """Forgets what the holders have (a worker re-attached, e.g. after stepping back): full versions next."""
        with shard.lock:
            old = shard.holders
            shard.holders = self.holders(addresses)
            shard.base, shard.base_version = None, 0
        for h in old:
            h.client.close()

    def stop(self, shard: LocalShard, wait: float = 5.0) -> None:
        shard.stop.set()
        shard.wake.set()
        if shard.thread is not None:
            shard.thread.join(wait)
        for h in shard.holders:
            h.client.close()

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    # ------------------------------------------------------------ the loop

    def _run(self, shard: LocalShard) -> None:
        while not shard.stop.is_set():
            shard.wake.wait(self.poll_interval)
            shard.wake.clear()
            try:
                with shard.lock:
                    self._round(shard)
            except Exception:  # a bug here must not silently stop replication of this rank
                log.exception("replication round of %s failed; retrying", shard.key)
                time.sleep(0.5)

    def _round(self, shard: LocalShard) -> None:
        view = shard.slots.latest()
        if view is None:
            return
        now = time.monotonic()
        due = [h for h in shard.holders if h.acked < view.version and h.next_try <= now]
        if not due:
            return
        snap = shard.slots.snapshot(view)
        delta = full = None
        try:
            if shard.base is not None and any(h.acked == shard.base_version for h in due):
                delta = codec.encode_snapshot(snap, shard.base)
            if any(shard.base is None or h.acked != shard.base_version for h in due):
                full = codec.encode_snapshot(snap)
        except CodecError as e:
            log.warning("encoding version %d of %s failed (%s); waiting for the next commit", view.version, shard.key, e)
            return
        if not shard.slots.unchanged(view):
            log.debug("%s: slot rewritten while encoding version %d; taking the newest", shard.key, view.version)
            return
        # The encodings are self-contained now: the worker may rewrite the slot from here on.
        jobs = [(h, delta if (delta is not None and h.acked == shard.base_version) else full) for h in due]
        results = list(self._pool.map(lambda hp: self._push(shard, view.version, hp[0], hp[1]), jobs))
        try:
            if delta is not None:
                shard.base = codec.decode_snapshot(delta, shard.base, inplace=True)
            else:
                shard.base = codec.decode_snapshot(full)
            shard.base_version = view.version
        except CodecError as e:  # cannot happen unless memory is corrupted; start over from a full version
            log.error("%s: could not advance the local base to version %d: %s", shard.key, view.version, e)
            shard.base, shard.base_version = None, 0
        if any(results):
            shard.last_push = time.time()

    def _push(self, shard: LocalShard, version: int, holder: Holder, packed: Packed) -> bool:
        k = shard.key
        base_version = holder.acked if packed.kind == "delta" else 0
        try:
            holder.client.push_and_commit(k.job_id, k.rank, k.world_size, version, packed, base_version,
                                          before_chunk=lambda n: self.pacer.before_chunk(holder.address, n))
        except (ReplicaError, FFStateError) as e:
            if not isinstance(e, ReplicaUnavailable):
                holder.acked = 0  # whatever went wrong, the next push is a full version
            holder.backoff(e)
            log.warning("push of %s version %d to %s failed (%s); retry in %.1fs", k, version, holder.address, e,
                        holder.next_try - time.monotonic())
            return False
        if holder.failures:
            log.info("holder %s is back: %s version %d re-seeded (%s)", holder.address, k, version, packed.kind)
        holder.acked, holder.failures, holder.last_error = version, 0, ""
        shard.pushed_bytes += packed.nbytes
        log.info("pushed %s version %d to %s: %s, %d bytes (%.2fx)", k, version, holder.address, packed.kind,
                 packed.nbytes, packed.ratio)
        return True
