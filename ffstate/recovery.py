"""Recovery: survey -> v* -> fetch -> load (docs/design.md section 5, I3).

Every rank lists the versions it could restore, of every shard it needs (its own and, under the razor,
its group's parts), from every source: its node's slots, the daemons holding replicas and what they can
step back to. The ranks publish their lists through the job's store and all pick the same v*: the
newest version every rank has. A rank then takes v* of each shard from its node's slots by memory copy
when they hold it, else fetches it from the holders (striped over them, in parallel), puts the razor's
parts back together, and hands the state to the trainer's ``load``. When the newest copies were made at
another world size (the job shrank or grew), ``restore`` hands over to ``ffstate/elastic/``, which runs the same
steps over every old rank's copy. ``restore`` is the whole flow; the steps are public for the tests, the
benchmarks and the elastic restore that drive them.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Collection

from ffstate import codec, layout, persist, placement, razor, shm
from ffstate._proto import replica_pb2 as pb
from ffstate.client import Client, stream_striped
from ffstate.errors import CodecError, FFStateError, ReplicaError, ReplicaUnavailable
from ffstate.job import Job
from ffstate.layout import Manifest

NEGOTIATE_TIMEOUT = 300.0  # seconds a rank waits for every rank's list of versions

log = logging.getLogger("ffstate.recovery")


@dataclass
class Available:
    """What one rank could restore, and from where."""

    local: list[int] = field(default_factory=list)  # versions in its node's slots
    remote: dict[str, list[int]] = field(default_factory=dict)  # holder address -> versions
    nbytes: int = 0  # the most memory a holder says the shard takes there: a bound on what a fetch may allocate
    disk: list[int] = field(default_factory=list)  # complete versions of the persistent tier
    disk_dir: Path | None = None  # the job's folder there

    @property
    def live(self) -> set[int]:
        return set(self.local).union(*self.remote.values())

    @property
    def versions(self) -> set[int]:
        return self.live | set(self.disk)


@dataclass
class Restored:
    """What a restore did, for the logs and metrics."""

    version: int
    last_version: int
    source: str
    nbytes: int
    seconds: float
    state: Any = None
    parts: dict[int, str] = field(default_factory=dict)  # under the razor: where each member's part came from
    entry_seconds: float = 0.0  # from the process's entry into ``replicate`` to the state loaded
    from_world: int = 0  # a resize: the world size the copies were made at (0: this run's own)

    @property
    def steps_lost(self) -> int:
        return self.last_version - self.version


def survey_ranks(job: str, ranks: list[int], world: int, lookups: dict[int, pb.AttachResponse | None],
                 daemons: dict[str, Client], node_daemon: Client | None = None,
                 others: dict[int, int] | None = None) -> dict[int, Available]:
    """Where each of ``ranks``' shards (made at ``world``) can be restored from: this node's slots (``lookups``,
    per rank on this node) and every reachable daemon in ``daemons`` (replicas, and other nodes' slots, which
    their daemon serves too). ``others``, when given, gets the newest version of any copy of the job made at
    another world size, per world size (what a resize would start from).
    """
    got = {r: Available(local=list(lookups[r].committed_versions) if lookups.get(r) is not None else [])
           for r in ranks}
    asked = dict(daemons)
    if node_daemon is not None:
        asked.setdefault(node_daemon.address, node_daemon)
    for address, client in asked.items():
        try:
            inv = client.inventory(job)
        except ReplicaUnavailable as e:
            log.warning("daemon %s is unreachable (%s); not counting on its copies", address, e)
            continue
        for s in inv.shards:
            if s.shard.world_size != world and s.versions and others is not None:
                others[s.shard.world_size] = max(others.get(s.shard.world_size, 0), max(s.versions))
        if address not in daemons:
            continue
        for s in inv.shards:
            r = s.shard.rank
            if r not in got or s.shard.world_size != world or not s.versions:
                continue
            if s.local and lookups.get(r) is not None:  # this node's slots: read directly; older versions via
                older = [v for v in s.versions if v not in lookups[r].committed_versions]  # its daemon's step-back
                if older:
                    got[r].remote[address] = older
            else:
                got[r].remote[address] = list(s.versions)
            got[r].nbytes = max(got[r].nbytes, s.bytes)
    return got


def restorable(available: dict[int, Available], live_only: bool = False) -> set[int]:
    """The versions at which every one of the shards can be had from some copy (``live_only``: in memory)."""
    sets = [a.live if live_only else a.versions for a in available.values()]
    return set.intersection(*sets) if sets else set()


def negotiate(job: Job, mine: set[int], missing: list[str] | None = None, seen: int = 0, live: set[int] | None = None,
              check: Callable[[list[int]], set[int]] | None = None, others: dict[int, int] | None = None,
              name: str = "versions") -> tuple[int, int, dict[int, int]]:
    """(v*, newest version any rank has, newest version of the copies made at other world sizes), the same on every
    rank.

    ``mine`` is what this rank can restore; ``seen`` the newest version it saw of any shard it needs
    (so that a job whose copies are partly lost is never taken for a new one); ``missing`` says, for
    the error every rank raises, which of those shards has no live copy at all. ``live`` (of ``mine``)
    is what it has in memory; the rest is on disk, and when v* would be read from the disk by any rank,
    every rank first ``check``s its disk-only versions (reading their files: newest first, the good ones
    returned) and the ranks agree again on what passed: a torn or corrupted version is never chosen.
    ``others``: the newest version of the copies this rank saw made at other world sizes (a resize); ``name``
    keeps two negotiations of one attempt apart.

    Raises:
        FFStateError: some ranks have versions and others none in common, and no copies of another world size
            exist: restoring any version would mix steps (never done), and restarting from scratch would silently
            lose the job's progress.
    """
    live = mine if live is None else live
    mine_told = {"versions": sorted(mine), "live": sorted(live), "missing": missing or [], "seen": max([seen, *mine]),
                 "others": {str(w): v for w, v in (others or {}).items()}}
    told = job.exchange(name, mine_told, range(job.world), NEGOTIATE_TIMEOUT) if job.store is not None else [mine_told]
    everyone = [set(t["versions"]) for t in told]
    last = max(t["seen"] for t in told)
    lost = sorted({line for t in told for line in t["missing"]})
    worlds: dict[int, int] = {}
    for t in told:
        for w, v in t["others"].items():
            worlds[int(w)] = max(worlds.get(int(w), 0), v)
    common = set.intersection(*everyone) if everyone else set()
    refused: set[int] = set()  # persisted versions some rank's check refused (damaged files on disk)
    if common and check is not None and any(max(common) not in set(t["live"]) for t in told):
        passed = live | check(sorted(mine - live, reverse=True))
        checked = {"versions": sorted(passed), "refused": sorted(mine - passed)}
        mine = passed
        if job.store is not None:
            told = job.exchange(f"{name}-checked", checked, range(job.world), NEGOTIATE_TIMEOUT)
        else:
            told = [checked]
        everyone = [set(t["versions"]) for t in told]
        refused = {v for t in told for v in t["refused"]}
        common = set.intersection(*everyone)
    if common:
        return max(common), last, worlds
    if last and not worlds and refused:  # the copies are there, on a disk that damaged them
        raise FFStateError(
            f"no version can be restored by every rank: the persisted versions {sorted(refused)[-5:]} failed their "
            f"checks (damaged or missing files, named in the warnings above), and no other copy is common to every "
            f"rank (versions per rank: {[sorted(v)[-3:] for v in everyone]}). Refusing to restore a mix of steps or "
            "to restart from step 0 silently. Put the damaged files back, or start the job under a new job id to "
            "begin from scratch.")
    if last and not worlds:  # some copy of the job exists: refuse, never start over silently
        missing_ranks = [r for r, v in enumerate(everyone) if not v]
        detail = ("; ".join(lost) + ". ") if lost else ""
        raise FFStateError(
            f"no version can be restored by every rank: {detail}Ranks {missing_ranks or 'all'} have no copy in "
            f"common with the others (versions per rank: {[sorted(v)[-3:] for v in everyone]}). The nodes holding "
            "those copies were lost together; refusing to restore a mix of steps or to restart from step 0 "
            "silently. Raise Config.replicas, or start the job under a new job id to begin from scratch.")
    return 0, last, worlds


def fetch(job: str, rank: int, world: int, version: int, mine: Available, local: pb.AttachResponse | None,
          holders: dict[str, Client], last_version: int, map_location: Any = None) -> Restored:
    """The state at ``version``: from the node's slots when they hold it, else from the holders; its tensors placed
    by ``map_location`` (``layout.empty_leaves``)."""
    start = time.perf_counter()
    state, source, nbytes = _fetch_one(job, rank, world, version, mine, local, holders, map_location=map_location)
    return Restored(version, last_version, source, nbytes, time.perf_counter() - start, state)


def fetch_ranks(job: str, world: int, version: int, available: dict[int, Available],
                lookups: dict[int, pb.AttachResponse | None], daemons: dict[str, Client],
                parts_only: Collection[int] = (), own: int | None = None,
                map_location: Any = None) -> dict[int, tuple[Any, str, int]]:
    """Each rank's shard at ``version`` as (state, source, bytes), fetched in parallel; of the ranks in
    ``parts_only``, only the razor's part when it comes from a holder (``razor.in_part``: a group member's
    own state is not this rank's to load). Rank ``own``'s tensors placed by ``map_location``, every other rank's on
    the CPU: copied out of (a razor's parts, a resize), never trained on; the device recorded is another process's."""
    with ThreadPoolExecutor(max(1, min(8, len(available)))) as pool:
        futures = {r: pool.submit(_fetch_one, job, r, world, version, a, lookups.get(r), daemons, r in parts_only,
                                  map_location if r == own else "cpu")
                   for r, a in available.items()}
        return {r: f.result() for r, f in futures.items()}


def _fetch_one(job: str, rank: int, world: int, version: int, mine: Available, local: pb.AttachResponse | None,
               holders: dict[str, Client], part: bool = False, map_location: Any = None) -> tuple[Any, str, int]:
    if local is not None and version in local.committed_versions:
        manifest = Manifest.from_json(local.manifest_json)
        slots = shm.Slots(list(local.slot_paths), manifest)
        try:  # straight from the slot into new tensors, summed as copied, checked against the daemon's record
            got = slots.read(version, lambda v: codec.unpack_verified(manifest.with_scalars(v.scalars), v.data,
                                                                      map_location=map_location))
        except shm.SlotError as e:
            log.error("rank %d: this node's slot of version %d failed its check (%s); trying the holders", rank,
                      version, e)
            got = None
        finally:
            slots.close()
        if got is not None:
            return got[1], f"local slots of {local.node_id}", manifest.nbytes
        log.warning("version %d of rank %d left this node's slots while restoring; fetching it from the holders",
                    version, rank)
    sources = [a for a, v in mine.remote.items() if version in v]
    if sources:
        # Decodes each chunk as it arrives, while the rest is on the wire; a header asking for more memory than
        # the holders said the shard takes is refused before anything is allocated.
        decoder = codec.Decoder(mine.nbytes or None, razor.in_part if part else None, map_location)
        clients = [holders[a] for a in sources]
        try:
            if part:  # the header says which segments hold the part: those alone come next, from copies of its bytes
                stream_striped(clients, job, rank, world, version, decoder.add, chunks=[0])
                if decoder.needed is not None and len(decoder.needed) > 1:
                    stream_striped(clients, job, rank, world, version, decoder.add, chunks=decoder.needed[1:],
                                   checksum=int(decoder.header["checksum"], 16))
            else:
                stream_striped(clients, job, rank, world, version, decoder.add)
            return decoder.state(), ",".join(sources), decoder.part_nbytes
        except (ReplicaError, CodecError) as e:
            if version not in mine.disk:
                raise ReplicaUnavailable(f"rank {rank}: fetching version {version} from {sources} failed: {e}") from e
            log.warning("rank %d: fetching version %d from %s failed (%s); reading the persisted copy", rank, version,
                        sources, e)
    if version in mine.disk and mine.disk_dir is not None:
        vdir = persist.version_dir(mine.disk_dir, version)
        state, nbytes = persist.read_shard(vdir, rank, map_location)  # checked against the version's checksum
        return state, f"persisted {vdir}", nbytes
    raise ReplicaUnavailable(f"rank {rank}: no copy of version {version} (holders: {mine.remote})")


# ---------------------------------------------------------------- the whole flow


def restore(job: Job, daemon: Client, holders: list[str], group: tuple[int, ...], load: Callable[[Any], None],
            entry: float, resize: Callable[[list[int], Path | None, int, int], Restored | None] | None = None,
            map_location: Any = None) -> Restored | None:
    """Restores this rank at v*, or returns None when the job has no copies (a fresh start).

    ``daemon`` is this node's daemon, ``holders`` the addresses of this rank's replica holders, ``group`` the ranks
    of its razor group (empty without the razor), ``load(state)`` puts a state into the training objects, ``entry``
    is ``time.perf_counter()`` at the process's entry into ``replicate``. When the job's newest copies were made at
    other world sizes (it shrank or grew), ``resize(those sizes, newest first, the persistent tier's job folder, v*,
    the newest step seen)`` restores in this run's shape from the first whose newest version held for every old
    rank is past v* (``ffstate/elastic/``); None: none is, and v* is taken.
    ``map_location`` places this rank's tensors (``layout.empty_leaves``; ``capture.placement``: onto the device
    its model is on, whichever its process had before), the razor group's on the CPU.

    Raises:
        FFStateError: no version every rank can restore although copies exist (see ``negotiate``), or the
            copies were made with another razor setting, or at another world size and ``resize`` is None.
    """
    me, topo, needed = job.rank, job.topology, sorted({job.rank, *group})
    lookups = {r: daemon.lookup(job.job, r, job.world) if r in topo.node_ranks else None for r in needed}
    # This node's daemon counts too: it holds other nodes' ranks' replicas (their parts, under the razor).
    daemons = {a: job.client(a) for a in [daemon.address, *holders, *_other_daemons(job, needed, holders)]}
    others: dict[int, int] = {}
    available = survey_ranks(job.job, needed, job.world, lookups, daemons, daemon, others)
    disk_dir = Path(job.cfg.persist_dir) / job.job if job.cfg.persist_dir else None
    reached = 0
    if disk_dir is not None:  # the persistent tier: its complete versions (checked before any is read)
        done = persist.complete_versions(disk_dir, job.world)
        reached = persist.reached(disk_dir)
        for a in available.values():
            a.disk, a.disk_dir = done, disk_dir
        for w, newest in persist.worlds(disk_dir).items():
            if w != job.world:
                others[w] = max(others.get(w, 0), newest)
    missing = _missing(job, available, razor_on=bool(group))
    if any(a.versions for a in available.values()):
        log.info("rank %d: copies found (newest versions per shard and source): %s", me,
                 {r: {"slots": sorted(a.local)[-3:], **{s: sorted(v)[-3:] for s, v in a.remote.items()},
                      **({"persisted": a.disk[-3:]} if a.disk else {})} for r, a in available.items()})
    seen = max([reached, *(max(a.versions) for a in available.values() if a.versions)])
    v, last, worlds = negotiate(job, restorable(available), missing=missing, seen=seen,
                                live=restorable(available, live_only=True),
                                check=lambda vs: checked(disk_dir, vs, needed), others=others)
    newer = sorted((w for w, n in worlds.items() if n > v), key=lambda w: (worlds[w], w), reverse=True)
    last = max([last, *worlds.values()])  # the steps lost count from the newest step any shape reached
    if newer and resize is None:  # copies of another shape are newer
        raise FFStateError(f"job {job.job} has copies made with world size {newer[0]}; this run has world size "
                           f"{job.world} and nothing to reshard them with")
    if newer:
        with layout.gc_paused():
            resized = resize(newer, disk_dir, v, last)
        if resized is not None:
            return resized
    if disk_dir is not None:
        drop_newer(job, disk_dir, v)
    if v == 0:
        log.info("rank %d: no replicas of job %s: starting at step 0", me, job.job)
        return None
    with layout.gc_paused():
        return _load(job, v, last, needed, available, lookups, daemons, load, entry, map_location)


def _load(job: Job, v: int, last: int, needed: list[int], available: dict[int, Available],
          lookups: dict[int, pb.AttachResponse | None], daemons: dict[str, Client], load: Callable[[Any], None],
          entry: float, map_location: Any = None) -> Restored:
    """Fetches version ``v`` of this rank's shard (and its razor group's parts), assembles it and loads it."""
    me = job.rank
    start = time.perf_counter()
    shards = fetch_ranks(job.job, job.world, v, available, lookups, daemons, parts_only=set(needed) - {me}, own=me,
                         map_location=map_location)
    mine = shards[me]
    plan = razor.plan_of(mine[0])
    parts: dict[int, str] = {}
    if plan is None:
        state, nbytes = mine[0], mine[2]
    else:
        if not set(plan.group) <= set(needed):
            raise FFStateError(f"rank {me}: version {v} was split over ranks {list(plan.group)}, this run expects "
                               f"{needed}: was Config.razor changed across the restart? Restart with the same "
                               "setting, or under a new job id")
        others = {r: got for r, got in shards.items() if r != me}
        state = razor.assemble(mine[0], {r: got[0] for r, got in shards.items()})
        parts = {r: got[1] for r, got in sorted(others.items())}
        nbytes = mine[2] + sum(got[2] for got in others.values())
    got = Restored(v, last, mine[1], nbytes, time.perf_counter() - start, parts=parts)
    load(state)
    del state
    got.entry_seconds = time.perf_counter() - entry
    log.info("rank %d: restored step %d (v*) of job %s from %s%s: %d steps lost, %.1f MB in %.3fs "
             "(%.1f MB/s); %.2fs from entry", me, v, job.job, got.source,
             f", the parts of ranks {sorted(parts)} from {sorted(set(parts.values()))}" if parts else "",
             got.steps_lost, got.nbytes / 1e6, got.seconds, got.nbytes / 1e6 / max(got.seconds, 1e-9),
             got.entry_seconds)
    job.record({"event": "restored", "version": v, "last_version": last, "steps_lost": got.steps_lost,
                "source": got.source, "parts_from": parts, "bytes": got.nbytes, "restore_seconds": got.seconds,
                "entry_seconds": got.entry_seconds, "world": job.world})
    return got


def drop_newer(job: Job, disk_dir: Path, v: int) -> None:
    """The persisted versions past v* belong to the run that died: the steps are about to be redone (maybe
    differently), into the same folders. Rank 0 removes them before any rank goes on (the others wait for it)."""
    if job.rank == 0:
        for gone in persist.drop_newer(disk_dir, v):
            log.info("rank 0: removed persisted version %s of the run that died (v* is %d)", gone.name, v)
    job.exchange("persist-dropped", v, [0], NEGOTIATE_TIMEOUT)


def checked(disk_dir: Path | None, versions: list[int], ranks: list[int]) -> set[int]:
    """The persisted ``versions`` whose files of ``ranks`` match what was flushed (sizes and checksums); each one
    that does not is logged with the file at fault, and never read."""
    good = set()
    for v in versions:
        try:
            persist.check(persist.version_dir(disk_dir, v), ranks)
            good.add(v)
        except persist.PersistError as e:
            log.warning("persisted version %d cannot be used: %s; an older one is taken", v, e)
    return good


def _other_daemons(job: Job, ranks: list[int], holders: list[str]) -> list[str]:
    """The daemons of the nodes that keep ``ranks``' copies (their own nodes and their holders), this
    node's excepted: where a rank finds its group's parts."""
    topo, cfg, nodes = job.topology, job.cfg, set()
    for r in ranks:
        node = placement.topology(r, job.world, cfg).node
        nodes.update([node, *placement.holder_nodes(node, topo.num_nodes, cfg.replicas)])
    nodes.discard(topo.node)
    if job.store is None or not nodes:
        return []
    return sorted(set(job.daemon_addresses(sorted(nodes))) - set(holders))


def _missing(job: Job, available: dict[int, Available], razor_on: bool) -> list[str]:
    """The shards this rank needs that have no live copy at all, and the nodes that kept them."""
    lost = []
    for r, a in sorted(available.items()):
        if a.versions:
            continue
        node = placement.topology(r, job.world, job.cfg).node
        holders = placement.holder_nodes(node, job.topology.num_nodes, job.cfg.replicas)
        replicas = f" and {', '.join(f'node{n}' for n in holders)} (replicas)" if holders else ""
        lost.append(f"no live copy of rank {r}'s shard (it was kept on node{node} (slots){replicas})")
    if lost and razor_on:
        lost.append("with the razor on, every rank of a data-parallel group needs every member's part of the "
                    "redundant state, so the group's surviving ranks cannot restore either")
    return lost
