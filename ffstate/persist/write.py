"""Writing persisted versions: one rank's files through DCP's own writer, and the version made complete.

A version lives in ``<persist_dir>/<job>/v<version:012d>/`` (a directory every node reaches: a parallel or
network filesystem across machines). Each rank's daemon writes, for each of its local ranks:

1. ``__<R>_0.distcp``: the rank's items (``items.py``), by ``FileSystemWriter.write_data``, fsynced;
2. ``ffstate-rank<R>.json``: its record: the manifest, the version's checksum, each item's place in the file
   (ffstate reads a version back from these records and ``torch.load(weights_only=True)``, never unpickling
   DCP's metadata), and the file's size and checksum; written to a temporary name and renamed.

Whichever daemon finds every rank's record present finalizes the version, under a lock: DCP's
``.metadata`` (every rank's chunks merged, duplicates of replicated tensors kept once) through
``FileSystemWriter.finish``, then ``ffstate-complete.json`` last. A version without that marker is not
complete and is never read; a worker or daemon killed mid-flush leaves only such a version. The newest
``keep`` complete versions are kept; older ones, and incomplete ones older than the newest complete one, go.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import io
import json
import logging
import os
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

import numpy as np

from ffstate import checksum
from ffstate.layout import Manifest

if TYPE_CHECKING:
    import torch

    from ffstate.persist.items import Item

log = logging.getLogger("ffstate.persist")

COMPLETE = "ffstate-complete.json"
# 2: checksums by ``ffstate.checksum`` (XXH3). 1: by ``ffstate.checksum.fingerprint`` (still read, ``persist/read.py``).
FORMAT = 2
_CHUNK = 8 << 20  # bytes read at a time when a file is summed: whole pieces of the checksum


def version_dir(job_dir: Path, version: int) -> Path:
    return job_dir / f"v{version:012d}"


def record_path(vdir: Path, rank: int) -> Path:
    return vdir / f"ffstate-rank{rank}.json"


@functools.lru_cache(maxsize=1)
def _dcp() -> Any:
    """torch.distributed.checkpoint's pieces and torch's ``Size`` and dtypes, imported when a version is first written
    (in the flushing process: the daemon itself runs without torch)."""
    import types

    import torch
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata, Metadata,
                                                       MetadataIndex, TensorProperties, TensorStorageMetadata)
    from torch.distributed.checkpoint.planner import (BytesIOWriteData, SavePlan, SavePlanner, TensorWriteData,
                                                      WriteItem, WriteItemType)
    from torch.distributed.checkpoint.storage import WriteResult

    class Planner(SavePlanner):
        """What DCP's ``FileSystemWriter.write_data`` asks of a planner: each item's data. The plan is made here."""

        def __init__(self, data: dict):
            self.data = data

        def set_up_planner(self, *args: Any, **kwargs: Any) -> None:  # pragma: no cover - not called
            pass

        def create_local_plan(self) -> Any:  # pragma: no cover - not called
            raise NotImplementedError

        def create_global_plan(self, all_plans: list) -> Any:  # pragma: no cover - not called
            raise NotImplementedError

        def finish_plan(self, new_plan: Any) -> Any:  # pragma: no cover - not called
            return new_plan

        def resolve_data(self, write_item: Any) -> torch.Tensor | io.BytesIO:
            got = self.data[write_item.index]
            return io.BytesIO(got) if isinstance(got, bytes) else got

    return types.SimpleNamespace(
        FileSystemWriter=FileSystemWriter, StorageInfo=_StorageInfo, BytesStorageMetadata=BytesStorageMetadata,
        ChunkStorageMetadata=ChunkStorageMetadata, Metadata=Metadata, MetadataIndex=MetadataIndex,
        TensorProperties=TensorProperties, TensorStorageMetadata=TensorStorageMetadata,
        BytesIOWriteData=BytesIOWriteData, SavePlan=SavePlan, TensorWriteData=TensorWriteData, WriteItem=WriteItem,
        WriteItemType=WriteItemType, WriteResult=WriteResult, Planner=Planner, Size=torch.Size, torch=torch)


def prepare() -> None:
    """Imports torch and torch.distributed.checkpoint now (the daemon's flushing process, as it starts)."""
    _dcp()


def _index(item: Item) -> Any:
    d = _dcp()
    return d.MetadataIndex(item.fqn) if item.is_bytes else d.MetadataIndex(item.fqn, d.Size(item.offsets))


def _write_item(item: Item) -> Any:
    d = _dcp()
    if item.is_bytes:
        return d.WriteItem(_index(item), d.WriteItemType.BYTE_IO, bytes_io_data=d.BytesIOWriteData(len(item.data)))
    whole = tuple(item.data.shape) == item.size
    chunk = d.ChunkStorageMetadata(d.Size(item.offsets), d.Size(item.data.shape))
    return d.WriteItem(_index(item), d.WriteItemType.TENSOR if whole else d.WriteItemType.SHARD,
                       tensor_data=d.TensorWriteData(chunk, d.TensorProperties(dtype=item.data.dtype),
                                                     d.Size(item.size)))


def file_checksum(path: Path, fmt: int = FORMAT) -> tuple[int, int]:
    """(size, checksum) of a file, read in pieces: ``ffstate.checksum`` of its bytes; for a version of format 1,
    ``checksum.fingerprint`` of each piece, folded."""
    size, acc = 0, 0
    with open(path, "rb") as f:
        while piece := f.read(_CHUNK):
            data = np.frombuffer(piece, dtype=np.uint8)
            if fmt == 1:
                acc = (acc * 1_000_003 + checksum.fingerprint(data)) & (2**64 - 1)
            else:
                acc += checksum.piece_sum(data, size // checksum.PIECE_BYTES)
            size += len(piece)
    return size, (acc if fmt == 1 else checksum.finish(acc, size))


def _atomic_json(path: Path, obj: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        json.dump(obj, f, separators=(",", ":"))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_rank(vdir: Path, job: str, version: int, rank: int, world: int, manifest: Manifest, checksum: int,
               items: list[Item], timeline: str = "") -> dict:
    """Writes one rank's version into ``vdir`` (its data file, then its record); returns the record. ``timeline``
    names the attempt that committed it: after a restore to v*, the versions past v* are redone (maybe
    differently), and a version is complete only when every rank's record comes from one attempt.

    Raises:
        OSError: the filesystem refused (full, read-only, gone): the caller counts it and goes on.
    """
    d = _dcp()
    vdir.mkdir(parents=True, exist_ok=True)
    writer = d.FileSystemWriter(vdir, single_file_per_rank=True, sync_files=True, overwrite=True)
    writer.set_up_storage_writer(False, rank=rank, use_collectives=False)
    plan = writer.prepare_local_plan(d.SavePlan([_write_item(i) for i in items]))
    results = writer.write_data(plan, d.Planner({_index(i): i.data for i in items})).value()
    where = {r.index: r.storage_data for r in results}
    files = sorted({info.relative_path for info in where.values()})
    record = {
        "format": FORMAT, "job": job, "version": version, "rank": rank, "world": world, "timeline": timeline,
        "manifest": manifest.to_json().decode(), "checksum": f"{checksum:016x}", "nbytes": manifest.nbytes,
        "files": {name: dict(zip(("size", "checksum"), file_checksum(vdir / name, FORMAT))) for name in files},
        "items": [{"fqn": i.fqn, "bytes": i.is_bytes, "dtype": str(i.data.dtype).removeprefix("torch.")
                   if not i.is_bytes else None, "size": list(i.size), "offsets": list(i.offsets),
                   "sizes": list(i.data.shape) if not i.is_bytes else None, "spec": i.spec, "start": i.start,
                   "rest": i.rest, "path": list(i.path), "file": where[_index(i)].relative_path,
                   "offset": where[_index(i)].offset, "length": where[_index(i)].length} for i in items],
    }
    _atomic_json(record_path(vdir, rank), record)
    return record


@contextlib.contextmanager
def _lock(vdir: Path) -> Iterator[None]:
    with open(vdir / ".finalize.lock", "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def finalize(vdir: Path, world: int) -> bool:
    """Makes the version complete once every rank's record is in ``vdir``: DCP's ``.metadata``, then the marker.
    Returns True if it is complete (by this call or an earlier one), False while records are missing."""
    if (vdir / COMPLETE).exists():
        return True
    if not all(record_path(vdir, r).exists() for r in range(world)):
        return False
    with _lock(vdir):
        if (vdir / COMPLETE).exists():
            return True
        records = [json.loads(record_path(vdir, r).read_text()) for r in range(world)]
        if len({rec.get("timeline", "") for rec in records}) > 1:  # a record of the run that died: not complete
            return False
        metadata, results = _metadata(records)
        writer = _dcp().FileSystemWriter(vdir, single_file_per_rank=True, sync_files=True, overwrite=True)
        writer.finish(metadata, [results])
        files = {name: {**info, "rank": rec["rank"]} for rec in records for name, info in rec["files"].items()}
        sums = {r: file_checksum(record_path(vdir, r), FORMAT) for r in range(world)}  # a record torn later: refused
        recs = {record_path(vdir, r).name: {"size": size, "checksum": checksum, "rank": r}
                for r, (size, checksum) in sums.items()}
        _atomic_json(vdir / COMPLETE, {"format": FORMAT, "job": records[0]["job"], "version": records[0]["version"],
                                      "world": world, "files": files, "records": recs, "time": time.time()})
    return True


def _metadata(records: list[dict]) -> tuple[Any, list]:
    """DCP's global metadata of a version: every rank's chunks, a chunk written by several ranks (a replicated
    tensor without the razor) kept once."""
    d = _dcp()
    sd: dict[str, Any] = {}
    planner: dict[str, tuple] = {}
    results: dict = {}
    for rec in records:
        for it in rec["items"]:
            fqn = it["fqn"]
            if it["bytes"]:
                index = d.MetadataIndex(fqn)
                sd.setdefault(fqn, d.BytesStorageMetadata())
            else:
                index = d.MetadataIndex(fqn, d.Size(it["offsets"]))
                meta = sd.setdefault(fqn, d.TensorStorageMetadata(
                    d.TensorProperties(dtype=getattr(d.torch, it["dtype"])), d.Size(it["size"]), []))
                if index not in results:
                    meta.chunks.append(d.ChunkStorageMetadata(d.Size(it["offsets"]), d.Size(it["sizes"])))
            if index in results:
                continue
            planner[fqn] = tuple(it["path"])
            results[index] = d.WriteResult(index, it["length"], d.StorageInfo(it["file"], it["offset"], it["length"]))
    return d.Metadata(state_dict_metadata=sd, planner_data=planner), list(results.values())


def _version_dirs(job_dir: Path) -> list[tuple[int, Path]]:
    """The version folders in ``job_dir`` (``v<step>``, complete or not), oldest first; none if it cannot be read."""
    try:
        entries = list(job_dir.iterdir())
    except OSError:
        return []
    return sorted((int(d.name[1:]), d) for d in entries if d.name.startswith("v") and d.name[1:].isdigit())


def drop_newer(job_dir: Path, version: int) -> list[Path]:
    """Removes every version folder past ``version`` (complete or not); returns them."""
    return [_remove(d) for v, d in _version_dirs(job_dir) if v > version]


def _remove(vdir: Path) -> Path:
    """Removes a version folder, its completion marker first: never complete while half removed."""
    (vdir / COMPLETE).unlink(missing_ok=True)
    shutil.rmtree(vdir, ignore_errors=True)
    return vdir


def remove_rank(vdir: Path, rank: int) -> None:
    """Removes what a failed flush wrote of ``rank``'s files in ``vdir`` (and the folder, if nothing else is in it);
    nothing of a complete version (its files are the ones the marker checks: a flush that failed after it was made
    complete, or one of the same version, wrote none)."""
    if (vdir / COMPLETE).exists():
        return
    for path in [*vdir.glob(f"__{rank}_*"), record_path(vdir, rank), record_path(vdir, rank).with_suffix(".json.tmp")]:
        try:
            path.unlink()
        except OSError:
            pass
    try:
        vdir.rmdir()
    except OSError:
        pass


def note_reached(job_dir: Path, node_id: str, version: int) -> None:
    """Records, best effort, the newest version this node's daemon took (``reached-<node>.json``): after the whole
    job is lost, the steps a resume from disk loses are counted from it."""
    job_dir.mkdir(parents=True, exist_ok=True)
    path = job_dir / f"reached-{node_id}.json"
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps({"version": version, "time": time.time()}))
    os.replace(tmp, path)


def reached(job_dir: Path) -> int:
    """The newest version any node's daemon recorded with ``note_reached`` (0: none)."""
    out = 0
    for path in job_dir.glob("reached-*.json"):
        try:
            out = max(out, int(json.loads(path.read_text())["version"]))
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return out


def complete_versions(job_dir: Path, world: int | None = None) -> list[int]:
    """The complete versions in ``job_dir``, oldest first; with ``world``, only those made at that world size (a job
    that shrank or grew has versions of both shapes)."""
    if world is None:
        return [v for v, d in _version_dirs(job_dir) if (d / COMPLETE).exists()]
    return [v for v, w in _complete_worlds(job_dir) if w == world]


def worlds(job_dir: Path) -> dict[int, int]:
    """The newest complete version per world size it was made at."""
    out: dict[int, int] = {}
    for v, w in _complete_worlds(job_dir):
        out[w] = max(out.get(w, 0), v)
    return out


def _complete_worlds(job_dir: Path) -> list[tuple[int, int]]:
    """(version, world size) of each complete version, oldest first; an unreadable marker counts as incomplete."""
    out = []
    for v, d in _version_dirs(job_dir):
        try:
            out.append((v, int(json.loads((d / COMPLETE).read_text())["world"])))
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return out


def prune(job_dir: Path, keep: int) -> list[Path]:
    """Removes complete versions beyond the newest ``keep`` and incomplete ones older than the newest complete one;
    returns what it removed."""
    done = complete_versions(job_dir)
    if not done:
        return []
    return [_remove(d) for v, d in _version_dirs(job_dir)
            if (v in done and v not in done[-keep:]) or (v not in done and v < done[-1])]
