"""The plain records a daemon reports about itself and a worker tells its daemon: what ``Inventory``,
the Prometheus metrics, ``ffstate status`` and ``ff.stats()`` show. No protobuf here: each record's
fields are named as in its message of ``proto/ffstate/v1/replica.proto`` (the record's docstring names
it; fields marked ``LOCAL`` are the daemon's own), and ``ffstate.wire`` converts between the two, for the
servicer and the client alike."""

from __future__ import annotations

from dataclasses import dataclass, field

from ffstate.ids import ShardKey

LOCAL = {"wire": False}  # metadata of a field that stays in the daemon (its metrics), never on the wire


@dataclass
class RazorReport:
    """RazorInfo: what a rank replicates of its state (the razor, ``ffstate/razor.py``), as its worker said."""

    group: list[int] = field(default_factory=list)  # ranks holding the redundant entries identically
    state_bytes: int = 0  # the rank's whole packed state
    redundant_bytes: int = 0  # of which held identically by the group
    shard_bytes: int = 0  # what it replicates: its own entries and its part
    reason: str = ""
    verifications: int = 0
    mismatches: int = 0


@dataclass
class RestoreReport:
    """RestoreInfo: the restores a rank's workers recorded in its slot header; the newest one's figures."""

    restores: int = 0
    version: int = 0  # v*
    steps_lost: int = 0
    seconds: float = 0.0  # fetch and load
    entry_seconds: float = 0.0  # from the process's entry
    from_world_size: int = 0  # the world size its copies were made at: a resize (0: the rank's own)


@dataclass
class ProfiledReport:
    """ProfiledInfo: the timeline a rank's workers profiled for the scheduler (``ffstate/scheduling/profiling.py``)."""

    steps: int = 0
    collectives: int = 0
    period_seconds: float = 0.0
    busy_seconds: float = 0.0


@dataclass
class WatchReport:
    """WatchInfo: a local rank as the daemon's watchdog sees it."""

    step_seconds: float
    compute_seconds: float
    since_seconds: float
    deadline_seconds: float
    paused: bool
    hangs: int
    straggler_ratio: float
    pid: int
    commit_seconds: float = 0.0


@dataclass
class ShardReport:
    """ShardInfo: one shard a daemon holds, a local rank's (its slots) or a replica."""

    shard: ShardKey
    local: bool
    version: int
    versions: list[int]
    bytes: int
    last_update_unix: float
    source: str
    replicated_version: int = 0
    razor: RazorReport | None = None
    pushed_bytes: int = 0
    pushed_versions: int = 0
    restore: RestoreReport | None = None
    profiled: ProfiledReport | None = None
    staged_version: int = 0  # a replica's version pushed and not yet committed (0: none)
    staged_bytes: int = 0
    watch: WatchReport | None = None
    holders_down: int = 0
    holders_seeding: int = 0
    # For the metrics only (not in ShardInfo): a local rank's versions read from its slots, not yet on every
    # holder, and the raw bytes of the versions it sent (over ``pushed_bytes``: the compression ratio).
    queue_versions: int = field(default=0, metadata=LOCAL)
    pushed_raw_bytes: int = field(default=0, metadata=LOCAL)


@dataclass
class LinkReport:
    """LinkInfo: one holder's link as the daemon's scheduler sees it."""

    holder: str
    estimate_bytes_per_second: float
    share: float
    waited_seconds: float
    deadline_overrides: int
    catch_ups: int
    scheduler: str
    collisions: int
    overlap_seconds: float
    rushes: int = 0


NO_FLUSHER = "the flushing process did not start"  # PersistReport.error when the daemon could not start it


@dataclass
class PersistReport:
    """PersistInfo: the daemon's flushes to the persistent tier (``daemon/persister.py``)."""

    dir: str
    every: int
    flushed: int = 0
    completed: int = 0
    skipped: int = 0
    failed: int = 0
    bytes: int = 0
    seconds: float = 0.0
    newest_complete: int = 0
    error: str = ""
    pending: int = 0
    flusher_pid: int = 0
    flusher_starts: int = 0


