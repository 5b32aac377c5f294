"""A rank's stacks, as the watchdog reads them: each worker registers ``faulthandler`` for SIGUSR1 at entry, writing
every thread's stack to ``stacks-rank<R>.txt`` in the job's run folder; the watchdog signals it, reads what was
appended, and takes from the main thread where the rank is (``where``) and whether it waits for other ranks inside
torch.distributed (``in_collective``)."""

from __future__ import annotations

import os
from pathlib import Path

# ffstate's own files (the worker's frames in a collective's hook or a commit are not the user's code)
PACKAGE = str(Path(__file__).resolve().parents[1]) + os.sep


def _frames(stacks: str) -> list[str]:
    """The main thread's frames in a ``faulthandler`` dump, innermost first."""
    block = stacks.split("Current thread", 1)[-1] if "Current thread" in stacks else stacks
    return [line.strip() for line in block.splitlines() if line.strip().startswith("File ")]


def in_collective(stacks: str) -> bool:
    """Whether the main thread is inside torch.distributed (a collective, a barrier, a store's wait): waiting for
    other ranks, as in the loop's own ``dist.all_reduce``, which ffstate's marks do not see."""
    frames = _frames(stacks)
    return bool(frames) and f"{os.sep}torch{os.sep}distributed{os.sep}" in frames[0]


def where(stacks: str, package: str = PACKAGE) -> str:
    """The main thread's innermost frame in a ``faulthandler`` dump, and its innermost outside torch and ffstate
    (``package``: its folder)."""
    frames = _frames(stacks)
    if not frames:
        return "no stack written"
    inner = frames[0]
    own = next((f for f in frames if "/torch/" not in f and not f.startswith(f'File "{package}')), None)
    return inner if own in (None, inner) else f"{inner}; in its own code: {own}"


def size(path: Path | None) -> int:
    try:
        return path.stat().st_size if path is not None else 0
    except OSError:
        return 0


def read_from(path: Path, offset: int, limit: int = 1 << 20) -> str:
    """What was appended to ``path`` after ``offset`` (at most ``limit`` bytes)."""
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            return f.read(limit).decode(errors="replace")
    except OSError:
        return ""
