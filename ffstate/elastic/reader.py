"""A version the daemons hold, read by torch.distributed.checkpoint as if it were a checkpoint on disk.

Each old rank's copy of version v* (from its node's slots, a replica or the persistent tier) is a captured state
plus the key map its worker made (``ffstate/persist/keys.py``, carried inside the state): which DCP key each
tensor has, and where a DTensor's local shard sits in the global tensor. ``Chunks`` turns every old rank's
tensors into DCP's storage chunks, keyed as ``dcp.save`` would key them (under the razor, a rank's part of the
redundant state is the few boxes that tile it), and checks that the chunks of each key cover its global tensor
exactly. ``ReplicaReader`` is a ``StorageReader`` over them: ``dcp.load`` at the new world size plans the reads
with its own planner and copies the overlaps out of the old ranks' tensors, so the state each new rank gets is
the one a DCP load of a consolidated copy of v* gives, by construction.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import torch
from torch.distributed.checkpoint import StorageReader
from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, Metadata, MetadataIndex, TensorProperties,
                                                   TensorStorageMetadata)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner
from torch.futures import Future
from torch.distributed._shard._utils import narrow_tensor_by_index

from ffstate import layout, razor
from ffstate.elastic.keys import KEYS, keys_tensor  # noqa: F401  (keys_tensor: re-exported)
from ffstate.errors import FFStateError
from ffstate.persist.items import keyed
from ffstate.persist.keymap import check_keys

log = logging.getLogger("ffstate.elastic")

def keys_of(state: Any, rank: int) -> dict:
    """The key map a rank's captured state carries (checked: bounded, well formed).

    Raises:
        FFStateError: none (copies made by a version of ffstate that did not carry one), or malformed.
    """
    try:
        raw = razor.own(state)[KEYS[0]][KEYS[1]]
    except (KeyError, TypeError):
        raise FFStateError(f"old rank {rank}'s copy carries no key map (made by an older ffstate?): its tensors "
                           "cannot be resharded; restart at its world size") from None
    return check_keys(bytes(raw.contiguous().numpy()))


class Chunks:
    """Every old rank's tensors as DCP storage chunks: ``metadata`` (what ``read_metadata`` returns) and, per
    chunk, the tensor it is read from.

    Args:
        states: old rank -> its captured state at v* (as committed: under the razor, its own entries and its
            part of the redundant ones).
        prefer: old ranks whose copies were read from this node (a chunk held by several ranks, a replicated
            tensor without the razor, is taken from the first of them that has it, else the lowest rank).

    Raises:
        FFStateError: a key's chunks do not tile its global tensor (an old rank is missing, or the copies were
            made with different layouts): never a partial load.
    """

    def __init__(self, states: dict[int, Any], prefer: list[int] = ()):
        order = [r for r in prefer if r in states] + sorted(set(states) - set(prefer))
        self.data: dict[MetadataIndex, torch.Tensor] = {}
        self.sizes: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
        for rank in order:
            self._add(rank, states[rank])
        self.metadata = self._metadata()

    def _add(self, rank: int, state: Any) -> None:
        names = keys_of(state, rank)["tensors"]
        plan = razor.plan_of(state)
        pieces = plan.parts()[plan.group.index(rank)] if plan is not None else []
        for path, leaf in layout.flatten(state)[1]:
            if not isinstance(leaf, torch.Tensor):
                continue
            for fqn, chunk, size, offsets, _ in keyed(path, leaf, names, plan, pieces):
                known = self.sizes.setdefault(fqn, (size, chunk.dtype))
                if known != (size, chunk.dtype):
                    raise FFStateError(f"old rank {rank} has {fqn} as {chunk.dtype} of size {list(size)}, another "
                                       f"rank as {known[1]} of size {list(known[0])}: copies of different layouts")
                if chunk.numel():  # an empty shard (a first dimension smaller than the world) holds nothing
                    self.data.setdefault(MetadataIndex(fqn, torch.Size(offsets)), chunk)

    def _metadata(self) -> Metadata:
        chunks: dict[str, list[ChunkStorageMetadata]] = {fqn: [] for fqn in self.sizes}
        for index, t in self.data.items():
            chunks[index.fqn].append(ChunkStorageMetadata(index.offset, t.shape))
        for fqn, (size, _) in self.sizes.items():
            covered = sum(math.prod(c.sizes) for c in chunks[fqn])
            if covered != math.prod(size):
                raise FFStateError(f"the old ranks' chunks of {fqn} cover {covered} of its {math.prod(size)} elements: "
                                   "a rank's copy is missing or was made with another layout")
        return Metadata(state_dict_metadata={
            fqn: TensorStorageMetadata(TensorProperties(dtype=dtype), torch.Size(size), chunks[fqn])
            for fqn, (size, dtype) in self.sizes.items()})

    @property
    def fqns(self) -> set[str]:
        return set(self.sizes)


class ReplicaReader(StorageReader):
    """``dcp.load``'s storage: the chunks of ``Chunks``, already in memory. Tensors only: ffstate puts the values
    DCP has no byte layout for (optimizer hyperparameters, schedulers, RNG, extras) back by its own rules
    (``rules.py``)."""

    def __init__(self, chunks: Chunks):
        super().__init__()
        self.chunks = chunks

    def reset(self, checkpoint_id: Any = None) -> None:
        pass

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        return self.chunks.metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        pass

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future:
        for req in plan.items:
            if req.type == LoadItemType.BYTE_IO:  # nothing of ours is bytes: refused, never guessed
                raise FFStateError(f"{req.storage_index.fqn}: not a tensor; the resize loads tensors only")
            source = narrow_tensor_by_index(self.chunks.data[req.storage_index], req.storage_offsets, req.lengths)
            target = planner.resolve_tensor(req).detach()
            if target.shape != source.shape or target.dtype != source.dtype:  # copy_ would cast, silently
                raise FFStateError(f"{req.storage_index.fqn}: the copies hold {source.dtype} {list(source.shape)} where "
                                   f"this run has {target.dtype} {list(target.shape)}")
            target.copy_(source)
            planner.commit_tensor(req, target)
        done: Future = Future()
        done.set_result(None)
        return done

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return False
