"""The header page of a shared-memory slot, declared once as a structure (docs/design.md section 4).

Every field a worker or its daemon reads or writes through the slot is a named field of ``Header``
(a ``ctypes`` structure laid over the slot's first page), with the side that writes it. Fields are
8-byte aligned, so each load and store of a u64 field is one machine access; on x86-64 stores land
in program order (TSO), which the seqlock relies on: the header's ``seq`` is written last when a
version is published and read first and last by a reader.
"""

from __future__ import annotations

import ctypes

MAGIC = b"FFSLOT01"
PAGE = 4096
COMM_RING = 48  # (start, end) pairs of the newest collectives a worker marked
BELL_NAME_MAX = 256  # bytes of the doorbell's name (a Unix socket's abstract address has room for 107)
TIMELINE_MAX = 64  # intervals of a profiled timeline the header holds
STACKS_PATH_MAX = 512  # bytes of the path a worker's stacks are written to

_u64, _i64, _f64 = ctypes.c_uint64, ctypes.c_int64, ctypes.c_double


class Interval(ctypes.LittleEndianStructure):
    _fields_ = [("start", _u64), ("end", _u64)]  # ns, wall clock


class Span(ctypes.LittleEndianStructure):
    _fields_ = [("start", _f64), ("end", _f64)]  # seconds from a step's commit


class Header(ctypes.LittleEndianStructure):
    """Slot k's first page. "worker" / "daemon": the only side that writes the field; "slot 0": read and
    written in the first slot's header only (per rank, not per version)."""

    _fields_ = [
        # Written when the daemon creates the slots.
        ("magic", ctypes.c_char * 8),
        # The seqlock (worker): odd while the slot is written, even once version and scalars are in place.
        ("seq", _u64),
        ("version", _u64),  # worker: the step this slot holds
        ("daemon_pid", _u64),  # daemon: its process, so that the node's next daemon reclaims a killed one's slots
        ("scalars_len", _u64),  # worker: bytes of the scalars' JSON after the header page
        ("data_bytes", _u64),  # daemon: the packed state's size (the manifest's nbytes)
        ("scalars_capacity", _u64),  # daemon: room for the scalars' JSON
        ("commit_ns", _u64),  # worker: wall-clock time of the commit
        ("layout_id", ctypes.c_char * 32),  # daemon: the manifest's layout id
        ("_pad0", ctypes.c_char * 32),
        # Daemon: the version it has finished reading from this slot (a block-policy worker waits for it).
        ("taken", _u64),
        # Daemon: the checksum of the slot's data (written first) and the seq of the write it belongs to
        # (written last): a rewrite of the slot, even of the same version after a step back, never pairs with an
        # older write's checksum.
        ("checked_seq", _u64),
        ("checksum", _u64),
        # Worker: how long the step this slot's commit ends was held by the lag policy (the hold after the previous
        # commit), ns: the watchdog does not count it as the rank's compute (a held rank is not a straggler).
        ("held_ns", _u64),
        # Worker (every slot): the razor's verification counters, for the daemon's reports.
        ("razor_verifications", _u64),
        ("razor_mismatches", _u64),
        # Worker, slot 0: collectives on the wire now, the ring's write count, and the ring (see scheduling/marks.py).
        ("comm_inflight", _i64),
        ("comm_count", _u64),
        ("comm_ring", Interval * COMM_RING),
        # Daemon, slot 0: the newest version every holder of this rank that answers has (the worker's lag check).
        ("replicated", _u64),
        # Worker, slot 0: wall-clock ns since its commit is held until replication catches up (policy block;
        # 0: not held). The other ranks then wait for it in their collectives: the daemon's pacer must not.
        ("lag_held_ns", _u64),
        # Daemon, slot 0: how many of this rank's holders lack its newest version and did not answer the last
        # push (down, or their node lost): the block policy does not hold a commit for them (lag.py).
        ("holders_down", _u64),
        ("_pad2", ctypes.c_char * 40),
        # Daemon, slot 0 (at creation): its doorbell, as this rank's id there, the name's length, the name.
        ("bell_id", _u64),
        ("bell_len", ctypes.c_uint16),
        ("bell_name", ctypes.c_char * BELL_NAME_MAX),
        ("_pad3", ctypes.c_char * 6),
        # Worker, slot 0 (at attach after a restore): restores so far, then the newest one's v*, steps lost,
        # seconds to fetch and load, seconds from the process's entry.
        ("restores", _u64),
        ("restore_version", _u64),
        ("restore_steps_lost", _u64),
        ("restore_seconds", _f64),
        ("restore_entry_seconds", _f64),
        # Worker, slot 0 (once): the profiled timeline (scheduling/profiling.py). ``timeline_steps`` is written last and
        # cleared first: 0 reads as none.
        ("timeline_steps", _u64),
        ("timeline_count", _u64),
        ("timeline_period", _f64),
        ("timeline", Span * TIMELINE_MAX),
        # Worker, slot 0 (at attach): its process, so that its node's daemon can ask it for its stacks (SIGUSR1) and
        # kill it when it hangs (watchdog.py); the wall-clock time of its last sign of life other than a commit
        # (the attach, the end of a declared pause); the end of a declared pause in progress (0: none); the file
        # its stacks go to.
        ("worker_pid", _u64),
        ("alive_ns", _u64),
        ("paused_until_ns", _u64),
        ("stacks_len", _u64),
        ("stacks_path", ctypes.c_char * STACKS_PATH_MAX),
        # Worker, slot 0 (at attach after a restore): the world size the newest restore's copies were made at (0: this
        # run's own; else the job was resized, ffstate/elastic/).
        ("restore_from_world", _u64),
        # Daemon, slot 0: wall-clock ns of a drain of this node (ffstate drain; 0: none): the worker stops at its next
        # commit. Worker, slot 0: the step it stopped at (0: not stopped).
        ("drain_ns", _u64),
        ("drained_version", _u64),
        # Worker, slot 0: its commits since it attached (the watchdog's warm-up counts commits, not its looks).
        ("commit_count", _u64),
        # Worker, slot 0: how long its newest commit held the training loop, seconds (the metrics' commit time).
        ("commit_seconds", _f64),
    ]


assert ctypes.sizeof(Header) <= PAGE, "the header must fit its page"
assert Header.seq.offset == 8 and Header.taken.offset == 128 and Header.comm_inflight.offset == 176


def header_of(buffer) -> Header:
    """The header laid over a writable buffer (a slot's mmap). Drop it before closing the mapping."""
    return Header.from_buffer(buffer)
