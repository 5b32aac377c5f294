"""``ffstate demo``: the main job, with failures, next to the same job without them.

1. torchrun, 4 CPU ranks as 2 simulated nodes (each with its own daemon), trains TinyGPT under DDP
   with a ZeRO-sharded AdamW (``demo/worker.py``). One rank is SIGKILLed after a chosen
   step; after the restart, a whole node (its two ranks and its daemon) is SIGKILLed; torchrun
   restarts the group each time and ffstate restores it from the surviving copies.
2. The same training again, without failures and without ffstate.
3. Both runs' final parameters and optimizer shards are compared bit for bit, and a report says
   where each failure hit, v*, steps lost, restore time and source, next to what a torch.save
   checkpoint every N steps would have lost and taken to reload.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from ffstate.daemon.running import stop_daemons
from ffstate.testing.bitwise import compare_runs, drop_compared


def torchrun(out: Path, steps: int, extra: list[str], env: dict, log: Path, timeout: float) -> float:
    """Runs the worker under torchrun; returns its wall time. Raises on failure, with the log's tail."""
    args = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
            "--max-restarts", "3", "-m", "ffstate.demo.worker", "--out", str(out), "--steps", str(steps), *extra]
    start = time.perf_counter()
    with open(log, "w") as f:
        proc = subprocess.run(args, stdout=f, stderr=subprocess.STDOUT, env=env, timeout=timeout)
    if proc.returncode != 0:
        tail = "".join(log.read_text().splitlines(keepends=True)[-40:])
        raise SystemExit(f"torchrun failed (exit {proc.returncode}); the end of {log}:\n{tail}")
    return time.perf_counter() - start


