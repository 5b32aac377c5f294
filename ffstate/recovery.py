"""Consistent-version negotiation and restore (DESIGN.md section 5, I3).

Every rank lists the versions it could restore (its node's slots, its holders' replicas and what
they can step back to), publishes them through the job's torch.distributed store, and all ranks
pick the same v*: the newest version every rank has. A rank then takes v* from its node's slots by
memory copy when they hold it, else fetches it from its holders (striped over them in parallel).
"""

from __future__ import annotations

import json
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from ffstate import codec, shm
from ffstate._proto import replica_pb2 as pb
from ffstate.client import Client, stream_striped
from ffstate.errors import CodecError, FFStateError, ReplicaError, ReplicaUnavailable
from ffstate.layout import Manifest

log = logging.getLogger("ffstate.recovery")


@dataclass
class Available:
    """What one rank could restore, and from where."""

    local: list[int] = field(default_factory=list)  # versions in its node's slots
    remote: dict[str, list[int]] = field(default_factory=dict)  # holder address -> versions
    nbytes: int = 0  # the most memory a holder says the shard takes there: a bound on what a fetch may allocate

    @property
    def versions(self) -> set[int]:
        return set(self.local).union(*self.remote.values())


@dataclass
class Restored:
    """What a restore did, for the logs and metrics."""

    version: int
    last_version: int
    source: str
    nbytes: int
    seconds: float
    state: Any = None

    @property
    def steps_lost(self) -> int:
        return self.last_version - self.version


def survey_ranks(job: str, ranks: list[int], world: int, lookups: dict[int, pb.AttachResponse | None],
                 daemons: dict[str, Client], node_daemon: Client | None = None) -> dict[int, Available]:
    """Where each of ``ranks``' shards can be restored from: this node's slots (``lookups``, per rank on
    this node) and every reachable daemon in ``daemons`` (replicas, and other nodes' slots, which
    their daemon serves too).

    Raises:
        FFStateError: the job's copies were made with another world size (resharding is not supported).
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
        other = sorted({s.shard.world_size for s in inv.shards if s.shard.world_size != world})
        if other:
            raise FFStateError(
                f"job {job} has copies made with world size {other} at {address}; this run has world size {world}. "
                "ffstate restores a rank from the same rank of the same world size (no resharding): restart with "
                f"world size {other[0]}, or use a new job id (FFSTATE_JOB_ID) to start from scratch")
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


def restorable(available: dict[int, Available]) -> set[int]:
    """The versions at which every one of the shards can be had from some live copy."""
    sets = [a.versions for a in available.values()]
    return set.intersection(*sets) if sets else set()


def negotiate(store: Any, prefix: str, rank: int, world: int, mine: set[int], timeout: float = 300.0,
              missing: list[str] | None = None, seen: int = 0) -> tuple[int, int, list[set[int]]]:
    """(v*, newest version any rank has, every rank's versions), the same on every rank.

    ``mine`` is what this rank can restore; ``seen`` the newest version it saw of any shard it needs
    (so that a job whose copies are partly lost is never taken for a new one); ``missing`` says, for
    the error every rank raises, which of those shards has no live copy at all.

    Raises:
        FFStateError: some ranks have versions and others none in common: restoring any version would
            mix steps (never done), and restarting from scratch would silently lose the job's progress.
    """
    versions = mine
    store.set(f"{prefix}/versions/{rank}", json.dumps({"versions": sorted(versions), "missing": missing or [],
                                                       "seen": max([seen, *versions])}))
    store.wait([f"{prefix}/versions/{r}" for r in range(world)], _timedelta(timeout))
    told = [json.loads(store.get(f"{prefix}/versions/{r}")) for r in range(world)]
    everyone = [set(t["versions"]) for t in told]
    last = max(t["seen"] for t in told)
    common = set.intersection(*everyone) if everyone else set()
    if common:
        return max(common), last, everyone
    lost = sorted({line for t in told for line in t["missing"]})
    if last:  # some copy of the job exists: refuse, never start over silently
        missing_ranks = [r for r, v in enumerate(everyone) if not v]
        detail = ("; ".join(lost) + ". ") if lost else ""
        raise FFStateError(
            f"no version can be restored by every rank: {detail}Ranks {missing_ranks or 'all'} have no copy in "
            f"common with the others (versions per rank: {[sorted(v)[-3:] for v in everyone]}). The nodes holding "
            "those copies were lost together; refusing to restore a mix of steps or to restart from step 0 "
            "silently. Raise Config.replicas, or start the job under a new job id to begin from scratch.")
    return 0, 0, everyone


def fetch(job: str, rank: int, world: int, version: int, mine: Available, local: pb.AttachResponse | None,
          holders: dict[str, Client], last_version: int) -> Restored:
    """The state at ``version``: from the node's slots when they hold it, else from the holders."""
    start = time.perf_counter()
    state, source, nbytes = _fetch_one(job, rank, world, version, mine, local, holders)
    return Restored(version, last_version, source, nbytes, time.perf_counter() - start, state)


def fetch_ranks(job: str, world: int, version: int, available: dict[int, Available],
                lookups: dict[int, pb.AttachResponse | None], daemons: dict[str, Client]
                ) -> dict[int, tuple[Any, str, int]]:
    """Each rank's shard at ``version`` as (state, source, bytes), fetched in parallel."""
    with ThreadPoolExecutor(max(1, min(8, len(available)))) as pool:
        futures = {r: pool.submit(_fetch_one, job, r, world, version, a, lookups.get(r), daemons)
                   for r, a in available.items()}
        return {r: f.result() for r, f in futures.items()}


def _fetch_one(job: str, rank: int, world: int, version: int, mine: Available, local: pb.AttachResponse | None,
               holders: dict[str, Client]) -> tuple[Any, str, int]:
    if local is not None and version in local.committed_versions:
        manifest = Manifest.from_json(local.manifest_json)
        slots = shm.Slots(list(local.slot_paths), manifest)
        try:  # straight from the slot into new tensors, summed as copied, checked against the daemon's record
            got = slots.read(version, lambda view: codec.unpack_verified(manifest.with_scalars(view.scalars), view.data),
                             summed=True)
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
    if not sources:
        raise ReplicaUnavailable(f"rank {rank}: no live copy of version {version} (holders: {mine.remote})")
    # Decodes each chunk as it arrives, while the rest is on the wire; a header asking for more memory than
    # the holders said the shard takes is refused before anything is allocated.
    decoder = codec.Decoder(max_nbytes=mine.nbytes or None)
    try:
        stream_striped([holders[a] for a in sources], job, rank, world, version, decoder.add)
        state = decoder.state()
    except (ReplicaError, CodecError) as e:
        raise ReplicaUnavailable(f"rank {rank}: fetching version {version} from {sources} failed: {e}") from e
    return state, ",".join(sources), int(decoder.header["nbytes"])


def _timedelta(seconds: float):
    import datetime

    return datetime.timedelta(seconds=seconds)
