"""Ids that name files and keys: a job's and a node's (checked before they reach /dev/shm or a store key),
and a shard's key: one rank of one job."""

from __future__ import annotations

import re
from dataclasses import dataclass

from ffstate.errors import ReplicaError, SlotError

ID_RE = re.compile(r"[A-Za-z0-9._-]{1,128}")


def check_id(value: str, what: str) -> str:
    if not isinstance(value, str) or not ID_RE.fullmatch(value):
        raise SlotError(f"{what} {str(value)[:64]!r} is not valid: use 1-128 letters, digits, '.', '_' or '-'")
    return value


@dataclass(frozen=True, order=True)
class ShardKey:
    """One rank's state in one job; validated on construction."""

    job_id: str
    rank: int
    world_size: int

    def __post_init__(self) -> None:
        try:
            check_id(self.job_id, "job id")
        except SlotError as e:
            raise ReplicaError(str(e), "INVALID_ARGUMENT") from None
        if not 0 < self.world_size <= 1 << 20 or not 0 <= self.rank < self.world_size:
            raise ReplicaError(f"rank {self.rank} of world size {self.world_size} is not a shard", "INVALID_ARGUMENT")

    def __str__(self) -> str:
        return f"{self.job_id}/rank {self.rank} of {self.world_size}"
