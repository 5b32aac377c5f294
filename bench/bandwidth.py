"""Bandwidth benchmark: gRPC push and fetch over a chunk-size sweep, next to raw TCP and gloo send/recv.

In one run, between two local processes (or, with ``--daemon HOST:PORT``, to that daemon):

- gRPC **push** (the client streams one version's chunks to a daemon, which verifies and stages
  them) and **fetch** (the daemon streams a full version back), and the same fetch over the daemon's **bulk socket**
  (a ticket from gRPC, the chunks on a plain TCP connection: what a restore uses), for each chunk size; with a local
  daemon, the CPU a push costs it and the client (seconds per GB pushed);
- a **raw TCP** socket moving the same bytes (one ``sendall``, ``recv_into`` a buffer): the ceiling;
- **gloo** ``send``/``recv`` of a uint8 tensor of the same size between two torch.distributed ranks.

The payload is incompressible (random bytes), so every chunk is full size. Medians of repeats.
Prints a table; writes ``bench/results/bandwidth.json`` and a PNG plot beside it.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import secrets
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Sequence

import numpy as np

from ffstate import codec
from ffstate.bench._report import environment, free_ports, publish, pyplot, table
from ffstate.client import Client

log = logging.getLogger("ffstate.bench.bandwidth")
JOB = "bench-bandwidth"


def _timed(fn, repeats: int) -> list[float]:
    fn()  # warm-up
    out = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        out.append(time.perf_counter() - start)
    return out


def raw_tcp(nbytes: int, repeats: int) -> list[float]:
    port = free_ports(1)
    peer = subprocess.Popen([sys.executable, "-m", "ffstate.bench._peers", "tcp-server", str(port), str(nbytes),
                             str(repeats + 1)], stdout=subprocess.PIPE, text=True)
    try:
        peer.stdout.readline()
        data = memoryview(np.random.default_rng(0).integers(0, 256, nbytes, dtype=np.uint8))
        with socket.create_connection(("127.0.0.1", port)) as s:
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

            def send() -> None:
                s.sendall(data)
                s.recv(1)

            return _timed(send, repeats)
    finally:
        peer.wait(30)


class RawPull:
    """``nbytes`` pulled over a raw TCP socket from a peer on ``host`` (run under ``prefix``, e.g. ``ip netns exec
    NS``): the ceiling of a restore's transfer on that link. Call it for one transfer; close it when done."""

    def __init__(self, nbytes: int, host: str = "127.0.0.1", prefix: Sequence[str] = ()):
        port = free_ports(1)
        self._peer = subprocess.Popen([*prefix, sys.executable, "-m", "ffstate.bench._peers", "tcp-source", host,
                                       str(port), str(nbytes)], stdout=subprocess.PIPE, text=True)
        self._peer.stdout.readline()
        self._sock = socket.create_connection((host, port))
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._view = memoryview(bytearray(nbytes))

    def __call__(self) -> None:
        self._sock.sendall(b"g")
        got, n = 0, len(self._view)
        while got < n:
            k = self._sock.recv_into(self._view[got:], n - got)
            if not k:
                raise ConnectionError("the raw TCP peer closed early")
            got += k

    def close(self) -> None:
        self._sock.close()
        self._peer.wait(30)


def gloo(nbytes: int, repeats: int) -> list[float]:
    port = free_ports(1)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, "-m", "ffstate.bench._peers", "gloo", str(r), str(port), str(nbytes),
                               str(repeats)], stdout=subprocess.PIPE, text=True, env=env) for r in (0, 1)]
    out = procs[0].communicate(timeout=600)[0]
    procs[1].wait(60)
    return json.loads(out.strip().splitlines()[-1])


