from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ShardKey(_message.Message):
    __slots__ = ("job_id", "rank", "world_size")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    rank: int
    world_size: int
    def __init__(self, job_id: _Optional[str] = ..., rank: _Optional[int] = ..., world_size: _Optional[int] = ...) -> None: ...

class AttachRequest(_message.Message):
    __slots__ = ("shard", "manifest_json", "scalars_capacity", "holders", "razor", "discard_after", "persist_keys")
    SHARD_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_JSON_FIELD_NUMBER: _ClassVar[int]
    SCALARS_CAPACITY_FIELD_NUMBER: _ClassVar[int]
    HOLDERS_FIELD_NUMBER: _ClassVar[int]
    RAZOR_FIELD_NUMBER: _ClassVar[int]
    DISCARD_AFTER_FIELD_NUMBER: _ClassVar[int]
    PERSIST_KEYS_FIELD_NUMBER: _ClassVar[int]
    shard: ShardKey
    manifest_json: bytes
    scalars_capacity: int
    holders: _containers.RepeatedScalarFieldContainer[str]
    razor: RazorInfo
    discard_after: int
    persist_keys: bytes
    def __init__(self, shard: _Optional[_Union[ShardKey, _Mapping]] = ..., manifest_json: _Optional[bytes] = ..., scalars_capacity: _Optional[int] = ..., holders: _Optional[_Iterable[str]] = ..., razor: _Optional[_Union[RazorInfo, _Mapping]] = ..., discard_after: _Optional[int] = ..., persist_keys: _Optional[bytes] = ...) -> None: ...

class RazorInfo(_message.Message):
    __slots__ = ("group", "state_bytes", "redundant_bytes", "shard_bytes", "reason", "verifications", "mismatches")
    GROUP_FIELD_NUMBER: _ClassVar[int]
    STATE_BYTES_FIELD_NUMBER: _ClassVar[int]
    REDUNDANT_BYTES_FIELD_NUMBER: _ClassVar[int]
    SHARD_BYTES_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    VERIFICATIONS_FIELD_NUMBER: _ClassVar[int]
    MISMATCHES_FIELD_NUMBER: _ClassVar[int]
    group: _containers.RepeatedScalarFieldContainer[int]
    state_bytes: int
    redundant_bytes: int
    shard_bytes: int
    reason: str
    verifications: int
    mismatches: int
    def __init__(self, group: _Optional[_Iterable[int]] = ..., state_bytes: _Optional[int] = ..., redundant_bytes: _Optional[int] = ..., shard_bytes: _Optional[int] = ..., reason: _Optional[str] = ..., verifications: _Optional[int] = ..., mismatches: _Optional[int] = ...) -> None: ...

class AttachResponse(_message.Message):
    __slots__ = ("slot_paths", "slot_bytes", "node_id", "committed_version", "committed_versions", "manifest_json")
    SLOT_PATHS_FIELD_NUMBER: _ClassVar[int]
    SLOT_BYTES_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_VERSION_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_JSON_FIELD_NUMBER: _ClassVar[int]
    slot_paths: _containers.RepeatedScalarFieldContainer[str]
    slot_bytes: int
    node_id: str
    committed_version: int
    committed_versions: _containers.RepeatedScalarFieldContainer[int]
    manifest_json: bytes
    def __init__(self, slot_paths: _Optional[_Iterable[str]] = ..., slot_bytes: _Optional[int] = ..., node_id: _Optional[str] = ..., committed_version: _Optional[int] = ..., committed_versions: _Optional[_Iterable[int]] = ..., manifest_json: _Optional[bytes] = ...) -> None: ...

class CommitNotice(_message.Message):
    __slots__ = ("shard", "version")
    SHARD_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    shard: ShardKey
    version: int
    def __init__(self, shard: _Optional[_Union[ShardKey, _Mapping]] = ..., version: _Optional[int] = ...) -> None: ...

