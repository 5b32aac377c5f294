"""Shared-memory snapshot slots between a worker and its node's daemon (DESIGN.md section 4, I2).

The daemon creates two slot files per local rank under /dev/shm (a double buffer) and owns them, so
a snapshot outlives the worker that wrote it. A slot is a page of header, an area for the state's
scalars (JSON), and the packed state's bytes. The worker writes the older slot and publishes it
with a seqlock: the sequence number is odd while the slot is being written and even once its
version, checksum and scalars are in place. A reader takes a slot only when its sequence number
is even and unchanged across the read, so a worker killed mid-write leaves that slot unreadable
and the other slot (the previous version) intact. The daemon, in turn, marks a slot *taken* once it
has read its version; a worker on the ``block`` lag policy waits for that mark before it
overwrites the slot, so no version escapes replication.

After each commit the worker rings its daemon's doorbell (``Doorbell``, a datagram naming the rank),
so that the daemon takes the new version at once instead of at its next look at the slots; a lost
ring costs only that wait.

The worker does not checksum what it writes: the daemon computes the checksum when it takes the
slot, off the training path (it was half of a commit's time), and records it beside the header; a
reader verifies the slot against that record, and computes it itself, under the seqlock, when the
daemon has not taken the slot yet. The seqlock, not the checksum, is what rules out a torn slot.

Stores land in program order on x86-64 (TSO); the header is written last and read first.
"""

from __future__ import annotations

import json
import logging
import mmap
import os
import itertools
import re
import socket
import struct
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from ffstate import codec
from ffstate.errors import FFStateError
from ffstate.layout import Manifest
from ffstate.profiling import ProfiledTimeline

log = logging.getLogger("ffstate.shm")

SHM_DIR = Path(os.environ.get("FFSTATE_SHM_DIR", "/dev/shm"))
MAGIC = b"FFSLOT01"
PAGE = 4096
# magic, seq, version, (unused, 0), scalars length, data bytes, scalars capacity, commit time (ns), layout id
HEADER = struct.Struct("<8sQQQQQQQ32s")
SEQ_OFFSET = 8
# Written by the daemon only: the version it has finished reading from this slot (see Slots.commit).
TAKEN_OFFSET = 128
# Written by the daemon only: the checksum of the slot's data (at +8, written first) and the sequence
# number of the write it belongs to (at +0, written last): a rewrite of the slot, even of the same
# version after a step back, never pairs with an older write's checksum.
CHECKED_OFFSET = 136
# Written by the worker only: the razor's verification counters (verifications, mismatches), for the daemon.
RAZOR_OFFSET = 160
# Written by the worker only (slot 0's header): its collectives on the wire now, then a ring of the last
# COMM_RING (start, end) times (ns) of its collectives and the ring's write count; see CommMarks.
COMM_OFFSET = 176
COMM_RING = 48
# Written by the daemon only (slot 0's header): the newest version every holder of this rank has, so
# that a commit checks the replication lag with one read instead of a call to the daemon.
REPLICATED_OFFSET = COMM_OFFSET + 16 + 16 * COMM_RING
# Written by the daemon only (slot 0's header, when it creates the slots): its doorbell, as the rank's id
# there (8 bytes), the length of the doorbell's name (2) and the name (a Unix socket's abstract address).
BELL_OFFSET = REPLICATED_OFFSET + 64
BELL = struct.Struct("<QH")
BELL_NAME_MAX = 256
# Written by the worker only (slot 0's header, at attach after a restore): restores so far, then the newest
# one's version (v*), steps lost, seconds to fetch and load, and seconds from the process's entry; see
# record_restore.
RESTORE_OFFSET = BELL_OFFSET + BELL.size + BELL_NAME_MAX + 6  # 8-byte aligned
RESTORE = struct.Struct("<QQQdd")
# Written by the worker only (slot 0's header, once): the profiled timeline of a training whose collectives are
# not marked (see profiling.py): steps profiled, the intervals' count, the step's period (s), then up to
# TIMELINE_MAX (start, end) offsets (s) from the step's commit. The steps field is written last: 0 reads as none.
TIMELINE_OFFSET = RESTORE_OFFSET + RESTORE.size
TIMELINE = struct.Struct("<QQd")
TIMELINE_MAX = 64
STALE_MARKS = 10.0  # seconds without a commit after which a worker's in-flight count is ignored
DEFAULT_SCALARS_CAPACITY = 1 << 20
ID_RE = re.compile(r"^[A-Za-z0-9._-]{1,128}$")


