"""One local rank's replication state, as the replicator keeps it: its holders (what each has acknowledged, its
backoff, whether it is down or must step back first), the daemon's copy of the rank's newest version (the base
of the next delta) and the chain of the last deltas, which serves holders that lag and steps the node's own copy
back (docs/design.md I3). The replicator (``replicator.py``) runs the loop over them."""

from __future__ import annotations

import logging
import struct
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from ffstate import codec
from ffstate.client import Client
from ffstate.codec import Packed, Snapshot, host
from ffstate.daemon.served import Counted
from ffstate.daemon.store import SERVE_WAIT, Store
from ffstate.errors import CodecError, ReplicaError
from ffstate.ids import ShardKey
from ffstate.layout import Manifest
from ffstate.shm import Slots

log = logging.getLogger("ffstate.daemon.replicator")
SEEDING_KEEP = 4  # at most this many times keep_deltas deltas kept for a holder being seeded (trim_chain)


@dataclass
class Holder:
    """A remote daemon holding replicas of this node's ranks, as seen by one local rank."""

    address: str
    client: Client
    acked: int = 0  # newest version the holder committed (0: none, send a full version)
    failures: int = 0
    next_try: float = 0.0
    down: bool = False  # its last push found it unreachable (not merely refusing): the lag policy does not wait for it
    # unreachable at its last try: nothing is encoded for it until a look at its connection finds it answering
    # (a full version of a large state costs seconds of CPU; a look, nothing)
    probe: bool = False
    answered: bool = False  # a look found it answering since its last push: if the next push fails, not its connection
    down_since: float = 0.0  # when it was first found unreachable (monotonic; 0: it is not)
    resume: int = 0  # the job resumed at this version: the holder steps its replica back to it before anything else
    full_in_flight: int = 0  # the version of a full version being encoded or sent to it (0: none)

    def backoff(self, cap: float = 1.0) -> None:
        self.failures += 1
        # At most a second (a tenth of one between looks at an unreachable holder, which cost nothing): a holder's
        # daemon restarted by its node's workers is back within seconds, and until it is re-seeded this rank's only
        # copy is its own node's.
        # (the exponent bounded: looks count as failures, ten a second, and 2.0 ** 1024 overflows a float)
        self.next_try = time.monotonic() + min(0.1 * 2 ** min(self.failures - 1, 10), cap)


