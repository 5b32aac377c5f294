"""Push benchmark: what one replicated version costs the holder and its sender, streamed (``Push``, a chunk a
message), in one call (``PushVersion``, which a client uses for a version no larger than one of its chunks and
at most 2 MiB: ``Client.in_one_call``) and over the daemon's bulk socket (``PushBulk``: the chunks on a plain TCP
connection, which a client uses for what does not go in one call), side by side.

A local daemon holds one rank; this process pushes and commits deltas of a float32 state to it (a version of
``--sizes`` bytes, its next step: ``w + 1e-4 * noise``, and a full version every 20), as a sending daemon's
replicator does after each commit. For each size, rounds alternate the two ways (``--rounds``, each of
``--pushes`` pushes); reported are the medians over rounds of the wall time, the holder's CPU and this process's
CPU a push (the sender's side of the call, its gRPC threads included; the versions are encoded beforehand).
Prints a table; writes ``bench/results/push.json`` and a PNG plot beside it.
"""

from __future__ import annotations

import argparse
import logging
import os
import secrets
import statistics
import time
from pathlib import Path

import torch

from ffstate import codec, wire
from ffstate.bench._report import environment, phase_order, publish, pyplot, table
from ffstate.bench.bandwidth import process_cpu, start_daemon
from ffstate.client import Client

log = logging.getLogger("ffstate.bench.push")
JOB = "bench-push"
WAYS = ("stream", "one call", "bulk socket")
CYCLE = 20  # a full version every CYCLE pushes, deltas between