def start_daemon(token: str, memory: int, host: str = "127.0.0.1", prefix: Sequence[str] = (),
                 extra: Sequence[str] = ()) -> tuple[subprocess.Popen, str]:
    """An ``ffstate serve`` on ``host`` (run under ``prefix``, e.g. ``ip netns exec NS``; ``extra``: more flags);
    (process, address)."""
    proc = subprocess.Popen([*prefix, sys.executable, "-m", "ffstate.cli", "serve", "--node-id", "bench", "--host", host,
                             "--port", "0", "--memory-limit", str(memory), "--max-chunk-bytes", "64M", *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            env={**os.environ, "FFSTATE_TOKEN": token})
    line = proc.stdout.readline()
    if "listening on" not in line:
        proc.kill()
        raise SystemExit(f"could not start a daemon: {line!r}")
    return proc, line.rsplit(" ", 1)[-1].strip()


def process_cpu(pid: int) -> float | None:
    """CPU seconds (user + system) process ``pid`` has used; None where /proc cannot say."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def grpc_sweep(address: str, token: str, nbytes: int, chunks: list[int], repeats: int, progress,
               holder_pid: int | None = None) -> dict:
    """Push and fetch times per chunk size; with ``holder_pid`` (a local daemon), the CPU a push costs the holder
    and this client, seconds per GB pushed (over the warm-up and the repeats)."""
    data = {"w": np.random.default_rng(1).integers(0, 256, nbytes, dtype=np.uint8)}
    out = {}
    with Client(address, token, timeout=120) as c, Client(address, token, timeout=120) as g:
        g.bulk = False  # Fetch over gRPC; ``c`` fetches over the daemon's bulk socket where it has one
        for cs in chunks:
            packed = codec.encode(data, chunk_bytes=cs)
            holder0, client0 = process_cpu(holder_pid) if holder_pid else None, process_cpu(os.getpid())
            push = _timed(lambda: c.push(JOB, 0, 1, 1, packed), repeats)
            holder1, client1 = process_cpu(holder_pid) if holder_pid else None, process_cpu(os.getpid())
            gb = (repeats + 1) * nbytes / 1e9
            c.commit(JOB, 0, 1, 1)
            fetch = _timed(lambda: g.fetch_chunks(JOB, 0, 1, 1), repeats)
            bulk = _timed(lambda: c.fetch_chunks(JOB, 0, 1, 1), repeats) if c.bulk else None
            out[cs] = {"push": push, "fetch": fetch, "bulk": bulk if c.bulk else None, "wire_bytes": packed.nbytes,
                       "holder_cpu": (holder1 - holder0) / gb if holder0 is not None and holder1 is not None else None,
                       "client_cpu": (client1 - client0) / gb if client0 is not None and client1 is not None else None}
            progress()
        c.drop(JOB)
    return out


def run(nbytes: int, chunks: list[int], repeats: int, daemon: str | None, out_dir: Path) -> dict:
    from rich.progress import Progress

    token = os.environ.get("FFSTATE_TOKEN") or secrets.token_hex(8)
    proc = None
    if daemon is None:
        proc, daemon = start_daemon(token, memory=6 * nbytes + (256 << 20))
    try:
        with Progress(transient=True) as bar:
            task = bar.add_task("measuring", total=len(chunks) + (0 if proc is None else 2))
            step = lambda: bar.advance(task)  # noqa: E731
            sweep = grpc_sweep(daemon, token, nbytes, chunks, repeats, step, proc.pid if proc is not None else None)
            tcp = gloo_t = None
            if proc is not None:  # the baselines run between local processes only
                tcp = raw_tcp(nbytes, repeats)
                step()
                gloo_t = gloo(nbytes, repeats)
                step()
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(30)
    gbps = lambda ts: nbytes / statistics.median(ts) / 1e9  # noqa: E731
    result = {
        "benchmark": "bandwidth",
        "environment": environment("cpu"),
        "config": {"nbytes": nbytes, "repeats": repeats, "daemon": daemon if proc is None else "local subprocess"},
        "grpc": {str(cs): {"push_GBps": gbps(v["push"]), "fetch_GBps": gbps(v["fetch"]), "wire_bytes": v["wire_bytes"],
                           "push_seconds": v["push"], "fetch_seconds": v["fetch"],
                           "bulk_fetch_GBps": gbps(v["bulk"]) if v["bulk"] else None, "bulk_fetch_seconds": v["bulk"],
                           "push_holder_cpu_s_per_GB": v["holder_cpu"], "push_client_cpu_s_per_GB": v["client_cpu"]}
                 for cs, v in sweep.items()},
    }
    if tcp is not None:
        result["raw_tcp"] = {"GBps": gbps(tcp), "seconds": tcp}
        result["gloo"] = {"GBps": gbps(gloo_t), "seconds": gloo_t}
        best = max(sweep, key=lambda cs: min(gbps(sweep[cs]["push"]), gbps(sweep[cs]["fetch"])))
        result["best_chunk_bytes"] = best
    return publish(out_dir, "bandwidth", result, report, plot)


def report(result: dict) -> str:
    cfg = result["config"]
    tcp = result.get("raw_tcp", {}).get("GBps")
    rows = []
    cpu = lambda x: "-" if x is None else f"{x:.2f}"  # noqa: E731
    for cs, v in result["grpc"].items():
        for what in ("push", "fetch", "bulk_fetch"):
            g = v.get(f"{what}_GBps")
            if g is None:  # a daemon without the bulk socket
                continue
            name = "bulk socket fetch" if what == "bulk_fetch" else f"gRPC {what}"
            rows.append([name, f"{int(cs) >> 10} KiB", f"{g:.3f}", f"{g / tcp:.2f}" if tcp else "-",
                         *((cpu(v.get("push_holder_cpu_s_per_GB")), cpu(v.get("push_client_cpu_s_per_GB")))
                           if what == "push" else ("-", "-"))])
    if tcp:
        rows.append(["raw TCP", "-", f"{tcp:.3f}", "1.00", "-", "-"])
        rows.append(["gloo send/recv", "-", f"{result['gloo']['GBps']:.3f}", f"{result['gloo']['GBps'] / tcp:.2f}",
                     "-", "-"])
    head = (f"{cfg['nbytes'] >> 20} MiB per transfer to {cfg['daemon']}, median of {cfg['repeats']}; a push's CPU: the "
            "holder's and this client's, seconds per GB pushed")
    lines = [head, "", table(rows, ["transport", "chunk", "GB/s", "x raw TCP", "holder CPU s/GB", "client CPU s/GB"])]
    if "best_chunk_bytes" in result:
        lines.append(f"\nbest chunk size (highest of min(push, fetch)): {result['best_chunk_bytes'] >> 10} KiB")
    return "\n".join(lines)


def plot(result: dict, path: Path) -> Path | None:
    plt = pyplot()
    if plt is None:
        return None
    sizes = [int(cs) for cs in result["grpc"]]
    fig, ax = plt.subplots(figsize=(7, 4))
    for what in ("push", "fetch", "bulk_fetch"):
        ys = [result["grpc"][str(s)].get(f"{what}_GBps") for s in sizes]
        if None not in ys:
            ax.plot([s >> 10 for s in sizes], ys, "o-", label="bulk socket fetch" if what == "bulk_fetch" else f"gRPC {what}")
    if "raw_tcp" in result:
        ax.axhline(result["raw_tcp"]["GBps"], color="k", ls="--", label="raw TCP")
        ax.axhline(result["gloo"]["GBps"], color="grey", ls=":", label="gloo send/recv")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("chunk size (KiB)")
    ax.set_ylabel("GB/s")
    ax.set_title(f"loopback, {result['config']['nbytes'] >> 20} MiB per transfer")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def add_arguments(p: argparse.ArgumentParser) -> None:
    from ffstate.cli import parse_bytes

    p.add_argument("--size", type=parse_bytes, default=256 << 20, help="bytes per transfer (default 256M)")
    p.add_argument("--chunks", default="256K,1M,4M,16M", help="chunk sizes to sweep (default 256K,1M,4M,16M)")
    p.add_argument("--repeats", type=int, default=5, help="timed repeats; medians are reported (default 5)")
    p.add_argument("--daemon", help="HOST:PORT of a running daemon to measure instead of a local one "
                                    "(token from $FFSTATE_TOKEN; no baselines then)")
    p.add_argument("--out", type=Path, default=Path("bench/results"), help="results folder (default: bench/results)")


def main(args: argparse.Namespace) -> int:
    from ffstate.cli import parse_bytes

    chunks = [parse_bytes(c) for c in args.chunks.split(",")]
    run(args.size, chunks, args.repeats, args.daemon, args.out)
    return 0


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    raise SystemExit(main(parser.parse_args()))