@dataclass
class LocalShard:
    """One rank of this node: its slots, and the state of its replication."""

    key: ShardKey
    manifest: Manifest
    slots: Slots
    holders: list[Holder]
    reserved: int
    base: Snapshot | None = None  # the daemon's copy of the newest version read from the slots
    base_version: int = 0
    # (version, version before, delta, scalars before): the last ``keep`` deltas, for the holders that lag
    # and for stepping the local copy back (a node lost while its holders lagged: docs/design.md I3)
    chain: list = field(default_factory=list)
    wake: threading.Event = field(default_factory=threading.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)  # a round, or a reset, at a time
    report_lock: threading.Lock = field(default_factory=threading.Lock)  # see report()
    stop: threading.Event = field(default_factory=threading.Event)
    thread: threading.Thread | None = None
    last_push: float = 0.0
    pushed_bytes: int = 0  # on the wire, to all holders
    pushed_versions: int = 0  # counted once per holder
    pushed_raw_bytes: int = 0  # the snapshots those versions restore (for the compression ratio)
    razor: Any = None  # the worker's reports.RazorReport, for the reports
    bell: int = 0  # the rank's id at the daemon's doorbell (0: none)
    persist_keys: dict | None = None  # the worker's DCP key map (ffstate/persist/keys.py), for the persistent tier
    said: tuple = (0.0, 0, 0, 0)  # monotonic time, versions, bytes and raw bytes at the last summary in the log
    seeding_counted: int = 0  # bytes of the deltas kept past keep_deltas for a holder being seeded, in the budget

    def _down(self, h: Holder) -> bool:
        return h.down and h.acked < self.base_version

    def _seeding(self, h: Holder, bases: set[int]) -> bool:
        """Lacks a base for the next delta: a full version next (a new holder, one that restarted between two
        pushes, one whose last push was refused, one that fell out of the deltas kept)."""
        return h.acked < self.base_version and h.acked not in bases

    @property
    def replicated_version(self) -> int:
        """The newest version every holder that answers has: one found unreachable (its node lost, its daemon
        restarting; a full version when it is back) is not counted, so that with ``replicas`` 2 the lag bound holds
        for the other while it is gone; with every holder unreachable, the newest every holder has. A holder that
        answers is counted however far behind (being seeded, refusing, slow): the ``block`` policy holds the
        training for it, as it does with one holder."""
        up = [h.acked for h in self.holders if not self._down(h)]
        return min(up or [h.acked for h in self.holders], default=0)

    @property
    def holders_down(self) -> int:
        """Holders that lack the newest version taken and did not answer their last push."""
        return sum(1 for h in self.holders if self._down(h))

    @property
    def holders_seeding(self) -> int:
        """Holders that answer and lack a base for the next delta (a full version next, or refused): what keeps
        the lag up (``ffstate status``, the metrics)."""
        bases = {c[1] for c in list(self.chain)}
        return sum(1 for h in self.holders if not self._down(h) and self._seeding(h, bases))

    def trim_chain(self, keep: int, budget: Any = None) -> None:
        """Keeps the last ``keep`` deltas, and back to the version of a full version sent to a holder until that
        holder's next batch (up to ``SEEDING_KEEP`` × ``keep``): versions are taken while it is encoded and sent,
        and a holder whose version had left the chain by the time it landed got another full version, and another,
        never seeded. Those past ``keep`` are counted against ``budget`` (``reserve``/``release``); without room,
        only ``keep`` are kept. Call under ``lock``."""
        seeding = min((h.full_in_flight for h in self.holders if h.full_in_flight), default=0)
        kept = sum(1 for c in self.chain if c[1] >= seeding) if seeding else 0
        chain = self.chain[-min(max(keep, kept), SEEDING_KEEP * keep):]
        extra = sum(c[2].nbytes for c in chain[:max(0, len(chain) - keep)])
        if budget is not None and extra > self.seeding_counted:
            try:
                budget.reserve(extra - self.seeding_counted, f"the deltas of {self.key} kept for a holder being seeded")
                self.seeding_counted = extra
            except ReplicaError:
                chain, extra = chain[-keep:], 0
        if budget is not None and extra < self.seeding_counted:
            budget.release(self.seeding_counted - extra)
            self.seeding_counted = extra
        self.chain = chain

    def report(self) -> None:
        """Writes ``replicated_version`` (and ``holders_down`` where no holder answers: the worker's commit then
        holds for none) into the slot header, where the worker's commit reads its lag.

        Pushes to several holders report from their own threads, and a reset swaps the holders: each
        computes and writes under ``report_lock``, so the last write is always the current minimum.
        """
        with self.report_lock:
            down = self.holders_down
            self.slots.set_replicated(self.replicated_version, down if down == len(self.holders) else 0)

    @property
    def paths(self) -> list[Path]:
        return self.slots.paths

    def versions_back(self) -> list[int]:
        """The versions the daemon's copy can be stepped back to through the chain (newest first)."""
        base, chain = self.base, list(self.chain)
        if base is None:
            return []
        out, expected = [self.base_version], self.base_version
        for version, before, _, _ in reversed(chain):
            if version != expected:
                break
            out.append(before)
            expected = before
        return out

    def step_back_to(self, version: int) -> bool:
        """Steps the daemon's copy back to ``version`` in place, dropping the newer deltas; when it cannot (out of
        reach), forgets it and returns False. Call under ``lock``."""
        try:
            if self.base is None or version not in self.versions_back():
                raise CodecError(f"version {version} is not within {self.versions_back()}")
            while self.base_version != version:
                v, before, packed, scalars = self.chain.pop()
                self.base = codec.revert_snapshot(packed, self.base, scalars)
                self.base_version = before
            return True
        except CodecError as e:
            log.info("%s: the daemon's copy cannot step back to version %d (%s)", self.key, version, e)
            self.base, self.base_version, self.chain = None, 0, []
            return False

    def stepped_back(self, version: int) -> Snapshot | None:
        """A copy of the local rank's state at ``version``, reverted through the chain; None if out of reach.
        Call under ``lock``."""
        if version not in self.versions_back():
            return None
        snap = Snapshot(self.base.manifest, host.clone(self.base.buffer), self.base.checksum)
        for v, before, packed, scalars in reversed(self.chain):
            if v == version:
                break
            snap = codec.revert_snapshot(packed, snap, scalars)
            if before == version:
                break
        return snap


