"""An elastic-ready data position: one global sample position for the whole job, the same on every rank, so that
a job resumed at another world size reads on from the first sample nobody has seen (the way DLRover's elastic
sampler and Mosaic's streaming datasets keep one global position).
"""

from __future__ import annotations

from typing import Any, Iterator

import torch
from torch.utils.data import Sampler


class ElasticSampler(Sampler[list[int]]):
    """A batch sampler over ``size`` samples whose state is the job's, not the rank's.

    Every epoch is one permutation of the samples (seeded by ``seed`` and the epoch: the same on every rank, at
    any world size). Each step of the job takes the next ``world * batch_size`` positions of it, and rank ``r``
    the ``batch_size`` positions ``position + r * batch_size ...``; an epoch ends when fewer than a step's worth
    remain. The state is ``{"epoch", "position"}`` (with ``seed`` and ``size``, checked at load). At a resize,
    ``reshard_state_dict`` checks that every old rank had the same and hands it on: the new ranks split the rest
    of the epoch among themselves.

    It counts the batches it hands out: use it as ``DataLoader(dataset, batch_sampler=sampler)`` with
    ``num_workers=0`` (a loader with workers takes batches ahead of the loop, and the count would run ahead of
    the steps committed), or take its batches yourself (``next(it)``) and load the samples as you like.

    Args:
        size: the number of samples.
        batch_size: per rank and step.
        rank, world: this rank's place; default from torch.distributed (0 and 1 without a process group).
        seed: the permutation's seed; shuffle: False keeps the samples in order.
    """

    def __init__(self, size: int, batch_size: int, rank: int | None = None, world: int | None = None, seed: int = 0,
                 shuffle: bool = True):
        import torch.distributed as dist

        if size < 1 or batch_size < 1:
            raise ValueError(f"size and batch_size must be >= 1, got {size} and {batch_size}")
        on = dist.is_available() and dist.is_initialized()
        self.rank = rank if rank is not None else (dist.get_rank() if on else 0)
        self.world = world if world is not None else (dist.get_world_size() if on else 1)
        if not 0 <= self.rank < self.world or self.world * batch_size > size:
            raise ValueError(f"rank {self.rank} of {self.world} with batch_size {batch_size} over {size} samples: a "
                             "step needs world * batch_size <= size")
        self.size, self.batch_size, self.seed, self.shuffle = size, batch_size, seed, shuffle
        self.epoch, self.position = 0, 0

    def _order(self) -> torch.Tensor:
        if not self.shuffle:
            return torch.arange(self.size)
        return torch.randperm(self.size, generator=torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch))

    def __iter__(self) -> Iterator[list[int]]:
        """The rest of the current epoch's batches for this rank; the epoch ends (and the next one begins) when
        fewer than a step's worth of positions remain."""
        step = self.world * self.batch_size
        order = self._order()
        while self.position + step <= self.size:
            start = self.position + self.rank * self.batch_size
            self.position += step
            yield order[start:start + self.batch_size].tolist()
        self.epoch, self.position = self.epoch + 1, 0

    def __len__(self) -> int:
        return (self.size - self.position) // (self.world * self.batch_size)

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed, "size": self.size}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["seed"] != self.seed or state["size"] != self.size:
            raise ValueError(f"a position over {state['size']} samples with seed {state['seed']}; this sampler has "
                             f"{self.size} and {self.seed}")
        self.epoch, self.position = int(state["epoch"]), int(state["position"])

    def reshard_state_dict(self, states: list[dict[str, Any]], old_world: int, new_rank: int,
                           new_world: int) -> dict[str, Any]:
        """The hook ffstate calls at a resize (``ffstate/elastic/rules.py``): the position is the job's, so every old
        rank must have had the same one; the new ranks take it as it is."""
        if any(s != states[0] for s in states[1:]):
            raise ValueError(f"the {old_world} old ranks' positions differ ({[s['position'] for s in states]}): "
                             "they were not one job's")
        return dict(states[0])
