"""Chaos benchmark: one torchrun job under a seeded schedule of many failures, ending bit-identical.

The demo's job (4 CPU ranks as 2 simulated nodes, TinyGPT under DDP with a ZeRO-sharded AdamW,
``demo/worker.py``) runs under a schedule drawn from ``--seed`` (``demo/faults.py``): ranks
SIGKILLed at random points of a step (right after the commit, after the backward, inside the commit
with the slot half written, or at a random time into the step), whole nodes lost (their ranks and
their daemon), daemons alone SIGKILLed while training goes on, and two in a row (a rank killed, then
another right after the group's restore). torchrun restarts the group after each; ffstate restores it.

Measured while it runs, every 0.25 s, per node: the daemon's RSS, the bytes it accounts against its
budget (Inventory), and the job's shared memory in /dev/shm. Then the same training without failures
and without ffstate, and both runs' final parameters, optimizer shards and extras compared bit for bit.

Reported: each failure (kind, step, v*, steps lost, downtime: the kill to the first step committed
after it), a summary per kind, each daemon's RSS and accounted bytes first and last, and after the job
the bytes still accounted by each daemon that exited at the job's end, once stopped (its offers and calls
closed), and the job's files left in /dev/shm.

Usage: ``ffstate bench chaos [--failures 20] [--seed 0] [--gap 4]``. Prints a table; writes
``bench/results/chaos.json`` and a PNG of memory over time with the failures marked.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import secrets
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from ffstate.bench._report import environment, free_ports, publish, pyplot, table
from ffstate.daemon.running import stop_daemons
from ffstate.demo.faults import HANG_PHASES, PHASES
from ffstate.testing.bitwise import compare_runs, drop_compared

WORLD, NODES = 4, 2
WARMUP = 3  # steps before the first failure
SAMPLE = 0.25  # seconds between memory samples
# With hangs in the schedule: the watchdog's deadline floor and first-steps allowance for the job (seconds; the
# defaults, 60 and 600, are for real jobs' step times and would make each hang here cost a minute).
HANG_FLOOR, HANG_STARTUP = 5.0, 30.0


def draw_schedule(seed: int, failures: int, gap: int, hangs: int = 0) -> tuple[list[dict], int]:
    """``failures`` failures, every kind at least once where there are four or more, and ``hangs`` hangs, ``gap``
    steps apart (twice that after a daemon's loss, whose replacement is re-seeded with full versions, and after a
    hang; two more before a hang, so that the watchdog knows the step since the last restart); returns them and the
    steps the job needs."""
    rng = random.Random(seed)
    kinds = ["rank", "node", "daemon", "double"][:failures]
    kinds += rng.choices(["rank", "node", "daemon", "double"], weights=[5, 2, 2, 1], k=failures - len(kinds))
    kinds += ["hang"] * hangs
    rng.shuffle(kinds)
    out, step = [], WARMUP
    for kind in kinds:
        step += gap * (2 if out and out[-1]["kind"] in ("daemon", "hang") else 1) + (2 if kind == "hang" else 0)
        f: dict = {"kind": kind, "step": step}
        if kind == "hang":
            f["rank"], f["phase"] = rng.randrange(WORLD), rng.choice(HANG_PHASES)
            out.append(f)
            continue
        if kind in ("rank", "double"):
            f["rank"] = rng.randrange(WORLD)
            f["phase"] = rng.choice(PHASES)
            if f["phase"] == "timer":
                f["delay"] = round(rng.uniform(0.0, 0.15), 3)
            if kind == "double":
                f["then"] = rng.choice([r for r in range(WORLD) if r != f["rank"]])
        else:
            f["node"] = rng.randrange(NODES)
        out.append(f)
    return out, step + gap + 2


class Sampler(threading.Thread):
    """Every ``SAMPLE`` seconds, per node: the daemon's pid, RSS, accounted bytes; the job's /dev/shm use."""

    def __init__(self, run_dir: Path, job: str, base_port: int, token: str):
        super().__init__(daemon=True)
        self.run_dir, self.job, self.base_port, self.token = run_dir, job, base_port, token
        self.rows: list[dict] = []
        self.stopped = threading.Event()
        self._clients: dict[int, object] = {}

    def _accounted(self, node: int) -> int | None:
        from ffstate.client import Client

        try:
            if node not in self._clients:
                self._clients[node] = Client(f"127.0.0.1:{self.base_port + node}", self.token, timeout=1.0, retries=0)
            return int(self._clients[node].inventory().bytes_used)
        except Exception:  # the daemon is down or starting: no figure this time
            self._clients.pop(node, None)
            return None

    def run(self) -> None:
        while not self.stopped.wait(SAMPLE):
            now = time.time()
            shm = [p for p in Path("/dev/shm").glob(f"*{self.job}*")]
            for node in range(NODES):
                pid = rss = None
                try:
                    pid = int((self.run_dir / f"daemon-node{node}.pid").read_text())
                    status = Path(f"/proc/{pid}/status").read_text()
                    rss = int(re.search(r"VmRSS:\s+(\d+) kB", status).group(1)) * 1024
                except (OSError, ValueError, AttributeError):
                    pass
                mine = [p for p in shm if p.name.startswith(f"ffstate-node{node}-")]
                self.rows.append({"time": now, "node": node, "pid": pid, "rss": rss,
                                  "accounted": self._accounted(node) if rss else None,
                                  "shm_files": len(mine), "shm_bytes": sum(_size(p) for p in mine)})


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _torchrun(out: Path, steps: int, extra: list[str], env: dict, log: Path, restarts: int, timeout: float,
              world: int = WORLD) -> float:
    args = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world),
            "--max-restarts", str(restarts), "-m", "ffstate.demo.worker", "--out", str(out), "--steps", str(steps),
            *extra]
    start = time.perf_counter()
    with open(log, "w") as f:
        proc = subprocess.run(args, stdout=f, stderr=subprocess.STDOUT, env=env, timeout=timeout)
    if proc.returncode != 0:
        tail = "".join(log.read_text().splitlines(keepends=True)[-60:])
        raise RuntimeError(f"torchrun failed (exit {proc.returncode}); the end of {log}:\n{tail}")
    return time.perf_counter() - start


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def failure_rows(schedule: list[dict], notes: list[dict], progress: list[dict], events: list[dict]) -> list[dict]:
    """One row per scheduled failure: when it hit, v*, steps lost, the downtime (kill -> next commit), and the
    longest stall (the longest time between two consecutive steps from the kill to the next failure: for a daemon
    killed alone, training goes on at once but holds later, when the slots go unread and replication waits for the
    new daemon)."""
    restored = [e for e in events if e.get("event") == "restored"]
    landed = {n["index"]: n["landed"] for n in notes if n["kind"] == "landed"}  # where each timer kill hit
    notes = [n for n in notes if n["kind"] != "landed"]
    kills = sorted(n["time"] for n in notes if n["kind"] != "double-then")
    rows = []
    for i, f in enumerate(schedule):
        mine = [n for n in notes if n["index"] == i]
        first = next((n for n in mine if n["kind"] != "double-then"), None)
        if first is None:
            rows.append({**f, "index": i, "hit": False})
            continue
        killed = first["time"] + first.get("delay", 0.0) if first.get("phase") == "timer" else first["time"]
        last = max(mine, key=lambda n: n["time"])
        after = last["time"] + (last.get("delay", 0.0) if last.get("phase") == "timer" else 0.0)
        if f["kind"] in ("daemon", "slow", "pause", "straggler"):  # training goes on: its next commit
            nxt = next((p for p in progress if p["time"] > after), None)
        else:  # the first commit of the restarted workers (a survivor may commit once after the kill)
            nxt = next((p for p in progress if p["time"] > after and p.get("attempt", 0) > last["attempt"]), None)
        until = next((t for t in kills if t > after), float("inf"))
        times = [killed] + [p["time"] for p in progress if after < p["time"] < until]
        row = {**f, "index": i, "hit": True, "after_step": first.get("after_step"), "killed_at": killed,
               "downtime": (nxt["time"] - killed) if nxt else None,
               "stall": max((b - a for a, b in zip(times, times[1:])), default=None),
               **({"landed": landed[i]} if i in landed else {})}
        # Training goes on after these, unless something restarted the group before the next failure (a commit
        # held past the watchdog's deadline, say): then that restart is this failure's, and so are its steps lost.
        restart = next((p for p in progress if after < p["time"] < until and p.get("attempt", 0) > last["attempt"]),
                       None)
        if f["kind"] in ("daemon", "slow", "pause", "straggler") and restart is None:
            row.update(v_star=None, steps_lost=0, restarted=False)  # training went on: nothing rolled back
        else:  # the restore of the attempt after the last kill of this failure
            attempt = last["attempt"] + 1
            row["restarted"] = f["kind"] in ("daemon", "slow", "pause", "straggler")
            mine_r = [e for e in restored if e["attempt"] == attempt]
            row.update(attempt=attempt, v_star=max((e["version"] for e in mine_r), default=None),
                       steps_lost=max((e["steps_lost"] for e in mine_r), default=None),
                       restore_seconds=max((e["restore_seconds"] for e in mine_r), default=None),
                       source=sorted({e["source"] for e in mine_r}))
        rows.append(row)
    return rows


def label(f: dict) -> str:
    if f["kind"] == "rank":
        return f"rank ({f['phase']}{', landed in ' + f['landed'] if f.get('landed') else ''})"
    if f["kind"] == "double":
        return f"two in a row ({f['phase']})"
    if f["kind"] == "hang":
        return f"hang ({f['phase']})"
    return {"node": "node (2 ranks + daemon)", "daemon": "daemon alone"}.get(f["kind"], f["kind"])


def run(failures: int, seed: int, gap: int, timeout: float, work: Path | None = None, hangs: int = 0,
        hang_floor: float = HANG_FLOOR) -> dict:
    schedule, steps = draw_schedule(seed, failures, gap, hangs)
    env = {"FFSTATE_HANG_FLOOR": str(hang_floor), "FFSTATE_HANG_STARTUP": str(HANG_STARTUP)} if hangs else {}
    return {**run_schedule(schedule, steps, timeout, work, env), "seed": seed, "gap": gap, "hang_floor": hang_floor}


def run_schedule(schedule: list[dict], steps: int, timeout: float, work: Path | None = None,
                 env: dict | None = None, worker: list[str] | None = None, world: int = WORLD) -> dict:
    """The job under ``schedule`` (``demo/faults.py``) for ``steps`` steps, then without failures and without
    ffstate, compared bit for bit; ``env``: more variables for the job (``FFSTATE_*`` knobs); ``worker``: more
    arguments for both runs' workers (``--parallel ddp``, say); ``world``: ranks, over the 2 simulated nodes."""
    worker = list(worker or [])
    own = work is None  # a folder of its own: once the runs are found equal their states go, the logs stay
    work = Path(work or tempfile.mkdtemp(prefix="ffstate-chaos-"))
    failing, reference = work / "with-failures", work / "reference"
    for d in (failing, reference):
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir(parents=True)
    (work / "schedule.json").write_text(json.dumps(schedule, indent=1))
    job, token, base = f"chaos-{secrets.token_hex(4)}", secrets.token_hex(16), free_ports(NODES)
    run_dir = Path(tempfile.gettempdir()) / f"ffstate-{job}"
    env = {**os.environ, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "FFSTATE_SIMULATED_NODES": str(NODES),
           "FFSTATE_JOB_ID": job, "FFSTATE_TOKEN": token, "FFSTATE_BASE_PORT": str(base),
           "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
    restarts = sum({"double": 2, "rank": 1, "node": 1, "hang": 1}.get(f["kind"], 0) for f in schedule) + 2
    sampler = Sampler(run_dir, job, base, token)
    sampler.start()
    try:
        wall = _torchrun(failing, steps, ["--chaos", str(work / "schedule.json"), *worker], env,
                         work / "with-failures.log", restarts, timeout, world)
    finally:
        left = stop_daemons(job, wait=0.0, grace=15.0)  # still alive 15 s after the job: SIGTERMed, reported
        sampler.stopped.set()
        sampler.join()
        for kept in [*run_dir.glob("daemon-*.log"), *run_dir.glob("stacks-rank*.txt"), run_dir / "events.jsonl"]:
            if kept.exists():
                shutil.copy(kept, failing / kept.name)
    shm_left = sorted(p.name for p in Path("/dev/shm").glob(f"*{job}*"))
    exits = [int(m) for log in failing.glob("daemon-*.log")  # the stop that follows each exit at the job's end
             for m in re.findall(r"\(--exit-when-empty\): exiting\n(?:.*\n)*?.*daemon \S+ stopped, (\d+) bytes accounted",
                                 log.read_text())]
    ref_wall = _torchrun(reference, steps, ["--no-ffstate", *worker], env, work / "reference.log", 0, timeout, world)
    diffs = compare_runs(failing, reference, world)
    rows = failure_rows(schedule, _jsonl(failing / "failures.jsonl"), _jsonl(failing / "progress.jsonl"),
                        _jsonl(failing / "events.jsonl"))
    shutil.rmtree(run_dir, ignore_errors=True)
    if own and not diffs:
        drop_compared(failing, reference)
    return {"benchmark": "chaos", "environment": environment("cpu"), "steps": steps, "schedule": schedule,
            "failures": rows, "samples": sampler.rows, "wall_seconds": wall,
            "reference_seconds": ref_wall, "step_seconds": ref_wall / steps, "bit_identical": not diffs,
            "differences": diffs[:20], "daemons_left": left, "shm_left": shm_left,
            "accounted_at_exit": exits, "work": str(work),
            "daemons": [f"127.0.0.1:{base + n}" for n in range(NODES)]}


def summary(result: dict) -> dict:
    """Per kind: count, steps lost (max), downtime (median, max); memory first/last per node."""
    kinds: dict[str, list[dict]] = {}
    for r in result["failures"]:
        if r["hit"]:
            kinds.setdefault(label(r), []).append(r)
    per_kind = {k: {"count": len(rs), "steps_lost_max": max(r["steps_lost"] or 0 for r in rs),
                    "steps_lost": [r["steps_lost"] for r in rs],
                    "downtime_median": statistics.median(r["downtime"] for r in rs if r["downtime"] is not None),
                    "downtime_max": max(r["downtime"] for r in rs if r["downtime"] is not None),
                    "stall_max": max((r["stall"] for r in rs if r.get("stall") is not None), default=None)}
                for k, rs in sorted(kinds.items())}
    memory = {}
    for node in range(NODES):
        s = [x for x in result["samples"] if x["node"] == node and x["rss"]]
        acc = [x["accounted"] for x in s if x["accounted"] is not None]
        memory[node] = {"rss_first": s[0]["rss"] if s else None, "rss_last": s[-1]["rss"] if s else None,
                        "rss_max": max((x["rss"] for x in s), default=None),
                        "accounted_first": acc[0] if acc else None, "accounted_last": acc[-1] if acc else None,
                        "accounted_max": max(acc, default=None)}
    return {"per_kind": per_kind, "memory": memory}


def report(result: dict) -> str:
    mb = lambda b: "-" if b is None else f"{b / 1e6:.1f}"  # noqa: E731
    rows = [[str(r["index"]), label(r) + (" (then a restart)" if r.get("restarted") else ""),
             str(r.get("after_step", "-")), str(r.get("v_star") or "-"),
             "-" if r.get("steps_lost") is None else str(r["steps_lost"]),
             "-" if r.get("downtime") is None else f"{r['downtime']:.1f}",
             "-" if r.get("stall") is None else f"{r['stall']:.1f}"] for r in result["failures"] if r["hit"]]
    out = [table(rows, ["#", "failure", "after step", "v*", "steps lost", "downtime s", "longest stall s"]), ""]
    s = result["summary"]
    out.append(table([[k, str(v["count"]), ",".join(map(str, v["steps_lost"])), f"{v['downtime_median']:.1f}",
                       f"{v['downtime_max']:.1f}", "-" if v.get("stall_max") is None else f"{v['stall_max']:.1f}"]
                      for k, v in s["per_kind"].items()],
                     ["kind", "failures", "steps lost each", "downtime median s", "downtime max s", "longest stall s"]))
    out.append("")
    out.append(table([[f"node{n}", mb(m["rss_first"]), mb(m["rss_last"]), mb(m["rss_max"]), mb(m["accounted_first"]),
                       mb(m["accounted_last"]), mb(m["accounted_max"])] for n, m in s["memory"].items()],
                     ["daemon", "RSS first MB", "RSS last MB", "RSS max MB", "accounted first MB",
                      "accounted last MB", "accounted max MB"]))
    hit = sum(r["hit"] for r in result["failures"])
    out.append(f"\n{hit} failures in {result['steps']} steps ({result['wall_seconds']:.0f} s; the same training "
               f"without failures and without ffstate {result['reference_seconds']:.0f} s); "
               f"{'bit-identical' if result['bit_identical'] else 'DIFFERENT: ' + str(result['differences'][:3])} "
               f"to it; after the job: accounted bytes at each daemon's exit {result['accounted_at_exit']}, "
               f"/dev/shm files left {len(result['shm_left'])}, daemons left {len(result['daemons_left'])}")
    if any(r["kind"] == "hang" for r in result["failures"]):
        out.append(f"a hang's downtime: the watchdog's deadline (floor {result.get('hang_floor', HANG_FLOOR):g} s "
                   "here; by default 10 median steps within [60, 600] s) and a restart; without it the job waits "
                   "the process group's timeout (30 min for gloo, 10 for NCCL) and then restarts")
    return "\n".join(out)


def plot(result: dict, path: Path) -> Path | None:
    plt = pyplot()
    if plt is None:
        return None
    t0 = min((x["time"] for x in result["samples"]), default=0.0)
    fig, axes = plt.subplots(3, 1, figsize=(11, 8), sharex=True)
    for ax, key, title in zip(axes, ("rss", "accounted", "shm_bytes"),
                              ("daemon RSS (MB)", "bytes accounted (MB)", "the job's /dev/shm (MB)")):
        for node in range(NODES):
            s = [x for x in result["samples"] if x["node"] == node and x[key] is not None]
            ax.plot([x["time"] - t0 for x in s], [x[key] / 1e6 for x in s], ".", ms=2, label=f"node{node}")
        for r in result["failures"]:
            if r["hit"]:
                ax.axvline(r["killed_at"] - t0, color="grey", lw=0.6, ls=":")
        ax.set_ylabel(title)
        ax.legend(loc="upper right", fontsize=7)
    axes[0].set_title(f"chaos run, seed {result['seed']}: {sum(r['hit'] for r in result['failures'])} failures "
                      "(dotted), memory per node")
    axes[-1].set_xlabel("seconds")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--failures", type=int, default=20, help="failures in the schedule (default 20)")
    p.add_argument("--seed", type=int, default=0, help="the schedule's seed (default 0)")
    p.add_argument("--gap", type=int, default=4, help="steps between failures (default 4)")
    p.add_argument("--hangs", type=int, default=0, help="hangs in the schedule besides the failures (default 0): a "
                   "rank asleep in its own code or stuck in a receive, found by its node's watchdog")
    p.add_argument("--hang-floor", type=float, default=HANG_FLOOR,
                   help=f"the watchdog's deadline floor for the job, seconds (default {HANG_FLOOR:g})")
    p.add_argument("--timeout", type=float, default=1500.0, help="seconds the job may take (default 1500)")
    p.add_argument("--out", type=Path, default=Path("bench/results"), help="results folder (default: bench/results)")


def main(args: argparse.Namespace) -> int:
    result = run(args.failures, args.seed, args.gap, args.timeout, hangs=args.hangs, hang_floor=args.hang_floor)
    result["summary"] = summary(result)
    publish(args.out, "chaos", result, report, plot)
    print(f"the job's logs are kept in {result['work']}" + ("" if result["bit_identical"] else
          ", with both runs' final states"), file=sys.stderr)
    return 0 if result["bit_identical"] else 1


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    add_arguments(parser)
    raise SystemExit(main(parser.parse_args()))
