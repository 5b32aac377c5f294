"""Shared-memory snapshot slots between a worker and its node's daemon (docs/design.md section 4, I2).

The daemon creates two slot files per local rank under /dev/shm (a double buffer) and owns them, so
a snapshot outlives the worker that wrote it. A slot is a page of header (``header.Header``), an area
for the state's scalars (JSON), and the packed state's bytes. The worker writes the older slot and
publishes it with a seqlock: the sequence number is odd while the slot is being written and even once
its version and scalars are in place. A reader takes a slot only when its sequence number is even and
unchanged across the read, so a worker killed mid-write leaves that slot unreadable and the other slot
(the previous version) intact. The daemon, in turn, marks a slot *taken* once it has read its version;
a worker on the ``block`` lag policy waits for that mark before it overwrites the slot, so no version
escapes replication.

Slots hand out bytes and never encode them: the worker packs its state into ``data[k]`` between
``begin`` and ``publish`` (``ffstate.commit``), and readers decode what ``read`` hands them. The
worker does not checksum what it writes: the daemon checksums a slot when it takes it, off the
training path, and records the sum in the header; a reader verifies the slot against that record,
and computes the sum itself, under the seqlock, when the daemon has not taken the slot yet. The
seqlock, not the checksum, is what rules out a torn slot.
"""

from __future__ import annotations

import ctypes
import json
import logging
import mmap
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np

from ffstate.errors import SlotError
from ffstate.ids import check_id
from ffstate.layout import Manifest
from ffstate.scheduling.profiling import ProfiledTimeline
from ffstate.shm.doorbell import Bell
from ffstate.shm.marks import MarksReader
from ffstate.shm.header import BELL_NAME_MAX, MAGIC, PAGE, TIMELINE_MAX, Header, header_of
from ffstate.shm.worker import WorkerFields, WorkerRecord  # noqa: F401 (WorkerRecord: re-exported)

log = logging.getLogger("ffstate.shm")

SHM_DIR = Path(os.environ.get("FFSTATE_SHM_DIR", "/dev/shm"))
DEFAULT_SCALARS_CAPACITY = 1 << 20


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
            head = Header(magic=MAGIC, data_bytes=manifest.nbytes, scalars_capacity=scalars_capacity,
                          layout_id=manifest.layout_id.encode(), daemon_pid=os.getpid())
            if bell is not None and k == 0:
                name = bell[0].encode()[:BELL_NAME_MAX]
                head.bell_id, head.bell_len, head.bell_name = bell[1], len(name), name
            os.pwrite(fd, bytes(head), 0)
        finally:
            os.close(fd)


def reclaim(node_id: str) -> list[Path]:
    """Removes the slot files of node ``node_id`` whose daemon is no longer alive (one SIGKILLed leaves them in
    /dev/shm, which is memory, until the machine reboots); returns what it removed. A live daemon's are kept."""
    gone = []
    for path in sorted(SHM_DIR.glob(f"ffstate-{check_id(node_id, 'node id')}-*")):
        try:
            with open(path, "rb") as f:
                raw = f.read(ctypes.sizeof(Header))
        except OSError:
            continue
        if len(raw) < ctypes.sizeof(Header) or raw[:8] != MAGIC:
            continue
        pid = Header.from_buffer_copy(raw).daemon_pid
        if pid and not _alive(pid):
            path.unlink(missing_ok=True)
            gone.append(path)
    return gone


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    return True


def remove_slots(paths: list[Path]) -> None:
    for path in paths:
        path.unlink(missing_ok=True)


@dataclass(frozen=True)
class SlotView:
    """A committed slot as read: valid while ``Slots.unchanged(view)`` says so."""

    index: int
    seq: int
    version: int
    checksum: int | None  # as recorded by the daemon; None until it has taken the slot
    scalars: list
    data: Any  # uint8 view of the slot's bytes, no copy: a tensor (the worker's) or a NumPy array (the daemon's)


def _as_tensor(view: np.ndarray) -> Any:
    import torch  # the worker's side only: the daemon runs without torch
    return torch.from_numpy(view)


