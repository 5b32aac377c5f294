"""Which node a rank is on, which daemons hold its replicas, and where each node's daemon listens.

A rank's state always has a copy on its own node (the daemon's shared-memory slots) and replicas on
the k nodes after it on a ring over the nodes, so losing any one node (k >= 1) leaves a copy of
every rank. Node identity comes from torchrun (``GROUP_RANK``, ``LOCAL_WORLD_SIZE``); the
``simulated_nodes`` override splits one machine's ranks into nodes, each with its own daemon.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import socket
import struct
from dataclasses import dataclass

from ffstate.config import Config
from ffstate.errors import FFStateError

log = logging.getLogger("ffstate.placement")


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
        _check_ports(cfg, num_nodes)
        node = rank // per
    else:
        per = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
        num_nodes = max(1, world_size // per)
        if per * num_nodes != world_size:
            raise FFStateError(f"{world_size} ranks with {per} per node: ffstate needs the same number on every node")
        node = int(os.environ.get("GROUP_RANK", rank // per))
    node_id = cfg.node_id if cfg.node_id and not cfg.simulated_nodes else f"node{node}"
    return Topology(rank, world_size, node, num_nodes, tuple(range(node * per, (node + 1) * per)), node_id)


def _check_ports(cfg: Config, num_nodes: int) -> None:
    """Simulated nodes share one host, so node n's daemon listens on each configured port + n: the last node's must
    be a TCP port. Raised at every rank's start, before a daemon is started."""
    ports = {"base_port (FFSTATE_BASE_PORT)": cfg.base_port, "metrics_port (FFSTATE_METRICS_PORT)": cfg.metrics_port,
             "bulk_port (FFSTATE_BULK_PORT)": cfg.bulk_port}
    for what, port in ports.items():
        if port > 0 and port + num_nodes - 1 > 65535:
            raise FFStateError(f"{what} {port}: simulated node {num_nodes - 1}'s daemon would listen on "
                               f"{port + num_nodes - 1}, past 65535 (simulated nodes take the port + their index); "
                               "choose a lower one")


def holder_nodes(node: int, num_nodes: int, k: int) -> list[int]:
    """The k nodes after ``node`` on the ring (fewer when there are not that many other nodes)."""
    return [(node + j) % num_nodes for j in range(1, min(k, num_nodes - 1) + 1)]


def daemon_address(node: int, cfg: Config) -> str:
    """Where node ``node``'s daemon listens, seen from that node: simulated nodes share a host and take one port
    each; a real node's host is ``local_address``."""
    port = cfg.base_port + (node if cfg.simulated_nodes else 0)
    return f"{local_address(cfg)}:{port}"


def local_address(cfg: Config) -> str:
    """The address of this node that the other nodes reach, found the way the job's own traffic finds it:
    ``Config.daemon_host`` when set; 127.0.0.1 for simulated nodes (one machine); else the address of the
    interface the collectives are told to use (``GLOO_SOCKET_IFNAME``, ``NCCL_SOCKET_IFNAME``); else that of
    the route to the rendezvous host (``MASTER_ADDR``, as torchrun sets it); else the host name's address
    that is not a loopback one; else 127.0.0.1 (one node)."""
    if cfg.daemon_host:
        return cfg.daemon_host
    if cfg.simulated_nodes:
        return "127.0.0.1"
    for var in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        name = os.environ.get(var, "").split(",")[0].lstrip("=")
        if name and not name.startswith("^") and (addr := interface_address(name)):
            return addr
    master = os.environ.get("MASTER_ADDR")
    if master and (addr := route_address(master, int(os.environ.get("MASTER_PORT", "29500") or 29500))):
        if not is_loopback(addr):
            return addr
    try:
        for *_, sockaddr in socket.getaddrinfo(socket.gethostname(), None, socket.AF_INET):
            if not is_loopback(sockaddr[0]):
                return sockaddr[0]
    except OSError:
        pass
    return "127.0.0.1"


def interface_address(name: str) -> str | None:
    """The IPv4 address of network interface ``name`` (Linux), or None."""
    import fcntl

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:  # SIOCGIFADDR
            raw = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))
        except OSError:
            return None
    return socket.inet_ntoa(raw[20:24])


def route_address(host: str, port: int) -> str | None:
    """This host's address on the route to ``host`` (a UDP socket's connect sends nothing), or None."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((host, port))
            return s.getsockname()[0]
    except OSError:
        return None


def is_local(host: str) -> bool:
    """Whether ``host`` is an address of this machine (it can be bound here)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.bind((socket.gethostbyname(host), 0))
        return True
    except OSError:
        return False


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(socket.gethostbyname(host)).is_loopback
    except (OSError, ValueError):
        return False
