"""Which node a rank is on, which daemons hold its replicas, and where each node's daemon listens.

A rank's state always has a copy on its own node (the daemon's shared-memory slots) and replicas on
the k nodes after it on a ring over the nodes, so losing any one node (k >= 1) leaves a copy of
every rank. Node identity comes from torchrun (``GROUP_RANK``, ``LOCAL_WORLD_SIZE``); the
``simulated_nodes`` override splits one machine's ranks into nodes, each with its own daemon.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from ffstate.config import Config
from ffstate.errors import FFStateError


@dataclass(frozen=True)
class Topology:
    rank: int
    world_size: int
    node: int  # this rank's node index, 0 .. num_nodes-1
    num_nodes: int
    node_ranks: tuple[int, ...]  # the ranks on this node
    node_id: str  # the name of this node's daemon

    @property
    def first_on_node(self) -> bool:
        return self.rank == self.node_ranks[0]


def topology(rank: int, world_size: int, cfg: Config) -> Topology:
    """This rank's place in the job.

    Raises:
        FFStateError: ranks do not divide evenly into nodes.
    """
    if cfg.simulated_nodes:
        num_nodes = cfg.simulated_nodes
        per = world_size // num_nodes
        if per * num_nodes != world_size:
            raise FFStateError(f"simulated_nodes={num_nodes} does not divide world size {world_size}")
        node = rank // per
    else:
        per = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
        num_nodes = max(1, world_size // per)
        if per * num_nodes != world_size:
            raise FFStateError(f"{world_size} ranks with {per} per node: ffstate needs the same number on every node")
        node = int(os.environ.get("GROUP_RANK", rank // per))
    node_id = cfg.node_id if cfg.node_id and not cfg.simulated_nodes else f"node{node}"
    return Topology(rank, world_size, node, num_nodes, tuple(range(node * per, (node + 1) * per)), node_id)


def holder_nodes(node: int, num_nodes: int, k: int) -> list[int]:
    """The k nodes after ``node`` on the ring (fewer when there are not that many other nodes)."""
    return [(node + j) % num_nodes for j in range(1, min(k, num_nodes - 1) + 1)]


def daemon_address(node: int, cfg: Config) -> str:
    """Where node ``node``'s daemon listens: simulated nodes share a host and take one port each."""
    port = cfg.base_port + (node if cfg.simulated_nodes else 0)
    return f"{cfg.daemon_host}:{port}"