class SlotError(FFStateError):
    """A slot is missing, of another layout, or used wrongly (e.g. a non-increasing version)."""


def check_id(value: str, what: str) -> str:
    if not ID_RE.match(value):
        raise SlotError(f"{what} {value!r} is not valid: use 1-128 letters, digits, '.', '_' or '-'")
    return value


def _round_up(n: int, to: int = PAGE) -> int:
    return (n + to - 1) // to * to


def slot_size(manifest: Manifest, scalars_capacity: int) -> int:
    return PAGE + _round_up(scalars_capacity) + _round_up(manifest.nbytes)


def slot_paths(node_id: str, job_id: str, rank: int, world_size: int) -> list[Path]:
    base = f"ffstate-{check_id(node_id, 'node id')}-{check_id(job_id, 'job id')}-r{rank}of{world_size}"
    return [SHM_DIR / f"{base}-{k}" for k in range(2)]


def create_slots(paths: list[Path], manifest: Manifest, scalars_capacity: int,
                 bell: tuple[str, int] | None = None) -> None:
    """Creates the slot files (zero-filled, so padding is zero), header written, nothing committed;
    ``bell``: the daemon's doorbell (its name, and the id it gave this rank) for the worker to ring."""
    size = slot_size(manifest, scalars_capacity)
    for k, path in enumerate(paths):
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, size)
            os.pwrite(fd, HEADER.pack(MAGIC, 0, 0, 0, 0, manifest.nbytes, scalars_capacity, 0,
                                      manifest.layout_id.encode()), 0)
            if bell is not None and k == 0:
                name = bell[0].encode()
                os.pwrite(fd, BELL.pack(bell[1], len(name)) + name, BELL_OFFSET)
        finally:
            os.close(fd)


def remove_slots(paths: list[Path]) -> None:
    for path in paths:
        try:
            path.unlink()
        except FileNotFoundError:
            pass


@dataclass(frozen=True)
class SlotView:
    """A committed slot as read: valid while ``Slots.unchanged(view)`` says so."""

    index: int
    seq: int
    version: int
    checksum: int | None  # as recorded by the daemon; None until it has taken the slot
    scalars: list
    data: torch.Tensor  # uint8 view of the slot's bytes, no copy


class Doorbell:
    """Daemon side: the socket its workers ring after each commit (``Slots.ring``), one per daemon.

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
            wake = self._wakes.get(struct.unpack("<Q", data)[0]) if len(data) == 8 else None
            if wake is None:
                log.debug("doorbell %s: ignored a %d-byte ring that names no attached rank", self.name, len(data))
                continue
            wake.set()
            self._on_ring()

    def close(self) -> None:
        self._closed.set()
        self._thread.join(2)
        self._sock.close()


class CommMarks:
    """Worker side: marks when the training's collectives are on the wire, in the slot header, for the
    daemon's scheduler (DESIGN.md section 4, step 3). Cheap: a few stores per gradient bucket."""

    def __init__(self) -> None:
        self._mm: mmap.mmap | None = None
        self._inflight = 0
        self._count = 0
        self._lock = threading.Lock()

    def attach(self, slots: "Slots | None") -> None:
        with self._lock:
            self._mm = slots._maps[0] if slots is not None and slots._maps else None
            if self._mm is not None:  # a worker that died mid-collective left its count behind: ours replaces it
                self._count = struct.unpack_from("<qQ", self._mm, COMM_OFFSET)[1]
                struct.pack_into("<q", self._mm, COMM_OFFSET, self._inflight)

    def start(self) -> int:
        with self._lock:
            self._inflight += 1
            if self._mm is not None:
                struct.pack_into("<q", self._mm, COMM_OFFSET, self._inflight)
        return time.time_ns()

    def end(self, started: int) -> None:
        with self._lock:
            self._inflight -= 1
            i = self._count % COMM_RING
            self._count += 1
            if self._mm is not None:
                struct.pack_into("<QQ", self._mm, COMM_OFFSET + 16 + 16 * i, started, time.time_ns())
                struct.pack_into("<qQ", self._mm, COMM_OFFSET, self._inflight, self._count)

    @property
    def count(self) -> int:
        """Collectives marked off the wire so far (the ring's write count once attached)."""
        return self._count


