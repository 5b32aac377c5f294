"""Reading a persisted version back, bit for bit, and checking it before anything of it is used.

``check`` compares the files a set of ranks needs with the sizes and checksums their records gave at flush, and
the records with theirs at completion (a torn, truncated or corrupted file is named in the error; a version of the
format before XXH3, 1, by the sums it was written with); ``read_shard`` rebuilds a rank's buffer from its record's
items (each tensor by ``torch.load(weights_only=True)`` from its place in the file, the
rank's own bytes from its ``rest`` entry), and checks the whole against the version's checksum before it
returns the state. DCP's ``.metadata`` (a pickle) is for other readers: ffstate never unpickles it.
"""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import torch

from ffstate import checksum as sums
from ffstate import codec
from ffstate.errors import FFStateError
from ffstate.layout import Manifest
from ffstate.persist.write import COMPLETE, FORMAT, file_checksum, record_path


class PersistError(FFStateError):
    """A persisted version that cannot be used: a file missing, torn or corrupted (named in the message)."""


def record(vdir: Path, rank: int) -> dict:
    try:
        return json.loads(record_path(vdir, rank).read_text())
    except (OSError, ValueError) as e:
        raise PersistError(f"{record_path(vdir, rank)}: unreadable record ({e})") from None


def check(vdir: Path, ranks: list[int], full: bool = True) -> None:
    """Checks the files of ``ranks`` in the complete version ``vdir``: sizes, and with ``full`` checksums.

    Raises:
        PersistError: naming the first file that does not match what was flushed.
    """
    try:
        marker = json.loads((vdir / COMPLETE).read_text())
    except (OSError, ValueError) as e:
        raise PersistError(f"{vdir / COMPLETE}: unreadable ({e})") from None
    fmt = _format(marker, vdir / COMPLETE)
    records = marker.get("records", {})  # the ranks' records' sums (none in a version completed before they were kept)
    for rank in ranks:
        if not record_path(vdir, rank).exists():
            raise PersistError(f"{record_path(vdir, rank)}: missing")
        if record_path(vdir, rank).name not in records:
            record(vdir, rank)  # at least it must parse
    for name, info in sorted({**marker["files"], **records}.items()):
        if info["rank"] not in ranks:
            continue
        path = vdir / name
        try:
            size = path.stat().st_size if not full else None
            if full:
                size, checksum = file_checksum(path, fmt)
                if checksum != info["checksum"] and size == info["size"]:
                    raise PersistError(f"{path}: checksum {checksum:016x}, flushed as {info['checksum']:016x}")
        except OSError as e:
            raise PersistError(f"{path}: {e.strerror or e}") from None
        if size != info["size"]:
            raise PersistError(f"{path}: {size} bytes, flushed as {info['size']}")


def _format(rec: dict, path: Path) -> int:
    fmt = rec.get("format", 1)
    if fmt not in (1, FORMAT):
        raise PersistError(f"{path}: persisted in format {fmt}, which this ffstate (format {FORMAT}) does not read")
    return fmt


def read_shard(vdir: Path, rank: int, map_location: Any = None) -> tuple[Any, int]:
    """(state, bytes) of ``rank``'s shard in version ``vdir``, verified against the version's checksum; its tensors
    placed by ``map_location`` (``layout.empty_leaves``).

    Raises:
        PersistError: an item cannot be read, or the rebuilt bytes are not the version's.
    """
    rec = record(vdir, rank)
    manifest = Manifest.from_json(rec["manifest"].encode())
    buf = torch.zeros(manifest.nbytes, dtype=torch.uint8)  # the padding between tensors is zero
    handles: dict[str, Any] = {}
    try:
        for it in rec["items"]:
            if it["bytes"] or (it["spec"] < 0 and not it["rest"]):
                continue
            f = handles.get(it["file"])
            if f is None:
                f = handles[it["file"]] = open(vdir / it["file"], "rb")
            f.seek(it["offset"])
            raw = f.read(it["length"])
            if len(raw) != it["length"]:
                raise PersistError(f"{vdir / it['file']}: item {it['fqn']} ends early")
            t = torch.load(io.BytesIO(raw), weights_only=True)
            data = t.contiguous().reshape(-1).view(torch.uint8)
            if it["rest"]:
                at = 0
                for n in it["rest"]:
                    spec = manifest.tensors[n]
                    buf[spec.offset: spec.offset + spec.nbytes] = data[at: at + spec.nbytes]
                    at += spec.nbytes
            else:
                start = manifest.tensors[it["spec"]].offset + it["start"]
                buf[start: start + data.numel()] = data
    except OSError as e:
        raise PersistError(f"{vdir}: reading rank {rank}'s items failed: {e}") from None
    except (RuntimeError, ValueError, KeyError, IndexError) as e:
        raise PersistError(f"{vdir}: rank {rank}'s items do not fit its manifest: {e}") from None
    finally:
        for f in handles.values():
            f.close()
    if _format(rec, record_path(vdir, rank)) == 1:
        state = codec.unpack(codec.Snapshot(manifest, buf, None), map_location)
        checksum = sums.fingerprint(buf.numpy(), codec._map)
    else:
        state, checksum = codec.unpack_verified(manifest, buf, map_location=map_location)
    if f"{checksum:016x}" != rec["checksum"]:
        raise PersistError(f"{vdir}: rank {rank}'s version rebuilt with checksum {checksum:016x}, flushed as "
                           f"{rec['checksum']}")
    return state, manifest.nbytes
