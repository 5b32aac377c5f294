"""Buffer <-> chunks: a snapshot encoded in full or as a delta against a base (the elements' zigzag differences,
each segment compressed by blosc2: ``segment.py``), decoded and verified end to end, applied in place onto its base,
or reverted (a delta taken off again: docs/design.md I2, I3). A failure leaves every buffer as it was. And the
state-level ``encode``/``decode`` on top. The codec runs on CPU buffers (the daemon's): a CUDA buffer is
brought to the host first."""

from __future__ import annotations

import json
from concurrent.futures import Future, wait
from typing import Any, Sequence

import numpy as np

import ffstate.codec.host as host
from ffstate.codec.segment import CODECS, apply_segment, encode_segment
from ffstate.codec.backend import POOL_MIN_BYTES, _map, _pool, buffer_checksum
from ffstate.codec.chunks import (DEFAULT_CHUNK_BYTES, FORMAT, MAX_CHUNK_BYTES, MIN_CHUNK_BYTES, Chunk, Packed,
                                  Snapshot, _check_segment_count, segments, verify_chunks)
from ffstate.codec.host import Buffer
from ffstate.errors import CodecError
from ffstate.layout import Manifest, diff_layouts
from ffstate.layout.host import empty_array


def encode_snapshot(snapshot: Snapshot, base: Snapshot | None = None, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                    codec: str = "lz4") -> Packed:
    """Encodes a snapshot as a full version, or as a delta against ``base`` (same layout); ``codec`` is
    blosc2's entropy stage: ``lz4`` (streaming: fast both ways) or ``zstd`` (smaller, slower).

    Raises:
        CodecError: ``base`` has another layout, or ``chunk_bytes`` or ``codec`` is out of range.
    """
    if codec not in CODECS:
        raise CodecError(f"codec must be one of {sorted(CODECS)}, got {codec!r}")
    if not MIN_CHUNK_BYTES <= chunk_bytes <= MAX_CHUNK_BYTES:
        raise CodecError(f"chunk_bytes must be in [{MIN_CHUNK_BYTES}, {MAX_CHUNK_BYTES}], got {chunk_bytes}")
    head, header, segs = _head(snapshot, base, chunk_bytes)
    buf = snapshot.buffer
    return Packed([head, *_encode_groups(buf, None if base is None else base.buffer, segs, head.count, codec)], header)


def encode_chunks(snapshot: Snapshot, indices: Sequence[int], chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                  codec: str = "lz4") -> Packed:
    """Chunks ``indices`` (ascending) of ``encode_snapshot(snapshot)`` (a full version), the same bytes, the others
    not encoded: a fetch of some chunks (a razor part's, or the header alone) costs what it asks for.

    Raises:
        CodecError: an index is not one of the version's chunks, or they do not ascend.
    """
    if codec not in CODECS:
        raise CodecError(f"codec must be one of {sorted(CODECS)}, got {codec!r}")
    if not MIN_CHUNK_BYTES <= chunk_bytes <= MAX_CHUNK_BYTES:
        raise CodecError(f"chunk_bytes must be in [{MIN_CHUNK_BYTES}, {MAX_CHUNK_BYTES}], got {chunk_bytes}")
    head, header, segs = _head(snapshot, None, chunk_bytes)
    if any(b <= a for a, b in zip(indices, indices[1:])) or (indices and not 0 <= indices[0] <= indices[-1] < head.count):
        raise CodecError(f"chunks named {list(indices[:3])}...{list(indices[-1:])}: chunk indices must ascend and "
                         f"stay below the version's {head.count} chunks")
    body = _encode_groups(snapshot.buffer, None, segs, head.count, codec, [i - 1 for i in indices if i])
    return Packed([head, *body] if indices and indices[0] == 0 else body, header)