class CommitNoticeAck(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PushChunk(_message.Message):
    __slots__ = ("shard", "version", "base_version", "chunk_index", "chunk_count", "checksum", "payload", "commit")
    SHARD_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    BASE_VERSION_FIELD_NUMBER: _ClassVar[int]
    CHUNK_INDEX_FIELD_NUMBER: _ClassVar[int]
    CHUNK_COUNT_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    COMMIT_FIELD_NUMBER: _ClassVar[int]
    shard: ShardKey
    version: int
    base_version: int
    chunk_index: int
    chunk_count: int
    checksum: int
    payload: bytes
    commit: bool
    def __init__(self, shard: _Optional[_Union[ShardKey, _Mapping]] = ..., version: _Optional[int] = ..., base_version: _Optional[int] = ..., chunk_index: _Optional[int] = ..., chunk_count: _Optional[int] = ..., checksum: _Optional[int] = ..., payload: _Optional[bytes] = ..., commit: _Optional[bool] = ...) -> None: ...

class PushChunks(_message.Message):
    __slots__ = ("chunks",)
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    chunks: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, chunks: _Optional[_Iterable[bytes]] = ...) -> None: ...

class PushResult(_message.Message):
    __slots__ = ("staged_version", "bytes_received", "committed_version", "checksum")
    STAGED_VERSION_FIELD_NUMBER: _ClassVar[int]
    BYTES_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_VERSION_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    staged_version: int
    bytes_received: int
    committed_version: int
    checksum: int
    def __init__(self, staged_version: _Optional[int] = ..., bytes_received: _Optional[int] = ..., committed_version: _Optional[int] = ..., checksum: _Optional[int] = ...) -> None: ...

class CommitRequest(_message.Message):
    __slots__ = ("shard", "version")
    SHARD_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    shard: ShardKey
    version: int
    def __init__(self, shard: _Optional[_Union[ShardKey, _Mapping]] = ..., version: _Optional[int] = ...) -> None: ...

class CommitResult(_message.Message):
    __slots__ = ("version", "checksum")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    version: int
    checksum: int
    def __init__(self, version: _Optional[int] = ..., checksum: _Optional[int] = ...) -> None: ...

class FetchRequest(_message.Message):
    __slots__ = ("shard", "version", "first_chunk", "chunk_step", "chunks", "checksum")
    SHARD_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    FIRST_CHUNK_FIELD_NUMBER: _ClassVar[int]
    CHUNK_STEP_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    shard: ShardKey
    version: int
    first_chunk: int
    chunk_step: int
    chunks: _containers.RepeatedScalarFieldContainer[int]
    checksum: int
    def __init__(self, shard: _Optional[_Union[ShardKey, _Mapping]] = ..., version: _Optional[int] = ..., first_chunk: _Optional[int] = ..., chunk_step: _Optional[int] = ..., chunks: _Optional[_Iterable[int]] = ..., checksum: _Optional[int] = ...) -> None: ...

class FetchChunk(_message.Message):
    __slots__ = ("version", "chunk_index", "chunk_count", "checksum", "payload")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    CHUNK_INDEX_FIELD_NUMBER: _ClassVar[int]
    CHUNK_COUNT_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    version: int
    chunk_index: int
    chunk_count: int
    checksum: int
    payload: bytes
    def __init__(self, version: _Optional[int] = ..., chunk_index: _Optional[int] = ..., chunk_count: _Optional[int] = ..., checksum: _Optional[int] = ..., payload: _Optional[bytes] = ...) -> None: ...

class PushOpen(_message.Message):
    __slots__ = ("shard", "version", "base_version", "chunk_count", "commit")
    SHARD_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    BASE_VERSION_FIELD_NUMBER: _ClassVar[int]
    CHUNK_COUNT_FIELD_NUMBER: _ClassVar[int]
    COMMIT_FIELD_NUMBER: _ClassVar[int]
    shard: ShardKey
    version: int
    base_version: int
    chunk_count: int
    commit: bool
    def __init__(self, shard: _Optional[_Union[ShardKey, _Mapping]] = ..., version: _Optional[int] = ..., base_version: _Optional[int] = ..., chunk_count: _Optional[int] = ..., commit: _Optional[bool] = ...) -> None: ...

class BulkTicket(_message.Message):
    __slots__ = ("ticket", "port", "version", "chunks")
    TICKET_FIELD_NUMBER: _ClassVar[int]
    PORT_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    ticket: bytes
    port: int
    version: int
    chunks: int
    def __init__(self, ticket: _Optional[bytes] = ..., port: _Optional[int] = ..., version: _Optional[int] = ..., chunks: _Optional[int] = ...) -> None: ...

class InventoryRequest(_message.Message):
    __slots__ = ("job_id",)
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    def __init__(self, job_id: _Optional[str] = ...) -> None: ...

