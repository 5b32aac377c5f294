"""Putting copies made at world size N into this run's objects at N' (shrink or grow), bit for bit what a DCP load
of a consolidated copy of the same version gives at N'.

``recovery.restore`` finds that the job's newest copies were made at another world size; ``restore`` agrees on v*
over every old rank's copy and fetches them all (slots, replicas, the persistent tier); ``load`` then applies the
rules to what has no byte layout (``rules.py``: refused before anything is loaded), reads every tensor through DCP's own
planner from the copies in memory (``reader.py``, ``targets.py``), and puts the rest in place. Every rank of the
new world learns whether every other one could (a refusal on one is an error on all: no rank trains alone).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from ffstate import capture, extras, persist
from ffstate.client import Client
from ffstate.config import Config
from ffstate.elastic import rules, targets
from ffstate.elastic.reader import Chunks
from ffstate.errors import FFStateError
from ffstate.job import Job
from ffstate.recovery import Restored, checked, drop_newer, fetch_ranks, negotiate, restorable, survey_ranks

log = logging.getLogger("ffstate.elastic")

AGREE_TIMEOUT = 300.0  # seconds a rank waits for every rank's verdict on the resize


def restore(job: Job, daemon: Client, old_worlds: list[int], disk_dir: Path | None, v_here: int, seen: int,
            load_states: Callable[[dict[int, Any], list[int]], None], entry: float) -> Restored | None:
    """Resumes this rank from copies made at another world size: of ``old_worlds`` (newest copies first), the first
    whose v* (the newest version every old rank has somewhere: this node's slots, any daemon of this job's nodes, the
    persistent tier in ``disk_dir``) is past ``v_here``, the v* this world size's own copies give. Every old rank's
    copy of it goes to ``load_states(states, prefer)`` (old rank -> state; ``prefer``: the old ranks read from this
    node). The newest copies seen are not always restorable: a node lost in the steps right after a resize takes the
    new shape's only copies of its ranks, while the old shape's are still kept (``worker.py``). ``seen``: the newest
    step any copy of the job reached, at any world size (what the steps lost count from).

    Returns:
        None when no old world size gives a version past ``v_here`` (the caller resumes at ``v_here``).

    Raises:
        FFStateError: ``v_here`` is 0 and no old world size has a version held for every old rank (the message
            names, for each, the old ranks without any copy).
    """
    why = []
    for old_world in old_worlds:
        found = _survey(job, daemon, old_world, disk_dir)
        if found.v > v_here:
            log.info("rank %d: the job's newest copies every rank can restore were made at world size %d (step %d; "
                     "seen up to %d), this run has %d: resuming from them, resharded", job.rank, old_world, found.v,
                     found.last, job.world)
            return _resume(job, old_world, disk_dir, found, max(found.last, seen), load_states, entry)
        why.append(f"world size {old_world}: {'; '.join(found.lost) or 'their versions have none in common'}"
                   if not found.v else f"world size {old_world}: step {found.v}, not past step {v_here} of world size "
                   f"{job.world}")
        log.warning("rank %d: the copies made at world size %d (seen up to step %d) give no version past %d that "
                    "every old rank has (%s)%s", job.rank, old_world, found.last, v_here, why[-1],
                    "; trying the next older shape" if old_world != old_worlds[-1] else "")
    if v_here:
        return None
    raise FFStateError(f"cannot resume at world size {job.world} from the copies made at world size(s) "
                       f"{', '.join(map(str, old_worlds))}: no version is "
                       f"held for every old rank ({' | '.join(why)}). Restart with the lost node's copies reachable, "
                       "or under a new job id to begin from scratch")


@dataclass
class Survey:
    """The copies made at one old world size: ``v`` (their v*, agreed by every rank; 0: none every old rank has),
    ``last`` (the newest step seen among them), and what fetching them needs: each old rank's ``available`` copies,
    this node's slot ``lookups`` (None where its slots do not hold the rank), the job's ``daemons`` by address; and
    why no version could be agreed (``lost``: the old ranks without any copy, or the refusal)."""

    v: int
    last: int
    available: dict
    lookups: dict
    daemons: dict[str, Client]
    lost: list[str]


def _survey(job: Job, daemon: Client, old_world: int, disk_dir: Path | None) -> Survey:
    """v* over the copies made at ``old_world`` (agreed by every rank), and what fetching them needs."""
    ranks = list(range(old_world))
    addresses = job.daemon_addresses(list(range(job.topology.num_nodes))) if job.store is not None else []
    daemons = {a: job.client(a) for a in dict.fromkeys([daemon.address, *addresses])}
    here = {s.shard.rank for s in daemon.inventory(job.job).shards
            if s.local and s.shard.world_size == old_world and s.versions}
    lookups = {r: daemon.lookup(job.job, r, old_world) if r in here else None for r in ranks}
    available = survey_ranks(job.job, ranks, old_world, lookups, daemons, daemon)
    if disk_dir is not None:
        done = persist.complete_versions(disk_dir, old_world)
        for a in available.values():
            a.disk, a.disk_dir = done, disk_dir
    lost = [f"no copy of old rank {r}'s state (world size {old_world}) on this job's daemons "
            f"{sorted(daemons)}{' or in the persistent tier' if disk_dir is not None else ''}"
            for r, a in sorted(available.items()) if not a.versions]
    seen = max([0, *(max(a.versions) for a in available.values() if a.versions)])
    try:  # every rank agrees on the same lists: each gets the same answer, or the same refusal
        v, last, _ = negotiate(job, restorable(available), missing=lost, seen=seen,
                               live=restorable(available, live_only=True),
                               check=lambda vs: checked(disk_dir, vs, ranks), name=f"resize-versions-{old_world}")
    except FFStateError as e:  # copies, but no version every old rank has: this shape cannot be resumed from
        return Survey(0, seen, available, lookups, daemons, lost or [str(e)])
    return Survey(v, last, available, lookups, daemons, lost)


def _resume(job: Job, old_world: int, disk_dir: Path | None, found: Survey, last: int,
            load_states: Callable[[dict[int, Any], list[int]], None], entry: float) -> Restored:
    me, ranks, v, lookups = job.rank, list(range(old_world)), found.v, found.lookups
    if disk_dir is not None:
        drop_newer(job, disk_dir, v)
    start = time.perf_counter()
    shards = fetch_ranks(job.job, old_world, v, found.available, lookups, found.daemons)
    fetched = time.perf_counter() - start
    load_states({r: got[0] for r, got in shards.items()}, sorted(r for r in ranks if lookups[r] is not None))
    sources = {r: got[1] for r, got in sorted(shards.items())}
    got = Restored(v, last, f"{old_world} old ranks' copies", sum(g[2] for g in shards.values()),
                   time.perf_counter() - start, parts=sources, from_world=old_world)
    got.entry_seconds = time.perf_counter() - entry
    log.info("rank %d: resumed step %d (v*) of job %s at world size %d from the copies of %d old ranks (%s): %d steps "
             "lost, %.1f MB read in %.3fs (fetch %.3fs); %.2fs from entry", me, v, job.job, job.world, old_world,
             sorted(set(sources.values())), got.steps_lost, got.nbytes / 1e6, got.seconds, fetched, got.entry_seconds)
    job.record({"event": "restored", "version": v, "last_version": last, "steps_lost": got.steps_lost,
                "source": got.source, "parts_from": sources, "bytes": got.nbytes, "restore_seconds": got.seconds,
                "fetch_seconds": fetched, "entry_seconds": got.entry_seconds, "from_world": old_world,
                "world": job.world})
    return got


def load(job: Job, model: torch.nn.Module, optimizer: torch.optim.Optimizer, lr_scheduler: Any, extra: Any,
         cfg: Config, states: dict[int, Any], prefer: list[int]) -> None:
    """Loads the old ranks' ``states`` (old rank -> captured state at v*, every one of them) into this rank's
    objects at its world size. ``prefer``: old ranks whose copies came from this node (read first where several
    hold a chunk).

    Raises:
        FFStateError: a value was refused (on this rank or any other), or the copies do not fit this run.
    """
    start = time.perf_counter()
    error = ""
    try:
        rest = rules.resolve(states, job.rank, job.world, cfg.resize_rng, lr_scheduler, extra)
        chunks = Chunks(states, prefer)
    except FFStateError as e:
        error = str(e)
    _agree(job, "resize-verdict", error)
    try:  # DCP's own refusals (the model's keys are not the copies') come as it loads: every rank raises together
        targets.load(model, optimizer, chunks, rest.groups)
    except FFStateError as e:
        error = str(e)
    _agree(job, "resize-loaded", error)
    if lr_scheduler is not None:
        lr_scheduler.load_state_dict(rest.sched)
    if extra is not None:
        extras.restore(extra, rest.extra)
    if rest.rng is not None:
        capture.set_rng_state(rest.rng)
    log.info("rank %d: resharded %d old ranks' copies into world size %d: %d tensors' chunks in %.3fs", job.rank,
             len(states), job.world, len(chunks.data), time.perf_counter() - start)


def _agree(job: Job, name: str, error: str) -> None:
    """Every rank's verdict (``error``, "" for none) through the job's store; raised on every rank if one refused, so
    that none goes on to train while another stops.

    Raises:
        FFStateError: this rank's error, else the first rank's that refused.
    """
    told = job.exchange(name, error, range(job.world), AGREE_TIMEOUT)
    if any(told):
        first = next(i for i, t in enumerate(told) if t)
        raise FFStateError(error or f"rank {first} refused the resize: {told[first]}")