@dataclass
class NodeReport:
    """InventoryResponse: what one daemon holds, its links and its memory."""

    node_id: str
    shards: list[ShardReport]
    bytes_used: int
    bytes_budget: int
    links: list[LinkReport]
    scheduler: str
    collectives: int = 0  # the training's collectives its workers marked
    collisions: int = 0  # of those, started with a replication chunk on the wire
    overlap_seconds: float = 0.0  # seconds chunks were on the wire during them
    persist: PersistReport | None = None  # None: no persistent tier
    link_share: float = field(default=1.0, metadata=LOCAL)  # share of each link replication may use
    refusals: dict[str, int] = field(default_factory=dict, metadata=LOCAL)  # requests refused, by gRPC status


@dataclass
class DrainRankReport:
    """DrainRank: one local rank of a node being drained."""

    shard: ShardKey
    committed: int = 0
    replicated: int = 0
    stopped_at: int = 0


@dataclass
class DrainReport:
    """DrainResult: a drain of this node out of a job (``ffstate drain``, ``daemon/drain.py``)."""

    state: str = "none"  # none, draining, drained, left, cancelled, failed
    version: int = 0  # the step its ranks stopped at
    requested_unix: float = 0.0
    drained_unix: float = 0.0
    left_unix: float = 0.0
    ranks: list[DrainRankReport] = field(default_factory=list)
    signalled: list[int] = field(default_factory=list)
    message: str = ""


@dataclass(frozen=True)
class Stats:
    """``ff.stats()``: what a rank's node daemon reports about it, with the node's scheduler counts."""

    version: int  # the rank's last commit
    replicated_version: int  # the newest version every holder of the rank that answers has (daemon/shard.py)
    pushed_bytes: int  # on the wire, counted per holder
    pushed_versions: int
    collectives: int  # the node's: the training's collectives its scheduler saw marked
    collisions: int  # of those, started while a replication chunk was on the wire
    overlap_seconds: float  # how long replication shared the link with them
    razor: RazorReport | None = None  # what the rank replicates of its state (state_bytes, shard_bytes, group...)
    restore: RestoreReport | None = None  # once a restored rank has committed: its restores, the newest one's figures
    profiled: ProfiledReport | None = None  # where the rank profiled its steps for the scheduler

    @staticmethod
    def of(node: NodeReport, rank: int, world: int, version: int) -> "Stats":
        mine = [s for s in node.shards if s.local and s.shard.rank == rank and s.shard.world_size == world]
        seen = dict(collectives=node.collectives, collisions=node.collisions, overlap_seconds=node.overlap_seconds)
        if not mine:
            return Stats(version, 0, 0, 0, **seen)
        s = mine[0]
        return Stats(version, s.replicated_version, s.pushed_bytes, s.pushed_versions, **seen, razor=s.razor,
                     restore=s.restore, profiled=s.profiled)


@dataclass
class PersistStats:
    """What the persister did since the daemon started (``Inventory``, metrics, ``ffstate status``)."""

    flushed: int = 0  # ranks' versions written
    completed: int = 0  # versions this daemon made complete
    skipped: int = 0  # ranks' versions skipped: an older flush was still running (or no memory for the copy)
    failed: int = 0  # ranks' versions the filesystem refused
    bytes: int = 0  # bytes of the ranks' states written
    seconds: float = 0.0  # the newest flush of one rank's version: copy excluded, write and fsync included
    newest_complete: int = 0
    error: str = ""  # the newest failure
    pending: int = 0  # ranks' versions copied and not yet written (queued, or being written)
    flusher_pid: int = 0  # the flushing process, once ready (0: starting, or not running)
    flusher_starts: int = 0  # times it was started (more than 1: it died, and was started again)