class Slots(WorkerFields):
    """The two slots of one rank, mapped here: ``data`` views them as uint8 tensors, or NumPy arrays (``tensors=False``)."""

    def __init__(self, paths: list[Path], manifest: Manifest, tensors: bool = True):
        self.paths = [Path(p) for p in paths]
        self.manifest = manifest
        self._maps: list[mmap.mmap] = []
        self.headers: list[Header] = []
        self.data: list[Any] = []
        self.wait_timed_out = False
        self._marks = MarksReader()
        for path in self.paths:
            try:
                fd = os.open(path, os.O_RDWR)
            except FileNotFoundError as e:
                raise SlotError(f"slot {path} does not exist: is the node's ffstate daemon running?") from e
            try:
                mm = mmap.mmap(fd, os.fstat(fd).st_size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            finally:
                os.close(fd)
            head = header_of(mm)
            if head.magic != MAGIC or head.data_bytes != manifest.nbytes or head.layout_id.decode() != manifest.layout_id:
                found = head.layout_id.decode(errors="replace"), head.data_bytes
                del head
                mm.close()
                raise SlotError(f"slot {path} holds another layout ({found[0]!r}, {found[1]} bytes); "
                                f"this state is {manifest.layout_id!r}, {manifest.nbytes} bytes")
            self._maps.append(mm)
            self.headers.append(head)
            self.scalars_capacity = head.scalars_capacity
            start = PAGE + _round_up(head.scalars_capacity)
            view = np.frombuffer(mm, np.uint8, manifest.nbytes, start) if manifest.nbytes else np.empty(0, np.uint8)
            self.data.append(_as_tensor(view) if tensors else view)
        self._bell: Bell | None = None  # the daemon's doorbell, if it has one
        if self.headers:
            h = self.headers[0]
            if h.bell_id and 0 < h.bell_len <= BELL_NAME_MAX:
                self._bell = Bell(h.bell_name[: h.bell_len].decode(errors="replace"), h.bell_id)

    def close(self) -> None:
        if self._bell is not None:
            self._bell.close()
        self.headers.clear()  # they export the mappings' buffers: dropped before the mappings close
        self.data.clear()
        for mm in self._maps:
            try:
                mm.close()
            except BufferError:  # a view of `data` is still alive somewhere: the mapping goes with the last one
                pass
        self._maps.clear()

    # ------------------------------------------------------------ both sides

    def committed(self, ascending: bool = False) -> list[tuple[int, int]]:
        """(version, slot) of each committed slot, newest first (or oldest first)."""
        out = [(h.version, k) for k, h in enumerate(self.headers) if h.seq and h.seq % 2 == 0]
        return sorted(out, reverse=not ascending)

    def taken(self, k: int) -> int:
        return self.headers[k].taken

    def committed_at(self) -> float:
        """Wall-clock seconds of the newest commit into these slots (0.0: none yet)."""
        return max((h.commit_ns for h in self.headers), default=0) / 1e9

    def replicated(self) -> int:
        """What the daemon last wrote with ``set_replicated``: the newest version every holder that answers has."""
        return self.headers[0].replicated if self.headers else 0

    def restore_record(self) -> tuple[int, int, int, float, float, int]:
        """(restores, and the newest one's version, steps lost, seconds, seconds from entry, world size its copies
        were made at (0: this run's)); all 0 for none."""
        if not self.headers:
            return 0, 0, 0, 0.0, 0.0, 0
        h = self.headers[0]
        return (h.restores, h.restore_version, h.restore_steps_lost, h.restore_seconds, h.restore_entry_seconds,
                h.restore_from_world)

    def razor_counters(self) -> tuple[int, int]:
        return (self.headers[0].razor_verifications, self.headers[0].razor_mismatches) if self.headers else (0, 0)

    def profiled_timeline(self) -> ProfiledTimeline | None:
        """What ``set_profiled_timeline`` wrote (None: nothing, or nothing sane)."""
        if not self.headers:
            return None
        h = self.headers[0]
        steps, n, period = h.timeline_steps, h.timeline_count, h.timeline_period
        if not steps or n > TIMELINE_MAX or not period > 0:
            return None
        return ProfiledTimeline(steps, period, tuple((s.start, s.end) for s in h.timeline[:n]))

    # ------------------------------------------------------------ worker side

    def begin(self, version: int, wait: float = 0.0) -> int:
        """Opens the older slot for ``version``: returns its index k, whose ``data[k]`` the worker fills and then
        ``publish``es. With ``wait`` > 0, first waits (at most that long) until the daemon has read the version
        the slot holds, so that none is skipped (the lag policy ``block``); past it, that version is skipped, a
        warning logged, and ``wait_timed_out`` set (is the daemon alive?).

        Raises:
            SlotError: ``version`` is not newer than the newest committed one.
        """
        done = self.committed()
        if done and version <= done[0][0]:
            raise SlotError(f"commit of version {version}, but version {done[0][0]} is already committed: "
                            "versions (training steps) must increase")
        k = 1 - done[0][1] if done else 0
        self.wait_timed_out = wait > 0 and not self._wait_taken(k, wait)
        h = self.headers[k]
        h.seq = h.seq + 1 if h.seq % 2 == 0 else h.seq + 2  # odd: being written
        return k

    def encode_scalars(self, scalars: list) -> bytes:
        """The state's scalars as the slot keeps them (JSON); SlotError if they do not fit its room for them."""
        raw = json.dumps(list(scalars), separators=(",", ":")).encode()
        if len(raw) > self.scalars_capacity:
            raise SlotError(f"the state's scalars take {len(raw)} bytes of JSON, the slot has room for "
                            f"{self.scalars_capacity}; attach with a larger scalars_capacity")
        return raw

    def publish(self, k: int, version: int, scalars: list | bytes, held_ns: int | None = None) -> None:
        """Publishes slot k, filled since ``begin``, as ``version`` with the state's ``scalars`` (the manifest's, or
        ``encode_scalars`` of them): once this returns, the snapshot survives this process's death. Then rings the
        daemon's doorbell. ``held_ns``: what ``take_held`` gave when the commit began (default: taken now)."""
        raw = scalars if isinstance(scalars, bytes) else self.encode_scalars(scalars)
        self._maps[k][PAGE : PAGE + len(raw)] = raw
        h = self.headers[k]
        held = self.take_held() if held_ns is None else held_ns
        h.version, h.scalars_len, h.commit_ns, h.held_ns = version, len(raw), time.time_ns(), held
        h.seq += 1  # even: committed
        self.headers[0].commit_count += 1
        if self._bell is not None:
            self._bell.ring()

    def discard_newer(self, version: int) -> None:
        """Un-commits every slot newer than ``version`` (the job stepped back to it: those steps are redone)."""
        for v, k in self.committed():
            if v > version:
                self.headers[k].seq += 1  # odd: not committed, and a reader mid-way sees the change

    def set_razor_counters(self, verifications: int, mismatches: int) -> None:
        """The razor's verification counters, which the daemon reports (``ffstate status``)."""
        for h in self.headers:
            h.razor_verifications, h.razor_mismatches = verifications, mismatches

    def record_restore(self, version: int, steps_lost: int, seconds: float, entry_seconds: float,
                       from_world: int = 0) -> None:
        """A restore of this rank to ``version`` (``from_world``: the world size of its copies, if not this run's), for
        the daemon's metrics and ``ffstate status``."""
        h = self.headers[0]
        h.restore_version, h.restore_steps_lost = version, steps_lost
        h.restore_seconds, h.restore_entry_seconds, h.restore_from_world = seconds, entry_seconds, from_world
        h.restores += 1

    def set_profiled_timeline(self, timeline: ProfiledTimeline) -> None:
        """The training's collectives as a few profiled steps showed them, for the scheduler."""
        h = self.headers[0]
        intervals = timeline.intervals[:TIMELINE_MAX]
        h.timeline_steps = 0  # none while it is rewritten
        for i, (start, end) in enumerate(intervals):
            h.timeline[i].start, h.timeline[i].end = start, end
        h.timeline_count, h.timeline_period = len(intervals), timeline.period
        h.timeline_steps = timeline.steps

    def _wait_taken(self, k: int, wait: float) -> bool:
        """Waits until the daemon has read slot k's version; False if it did not within ``wait`` seconds."""
        h = self.headers[k]
        old = h.version
        if not h.seq or h.seq % 2 or h.taken >= old:
            return True
        deadline = time.monotonic() + wait
        while h.taken < old:
            if time.monotonic() > deadline:
                log.warning("the daemon has not read version %d of %s in %.1fs; overwriting it (that version will "
                            "not be replicated)", old, self.paths[k], wait)
                return False
            time.sleep(0.0005)
        return True

    # ------------------------------------------------------------ daemon side

    def mark_taken(self, view: SlotView) -> None:
        """The slot's version is read; the worker may overwrite it."""
        self.headers[view.index].taken = view.version

    def record_checksum(self, view: SlotView, checksum: int) -> None:
        """Records the checksum of the slot's data, computed while ``unchanged(view)``."""
        h = self.headers[view.index]
        h.checksum = checksum
        h.checked_seq = view.seq

    def set_replicated(self, version: int, holders_down: int = 0) -> None:
        """The newest version every holder of this rank that answers has (0: none, or forgotten), and how many of
        the holders that lack the newest version are down (written only where none answers: ``daemon/shard.py``)."""
        try:
            self.headers[0].holders_down = holders_down
            self.headers[0].replicated = version
        except IndexError:  # closed (the job was dropped) while a push was finishing
            pass

    def holders_down(self) -> int:
        """What the daemon last wrote with ``set_replicated``: lagging holders that did not answer its last push."""
        return self.headers[0].holders_down if self.headers else 0

    def comm_marks(self) -> tuple[int, list[tuple[float, float]], list[float]]:
        """(collectives in flight, recent (start, end) times, the two newest commit times), seconds
        (``shm.marks.MarksReader``)."""
        return self._marks.read(self.headers)

    def latest(self) -> SlotView | None:
        """The newest committed slot, or None. Check ``unchanged(view)`` after using its data."""
        for _, k in self.committed():
            view = self.view(k)
            if view is not None:
                return view
        return None

    def _view_of(self, version: int) -> SlotView | None:
        for v, k in self.committed():
            if v == version:
                return self.view(k)
        return None

    def view(self, k: int) -> SlotView | None:
        """Slot k as read now, if it is committed and stayed so while its header was read."""
        h = self.headers[k]
        seq, version, slen = h.seq, h.version, h.scalars_len
        if seq % 2 or slen > self.scalars_capacity:
            return None
        checked, checksum = h.checked_seq, h.checksum
        raw = bytes(self._maps[k][PAGE : PAGE + slen])
        if h.seq != seq:
            return None
        try:
            scalars = json.loads(raw)
        except ValueError:
            return None
        return SlotView(k, seq, version, checksum if checked == seq else None, scalars, self.data[k])

    def unchanged(self, view: SlotView) -> bool:
        """True while the worker has not started rewriting the slot ``view`` came from."""
        return self.headers[view.index].seq == view.seq

    def read(self, version: int, take: Callable[[SlotView], tuple[Any, int]]) -> tuple[SlotView, Any] | None:
        """``take(view)`` of the committed slot holding ``version`` (0: the newest), verified.

        ``take`` gets the slot's view (its ``data`` is the slot's bytes, no copy), must copy what it keeps,
        and returns what it keeps and the checksum of ``view.data`` (``codec.unpack_verified`` sums as it
        copies: one pass, not two). The checksum is checked against the daemon's record (none yet: the
        reader's own sum stands); the result counts only if the worker did not start rewriting the slot
        meanwhile, else it is read again. None when no committed slot holds ``version``.

        Raises:
            SlotError: the slot's bytes do not match the daemon's checksum (memory corrupted), or the
                writer keeps rewriting the slot.
        """
        for _ in range(100):
            view = self.latest() if not version else self._view_of(version)
            if view is None:
                return None
            got, checksum = take(view)
            if not self.unchanged(view):
                continue
            if view.checksum is not None and checksum != view.checksum:
                raise SlotError(f"version {view.version} in {self.paths[view.index]} has checksum {checksum:016x}, "
                                f"the daemon recorded {view.checksum:016x}: the slot's memory is corrupted")
            return SlotView(view.index, view.seq, view.version, checksum, view.scalars, view.data), got
        raise SlotError(f"could not read a stable copy of {self.paths}: the writer keeps rewriting them")
