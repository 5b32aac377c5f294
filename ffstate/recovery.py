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
from dataclasses import dataclass, field
from typing import Any

from ffstate import codec, layout, shm
from ffstate._proto import replica_pb2 as pb
from ffstate.client import Client, fetch_striped
from ffstate.errors import CodecError, FFStateError, ReplicaError, ReplicaUnavailable
from ffstate.layout import Manifest

log = logging.getLogger("ffstate.recovery")


@dataclass
class Available:
    """What one rank could restore, and from where."""

    local: list[int] = field(default_factory=list)  # versions in its node's slots
    remote: dict[str, list[int]] = field(default_factory=dict)  # holder address -> versions

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


def survey(job: str, rank: int, world: int, local: pb.AttachResponse | None, holders: dict[str, Client],
           node_daemon: Client | None = None) -> Available:
    """The versions this rank could restore: its node's slots, then each reachable holder.

    Raises:
        FFStateError: the job's copies were made with another world size (resharding is not supported).
    """
    got = Available(local=list(local.committed_versions) if local is not None else [])
    daemons = dict(holders)
    if node_daemon is not None:
        daemons.setdefault(node_daemon.address, node_daemon)
    for address, client in daemons.items():
        try:
            inv = client.inventory(job)
        except ReplicaUnavailable as e:
            log.warning("holder %s is unreachable (%s); not counting on its replicas", address, e)
            continue
        other = sorted({s.shard.world_size for s in inv.shards if s.shard.world_size != world})
        if other:
            raise FFStateError(
                f"job {job} has copies made with world size {other} at {address}; this run has world size {world}. "
                "ffstate restores a rank from the same rank of the same world size (no resharding): restart with "
                f"world size {other[0]}, or use a new job id (FFSTATE_JOB_ID) to start from scratch")
        if address not in holders:
            continue
        for s in inv.shards:
            if not s.local and s.shard.rank == rank and s.shard.world_size == world:
                got.remote[address] = list(s.versions)
    return got


def negotiate(store: Any, prefix: str, rank: int, world: int, mine: Available, timeout: float = 300.0
              ) -> tuple[int, int, list[set[int]]]:
    """(v*, newest version any rank has, every rank's versions), the same on every rank.

    Raises:
        FFStateError: some ranks have versions and others none in common: restoring any version would
            mix steps (never done), and restarting from scratch would silently lose the job's progress.
    """
    store.set(f"{prefix}/versions/{rank}", json.dumps(sorted(mine.versions)))
    store.wait([f"{prefix}/versions/{r}" for r in range(world)], _timedelta(timeout))
    everyone = [set(json.loads(store.get(f"{prefix}/versions/{r}"))) for r in range(world)]
    last = max((max(v) for v in everyone if v), default=0)
    common = set.intersection(*everyone) if everyone else set()
    if common:
        return max(common), last, everyone
    if last:
        missing = [r for r, v in enumerate(everyone) if not v]
        raise FFStateError(
            f"no version can be restored by every rank: ranks {missing or 'all'} have no copy in common with the "
            f"others (versions per rank: {[sorted(v)[-3:] for v in everyone]}). Their node and its replica holders "
            "were lost together; refusing to restore a mix of steps or to restart from step 0 silently. "
            "Raise Config.replicas, or start the job under a new job id to begin from scratch.")
    return 0, 0, everyone


def fetch(job: str, rank: int, world: int, version: int, mine: Available, local: pb.AttachResponse | None,
          holders: dict[str, Client], last_version: int) -> Restored:
    """The state at ``version``: from the node's slots when they hold it, else from the holders."""
    start = time.perf_counter()
    if local is not None and version in local.committed_versions:
        manifest = Manifest.from_json(local.manifest_json)
        slots = shm.Slots(list(local.slot_paths), manifest)
        try:  # straight from the slot into new tensors: one copy, then the slot's checksum is verified
            got = slots.read(version, lambda view: layout.materialize(manifest.with_scalars(view.scalars), view.data))
        finally:
            slots.close()
        if got is not None:
            state = got[1]
            return Restored(version, last_version, f"local slots of {local.node_id}", manifest.nbytes,
                            time.perf_counter() - start, state)
        log.warning("version %d left this node's slots while restoring; fetching it from the holders", version)
    sources = [a for a, v in mine.remote.items() if version in v]
    if not sources:
        raise ReplicaUnavailable(f"rank {rank}: no live copy of version {version} (holders: {mine.remote})")
    try:
        packed = fetch_striped([holders[a] for a in sources], job, rank, world, version)
        state = codec.decode(packed)
    except (ReplicaError, CodecError) as e:
        raise ReplicaUnavailable(f"rank {rank}: fetching version {version} from {sources} failed: {e}") from e
    return Restored(version, last_version, ",".join(sources), packed.raw_nbytes, time.perf_counter() - start, state)


def _timedelta(seconds: float):
    import datetime

    return datetime.timedelta(seconds=seconds)
