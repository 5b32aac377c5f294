"""The daemon's default memory budget: a quarter of the memory it may use, which in a container is the container's
limit (its cgroup's ``memory.max``, or ``memory.limit_in_bytes`` under cgroup v1), not the host's RAM. A budget
sized from the host's RAM in a pod limited to a fraction of it would let the daemon grow past the limit, and the
kernel's OOM killer, not a refusal, would end it."""

from __future__ import annotations

import logging
import os
from pathlib import Path

log = logging.getLogger("ffstate.daemon")

CGROUP = Path("/sys/fs/cgroup")
SELF = Path("/proc/self/cgroup")


def host_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _limit(path: Path) -> int | None:
    try:
        raw = path.read_text().strip()
    except OSError:  # not there, or not readable: no limit known there
        return None
    return int(raw) if raw.isascii() and raw.isdigit() else None  # "max": none


def cgroup_limit(root: Path = CGROUP, self_cgroup: Path = SELF) -> int | None:
    """The smallest memory limit of this process's cgroup and its ancestors (each one's applies), or None."""
    try:
        lines = self_cgroup.read_text().splitlines()
    except OSError:
        return None
    limits = []
    for line in lines:
        hierarchy, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        if hierarchy == "0" and not controllers:  # cgroup v2 (unified)
            # mounted at the root, or beside v1's hierarchies at unified/ (hybrid)
            base = root if (root / "cgroup.controllers").exists() else root / "unified"
            name = "memory.max"
        elif "memory" in controllers.split(","):  # cgroup v1
            base, name = root / "memory", "memory.limit_in_bytes"
        else:
            continue
        parts = [p for p in path.split("/") if p and p != ".."]
        for depth in range(len(parts), -1, -1):  # the cgroup, then each ancestor up to the root
            limit = _limit(base.joinpath(*parts[:depth], name))
            if limit is not None:
                limits.append(limit)
    limits = [n for n in limits if n > 0]  # 0 (none allowed) is no limit a running process can be under
    return min(limits) if limits else None


def default_memory_limit() -> int:
    """A quarter of the memory this daemon may use: the host's RAM, or its cgroup's limit where that is lower."""
    try:
        limit = cgroup_limit()
    except Exception as e:  # files not as the kernel writes them: the daemon starts anyway, on the host's RAM
        log.warning("could not read this process's cgroup memory limit (%s); the default budget is a quarter of "
                    "the host's RAM", e)
        limit = None
    return min(host_bytes(), limit if limit is not None else host_bytes()) // 4
