"""Downtime benchmark: the same job losing the same ranks at the same steps, under plain torchrun (every worker
restarted) and in the mode where survivors stay in their processes (``ffstate.inprocess``), side by side in one run.

The job is ``_downtime_worker.py`` (the README's DDP loop, 4 ranks as 2 simulated nodes, TinyGPT + AdamW); every
``--gap`` steps one rank SIGKILLs itself right after its commit, ``--failures`` times, ranks taken in turn. Under
torchrun its agent restarts the group (``--max-restarts``); in-process each node launches ``ceil(failures / 2)``
warm spares beside its 2 ranks. Per failure, from the processes' own marks (``progress.jsonl``):

- **downtime**: the kill to the first step every rank committed after it;
- **start**: the kill to the first moment the next attempt runs: a survivor re-entering the training function
  in-process (the engine found the death, stopped the others' collectives), a new worker's process starting under
  torchrun (the agent found the death, stopped the others, started new ones);
- **group**: from there to the new process group (imports and rendezvous under torchrun);
- **restore**: ffstate's entry: v* agreed, every rank's state loaded (slots, or a peer);
- **first step**: from the restore to the first commit after it.

Medians over the failures; both jobs must end with the same state, bit for bit (every rank's final state compared;
a difference fails the benchmark, its logs kept). Prints a table; writes ``bench/results/downtime.json``, a PNG and
a dated record.

Usage: ``ffstate bench downtime [--failures 5] [--gap 8] [--step-seconds 0]``.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import secrets
import statistics
import subprocess
import sys
import time
from pathlib import Path

from ffstate.bench._report import environment, free_ports, kept_on_failure, publish, pyplot, table
from ffstate.testing.bitwise import compare_runs

log = logging.getLogger("ffstate.bench.downtime")
RANKS, NODES = 4, 2
ORDER = (1, 3, 1, 2, 0, 3, 2, 0)  # the ranks that fail, in turn
WORKER = [sys.executable, "-m", "ffstate.bench._downtime_worker"]


def schedule(failures: int, gap: int) -> list[tuple[int, int]]:
    """(rank, step) of each failure."""
    return [(ORDER[i % len(ORDER)], (i + 1) * gap) for i in range(failures)]


def inprocess_kills(failures: list[tuple[int, int]], spares: int) -> list[tuple[int, int]]:
    """The processes (launch ranks) that hold each failing rank at its step: a node's spares take its dead ranks in
    launch order (``ffstate/inprocess/assignment.py``)."""
    per, machine = RANKS // NODES, RANKS // NODES + spares
    holder = [n * machine + j for n in range(NODES) for j in range(per)]
    idle = {n: [n * machine + per + j for j in range(spares)] for n in range(NODES)}
    out = []
    for rank, step in failures:
        out.append((holder[rank], step))
        holder[rank] = idle[rank // per].pop(0)
    return out


def _env(work: Path) -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "FFSTATE_SIMULATED_NODES": str(NODES), "TMPDIR": str(work),
            "FFSTATE_JOB_ID": f"downtime-{secrets.token_hex(4)}", "FFSTATE_TOKEN": secrets.token_hex(16),
            "FFSTATE_BASE_PORT": str(free_ports(NODES)), "TORCH_CPP_LOG_LEVEL": "ERROR"}


def run_torchrun(work: Path, steps: int, failures: list[tuple[int, int]], step_seconds: float, timeout: float) -> None:
    env = {**_env(work), "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    kills = [a for rank, step in failures for a in ("--kill", f"{rank}:{step}")]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(RANKS),
           "--max-restarts", str(len(failures)), "-m", "ffstate.bench._downtime_worker", str(work), str(steps),
           "--mode", "torchrun", "--step-seconds", str(step_seconds), *kills]
    with open(work / "torchrun.log", "w") as out:
        got = subprocess.run(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, timeout=timeout)
    if got.returncode:
        raise SystemExit(f"the torchrun job failed (exit {got.returncode}); see {work / 'torchrun.log'}")


def run_inprocess(work: Path, steps: int, failures: list[tuple[int, int]], step_seconds: float,
                  timeout: float) -> None:
    spares = math.ceil(len(failures) / NODES)
    processes = NODES * (RANKS // NODES + spares)
    port = free_ports(2)
    env = {**_env(work), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(processes),
           "FFSTATE_SPARES": str(spares), "FFSTATE_SPARE_NODES": "0"}
    kills = [a for p, step in inprocess_kills(failures, spares) for a in ("--kill", f"{p}:{step}")]
    cmd = [*WORKER, str(work), str(steps), "--mode", "inprocess", "--step-seconds", str(step_seconds), *kills]
    procs = [subprocess.Popen(cmd, env={**env, "RANK": str(r)}, stdout=open(work / f"process{r}.log", "w"),
                              stderr=subprocess.STDOUT) for r in range(processes)]
    deadline = time.monotonic() + timeout
    try:
        codes = [p.wait(max(1.0, deadline - time.monotonic())) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        ready = work / f"ffstate-{env['FFSTATE_JOB_ID']}" / f"stores-{port}.ready"  # this job's host alone
        subprocess.run(["pkill", "-f", f"ffstate.inprocess.store --ready {ready} "], check=False)
    bad = [(r, c) for r, c in enumerate(codes) if c not in (0, -9)]
    if bad or codes.count(-9) != len(failures):
        raise SystemExit(f"the in-process job failed (exit codes {codes}); see {work}/process*.log")


def breakdown(work: Path) -> list[dict]:
    """Per failure: downtime and its parts, from the processes' marks."""
    rows = [json.loads(line) for line in (work / "progress.jsonl").read_text().splitlines()]
    kills = [r for r in rows if "kill" in r]
    out = []
    for i, k in enumerate(kills):
        until = kills[i + 1]["time"] if i + 1 < len(kills) else float("inf")
        after = [r for r in rows if k["time"] < r["time"] < until]
        events = {e: [r["time"] for r in after if r.get("event") == e] for e in ("started", "group", "restored")}
        commits = {}
        for r in after:
            if "step" in r and r["rank"] not in commits and any(t <= r["time"] for t in events["restored"]):
                commits[r["rank"]] = r["time"]
        if not events["group"] or len(commits) < RANKS:
            raise SystemExit(f"failure {i + 1}: no complete restart in the marks of {work}")
        begun = min(events["started"] or events["group"])  # in-process: the survivors re-enter at the group
        group, restored, first = max(events["group"]), max(events["restored"]), max(commits.values())
        out.append({"killed": k["kill"], "downtime": first - k["time"], "start": begun - k["time"],
                    "group": group - begun, "restore": restored - group, "first_step": first - restored})
    return out


