"""An encoded version as it travels: chunk 0 is the JSON header, chunks 1.. are segments of the packed
buffer, each with its checksum (docs/wire-format.md); and the checks a received chunk list passes
before anything is decoded (complete, in order, one version's, every checksum right: docs/design.md I6)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from ffstate import checksum
from ffstate.codec.backend import POOL_MIN_BYTES, _map
from ffstate.codec.host import Buffer
from ffstate.errors import CodecError
from ffstate.layout import Manifest

# 3: XXH3 checksums. Refused, saying what to do: 2 (checksums of 64-bit words mixed one by one), 1 (byte planes
# before python-blosc2).
FORMAT = 5  # 5: a segment that does not compress is stored (4: every segment a blosc2 stream; 3: XOR deltas)
# One encoded segment before compaction: 1 MiB, the best of the chunk sizes `ffstate bench bandwidth` sweeps (min of
# gRPC push and fetch throughput on loopback); per-chunk costs are noise at that size and a resend is cheap.
DEFAULT_CHUNK_BYTES = 1 << 20
MIN_CHUNK_BYTES, MAX_CHUNK_BYTES = 4 << 10, 1 << 30
# Bytes each chunk costs on the wire beside its payload: index, count (u32 each) and checksum (u64).
CHUNK_OVERHEAD = 16
MAX_HEADER_BYTES = 256 << 20


@dataclass(frozen=True)
class Chunk:
    """One unit of an encoded version: ``payload`` is bytes-like, ``checksum`` covers it."""

    index: int
    count: int
    checksum: int
    payload: memoryview

    @staticmethod
    def of(index: int, count: int, payload: np.ndarray | bytes) -> "Chunk":
        arr = np.frombuffer(payload, dtype=np.uint8) if isinstance(payload, bytes) else payload
        return Chunk(index, count, checksum.checksum(arr), memoryview(arr).cast("B"))


@dataclass(frozen=True)
class Snapshot:
    """A packed state: its manifest, the flat uint8 buffer (a tensor on the training's side, a NumPy array in the
    daemon: ``host.py``), and the buffer's checksum (None: not computed)."""

    manifest: Manifest
    buffer: Buffer
    checksum: int | None


@dataclass
class Packed:
    """An encoded version: chunk 0 is the header (JSON), chunks 1.. are segments of the buffer.

    ``nbytes`` is what goes on the wire; ``raw_nbytes`` is the size of the snapshot it restores.
    """

    chunks: list[Chunk]
    _header: dict | None = field(default=None, repr=False)

    @property
    def header(self) -> dict:
        if self._header is None:
            self._header = _parse_header(self.chunks)
        return self._header

    @property
    def kind(self) -> str:
        return self.header["kind"]

    @property
    def nbytes(self) -> int:
        return sum(len(c.payload) + CHUNK_OVERHEAD for c in self.chunks)

    @property
    def raw_nbytes(self) -> int:
        return int(self.header["nbytes"])

    @property
    def checksum(self) -> int:
        return int(self.header["checksum"], 16)

    @property
    def base_checksum(self) -> int | None:
        b = self.header.get("base_checksum")
        return None if b is None else int(b, 16)

    @property
    def ratio(self) -> float:
        return self.raw_nbytes / max(1, self.nbytes)


def _verify_chunk(c: Chunk) -> None:
    got = checksum.checksum(c.payload)
    if got != c.checksum:
        raise CodecError(other_format(c) or
                         f"chunk {c.index} of {c.count} is corrupted: checksum {got:016x}, expected {c.checksum:016x}")


def other_format(c: Chunk) -> str | None:
    """What to say when a header chunk fails its checksum because an ffstate of another wire format sent it (its
    checksums are of another kind): None when it is not such a header."""
    if c.index != 0 or len(c.payload) > MAX_HEADER_BYTES:
        return None
    try:
        fmt = json.loads(bytes(c.payload)).get("format")
    except (ValueError, AttributeError, RecursionError):
        return None
    if not isinstance(fmt, int) or fmt == FORMAT:
        return None
    return (f"wire format {fmt} is not supported by this ffstate (format {FORMAT}): an ffstate of another version "
            "sent it; run one version on every node")