class FullVersion:
    """A full version of the daemon's copy, for the holders that lack a base (a holder re-seeded): encoded from a
    private copy, on the first of its holders' push threads, once for all of them, so the shard's loop goes on
    taking versions meanwhile (a large state's encoding takes seconds: versions not taken hold the worker's
    commits, then are overwritten). Its memory, the copy and the encoding, is counted (``counted`` bytes, given
    back with ``release``) until the last of its holders' pushes ends (``done``)."""

    def __init__(self, snapshot: Snapshot, chunk_bytes: int, counted: int = 0, release: Any = None):
        self._snapshot, self._chunk_bytes = snapshot, chunk_bytes
        self._counted, self._release = counted, release
        self._lock = threading.Lock()
        self._packed: Packed | None = None
        self._users = 0

    def use(self) -> "FullVersion":
        """One more holder's push will send it (under the shard's lock, before the push is submitted)."""
        with self._lock:
            self._users += 1
        return self

    def packed(self) -> Packed:
        """The encoding, made by the first push that asks (the others wait for it); the copy then goes, and only
        the encoding stays counted."""
        with self._lock:
            if self._packed is None:
                self._packed = codec.encode_snapshot(self._snapshot, chunk_bytes=self._chunk_bytes)
                self._snapshot = None
                freed = max(0, self._counted - self._packed.nbytes)
                if freed and self._release is not None:
                    self._release(freed)
                    self._counted -= freed
            return self._packed

    def done(self) -> None:
        """One holder's push of it ended (sent or not); the last one frees its memory."""
        with self._lock:
            self._users -= 1
            if self._users > 0:
                return
            self._packed = self._snapshot = None
        if self._counted and self._release is not None:
            self._release(self._counted)
            self._counted = 0


def full_version(shard: LocalShard, budget: Any, chunk_bytes: int) -> FullVersion | Packed:
    """The daemon's copy of ``shard`` as a full version, encoded on the push threads from a copy (the daemon's
    changes in place at the next version taken); with no room in ``budget`` (``reserve``/``release``; None: not
    counted) for the copy and its encoding, encoded here, under the shard's lock, as a smaller daemon must (no
    version is taken meanwhile). Call under ``shard.lock``."""
    base, counted = shard.base, 2 * shard.manifest.nbytes
    if budget is not None:
        try:
            budget.reserve(counted, f"a full version of {shard.key} for a holder that lacks it")
        except ReplicaError as e:
            log.info("%s; encoding it in the replication loop instead (no version is taken meanwhile)", e)
            return codec.encode_snapshot(base, chunk_bytes=chunk_bytes)
    try:
        copy = Snapshot(base.manifest, host.clone(base.buffer), base.checksum)
    except BaseException:
        if budget is not None:
            budget.release(counted)
        raise
    return FullVersion(copy, chunk_bytes, counted if budget is not None else 0,
                       budget.release if budget is not None else None)


GONE = (ValueError, IndexError, struct.error)  # a shard dropped (its mappings closed) while it was read


def copy_verified(slots: Slots, version: int = 0) -> tuple[int, Snapshot] | None:
    """(version, a verified private copy) of the newest committed slot, or of ``version`` if given."""
    got = slots.read(version, lambda view: (host.clone(view.data), codec.buffer_checksum(view.data)))
    if got is None:
        return None
    view, buf = got
    return view.version, Snapshot(slots.manifest.with_scalars(view.scalars), buf, view.checksum)


def serve_from_slots(shard: LocalShard, store: Store, version: int, only: Sequence[int]) -> tuple[int, Packed, Counted]:
    """(version, full encoding or the chunks ``only``, its count to release once sent) of a rank of this node, from
    its slots (``version`` 0: the newest), or from the daemon's copy stepped back where the slots hold no longer.

    Raises:
        ReplicaError: NOT_FOUND, the version is neither in the slots nor within the deltas kept;
            RESOURCE_EXHAUSTED, no room for a copy and its encoding.
    """
    what = f"serving {shard.key} from its slots"
    counted = 2 * shard.manifest.nbytes  # a copy and its encoding, which the state's headers may take past it
    store.reserve(counted, what, SERVE_WAIT)
    try:
        got = copy_verified(shard.slots, version)
        if got is None and version:  # older than the slots: step the daemon's copy back (docs/design.md I3)
            with shard.lock:
                snap = shard.stepped_back(version)
            got = (version, snap) if snap is not None else None
        if got is None:
            raise ReplicaError(f"{shard.key} version {version or 'newest'} is not in this node's slots (committed: "
                               f"{[v for v, _ in shard.slots.committed()]}) nor within the deltas kept "
                               f"({shard.versions_back()})", "NOT_FOUND")
        found, packed = got[0], codec.encode_chunks(got[1], only) if only else codec.encode_snapshot(got[1])
        got = snap = None  # the copy goes: from here its encoding alone is counted, exactly
        if packed.nbytes > counted:
            store.reserve(packed.nbytes - counted, what)
        else:
            store.release(counted - packed.nbytes)
        counted = packed.nbytes
        return found, packed, Counted(store.release, counted)
    except BaseException:
        store.release(counted)
        raise
