"""Real, slow networks on one machine: Linux network namespaces joined by a ``tc``-shaped veth link.

``shaped_link(rate)`` creates two namespaces, ``<prefix>0`` (10.77.<n>.1) and ``<prefix>1``
(10.77.<n>.2), joined by a veth pair whose two ends are each limited to ``rate`` by a token-bucket
filter (``tc qdisc ... tbf``), with loopback up in both; and it always removes them, on error too.
Each namespace plays a node: a process started with ``Link.cmd(i, ...)`` runs inside node i's
namespace, and traffic between the nodes (gloo's and ffstate's alike) crosses the shaped link.
Needs root and iproute2 (``ip``, ``tc``); ``unavailable()`` says why not, for a test to skip.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import uuid
from dataclasses import dataclass
from typing import Iterator


@dataclass(frozen=True)
class Link:
    """Two namespaces joined by a shaped link."""

    namespaces: tuple[str, str]
    addresses: tuple[str, str]
    devices: tuple[str, str]
    rate: str

    def cmd(self, node: int, args: list[str]) -> list[str]:
        """``args`` run inside node ``node``'s namespace."""
        return ["ip", "netns", "exec", self.namespaces[node], *args]


def _run(*args: str) -> None:
    subprocess.run(args, check=True, capture_output=True, text=True, timeout=30)


def unavailable() -> str:
    """Why shaped links cannot be made here ("" when they can)."""
    if os.geteuid() != 0:
        return "network namespaces and tc need root"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` (iproute2) is not installed"
    name = f"ffprobe{uuid.uuid4().hex[:6]}"
    try:
        _run("ip", "netns", "add", name)
    except (subprocess.CalledProcessError, OSError) as e:
        return f"cannot create a network namespace: {getattr(e, 'stderr', '') or e}"
    _run("ip", "netns", "del", name)
    return ""


def torchrun_two_nodes(link: Link, worker: list[str], env: dict, nproc: int = 2, timeout: float = 900,
                      restarts: int = 3) -> list[subprocess.CompletedProcess]:
    """``worker`` (``-m module args...``) as a 2-node torchrun job, one agent per namespace (c10d rendezvous
    hosted by node 0, ``--local-addr`` its address), each node's gloo told its link device
    (``GLOO_SOCKET_IFNAME``), as on a host with several interfaces; ffstate finds each node's daemon
    address by itself. Returns both agents' results (stdout and stderr together)."""
    import random
    import sys

    port = random.randint(20000, 60000)
    procs = []
    for node in range(2):
        node_env = {**env, "GLOO_SOCKET_IFNAME": link.devices[node]}
        node_env.pop("FFSTATE_SIMULATED_NODES", None)
        args = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(node),
                "--nproc-per-node", str(nproc), "--rdzv-backend", "c10d", "--rdzv-endpoint",
                f"{link.addresses[0]}:{port}", "--rdzv-id", f"ff{port}", "--rdzv-conf", f"is_host={int(node == 0)}",
                "--local-addr", link.addresses[node], "--max-restarts", str(restarts), *worker]
        procs.append(subprocess.Popen(link.cmd(node, args), env=node_env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    results = []
    for p in procs:
        try:
            out, _ = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            out, _ = p.communicate()
        results.append(subprocess.CompletedProcess(p.args, p.returncode, out))
    return results


UNITS = {"gbit": 1e9, "mbit": 1e6, "kbit": 1e3, "bit": 1.0}


def rate_bytes_per_s(rate: str) -> float:
    """A tc rate (``200mbit``, ``1gbit``) in bytes per second."""
    for unit, bits in UNITS.items():
        if rate.endswith(unit) and rate[: -len(unit)].replace(".", "", 1).isdigit():
            return float(rate[: -len(unit)]) * bits / 8
    raise ValueError(f"not a tc rate: {rate!r} (e.g. 200mbit, 1gbit)")


@contextlib.contextmanager
def shaped_link(rate: str = "200mbit", burst: str | None = None, latency: str = "50ms") -> Iterator[Link]:
    """Two namespaces joined by a veth pair limited to ``rate`` each way; removed on exit, always.

    ``burst`` (the token bucket's depth) defaults to one millisecond of the rate, at least 16 KiB: a
    NIC never sends faster than its rate, while a deep bucket would let every short collective
    through at the veth's speed (a 256 KB bucket at 100 Mbit/s passed FSDP2's all-gathers in 1 ms
    instead of 7, and made any other traffic look costly by spending the bucket).
    """
    if burst is None:
        burst = str(max(16 << 10, int(rate_bytes_per_s(rate) / 1000)))
    tag = uuid.uuid4().hex[:6]
    ns = (f"ff{tag}n0", f"ff{tag}n1")
    dev = (f"ff{tag}a", f"ff{tag}b")
    subnet = int(tag, 16) % 250 + 1
    addr = (f"10.77.{subnet}.1", f"10.77.{subnet}.2")
    made: list[str] = []
    try:
        for n in ns:
            _run("ip", "netns", "add", n)
            made.append(n)
        _run("ip", "link", "add", dev[0], "type", "veth", "peer", "name", dev[1])
        for i in range(2):
            _run("ip", "link", "set", dev[i], "netns", ns[i])
            inside = ("ip", "netns", "exec", ns[i])
            _run(*inside, "ip", "addr", "add", f"{addr[i]}/24", "dev", dev[i])
            _run(*inside, "ip", "link", "set", dev[i], "up")
            _run(*inside, "ip", "link", "set", "lo", "up")
            _run(*inside, "tc", "qdisc", "add", "dev", dev[i], "root", "tbf", "rate", rate, "burst", burst,
                 "latency", latency)
        yield Link(ns, addr, dev, rate)
    finally:
        subprocess.run(["ip", "link", "del", dev[0]], capture_output=True)  # if it never left the root namespace
        for n in made:  # deleting a namespace removes its end of the veth pair, and with it the pair
            for pid in subprocess.run(["ip", "netns", "pids", n], capture_output=True, text=True).stdout.split():
                with contextlib.suppress(ProcessLookupError, ValueError):
                    os.kill(int(pid), 9)
            subprocess.run(["ip", "netns", "del", n], capture_output=True)