def segments(manifest: Manifest, chunk_bytes: int) -> list[tuple[int, int, int]]:
    """(byte offset, element count, itemsize) of every segment, in chunk order."""
    out = []
    for g in manifest.groups:
        step = max(1, chunk_bytes // g.itemsize) * g.itemsize
        for start in range(g.offset, g.offset + g.nbytes, step):
            nbytes = min(step, g.offset + g.nbytes - start)
            out.append((start, nbytes // g.itemsize, g.itemsize))
    return out


def segment_count(manifest: Manifest, chunk_bytes: int) -> int:
    """``len(segments(manifest, chunk_bytes))``, by arithmetic: checking a version's chunk count costs nothing
    in proportion to the size its manifest claims."""
    total = 0
    for g in manifest.groups:
        step = max(1, chunk_bytes // g.itemsize) * g.itemsize
        total += -(-g.nbytes // step)
    return total


def _check_segment_count(chunks: Sequence[Chunk], manifest: Manifest, chunk_bytes: int) -> None:
    need = segment_count(manifest, chunk_bytes)
    if len(chunks) - 1 != need:
        raise CodecError(f"version has {len(chunks) - 1} segment chunks, its manifest needs {need}")


def verify_chunks(chunks: Sequence[Chunk]) -> None:
    """Checks a received chunk list: complete, in order, one version's, every checksum right.

    Raises:
        CodecError: naming the first chunk that is missing, out of place or corrupted.
    """
    if not chunks:
        raise CodecError("empty chunk list: a version has at least its header chunk")
    count = chunks[0].count
    if len(chunks) != count:
        raise CodecError(f"truncated or padded chunk list: {len(chunks)} chunks, the version has {count}")
    for i, c in enumerate(chunks):
        if c.index != i or c.count != count:
            raise CodecError(f"chunk {i} of {count} claims to be chunk {c.index} of {c.count}: reordered or foreign")
    _map(_verify_chunk, chunks, inline=sum(len(c.payload) for c in chunks) < POOL_MIN_BYTES)


def _parse_header(chunks: Sequence[Chunk]) -> dict:
    """Parses and validates chunk 0, the JSON header (``verify_chunks`` checks the list itself)."""
    if not chunks:
        raise CodecError("empty chunk list: a version has at least its header chunk")
    if len(chunks[0].payload) > MAX_HEADER_BYTES:
        raise CodecError(f"header chunk of {len(chunks[0].payload)} bytes exceeds {MAX_HEADER_BYTES}")
    try:
        header = json.loads(bytes(chunks[0].payload))
    except (ValueError, RecursionError) as e:  # RecursionError: nesting deeper than the parser's stack
        raise CodecError(f"malformed header chunk: not JSON ({type(e).__name__})") from None
    if not isinstance(header, dict):
        raise CodecError(f"malformed header chunk: a JSON {type(header).__name__}, not an object")
    kind, fmt = header.get("kind"), header.get("format")
    if fmt != FORMAT:
        raise CodecError(f"wire format {str(fmt)[:20]} is not supported by this ffstate (format {FORMAT})"
                         + ("; an ffstate of another version sent it: run one version on every node"
                            if isinstance(fmt, int) and 0 < fmt < FORMAT else ""))
    if kind not in ("full", "delta"):
        raise CodecError(f"malformed header: kind {str(kind)[:20]!r}")
    fields = {"checksum": (_hex64, "the version's checksum"), "nbytes": (_count, "its size"),
              "chunk_bytes": (_count, "its segment size"), "layout_id": (_short_str, "its layout id"),
              **({"manifest": (dict, "a full version's manifest")} if kind == "full" else
                 {"scalars": (list, "a delta's scalars"), "base_checksum": (_hex64, "a delta's base checksum")})}
    for name, (check, what) in fields.items():
        value = header.get(name)
        if not (isinstance(value, check) if isinstance(check, type) else check(value)):
            raise CodecError(f"malformed header: {what} ({name!r}) is {'missing' if value is None else 'invalid'}")
    if not MIN_CHUNK_BYTES <= header["chunk_bytes"] <= MAX_CHUNK_BYTES:
        raise CodecError(f"malformed header: chunk_bytes {header['chunk_bytes']} is out of range")
    return header


def _hex64(value: object) -> bool:
    return isinstance(value, str) and 0 < len(value) <= 16 and all(c in "0123456789abcdefABCDEF" for c in value)


def _count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 1 << 62


def _short_str(value: object) -> bool:
    return isinstance(value, str) and len(value) <= 128