class ShardInfo(_message.Message):
    __slots__ = ("shard", "local", "version", "versions", "bytes", "last_update_unix", "source", "replicated_version", "razor", "pushed_bytes", "pushed_versions", "restore", "profiled", "staged_version", "staged_bytes", "watch", "holders_down", "holders_seeding")
    SHARD_FIELD_NUMBER: _ClassVar[int]
    LOCAL_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    VERSIONS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    LAST_UPDATE_UNIX_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    REPLICATED_VERSION_FIELD_NUMBER: _ClassVar[int]
    RAZOR_FIELD_NUMBER: _ClassVar[int]
    PUSHED_BYTES_FIELD_NUMBER: _ClassVar[int]
    PUSHED_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    RESTORE_FIELD_NUMBER: _ClassVar[int]
    PROFILED_FIELD_NUMBER: _ClassVar[int]
    STAGED_VERSION_FIELD_NUMBER: _ClassVar[int]
    STAGED_BYTES_FIELD_NUMBER: _ClassVar[int]
    WATCH_FIELD_NUMBER: _ClassVar[int]
    HOLDERS_DOWN_FIELD_NUMBER: _ClassVar[int]
    HOLDERS_SEEDING_FIELD_NUMBER: _ClassVar[int]
    shard: ShardKey
    local: bool
    version: int
    versions: _containers.RepeatedScalarFieldContainer[int]
    bytes: int
    last_update_unix: float
    source: str
    replicated_version: int
    razor: RazorInfo
    pushed_bytes: int
    pushed_versions: int
    restore: RestoreInfo
    profiled: ProfiledInfo
    staged_version: int
    staged_bytes: int
    watch: WatchInfo
    holders_down: int
    holders_seeding: int
    def __init__(self, shard: _Optional[_Union[ShardKey, _Mapping]] = ..., local: _Optional[bool] = ..., version: _Optional[int] = ..., versions: _Optional[_Iterable[int]] = ..., bytes: _Optional[int] = ..., last_update_unix: _Optional[float] = ..., source: _Optional[str] = ..., replicated_version: _Optional[int] = ..., razor: _Optional[_Union[RazorInfo, _Mapping]] = ..., pushed_bytes: _Optional[int] = ..., pushed_versions: _Optional[int] = ..., restore: _Optional[_Union[RestoreInfo, _Mapping]] = ..., profiled: _Optional[_Union[ProfiledInfo, _Mapping]] = ..., staged_version: _Optional[int] = ..., staged_bytes: _Optional[int] = ..., watch: _Optional[_Union[WatchInfo, _Mapping]] = ..., holders_down: _Optional[int] = ..., holders_seeding: _Optional[int] = ...) -> None: ...

class WatchInfo(_message.Message):
    __slots__ = ("step_seconds", "compute_seconds", "since_seconds", "deadline_seconds", "paused", "hangs", "straggler_ratio", "pid", "commit_seconds")
    STEP_SECONDS_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    SINCE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PAUSED_FIELD_NUMBER: _ClassVar[int]
    HANGS_FIELD_NUMBER: _ClassVar[int]
    STRAGGLER_RATIO_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    COMMIT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    step_seconds: float
    compute_seconds: float
    since_seconds: float
    deadline_seconds: float
    paused: bool
    hangs: int
    straggler_ratio: float
    pid: int
    commit_seconds: float
    def __init__(self, step_seconds: _Optional[float] = ..., compute_seconds: _Optional[float] = ..., since_seconds: _Optional[float] = ..., deadline_seconds: _Optional[float] = ..., paused: _Optional[bool] = ..., hangs: _Optional[int] = ..., straggler_ratio: _Optional[float] = ..., pid: _Optional[int] = ..., commit_seconds: _Optional[float] = ...) -> None: ...

class ProfiledInfo(_message.Message):
    __slots__ = ("steps", "collectives", "period_seconds", "busy_seconds")
    STEPS_FIELD_NUMBER: _ClassVar[int]
    COLLECTIVES_FIELD_NUMBER: _ClassVar[int]
    PERIOD_SECONDS_FIELD_NUMBER: _ClassVar[int]
    BUSY_SECONDS_FIELD_NUMBER: _ClassVar[int]
    steps: int
    collectives: int
    period_seconds: float
    busy_seconds: float
    def __init__(self, steps: _Optional[int] = ..., collectives: _Optional[int] = ..., period_seconds: _Optional[float] = ..., busy_seconds: _Optional[float] = ...) -> None: ...