def checkpoint_baseline(state_file: Path, repeats: int = 3) -> tuple[float, float, int]:
    """(save seconds, load seconds, bytes) of torch.save/torch.load of one rank's state, medians."""
    state = torch.load(state_file, weights_only=True)
    path = state_file.with_suffix(".ckpt")
    saves, loads = [], []
    for _ in range(repeats):
        t = time.perf_counter()
        torch.save(state, path)
        saves.append(time.perf_counter() - t)
        t = time.perf_counter()
        torch.load(path, weights_only=True)
        loads.append(time.perf_counter() - t)
    size = path.stat().st_size
    path.unlink()
    return sorted(saves)[repeats // 2], sorted(loads)[repeats // 2], size


def main(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=max(160, Console().width))
    out = Path(args.out or tempfile.mkdtemp(prefix="ffstate-demo-"))
    failing, reference = out / "with-failures", out / "reference"
    for d in (failing, reference):
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir(parents=True)
    job = f"demo-{secrets.token_hex(4)}"
    run_dir = Path(tempfile.gettempdir()) / f"ffstate-{job}"
    env = {**os.environ, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "FFSTATE_SIMULATED_NODES": "2",
           "FFSTATE_JOB_ID": job, "FFSTATE_TOKEN": secrets.token_hex(16), "FFSTATE_BASE_PORT": str(args.base_port),
           "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    console.print(f"[bold]ffstate demo[/bold]: 4 ranks as 2 simulated nodes, TinyGPT + DDP + ZeRO AdamW, "
                  f"{args.steps} steps; rank {args.kill_rank} killed after step {args.kill_step}, node "
                  f"{args.kill_node} (ranks and daemon) after step {args.kill_node_step}. Logs in {out}")
    try:
        t_fail = torchrun(failing, args.steps, ["--kill-rank", str(args.kill_rank), "--kill-step", str(args.kill_step),
                                                "--kill-node", str(args.kill_node), "--kill-node-step",
                                                str(args.kill_node_step)], env, out / "with-failures.log", args.timeout)
        console.print(f"run with failures finished in {t_fail:.1f}s; now the reference run, without failures")
        t_ref = torchrun(reference, args.steps, ["--no-ffstate"], env, out / "reference.log", args.timeout)
    finally:
        # none after a finished run, both after a Ctrl-C: a clean stop (a daemon allows a flush 40 s), then SIGKILL
        left = stop_daemons(job, wait=45.0, kill=True)
        for kept in [*run_dir.glob("daemon-*.log"), run_dir / "events.jsonl"]:  # the daemons' logs stay with the demo's
            if kept.exists():
                shutil.copy(kept, failing / kept.name)
    failures = [json.loads(line) for line in (failing / "failures.jsonl").read_text().splitlines()]
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()
              if json.loads(line).get("event") == "restored"]
    step_time = t_ref / args.steps
    save_s, load_s, ckpt_bytes = checkpoint_baseline(reference / "final-rank0.pt")

    table = Table(title="failures and recoveries (ffstate vs a torch.save checkpoint every "
                        f"{args.ckpt_every} steps)")
    for col in ("failure", "hit after step", "v*", "steps lost", "restore (max over ranks)", "restored from",
                "checkpoint: steps lost", "checkpoint: reload"):
        table.add_column(col)
    nodes = {f"{args.host}:{args.base_port + n}": f"replica on node{n}" for n in range(2)}
    for i, f in enumerate(failures):
        what = f"rank {f['rank']} SIGKILLed" if f["failure"] == "rank" else f"node {f['node']}: 2 ranks + daemon"
        mine = sorted((e for e in events if e["attempt"] == i + 1), key=lambda e: e["rank"])
        by_source: dict[str, list[str]] = {}
        for e in mine:
            src = nodes.get(e["source"], e["source"].replace("local slots of ", "") + " slots")
            by_source.setdefault(src, []).append(str(e["rank"]))
        sources = "; ".join(f"ranks {','.join(r)}: {s}" for s, r in by_source.items())
        lost_ckpt = f["after_step"] % args.ckpt_every
        table.add_row(what, str(f["after_step"]), ",".join(sorted({str(e["version"]) for e in mine})),
                      ",".join(sorted({str(e["steps_lost"]) for e in mine})),
                      f"{max(e['restore_seconds'] for e in mine) * 1e3:.0f} ms", sources,
                      f"{lost_ckpt} ({lost_ckpt * step_time:.1f}s)", f"{load_s * 1e3:.0f} ms")
    console.print(table)
    finished = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()
                if json.loads(line).get("event") == "finished"]
    if finished and finished[0].get("razor_group"):
        share = statistics.median(e["shard_bytes"] / e["state_bytes"] for e in finished)
        group = finished[0]["razor_group"]
        console.print(f"razor: DDP keeps the parameters identical on ranks {group}, so each rank replicated its "
                      f"1/{len(group)} of them plus its own ZeRO optimizer shard: {share:.2f} of its "
                      f"{finished[0]['state_bytes'] / 1e6:.1f} MB state; every restore put the parameters back "
                      f"together from all {len(group)} ranks' parts")
    diffs = compare_runs(failing, reference, 4)
    if diffs:
        console.print(f"[bold red]NOT bit-identical[/bold red]: {len(diffs)} differences, e.g. {diffs[:5]}")
    else:
        console.print("[bold green]bit-identical[/bold green]: every parameter, optimizer shard tensor and extra of "
                      "all 4 ranks equals the run without failures, bit for bit")
    console.print(f"step time {step_time * 1e3:.0f} ms (reference run); one rank's state {ckpt_bytes / 1e6:.1f} MB: "
                  f"torch.save {save_s * 1e3:.0f} ms, torch.load {load_s * 1e3:.0f} ms. With a checkpoint every "
                  f"{args.ckpt_every} steps a failure loses {args.ckpt_every / 2:.1f} steps on average "
                  f"({args.ckpt_every / 2 * step_time:.1f}s of training) plus the reload; ffstate lost the steps above.")
    console.print(f"daemons left running: {len(left)}" + (f" (stopped: {left})" if left else ""))
    if diffs or left:
        console.print(f"kept for a look in {out}: both runs' logs and final states, the daemons' logs and the job's "
                      "events")
    elif not args.out:  # a folder of its own in the temporary folder: the states go, the logs stay
        drop_compared(failing, reference)
        console.print(f"logs (the job's, the daemons', the events) kept in {out}")
    shutil.rmtree(run_dir, ignore_errors=True)
    return 1 if diffs or left else 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--steps", type=int, default=30, help="training steps (default 30)")
    p.add_argument("--kill-rank", type=int, default=1, help="the rank SIGKILLed first (default 1)")
    p.add_argument("--kill-step", type=int, default=8, help="...right after committing this step (default 8)")
    p.add_argument("--kill-node", type=int, default=1, help="the simulated node killed second (default 1)")
    p.add_argument("--kill-node-step", type=int, default=23, help="...after this step (default 23)")
    p.add_argument("--ckpt-every", type=int, default=10, help="the torch.save baseline's cadence (default 10)")
    p.add_argument("--base-port", type=int, default=7700, help="node n's daemon listens on this + n (default 7700)")
    p.add_argument("--host", default="127.0.0.1", help=argparse.SUPPRESS)
    p.add_argument("--timeout", type=float, default=900, help="seconds per torchrun (default 900)")
    p.add_argument("--out", help="folder for logs and final states (default: a new temporary folder)")