class Slots:
    """The two slots of one rank, mapped into this process (worker or daemon)."""

    def __init__(self, paths: list[Path], manifest: Manifest):
        self.paths = [Path(p) for p in paths]
        self.manifest = manifest
        self._maps: list[mmap.mmap] = []
        self.wait_timed_out = False
        self.data: list[torch.Tensor] = []
        for path in self.paths:
            try:
                fd = os.open(path, os.O_RDWR)
            except FileNotFoundError as e:
                raise SlotError(f"slot {path} does not exist: is the node's ffstate daemon running?") from e
            try:
                size = os.fstat(fd).st_size
                mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            finally:
                os.close(fd)
            magic, _, _, _, _, nbytes, cap, _, layout_id = HEADER.unpack_from(mm, 0)
            if magic != MAGIC or nbytes != manifest.nbytes or layout_id.decode() != manifest.layout_id:
                mm.close()
                raise SlotError(f"slot {path} holds another layout ({layout_id.decode()!r}, {nbytes} bytes); "
                                f"this state is {manifest.layout_id!r}, {manifest.nbytes} bytes")
            self._maps.append(mm)
            self.scalars_capacity = cap
            start = PAGE + _round_up(cap)
            self.data.append(torch.frombuffer(mm, dtype=torch.uint8, offset=start, count=manifest.nbytes)
                             if manifest.nbytes else torch.empty(0, dtype=torch.uint8))
        self._targets: list[list[torch.Tensor] | None] = [None] * len(self.paths)  # commit's views, made once
        self._bell: tuple[str, bytes] | None = None  # (address, ring) of the daemon's doorbell, if it has one
        self._bell_socket: socket.socket | None = None
        if self._maps:
            ident, n = BELL.unpack_from(self._maps[0], BELL_OFFSET)
            if ident and 0 < n <= BELL_NAME_MAX:
                name = bytes(self._maps[0][BELL_OFFSET + BELL.size : BELL_OFFSET + BELL.size + n]).decode(errors="replace")
                self._bell = "\0" + name, struct.pack("<Q", ident)

    def close(self) -> None:
        if self._bell_socket is not None:
            self._bell_socket.close()
            self._bell_socket = None
        self._targets = [None] * len(self._targets)
        self.data.clear()
        for mm in self._maps:
            try:
                mm.close()
            except BufferError:  # a tensor view is still alive somewhere; the mapping goes with the process
                pass
        self._maps.clear()

    # ------------------------------------------------------------ header access

    def _header(self, k: int) -> tuple:
        return HEADER.unpack_from(self._maps[k], 0)

    def _seq(self, k: int) -> int:
        return struct.unpack_from("<Q", self._maps[k], SEQ_OFFSET)[0]

    def _set_seq(self, k: int, seq: int) -> None:
        struct.pack_into("<Q", self._maps[k], SEQ_OFFSET, seq)

    def committed(self, ascending: bool = False) -> list[tuple[int, int]]:
        """(version, slot) of each committed slot, newest first (or oldest first)."""
        out = []
        for k in range(len(self._maps)):
            _, seq, version, *_ = self._header(k)
            if seq and seq % 2 == 0:
                out.append((version, k))
        return sorted(out, reverse=not ascending)

    def taken(self, k: int) -> int:
        return struct.unpack_from("<Q", self._maps[k], TAKEN_OFFSET)[0]

    def mark_taken(self, view: "SlotView") -> None:
        """Daemon side: the slot's version is read; the worker may overwrite it."""
        struct.pack_into("<Q", self._maps[view.index], TAKEN_OFFSET, view.version)

    def set_razor_counters(self, verifications: int, mismatches: int) -> None:
        """Worker side: the razor's verification counters, which the daemon reports (``ffstate status``)."""
        for mm in self._maps:
            struct.pack_into("<QQ", mm, RAZOR_OFFSET, verifications, mismatches)

    def comm_marks(self) -> tuple[int, list[tuple[float, float]], list[float]]:
        """Daemon side: (collectives in flight, recent (start, end) times, the two newest commit times), seconds."""
        if not self._maps:
            return 0, [], []
        mm = self._maps[0]
        inflight, count = struct.unpack_from("<qQ", mm, COMM_OFFSET)
        n = min(count, COMM_RING)
        ring = struct.unpack_from(f"<{2 * COMM_RING}Q", mm, COMM_OFFSET + 16)
        intervals = sorted((ring[2 * i] / 1e9, ring[2 * i + 1] / 1e9) for i in range(n) if ring[2 * i + 1])
        commits = sorted(self._header(k)[7] / 1e9 for k in range(len(self._maps)) if self._header(k)[7])
        if inflight and commits and time.time() - commits[-1] > STALE_MARKS:
            inflight = 0  # no commit for that long: the worker is gone or stuck, its count means nothing
        return max(inflight, 0), intervals, commits

    def committed_at(self) -> float:
        """Wall-clock seconds of the newest commit into these slots (0.0: none yet)."""
        return max((self._header(k)[7] for k in range(len(self._maps))), default=0) / 1e9

    def set_replicated(self, version: int) -> None:
        """Daemon side: the newest version every holder of this rank has (0: none, or forgotten)."""
        try:
            struct.pack_into("<Q", self._maps[0], REPLICATED_OFFSET, version)
        except (IndexError, ValueError):  # closed (the job was dropped) while a push was finishing
            pass

    def replicated(self) -> int:
        """Worker side: what the daemon last wrote with ``set_replicated``."""
        return struct.unpack_from("<Q", self._maps[0], REPLICATED_OFFSET)[0] if self._maps else 0

    def record_restore(self, version: int, steps_lost: int, seconds: float, entry_seconds: float) -> None:
        """Worker side: a restore of this rank to ``version``, for the daemon's metrics and ``ffstate status``."""
        count = RESTORE.unpack_from(self._maps[0], RESTORE_OFFSET)[0]
        RESTORE.pack_into(self._maps[0], RESTORE_OFFSET, count + 1, version, steps_lost, seconds, entry_seconds)

    def restore_record(self) -> tuple[int, int, int, float, float]:
        """(restores, and the newest one's version, steps lost, seconds, seconds from entry); all 0 for none."""
        return RESTORE.unpack_from(self._maps[0], RESTORE_OFFSET) if self._maps else (0, 0, 0, 0.0, 0.0)

    def set_profiled_timeline(self, timeline: ProfiledTimeline) -> None:
        """Worker side: the training's collectives as a few profiled steps showed them, for the scheduler."""
        mm = self._maps[0]
        intervals = timeline.intervals[:TIMELINE_MAX]
        struct.pack_into("<Q", mm, TIMELINE_OFFSET, 0)  # none while it is rewritten
        if intervals:
            struct.pack_into(f"<{2 * len(intervals)}d", mm, TIMELINE_OFFSET + TIMELINE.size,
                             *(x for pair in intervals for x in pair))
        TIMELINE.pack_into(mm, TIMELINE_OFFSET, 0, len(intervals), timeline.period)
        struct.pack_into("<Q", mm, TIMELINE_OFFSET, timeline.steps)

    def profiled_timeline(self) -> ProfiledTimeline | None:
        """What ``set_profiled_timeline`` wrote (None: nothing, or nothing sane)."""
        if not self._maps:
            return None
        steps, n, period = TIMELINE.unpack_from(self._maps[0], TIMELINE_OFFSET)
        if not steps or n > TIMELINE_MAX or not period > 0:
            return None
        flat = struct.unpack_from(f"<{2 * n}d", self._maps[0], TIMELINE_OFFSET + TIMELINE.size)
        return ProfiledTimeline(steps, period, tuple(zip(flat[::2], flat[1::2])))

    def razor_counters(self) -> tuple[int, int]:
        return struct.unpack_from("<QQ", self._maps[0], RAZOR_OFFSET) if self._maps else (0, 0)

    def record_checksum(self, view: "SlotView", checksum: int) -> None:
        """Daemon side: records the checksum of the slot's data, computed while ``unchanged(view)``."""
        mm = self._maps[view.index]
        struct.pack_into("<Q", mm, CHECKED_OFFSET + 8, checksum)
        struct.pack_into("<Q", mm, CHECKED_OFFSET, view.seq)

    # ------------------------------------------------------------ worker side

    def commit(self, state: Any, version: int, wait: float = 0.0) -> None:
        """Packs ``state`` into the older slot and publishes it as ``version`` (one copy, no checksum).

        Once this returns, the snapshot survives this process's death. With ``wait`` > 0, first waits
        (at most that many seconds) until the daemon has read the version the older slot holds, so
        that no version is skipped (the lag policy ``block``); past it, the version is skipped, a
        warning logged, and ``self.wait_timed_out`` set (is the daemon alive?).

        Raises:
            SlotError: ``version`` is not newer than the newest committed one.
            CodecError: the state's layout is not the one the slots were made for.
        """
        done = self.committed()
        if done and version <= done[0][0]:
            raise SlotError(f"commit of version {version}, but version {done[0][0]} is already committed: "
                            "versions (training steps) must increase")
        k = 1 - done[0][1] if done else 0
        self.wait_timed_out = wait > 0 and not self._wait_taken(k, wait)
        seq = self._seq(k)
        self._set_seq(k, seq + 1 if seq % 2 == 0 else seq + 2)  # odd: being written
        if self._targets[k] is None:
            self._targets[k] = codec.pack_targets(self.data[k], self.manifest)
        snap = codec.pack_into(state, self.data[k], self.manifest, checksum=False, targets=self._targets[k])
        scalars = json.dumps(list(snap.manifest.scalars), separators=(",", ":")).encode()
        if len(scalars) > self.scalars_capacity:
            raise SlotError(f"the state's scalars take {len(scalars)} bytes of JSON, the slot has room for "
                            f"{self.scalars_capacity}; attach with a larger scalars_capacity")
        mm = self._maps[k]
        start = PAGE
        mm[start : start + len(scalars)] = scalars
        magic, seq_odd, _, _, _, nbytes, cap, _, lid = self._header(k)
        HEADER.pack_into(mm, 0, magic, seq_odd, version, 0, len(scalars), nbytes, cap, time.time_ns(), lid)
        self._set_seq(k, seq_odd + 1)  # even: committed
        self.ring()

    def ring(self) -> None:
        """Worker side: tells the daemon a version was just committed, so that it takes it now (a few
        microseconds). Best effort: a daemon gone or too busy to read its rings finds the slot at its
        next look."""
        if self._bell is None:
            return
        if self._bell_socket is None:
            self._bell_socket = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            self._bell_socket.setblocking(False)
        try:
            self._bell_socket.sendto(self._bell[1], self._bell[0])
        except OSError:  # no such socket (the daemon died), or its queue is full
            pass

    def discard_newer(self, version: int) -> None:
        """Un-commits every slot newer than ``version`` (the job stepped back to it: those steps are redone)."""
        for v, k in self.committed():
            if v > version:
                self._set_seq(k, self._seq(k) + 1)  # odd: not committed, and a reader mid-way sees the change

    def _wait_taken(self, k: int, wait: float) -> bool:
        """Waits until the daemon has read slot k's version; False if it did not within ``wait`` seconds."""
        _, seq, old, *_ = self._header(k)
        if not seq or seq % 2 or self.taken(k) >= old:
            return True
        deadline = time.monotonic() + wait
        while self.taken(k) < old:
            if time.monotonic() > deadline:
                log.warning("the daemon has not read version %d of %s in %.1fs; overwriting it (that version will "
                            "not be replicated)", old, self.paths[k], wait)
                return False
            time.sleep(0.0005)
        return True

    # ------------------------------------------------------------ daemon side

    def latest(self) -> SlotView | None:
        """The newest committed slot, or None. Check ``unchanged(view)`` after using its data."""
        for _, k in self.committed():
            view = self._view(k)
            if view is not None:
                return view
        return None

    def _view_of(self, version: int) -> SlotView | None:
        for v, k in self.committed():
            if v == version:
                return self._view(k)
        return None

    def view(self, k: int) -> SlotView | None:
        return self._view(k)

    def _view(self, k: int) -> SlotView | None:
        """Slot k as read now, if it is committed and stayed so while its header was read."""
        _, seq, version, _, slen, *_ = self._header(k)
        if seq % 2 or slen > self.scalars_capacity:
            return None
        checked, checksum = struct.unpack_from("<QQ", self._maps[k], CHECKED_OFFSET)
        raw = bytes(self._maps[k][PAGE : PAGE + slen])
        if self._seq(k) != seq:
            return None
        try:
            scalars = json.loads(raw)
        except ValueError:
            return None
        return SlotView(k, seq, version, checksum if checked == seq else None, scalars, self.data[k])

    def unchanged(self, view: SlotView) -> bool:
        """True while the worker has not started rewriting the slot ``view`` came from."""
        return self._seq(view.index) == view.seq

    def read(self, version: int, take: Callable[[SlotView], Any], summed: bool = False) -> tuple[SlotView, Any] | None:
        """``take(view)`` of the committed slot holding ``version`` (0: the newest), verified.

        ``take`` gets the slot's view (its ``data`` is the slot's bytes, no copy) and must copy what
        it keeps. The slot's checksum is checked against the daemon's record of it (computed here
        when there is none yet); the result counts only if the worker did not start rewriting the
        slot meanwhile, else it is read again. With ``summed``, ``take`` returns what it keeps and the
        checksum of ``view.data``, computed as it copied (``codec.unpack_verified``): one pass, not two.
        None when no committed slot holds ``version``.

        Raises:
            SlotError: the slot's bytes do not match the daemon's checksum (memory corrupted), or the
                writer keeps rewriting the slot.
        """
        for _ in range(100):
            view = self.latest() if not version else self._view_of(version)
            if view is None:
                return None
            if summed:
                got, checksum = take(view)
            else:
                got = take(view)
                checksum = codec.buffer_checksum(view.data)
            if not self.unchanged(view):
                continue
            if view.checksum is not None and checksum != view.checksum:
                raise SlotError(f"version {view.version} in {self.paths[view.index]} has checksum {checksum:016x}, "
                                f"the daemon recorded {view.checksum:016x}: the slot's memory is corrupted")
            return SlotView(view.index, view.seq, view.version, checksum, view.scalars, view.data), got
        raise SlotError(f"could not read a stable copy of {self.paths}: the writer keeps rewriting them")

    def copy_latest(self, version: int = 0) -> tuple[int, codec.Snapshot] | None:
        """(version, a verified private copy) of the newest committed slot, or of ``version`` if given."""
        got = self.read(version, lambda view: view.data.clone())
        if got is None:
            return None
        view, buf = got
        return view.version, codec.Snapshot(self.manifest.with_scalars(view.scalars), buf, view.checksum)