class RestoreInfo(_message.Message):
    __slots__ = ("restores", "version", "steps_lost", "seconds", "entry_seconds", "from_world_size")
    RESTORES_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    STEPS_LOST_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    ENTRY_SECONDS_FIELD_NUMBER: _ClassVar[int]
    FROM_WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    restores: int
    version: int
    steps_lost: int
    seconds: float
    entry_seconds: float
    from_world_size: int
    def __init__(self, restores: _Optional[int] = ..., version: _Optional[int] = ..., steps_lost: _Optional[int] = ..., seconds: _Optional[float] = ..., entry_seconds: _Optional[float] = ..., from_world_size: _Optional[int] = ...) -> None: ...

class InventoryResponse(_message.Message):
    __slots__ = ("node_id", "shards", "bytes_used", "bytes_budget", "links", "scheduler", "collectives", "collisions", "overlap_seconds", "persist")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    SHARDS_FIELD_NUMBER: _ClassVar[int]
    BYTES_USED_FIELD_NUMBER: _ClassVar[int]
    BYTES_BUDGET_FIELD_NUMBER: _ClassVar[int]
    LINKS_FIELD_NUMBER: _ClassVar[int]
    SCHEDULER_FIELD_NUMBER: _ClassVar[int]
    COLLECTIVES_FIELD_NUMBER: _ClassVar[int]
    COLLISIONS_FIELD_NUMBER: _ClassVar[int]
    OVERLAP_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PERSIST_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    shards: _containers.RepeatedCompositeFieldContainer[ShardInfo]
    bytes_used: int
    bytes_budget: int
    links: _containers.RepeatedCompositeFieldContainer[LinkInfo]
    scheduler: str
    collectives: int
    collisions: int
    overlap_seconds: float
    persist: PersistInfo
    def __init__(self, node_id: _Optional[str] = ..., shards: _Optional[_Iterable[_Union[ShardInfo, _Mapping]]] = ..., bytes_used: _Optional[int] = ..., bytes_budget: _Optional[int] = ..., links: _Optional[_Iterable[_Union[LinkInfo, _Mapping]]] = ..., scheduler: _Optional[str] = ..., collectives: _Optional[int] = ..., collisions: _Optional[int] = ..., overlap_seconds: _Optional[float] = ..., persist: _Optional[_Union[PersistInfo, _Mapping]] = ...) -> None: ...

class PersistInfo(_message.Message):
    __slots__ = ("dir", "every", "flushed", "completed", "skipped", "failed", "bytes", "seconds", "newest_complete", "error", "pending", "flusher_pid", "flusher_starts")
    DIR_FIELD_NUMBER: _ClassVar[int]
    EVERY_FIELD_NUMBER: _ClassVar[int]
    FLUSHED_FIELD_NUMBER: _ClassVar[int]
    COMPLETED_FIELD_NUMBER: _ClassVar[int]
    SKIPPED_FIELD_NUMBER: _ClassVar[int]
    FAILED_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    NEWEST_COMPLETE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    PENDING_FIELD_NUMBER: _ClassVar[int]
    FLUSHER_PID_FIELD_NUMBER: _ClassVar[int]
    FLUSHER_STARTS_FIELD_NUMBER: _ClassVar[int]
    dir: str
    every: int
    flushed: int
    completed: int
    skipped: int
    failed: int
    bytes: int
    seconds: float
    newest_complete: int
    error: str
    pending: int
    flusher_pid: int
    flusher_starts: int
    def __init__(self, dir: _Optional[str] = ..., every: _Optional[int] = ..., flushed: _Optional[int] = ..., completed: _Optional[int] = ..., skipped: _Optional[int] = ..., failed: _Optional[int] = ..., bytes: _Optional[int] = ..., seconds: _Optional[float] = ..., newest_complete: _Optional[int] = ..., error: _Optional[str] = ..., pending: _Optional[int] = ..., flusher_pid: _Optional[int] = ..., flusher_starts: _Optional[int] = ...) -> None: ...

