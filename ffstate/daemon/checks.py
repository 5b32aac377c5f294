"""The checks a pushed version's chunks pass as they arrive, before anything is staged (``store.py``): the stream's
first chunk against what is held of its shard, each next one against the first, each chunk's checksum."""

from __future__ import annotations

from ffstate import checksum
from ffstate.codec import Chunk
from ffstate.codec.chunks import other_format
from ffstate.daemon.held import IncomingChunk, Replica
from ffstate.errors import ReplicaError

MAX_CHUNKS = 1 << 20  # chunks a version may have (a fetch may name as many)


def check_first(c: IncomingChunk, held: Replica | None) -> IncomingChunk:
    """A push's first chunk, against what is held of its shard (``held``)."""
    if c.version <= 0:
        raise ReplicaError(f"version must be > 0, got {c.version}", "INVALID_ARGUMENT")
    if not 0 < c.count <= MAX_CHUNKS:
        raise ReplicaError(f"chunk count {c.count} is out of range (1..{MAX_CHUNKS})", "INVALID_ARGUMENT")
    if c.base_version:
        if held is None:
            raise ReplicaError(f"version gap: {c.key} version {c.version} is a delta against version "
                               f"{c.base_version}, and nothing is held here; push a full version",
                               "FAILED_PRECONDITION")
        if held.version != c.base_version:
            raise ReplicaError(f"version gap: {c.key} version {c.version} is a delta against version "
                               f"{c.base_version}, this daemon holds version {held.version}",
                               "FAILED_PRECONDITION")
        if c.version <= c.base_version:
            raise ReplicaError(f"a delta must move forward: version {c.version} on base {c.base_version}",
                               "INVALID_ARGUMENT")
    return c


def check_next(first: IncomingChunk, c: IncomingChunk, expected: int, max_chunk_bytes: int) -> None:
    """Each next chunk of the stream, against its first: the same version, in order, within the size limit."""
    if (c.key, c.version, c.base_version, c.count) != (first.key, first.version, first.base_version, first.count):
        raise ReplicaError(f"chunk {c.index} belongs to {c.key} version {c.version} (base {c.base_version}, "
                           f"{c.count} chunks), the stream started {first.key} version {first.version} "
                           f"(base {first.base_version}, {first.count} chunks)", "INVALID_ARGUMENT")
    if c.index >= c.count:
        raise ReplicaError(f"chunk {c.index} is past the version's {c.count} chunks", "INVALID_ARGUMENT")
    if c.index < expected:
        raise ReplicaError(f"duplicate chunk {c.index} (expected chunk {expected})", "INVALID_ARGUMENT")
    if c.index != expected:
        raise ReplicaError(f"chunk {c.index} out of order: expected chunk {expected}", "INVALID_ARGUMENT")
    if len(c.payload) > max_chunk_bytes:
        raise ReplicaError(f"chunk {c.index} has {len(c.payload)} bytes, more than the limit "
                           f"{max_chunk_bytes}", "RESOURCE_EXHAUSTED")


def verify_one(chunk: Chunk) -> None:
    """The checksum of one chunk, as it arrives (the list as a whole is checked again at commit)."""
    got = checksum.checksum(chunk.payload)
    if got != chunk.checksum:
        if (why := other_format(chunk)) is not None:
            raise ReplicaError(why, "INVALID_ARGUMENT")
        raise ReplicaError(f"chunk {chunk.index} of {chunk.count} is corrupted: checksum {got:016x}, expected "
                           f"{chunk.checksum:016x}", "DATA_LOSS")