def run(failures: int, gap: int, step_seconds: float, out_dir: Path, timeout: float = 900) -> dict:
    plan = schedule(failures, gap)
    steps = (failures + 1) * gap
    result = {"benchmark": "downtime", "environment": environment("cpu"),
              "config": {"ranks": RANKS, "nodes": NODES, "failures": failures, "gap": gap, "steps": steps,
                         "step_seconds": step_seconds, "spares_per_node": math.ceil(failures / NODES),
                         "schedule": plan}, "modes": {}}
    with kept_on_failure("downtime") as work:
        for mode, runner in (("torchrun", run_torchrun), ("inprocess", run_inprocess)):
            d = work / mode
            d.mkdir()
            log.info("%s: %d failures, one every %d steps", mode, failures, gap)
            runner(d, steps, plan, step_seconds, timeout)
            rows = breakdown(d)
            result["modes"][mode] = {"failures": rows, **{f"median_{k}": statistics.median(r[k] for r in rows)
                                                          for k in ("downtime", "start", "group", "restore",
                                                                    "first_step")}}
        diffs = compare_runs(work / "torchrun", work / "inprocess", RANKS)
        result["same_final_state"] = not diffs
        if diffs:  # the two modes trained the same job through the same failures: a difference is a bug
            raise RuntimeError(f"the two modes ended in different states ({len(diffs)} differences), e.g. {diffs[:3]}")
    return publish(out_dir, "downtime", result, report, plot)


def report(result: dict) -> str:
    cfg = result["config"]
    rows = [[mode, str(len(m["failures"])), f"{m['median_downtime']:.3f}", f"{m['median_start']:.3f}",
             f"{m['median_group']:.3f}", f"{m['median_restore']:.3f}", f"{m['median_first_step']:.3f}",
             " ".join(f"{r['downtime']:.2f}" for r in m["failures"])] for mode, m in result["modes"].items()]
    head = (f"DDP, {cfg['ranks']} ranks as {cfg['nodes']} nodes, TinyGPT + AdamW; a rank SIGKILLed every {cfg['gap']} "
            f"steps, {cfg['failures']} times; in-process: {cfg['spares_per_node']} warm spares a node; seconds, "
            f"medians over the failures; final states the same in both modes: {result['same_final_state']}")
    return "\n".join([head, "", table(rows, ["mode", "failures", "downtime", "start", "group", "restore",
                                             "first step", "each failure's downtime"])])


def plot(result: dict, path: Path) -> Path | None:
    plt = pyplot()
    if plt is None:
        return None
    fig, ax = plt.subplots(figsize=(6.5, 3.2))
    parts = ("start", "group", "restore", "first_step")
    modes = list(result["modes"])
    left = [0.0] * len(modes)
    for part in parts:
        widths = [result["modes"][m][f"median_{part}"] for m in modes]
        ax.barh(modes, widths, left=left, label=part.replace("_", " "))
        left = [a + b for a, b in zip(left, widths)]
    ax.set_xlabel("seconds from the kill to the next step (medians)")
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return path


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--failures", type=int, default=5, help="ranks SIGKILLed, one at a time (default 5)")
    p.add_argument("--gap", type=int, default=8, help="steps between failures (default 8)")
    p.add_argument("--step-seconds", type=float, default=0.0, help="each step takes at least this long (default 0)")
    p.add_argument("--out", type=Path, default=Path("bench/results"), help="results folder (default: bench/results)")


def main(args: argparse.Namespace) -> int:
    if args.failures < 1 or args.gap < 2:
        raise SystemExit("--failures >= 1 and --gap >= 2")
    run(args.failures, args.gap, args.step_seconds, args.out)
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    sys.exit(main(parser.parse_args()))