def encode_started(snapshot: Snapshot, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> tuple[Chunk, dict, list[Future]]:
    """``encode_snapshot(snapshot)`` (a full version, LZ4) begun on the codec's threads: (its header chunk, the
    header, each segment's chunk as a future, in order), the same bytes; its first chunks can go out while the rest
    are made. ``snapshot``'s buffer must not change until every future is done."""
    if not MIN_CHUNK_BYTES <= chunk_bytes <= MAX_CHUNK_BYTES:
        raise CodecError(f"chunk_bytes must be in [{MIN_CHUNK_BYTES}, {MAX_CHUNK_BYTES}], got {chunk_bytes}")
    head, header, segs = _head(snapshot, None, chunk_bytes)
    data = host.array(snapshot.buffer)

    pool, futures = _pool(), []
    try:
        for i in range(len(segs)):
            futures.append(pool.submit(_segment_chunk, data, None, segs[i], i + 1, head.count, "lz4"))
    except BaseException:  # the pool shut down (the process exiting): none may read the buffer after this returns
        for f in futures:
            f.cancel()
        wait(futures)
        raise
    return head, header, futures


def _head(snapshot: Snapshot, base: Snapshot | None, chunk_bytes: int) -> tuple[Chunk, dict, list]:
    m = snapshot.manifest
    checksum = buffer_checksum(snapshot.buffer) if snapshot.checksum is None else snapshot.checksum
    header: dict[str, Any] = {
        "format": FORMAT,
        "layout_id": m.layout_id,
        "nbytes": m.nbytes,
        "checksum": f"{checksum:016x}",
        "chunk_bytes": chunk_bytes,
    }
    if base is None:
        header.update(kind="full", manifest=json.loads(m.to_json()))
    else:
        if base.manifest.layout_id != m.layout_id:
            raise CodecError(f"base has another layout than the state: {diff_layouts(m, base.manifest)}")
        header.update(kind="delta", base_checksum=f"{base.checksum:016x}", scalars=list(m.scalars))
    segs = segments(m, chunk_bytes)
    return Chunk.of(0, 1 + len(segs), json.dumps(header, separators=(",", ":")).encode()), header, segs


def decode_snapshot(
    packed: Packed,
    base: Snapshot | None = None,
    max_nbytes: int | None = None,
    device: Any = "cpu",
    inplace: bool = False,
) -> Snapshot:
    """The snapshot an encoded version restores, verified end to end; ``base`` is required for a delta.

    The result's buffer is on ``device`` for a full version (``None``: a NumPy array, the daemon's, which runs
    without torch), of the base's kind and on its device for a delta (decoded on the host, then copied there).
    With ``inplace``, a delta is applied to
    ``base.buffer`` itself (no copy of the base); if anything fails the buffer is left exactly
    as it was: the delta is taken off again (docs/design.md I2).
    ``max_nbytes`` bounds the buffer a full version may ask for (a daemon passes what its memory
    budget allows); the chunk count is checked against the manifest before anything is allocated.

    Raises:
        CodecError: a chunk is corrupted, missing, reordered or foreign; the base is missing or wrong;
            or the decoded buffer does not match the version's checksum.
    """
    verify_chunks(packed.chunks)
    header = packed.header
    if header["kind"] == "full":
        manifest = Manifest.from_json(json.dumps(header["manifest"]).encode())
        if max_nbytes is not None and manifest.nbytes > max_nbytes:
            raise CodecError(f"version needs {manifest.nbytes} bytes, more than the {max_nbytes} allowed")
        _check_segment_count(packed.chunks, manifest, header["chunk_bytes"])
        if inplace:
            raise CodecError("in-place decoding applies a delta onto its base; a full version has no base")
        out = empty_array(manifest.nbytes)  # not zeroed: every byte is a segment's (the groups tile it)
    else:
        if base is None:
            raise CodecError("this version is a delta: decoding it needs the base it was encoded against")
        if base.manifest.layout_id != header["layout_id"]:
            raise CodecError(
                f"wrong base: the delta is for layout {header['layout_id']}, the base has {base.manifest.layout_id}"
            )
        if base.checksum != packed.base_checksum:
            raise CodecError(
                f"wrong base: the delta was encoded against a base with checksum {header['base_checksum']}, "
                f"the given base has {base.checksum:016x}"
            )
        manifest = base.manifest.with_scalars(header["scalars"])
        _check_segment_count(packed.chunks, manifest, header["chunk_bytes"])
        if inplace and host.is_cuda(base.buffer):
            raise CodecError("in-place decoding works on a host buffer (the daemon's); this base is on a GPU")
        out = base.buffer if inplace else host.host_copy(base.buffer)
    if manifest.layout_id != header["layout_id"] or manifest.nbytes != header["nbytes"]:
        raise CodecError("the header's layout id or size does not match its manifest")
    _apply_groups(packed.chunks[1:], manifest, header["chunk_bytes"], out, into_zeros=header["kind"] == "full")
    got = buffer_checksum(out)
    if got != packed.checksum:
        if inplace:
            _apply_groups(packed.chunks[1:], manifest, header["chunk_bytes"], out, revert=True)  # undo
        raise CodecError(
            f"decoded snapshot has checksum {got:016x}, the version says {header['checksum']}: "
            "the chunks do not belong to this version or its base"
        )
    return Snapshot(manifest, _placed(out, device) if header["kind"] == "full" else _like(out, base.buffer), got)


def _placed(out: np.ndarray, device: Any) -> Buffer:
    """A full version's new buffer as asked: the NumPy array itself (``None``), else a tensor on ``device``."""
    if device is None:
        return out
    import torch

    t = torch.from_numpy(out)
    return t if torch.device(device).type == "cpu" else t.to(device)


def _like(out: Buffer, base: Buffer) -> Buffer:
    """A delta's result, decoded on the host, where its base is (a GPU base's copy goes back to the GPU)."""
    return out.to(base.device) if host.is_cuda(base) and not host.is_cuda(out) else out


def revert_snapshot(packed: Packed, snapshot: Snapshot, base_scalars: Sequence[Any]) -> Snapshot:
    """Steps ``snapshot`` (the version a delta produced) back to the delta's base, in place.

    A delta taken off its version gives its base back, so a replica keeps its last deltas instead of old copies
    (docs/design.md I3). The delta carries only the new version's scalars: ``base_scalars`` are the
    base's. On any failure the buffer is left as it was.

    Raises:
        CodecError: ``packed`` is not a delta that produced ``snapshot``.
    """
    verify_chunks(packed.chunks)
    header = packed.header
    if header["kind"] != "delta":
        raise CodecError("only a delta can be reverted")
    if header["layout_id"] != snapshot.manifest.layout_id or snapshot.checksum != packed.checksum:
        raise CodecError(f"this delta produced the snapshot with checksum {header['checksum']}, "
                         f"not the given one ({snapshot.checksum:016x})")
    manifest = snapshot.manifest.with_scalars(base_scalars)
    _check_segment_count(packed.chunks, manifest, header["chunk_bytes"])
    if host.is_cuda(snapshot.buffer):
        raise CodecError("reverting works on a host buffer (the daemon's); this snapshot is on a GPU")
    out = snapshot.buffer
    _apply_groups(packed.chunks[1:], manifest, header["chunk_bytes"], out, revert=True)
    got = buffer_checksum(out)
    if got != packed.base_checksum:
        _apply_groups(packed.chunks[1:], manifest, header["chunk_bytes"], out)  # undo: the delta on again
        raise CodecError(f"reverting gave checksum {got:016x}, the delta's base has {header['base_checksum']}")
    return Snapshot(manifest, out, got)


def _encode_groups(buf: Buffer, base: Buffer | None, segs: list[tuple[int, int, int]], count: int,
                   codec: str, only: Sequence[int] | None = None) -> list[Chunk]:
    """The chunks 1.. of a version (``only``: of these segments): each segment of ``buf`` (its delta from ``base``)
    encoded and checksummed in one task."""
    data = host.array(buf)
    base_host = None if base is None else host.array(base)
    chosen = range(len(segs)) if only is None else only

    work = sum(segs[i][1] * segs[i][2] for i in chosen) if only is not None else host.size(buf)
    return _map(lambda i: _segment_chunk(data, base_host, segs[i], i + 1, count, codec), chosen,
                inline=work < POOL_MIN_BYTES)


def _segment_chunk(data: np.ndarray, base: np.ndarray | None, seg: tuple[int, int, int], index: int, count: int,
                   codec: str) -> Chunk:
    """Chunk ``index`` of ``count``: the segment ``seg`` (offset, elements, itemsize) of ``data`` (its delta from
    ``base``) encoded and checksummed, in one task."""
    off, n, size = seg
    end = off + n * size
    return Chunk.of(index, count, encode_segment(data[off:end], None if base is None else base[off:end], size, off,
                                                 codec))


def _apply_groups(chunks: Sequence[Chunk], manifest: Manifest, chunk_bytes: int, out: Buffer,
                  into_zeros: bool = False, revert: bool = False) -> None:
    """Applies every segment onto ``out`` (``revert``: takes every one off; ``into_zeros``: a full version's new
    buffer, decompressed straight into); if one is malformed (or fails otherwise: memory), the others are undone and
    its error raised."""
    segs = segments(manifest, chunk_bytes)
    payloads = [np.frombuffer(c.payload, dtype=np.uint8) for c in chunks]
    data = host.writable(out)  # the callers' buffers are on the host: decode_snapshot and revert_snapshot refuse others

    def apply(item: tuple[np.ndarray, tuple[int, int, int]]) -> Exception | None:
        payload, (off, n, size) = item
        try:
            apply_segment(payload, size, off, data[off : off + n * size], into_zeros, revert)
        except Exception as e:  # noqa: BLE001 (apply_segment validates and allocates before it writes: this
            return e  # segment is untouched; a MemoryError too must not leave the others applied)
        return None

    def undo(item: tuple[np.ndarray, tuple[int, int, int]]) -> None:
        payload, (off, n, size) = item
        apply_segment(payload, size, off, data[off : off + n * size], revert=not revert)

    items = list(zip(payloads, segs))
    inline = data.size < POOL_MIN_BYTES
    errors = _map(apply, items, inline=inline)
    failed = [e for e in errors if e is not None]
    if failed:
        if not into_zeros:  # a new buffer is dropped with the error; a base is restored
            _map(undo, [item for item, e in zip(items, errors) if e is None], inline=inline)
        raise failed[0]


def encode(state: Any, base: Any = None, chunk_bytes: int = DEFAULT_CHUNK_BYTES, codec: str = "lz4") -> Packed:
    """Encodes a state: in full when ``base`` is None, else as a delta against ``base`` (same structure).

    Raises:
        CodecError: the state holds an unsupported value, or ``base`` has another structure.
    """
    from ffstate.codec.packing import pack  # torch's side: the daemon imports this module without it

    snapshot = pack(state)
    return encode_snapshot(snapshot, None if base is None else pack(base), chunk_bytes, codec)


def decode(packed: Packed, base: Any = None, map_location: Any = None) -> Any:
    """The exact state an encoded version holds (same nesting and types, bitwise-equal tensors).

    Raises:
        CodecError: see ``decode_snapshot``.
    """
    from ffstate.codec.packing import pack, unpack

    snapshot = decode_snapshot(packed, None if base is None else pack(base))
    return unpack(snapshot, map_location)
