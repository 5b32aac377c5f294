"""Scale by simulation: does replication fit in the idle network time of a real training step?

A model of one training step's network use per node, for a given model size, data/tensor parallel
sizes, NIC bandwidth and per-step compute time, with k replicas. It reports, per node and step:
the training's own traffic (the data-parallel gradient all-reduce), the fraction of the link it
leaves idle, the bytes ffstate replicates (with the razor and without), the time they take, the
replication lag in steps, and the expected step-time overhead.

Assumptions (each a parameter; the defaults are stated in ``--help`` and the README):

- the step time is compute bound: ``6 * params * tokens_per_step / (gpus * peak_flops * mfu)``,
  H100 bf16 peak 989 TFLOP/s, MFU 0.4, 4M tokens per step;
- tensor parallelism stays inside a node (NVLink); the data-parallel all-reduce of bf16 gradients
  is hierarchical, so each node's NIC carries ``2 * (N - 1) / N`` times the gradient bytes of one
  tensor-parallel shard set (N nodes in the ring), and it is not overlapped with replication;
- the training state is 16 bytes per parameter (bf16 weights and gradients, fp32 master weights and
  two Adam moments); with the razor every byte is replicated once per job, spread evenly over the
  nodes; without it, every data-parallel rank replicates the state it holds (DP times the bytes);
- calibrated here: the bytes on the wire per step are ``wire_ratio`` (0.73, what ``ffstate bench
  overhead --size medium`` measured: 7.53 MB on the wire for 10.32 MB replicated per rank per step)
  of the raw bytes, and a link moves ``link_efficiency`` (0.95: a 200 Mbit/s tc link moved 191
  Mbit/s here) of its rate;
- replication uses the idle link time; when it needs more, the lag grows until the scheduler's
  deadline sends it anyway, and the excess is the overhead (k replicas: k times the bytes).

Usage: ``python -m ffstate.bench.simulate [--out bench/results]`` (or ``ffstate bench simulate``).
Prints the table for 7B on 64 GPUs and 70B on 1024 GPUs at 100, 200 and 400 Gbit/s; writes
``bench/results/simulate.json``.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import asdict, dataclass
from pathlib import Path

from ffstate.bench._report import table, write_json

PEAK_FLOPS = 989e12  # H100 SXM bf16 dense
STATE_BYTES_PER_PARAM = 16  # bf16 weights + bf16 grads + fp32 master + 2 fp32 Adam moments
GRAD_BYTES_PER_PARAM = 2


@dataclass(frozen=True)
class Job:
    name: str
    params: float
    gpus: int
    tp: int  # tensor parallel, inside a node
    gpus_per_node: int = 8
    tokens_per_step: float = 4e6
    mfu: float = 0.4

    @property
    def nodes(self) -> int:
        return self.gpus // self.gpus_per_node

    @property
    def dp(self) -> int:
        return self.gpus // self.tp

    @property
    def step_seconds(self) -> float:
        return 6 * self.params * self.tokens_per_step / (self.gpus * PEAK_FLOPS * self.mfu)


def simulate(job: Job, gbit: float, k: int = 1, razor: bool = True, wire_ratio: float = 0.73,
             link_efficiency: float = 0.95, max_lag: int = 4) -> dict:
    """One step of ``job`` on NICs of ``gbit`` Gbit/s per node, k replicas; see the module docstring."""
    link = gbit * 1e9 / 8 * link_efficiency  # bytes per second per node
    step = job.step_seconds
    shard_set = GRAD_BYTES_PER_PARAM * job.params / job.tp  # gradient bytes of one tensor-parallel shard set
    ring = job.nodes
    train_bytes = 2 * (ring - 1) / ring * shard_set if ring > 1 else 0.0
    train_seconds = train_bytes / link
    idle_seconds = max(step - train_seconds, 0.0)
    state = STATE_BYTES_PER_PARAM * job.params * (1 if razor else job.dp)
    repl_bytes = k * wire_ratio * state / job.nodes
    repl_seconds = repl_bytes / link
    fits = repl_seconds <= idle_seconds
    lag = 1 if fits else (max_lag if idle_seconds == 0 else min(max_lag, math.ceil(repl_seconds / max(idle_seconds, 1e-9))))
    overhead = 0.0 if fits else (repl_seconds - idle_seconds) / step
    return {"job": job.name, "gbit": gbit, "k": k, "razor": razor, "step_seconds": step,
            "train_bytes_per_node": train_bytes, "idle_fraction": idle_seconds / step,
            "replicated_bytes_per_node": repl_bytes, "replication_seconds": repl_seconds,
            "lag_steps": lag, "overhead": overhead}


JOBS = [Job("7B / 64 GPUs (DP 64)", 7e9, 64, tp=1), Job("70B / 1024 GPUs (TP 8, DP 128)", 70e9, 1024, tp=8)]


def run(out_dir: Path, rates: tuple[float, ...] = (100, 200, 400)) -> dict:
    rows = [simulate(job, g, k, razor) for job in JOBS for g in rates for k in (1, 2) for razor in (True, False)]
    result = {"benchmark": "simulate", "jobs": [asdict(j) for j in JOBS], "rows": rows}
    path = write_json(out_dir, "simulate", result)
    print(report(result))
    print(f"\nwrote {path}")
    return result


def report(result: dict) -> str:
    out = []
    for r in result["rows"]:
        out.append([r["job"], f"{r['gbit']:.0f}", str(r["k"]), "on" if r["razor"] else "off", f"{r['step_seconds']:.1f}",
                    f"{r['idle_fraction']:.0%}", f"{r['replicated_bytes_per_node'] / 1e9:.1f}",
                    f"{r['replication_seconds']:.2f}", str(r["lag_steps"]), f"{r['overhead']:.0%}"])
    return table(out, ["job", "Gbit/s", "k", "razor", "step s", "link idle", "GB/node/step", "repl s", "lag",
                       "overhead"])


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", type=Path, default=Path("bench/results"), help="results folder (default: bench/results)")


def main(args: argparse.Namespace) -> int:
    run(args.out)
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    raise SystemExit(main(parser.parse_args()))