class LinkInfo(_message.Message):
    __slots__ = ("holder", "estimate_bytes_per_second", "share", "waited_seconds", "deadline_overrides", "scheduler", "collisions", "overlap_seconds", "catch_ups", "rushes")
    HOLDER_FIELD_NUMBER: _ClassVar[int]
    ESTIMATE_BYTES_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    SHARE_FIELD_NUMBER: _ClassVar[int]
    WAITED_SECONDS_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_OVERRIDES_FIELD_NUMBER: _ClassVar[int]
    SCHEDULER_FIELD_NUMBER: _ClassVar[int]
    COLLISIONS_FIELD_NUMBER: _ClassVar[int]
    OVERLAP_SECONDS_FIELD_NUMBER: _ClassVar[int]
    CATCH_UPS_FIELD_NUMBER: _ClassVar[int]
    RUSHES_FIELD_NUMBER: _ClassVar[int]
    holder: str
    estimate_bytes_per_second: float
    share: float
    waited_seconds: float
    deadline_overrides: int
    scheduler: str
    collisions: int
    overlap_seconds: float
    catch_ups: int
    rushes: int
    def __init__(self, holder: _Optional[str] = ..., estimate_bytes_per_second: _Optional[float] = ..., share: _Optional[float] = ..., waited_seconds: _Optional[float] = ..., deadline_overrides: _Optional[int] = ..., scheduler: _Optional[str] = ..., collisions: _Optional[int] = ..., overlap_seconds: _Optional[float] = ..., catch_ups: _Optional[int] = ..., rushes: _Optional[int] = ...) -> None: ...

class StepBackRequest(_message.Message):
    __slots__ = ("shard", "version")
    SHARD_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    shard: ShardKey
    version: int
    def __init__(self, shard: _Optional[_Union[ShardKey, _Mapping]] = ..., version: _Optional[int] = ...) -> None: ...

class StepBackResult(_message.Message):
    __slots__ = ("version", "checksum")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    version: int
    checksum: int
    def __init__(self, version: _Optional[int] = ..., checksum: _Optional[int] = ...) -> None: ...

class DropRequest(_message.Message):
    __slots__ = ("shard", "only_world")
    SHARD_FIELD_NUMBER: _ClassVar[int]
    ONLY_WORLD_FIELD_NUMBER: _ClassVar[int]
    shard: ShardKey
    only_world: bool
    def __init__(self, shard: _Optional[_Union[ShardKey, _Mapping]] = ..., only_world: _Optional[bool] = ...) -> None: ...

class DropResult(_message.Message):
    __slots__ = ("dropped",)
    DROPPED_FIELD_NUMBER: _ClassVar[int]
    dropped: int
    def __init__(self, dropped: _Optional[int] = ...) -> None: ...

class DrainRequest(_message.Message):
    __slots__ = ("job_id", "leave", "cancel", "query")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    LEAVE_FIELD_NUMBER: _ClassVar[int]
    CANCEL_FIELD_NUMBER: _ClassVar[int]
    QUERY_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    leave: bool
    cancel: bool
    query: bool
    def __init__(self, job_id: _Optional[str] = ..., leave: _Optional[bool] = ..., cancel: _Optional[bool] = ..., query: _Optional[bool] = ...) -> None: ...

class DrainRank(_message.Message):
    __slots__ = ("shard", "committed", "replicated", "stopped_at")
    SHARD_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_FIELD_NUMBER: _ClassVar[int]
    REPLICATED_FIELD_NUMBER: _ClassVar[int]
    STOPPED_AT_FIELD_NUMBER: _ClassVar[int]
    shard: ShardKey
    committed: int
    replicated: int
    stopped_at: int
    def __init__(self, shard: _Optional[_Union[ShardKey, _Mapping]] = ..., committed: _Optional[int] = ..., replicated: _Optional[int] = ..., stopped_at: _Optional[int] = ...) -> None: ...

class DrainResult(_message.Message):
    __slots__ = ("state", "version", "requested_unix", "drained_unix", "left_unix", "ranks", "signalled", "message")
    STATE_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    REQUESTED_UNIX_FIELD_NUMBER: _ClassVar[int]
    DRAINED_UNIX_FIELD_NUMBER: _ClassVar[int]
    LEFT_UNIX_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    SIGNALLED_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    state: str
    version: int
    requested_unix: float
    drained_unix: float
    left_unix: float
    ranks: _containers.RepeatedCompositeFieldContainer[DrainRank]
    signalled: _containers.RepeatedScalarFieldContainer[int]
    message: str
    def __init__(self, state: _Optional[str] = ..., version: _Optional[int] = ..., requested_unix: _Optional[float] = ..., drained_unix: _Optional[float] = ..., left_unix: _Optional[float] = ..., ranks: _Optional[_Iterable[_Union[DrainRank, _Mapping]]] = ..., signalled: _Optional[_Iterable[int]] = ..., message: _Optional[str] = ...) -> None: ...