def versions(nbytes: int, seed: int = 0) -> list[codec.Packed]:
    """A full version of a float32 state of ``nbytes``, then CYCLE - 1 deltas, each on the one before."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(max(1, nbytes // 4), generator=g)
    states = [{"w": w, "step": 0}]
    for step in range(1, CYCLE):
        w = w + 1e-4 * torch.randn(w.numel(), generator=g)
        states.append({"w": w, "step": step})
    return [codec.encode(states[0])] + [codec.encode(states[i], states[i - 1]) for i in range(1, CYCLE)]


def pushes(client: Client, packs: list[codec.Packed], first: int, n: int, rank: int) -> None:
    """Versions first+1 .. first+n of rank ``rank``, pushed and committed; ``first`` is a multiple of CYCLE."""
    for v in range(first + 1, first + n + 1):
        k = (v - 1) % CYCLE
        client.push_and_commit(JOB, rank, len(WAYS), v, packs[k], base_version=0 if k == 0 else v - 1)


def run(sizes: list[int], pushes_per_round: int, rounds: int, out_dir: Path) -> dict:
    n = -(-pushes_per_round // CYCLE) * CYCLE  # whole cycles: each round starts at a full version
    token = secrets.token_hex(8)
    proc, address = start_daemon(token, memory=64 * max(sizes) + (256 << 20))
    results: dict = {}
    try:
        clients = {"stream": Client(address, token, small_push_bytes=0),
                   "one call": Client(address, token, small_push_bytes=wire.SMALL_PUSH_BYTES),
                   "bulk socket": Client(address, token, small_push_bytes=0)}
        clients["stream"].bulk = clients["one call"].bulk = False  # gRPC's two ways; the third the bulk socket
        for size in sizes:
            packs = versions(size)
            per = {way: {"wall": [], "holder": [], "sender": []} for way in WAYS}
            for rank, way in enumerate(WAYS):  # a warm-up round each: connections up, buffers allocated
                pushes(clients[way], packs, 0, CYCLE, rank)
            for r in range(rounds):
                for way in phase_order(list(WAYS), r):
                    rank = WAYS.index(way)
                    holder0, sender0, t0 = process_cpu(proc.pid), process_cpu(os.getpid()), time.perf_counter()
                    pushes(clients[way], packs, (r + 1) * n, n, rank)
                    wall = time.perf_counter() - t0
                    holder1, sender1 = process_cpu(proc.pid), process_cpu(os.getpid())
                    per[way]["wall"].append(wall / n)
                    per[way]["holder"].append((holder1 - holder0) / n)
                    per[way]["sender"].append((sender1 - sender0) / n)
            for rank in range(len(WAYS)):
                clients["stream"].drop(JOB, rank, len(WAYS))
            results[str(size)] = {
                "wire_bytes_full": packs[0].nbytes, "wire_bytes_delta": statistics.median(p.nbytes for p in packs[1:]),
                # what the one-call client did: the deltas in one call each, or streamed as the other way
                "deltas_in_one_call": sum(clients["one call"].in_one_call(p) for p in packs[1:]),
                "full_in_one_call": clients["one call"].in_one_call(packs[0]),
                "ways": {way: {f"{k}_seconds": v for k, v in per[way].items()} for way in WAYS}}
            log.info("%d bytes: done", size)
        for c in clients.values():
            c.close()
    finally:
        proc.terminate()
        proc.wait(30)
    result = {"benchmark": "push", "environment": environment("cpu"),
              "config": {"sizes": sizes, "pushes_per_round": n, "rounds": rounds,
                         "small_push_bytes": wire.SMALL_PUSH_BYTES},
              "sizes": results}
    return publish(out_dir, "push", result, report, plot)


def _med(way: dict, what: str) -> float:
    return statistics.median(way[f"{what}_seconds"]) * 1e3


def report(result: dict) -> str:
    cfg = result["config"]
    rows = []
    for size, v in result["sizes"].items():
        s = v["ways"]["stream"]
        ones = v["deltas_in_one_call"]
        for way, w in v["ways"].items():
            note = "" if way != "one call" or ones == CYCLE - 1 else \
                " (streams: larger than a chunk)" if not ones else f" ({ones} of {CYCLE - 1} deltas in one call)"
            rows.append([f"{int(size) / 2**20:.2f}", f"{v['wire_bytes_delta'] / 2**20:.2f}", way + note,
                         f"{_med(w, 'wall'):.2f}", f"{_med(w, 'holder'):.2f}", f"{_med(w, 'sender'):.2f}",
                         "1.00" if way == "stream" else
                         f"{(_med(w, 'holder') + _med(w, 'sender')) / (_med(s, 'holder') + _med(s, 'sender')):.2f}"])
    head = (f"a version pushed and committed to a local daemon, full every {CYCLE}, deltas between; medians over "
            f"{cfg['rounds']} alternating rounds of {cfg['pushes_per_round']} pushes; milliseconds a push; CPU x "
            "stream: (holder + sender) against streaming")
    return "\n".join([head, "", table(rows, ["state MiB", "delta MiB", "way", "wall ms", "holder CPU ms",
                                             "sender CPU ms", "CPU x stream"])])


def plot(result: dict, path: Path) -> Path | None:
    plt = pyplot()
    if plt is None:
        return None
    sizes = list(result["sizes"])
    fig, ax = plt.subplots(figsize=(7, 4))
    for way, style in zip(WAYS, ("o-", "s--", "^:")):
        for what, color in (("holder", "tab:blue"), ("sender", "tab:orange")):
            ax.plot([int(s) / 2**20 for s in sizes], [_med(result["sizes"][s]["ways"][way], what) for s in sizes],
                    style, color=color, label=f"{what}, {way}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("state MiB a version")
    ax.set_ylabel("CPU ms a push")
    ax.set_title("a push's CPU: streamed, in one call, on the bulk socket")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sizes", default="64K,768K,1536K,8M",
                   help="bytes of state a version, comma-separated (default 64K,768K,1536K,8M: 8M's deltas are "
                        "larger than one of their chunks, and stream both ways)")
    p.add_argument("--pushes", type=int, default=200, help="pushes a round, rounded up to whole cycles of 20 "
                                                           "(default 200)")
    p.add_argument("--rounds", type=int, default=5, help="alternating rounds a way; medians are reported (default 5)")
    p.add_argument("--out", type=Path, default=Path("bench/results"), help="results folder (default: bench/results)")


def main(args: argparse.Namespace) -> int:
    from ffstate.cli import parse_bytes

    run([parse_bytes(s) for s in args.sizes.split(",")], args.pushes, args.rounds, args.out)
    return 0


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    raise SystemExit(main(parser.parse_args()))
