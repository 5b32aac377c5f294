"""Overhead benchmark: step time and bytes replicated per step, ffstate off and on, razor off and on, in one run.

torchrun with 4 CPU ranks as 2 simulated nodes (each with its own ``ffstate serve`` daemon, started
here) trains TinyGPT under DDP (plain AdamW: model and optimizer state identical across the group)
and under DDP with a ZeroRedundancyOptimizer (parameters identical, optimizer shards per rank). In
each job the modes run in interleaved phases (``bench/_overhead_worker.py``):

- ``off``: no ffstate;
- ``razor-off``: ffstate replicating every rank's whole state to the other node;
- ``razor-on``: ffstate replicating each byte once per data-parallel group.

Reported per parallelism and mode: the median step time and its ratio to ``off``; the bytes each
rank replicates per step (on the wire: deltas, after compaction) and the raw size of what it
replicates (its whole state, or its own entries plus its part). Prints a table; writes
``bench/results/overhead.json`` and a PNG plot beside it.

Usage: ``ffstate bench overhead [--parallel ddp,ddp-zero] [--razor on,off] [--steps 10] [--repeats 3]``.
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
import tempfile
from pathlib import Path

from ffstate.bench._report import environment, pyplot, table, write_json
from ffstate.bench.bandwidth import _free_port
from ffstate.bench.codec import SIZES

log = logging.getLogger("ffstate.bench.overhead")
NODES = 2


def _serve(port: int, node: int, token: str, log_path: Path) -> subprocess.Popen:
    with open(log_path, "w") as out:
        return subprocess.Popen([sys.executable, "-m", "ffstate.cli", "serve", "--port", str(port), "--node-id",
                                 f"node{node}"], stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, "FFSTATE_TOKEN": token})


def _free_base(n: int) -> int:
    for _ in range(50):
        base = _free_port()
        try:
            for port in range(base, base + n):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
    raise SystemExit("no free ports for the daemons")


def run_job(parallel: str, modes: list[str], steps: int, repeats: int, size: str, work: Path) -> list[dict]:
    token, base = secrets.token_hex(8), _free_base(NODES)
    out = work / parallel
    out.mkdir(parents=True, exist_ok=True)
    daemons = [_serve(base + n, n, token, work / f"daemon-{parallel}-{n}.log") for n in range(NODES)]
    env = {**os.environ, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "FFSTATE_SIMULATED_NODES": str(NODES),
           "FFSTATE_BASE_PORT": str(base), "FFSTATE_TOKEN": token, "FFSTATE_JOB_ID": f"overhead-{parallel}",
           "OMP_NUM_THREADS": "1", "TMPDIR": str(work)}
    args = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4", "-m",
            "ffstate.bench._overhead_worker", "--out", str(out), "--parallel", parallel, "--modes", ",".join(modes),
            "--steps", str(steps), "--repeats", str(repeats), "--size", size]
    try:
        log_path = work / f"torchrun-{parallel}.log"
        with open(log_path, "w") as f:
            proc = subprocess.run(args, stdout=f, stderr=subprocess.STDOUT, env=env, timeout=3600)
        if proc.returncode != 0:
            tail = "".join(log_path.read_text().splitlines(keepends=True)[-30:])
            raise SystemExit(f"the {parallel} job failed (exit {proc.returncode}):\n{tail}")
    finally:
        for d in daemons:
            d.terminate()
            d.wait(30)
    return [json.loads((out / f"overhead-rank{r}.json").read_text()) for r in range(4)]


def summarize(parallel: str, ranks: list[dict], modes: list[str]) -> dict:
    out = {}
    for mode in modes:
        per_rank = [r["results"][mode] for r in ranks]
        # A step takes as long as its slowest rank: the median over steps of the per-step maximum.
        step = statistics.median(max(ts) for ts in zip(*(p["step_seconds"] for p in per_rank)))
        row = {"step_seconds": step}
        if mode != "off":
            row["wire_bytes_per_step_per_rank"] = statistics.median(
                p["wire_bytes"] / p["wire_versions"] for p in per_rank if p["wire_versions"])
            row["replicated_bytes_per_rank"] = statistics.median(p["shard_bytes"] for p in per_rank)
            row["state_bytes_per_rank"] = statistics.median(p["state_bytes"] for p in per_rank)
        out[mode] = row
    for row in out.values():
        row["step_ratio"] = row["step_seconds"] / out["off"]["step_seconds"] if "off" in out else None
    return out


def run(parallels: list[str], razor: list[str], steps: int, repeats: int, size: str, out_dir: Path) -> dict:
    modes = ["off"] + [f"razor-{r}" for r in razor]
    result = {"benchmark": "overhead", "environment": environment("cpu"),
              "config": {"parallel": parallels, "modes": modes, "steps_per_phase": steps, "repeats": repeats,
                         "size": size, "ranks": 4, "nodes": NODES, "replicas": 1}, "jobs": {}}
    with tempfile.TemporaryDirectory(prefix="ffstate-overhead-") as tmp:
        for parallel in parallels:
            ranks = run_job(parallel, modes, steps, repeats, size, Path(tmp))
            result["jobs"][parallel] = summarize(parallel, ranks, modes)
    path = write_json(out_dir, "overhead", result)
    print(report(result))
    print(f"\nwrote {path}")
    png = plot(result, out_dir / "overhead.png")
    if png:
        print(f"wrote {png}")
    return result


def report(result: dict) -> str:
    rows = []
    for parallel, job in result["jobs"].items():
        full = job.get("razor-off", {}).get("wire_bytes_per_step_per_rank")
        for mode, row in job.items():
            wire = row.get("wire_bytes_per_step_per_rank")
            rows.append([parallel, mode, f"{row['step_seconds'] * 1e3:.0f}",
                         f"{row['step_ratio']:.3f}" if row.get("step_ratio") else "-",
                         f"{wire / 1e6:.3f}" if wire else "-",
                         f"{wire / full:.2f}" if wire and full else "-",
                         f"{row['replicated_bytes_per_rank'] / 1e6:.2f} of {row['state_bytes_per_rank'] / 1e6:.2f}"
                         if "replicated_bytes_per_rank" in row else "-"])
    cfg = result["config"]
    head = (f"TinyGPT-{cfg['size']}, {cfg['ranks']} ranks as {cfg['nodes']} nodes, k={cfg['replicas']}; "
            f"{cfg['repeats']} interleaved phases of {cfg['steps_per_phase']} steps per mode; medians")
    return "\n".join([head, "", table(rows, ["parallel", "mode", "step ms", "x off", "wire MB/step/rank",
                                             "x razor-off", "replicated MB of state MB"])])


def plot(result: dict, path: Path) -> Path | None:
    plt = pyplot()
    if plt is None:
        return None
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.6))
    labels, wire, ratio = [], [], []
    for parallel, job in result["jobs"].items():
        for mode, row in job.items():
            labels.append(f"{parallel}\n{mode}")
            wire.append(row.get("wire_bytes_per_step_per_rank", 0) / 1e6)
            ratio.append(row.get("step_ratio") or 0)
    left.bar(labels, wire, color="tab:blue")
    left.set_ylabel("MB per step per rank (wire)")
    right.bar(labels, ratio, color="tab:orange")
    right.axhline(1.0, color="k", lw=0.8)
    right.set_ylabel("step time / ffstate off")
    for ax in (left, right):
        ax.tick_params(axis="x", labelsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--parallel", default="ddp,ddp-zero", help="jobs to run: ddp, ddp-zero (default: both)")
    p.add_argument("--razor", default="off,on", help="razor settings to compare, beside ffstate off (default: off,on)")
    p.add_argument("--steps", type=int, default=10, help="steps per phase; the first two are not timed (default 10)")
    p.add_argument("--repeats", type=int, default=3, help="interleaved phases per mode (default 3)")
    p.add_argument("--size", choices=sorted(SIZES), default="small", help="TinyGPT size (default: small)")
    p.add_argument("--out", type=Path, default=Path("bench/results"), help="results folder (default: bench/results)")


def main(args: argparse.Namespace) -> int:
    parallels = [x for x in args.parallel.split(",") if x]
    razor = [x for x in args.razor.split(",") if x]
    if not set(parallels) <= {"ddp", "ddp-zero"} or not set(razor) <= {"on", "off"} or args.steps < 4:
        raise SystemExit("--parallel takes ddp and/or ddp-zero, --razor on and/or off, --steps at least 4")
    run(parallels, razor, args.steps, args.repeats, args.size, args.out)
    return 0


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    raise SystemExit(main(parser.parse_args()))
