"""Overhead benchmark: step time and bytes replicated per step, ffstate off and on, paced and naive, razor on
and off, in one run, on loopback and on tc-shaped links.

torchrun with 4 CPU ranks as 2 nodes (2 with ``--ranks-per-node 1``) trains TinyGPT under DDP
(plain AdamW: model and optimizer state identical across the group), under DDP with a
ZeroRedundancyOptimizer, under FSDP2 (``fully_shard``: all-gathers from the forward's first
layer on, so replication sent at a commit meets the next step's collectives at once), and with
``manual`` data parallelism (no wrapper, the gradients all-reduced by hand: nothing marks its
collectives, so the scheduler learns them from a few profiled steps). On
``loopback`` the nodes are simulated on one network; on a rate such as ``200mbit`` each node is a
network namespace with its own torchrun agent and daemons, joined by a veth link shaped with
``tc``, so the training's gloo traffic and the replication cross the same slow link. In each job
the modes run in interleaved phases of the same training (``bench/_overhead_worker.py``):

- ``off``: no ffstate;
- ``local``: ffstate with no replicas (k=0): each step's commit into the node's shared memory and the
  daemon's checksum of it, nothing on the network; what ffstate costs before any replication (its
  ratio to ``off`` is the commit's share of ``scheduler``'s);
- ``naive``: ffstate, razor on, every version sent as soon as it is captured;
- ``scheduler``: ffstate, razor on, paced into the training's idle windows under a share of the link;
- ``razor-off``: the scheduler, every rank replicating its whole state;
- ``unprofiled``: the scheduler without a profiled timeline (``profile_steps=0``): under ``manual``
  it paces by rate alone, which is what the profiled steps are measured against;
- ``scheduler`` runs at the default ``max_lag`` 1: a commit waits until every holder has the version before it (a
  node lost then costs at most one step), which costs the training whenever replication runs late;
- ``lag4``: the scheduler with ``max_lag=4`` (the default before): holders may fall 3 versions behind;
- ``lag1``: the scheduler with ``max_lag=1`` named explicitly (the default's figures under another name).

Reported per job and mode: the median step time (the slowest rank's) and its ratio to ``off``, pooled
over phases and paired (each phase against the ``off`` phase of its repeat, median over repeats); the
bytes each rank replicates per step (on the wire: deltas after compaction) and the raw size of what
it replicates; the time ``ff.commit`` held the loop (and, in brackets, its own thread's CPU: where ranks share
a core, a commit's wall time also counts the other ranks' turns), and the forward's, backward's and optimizer step's (where the
collectives and their collisions show); the training's collectives that started while a
replication chunk was on the wire and the seconds chunks shared the link with collectives (counted by
the daemons from the workers' marks: what the pacing is for, without a noisy step time); and both
daemons' CPU over the timed steps (from /proc, as they began and ended), per step and per MB of state replicated
(every rank's share, raw).
Prints a table; writes ``bench/results/overhead.json`` and a PNG plot beside it.

Usage: ``ffstate bench overhead [--parallel ddp,ddp-zero,fsdp2,manual] [--modes off,naive,scheduler,razor-off]
[--link loopback,200mbit] [--steps 10] [--repeats 3] [--size small] [--batch 8] [--link-share 0.5]
[--daemon-nice 19|idle] [--persist-nice idle|N] [--measure-link] [--ranks-per-node 2] [--pin 0:1]``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import secrets
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

from ffstate.bench import netns
from ffstate.bench._report import environment, free_ports, kept_on_failure, publish, pyplot, table
from ffstate.bench.codec import SIZES
from ffstate.cli import nice_level

log = logging.getLogger("ffstate.bench.overhead")
NODES = 2


def _serve(args: list[str], token: str, log_path: Path) -> subprocess.Popen:
    with open(log_path, "w") as out:
        return subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "FFSTATE_TOKEN": token})


def _schedulers(modes: list[str]) -> list[str]:
    from ffstate.bench._overhead_worker import MODES

    return sorted({MODES[m][1] for m in modes if m in MODES})


def run_job(parallel: str, modes: list[str], steps: int, repeats: int, size: str, work: Path,
            link: "netns.Link | None" = None, per_node: int = 2, batch: int = 8, share: float = 0.5,
            nice: int | str = 19, measure_link: bool = False, pin: tuple[str, str] | None = None,
            persist_nice: int | str = "idle", hook: str = "none") -> list[dict]:
    """One torchrun job (``per_node`` ranks on each of 2 nodes) running every mode in interleaved phases;
    the daemons of each scheduler policy on their own ports. On loopback the nodes are simulated; on a
    link, each is a namespace."""
    token = secrets.token_hex(8)
    tag = f"{parallel}-{link.rate if link else 'loopback'}"
    out = work / tag
    out.mkdir(parents=True, exist_ok=True)
    ports, daemons = {}, []
    serve = [sys.executable, "-m", "ffstate.cli", "serve"]
    for scheduler in _schedulers(modes):
        base = free_ports(NODES)
        ports[scheduler] = base
        for n in range(NODES):
            flags = ["--node-id", f"node{n}", "--scheduler", scheduler.split("+")[0], "--memory-limit", "4G",
                     "--link-share", str(share), "--nice", str(nice)]
            if scheduler.endswith("+persist"):  # every version flushed, as often as the disk allows
                flags += ["--persist-dir", str(work / f"persist-{tag}"), "--persist-every", "1", "--persist-nice",
                          str(persist_nice)]
            if scheduler.endswith("+nowatch"):  # no watchdog (the others watch their ranks, the default)
                flags += ["--hang-action", "off"]
            if link is not None and not measure_link:  # the NIC's rate, as an operator would set it
                flags += ["--link-bandwidth", str(int(netns.rate_bytes_per_s(link.rate)))]
            pinned = ["taskset", "-c", pin[1], *serve] if pin else serve
            if link is None:
                args = [*pinned, "--host", "127.0.0.1", "--port", str(base + n), *flags]
            else:
                args = link.cmd(n, [*pinned, "--host", link.addresses[n], "--port", str(base), *flags])
            daemons.append((scheduler, _serve(args, token, work / f"daemon-{tag}-{scheduler}-{n}.log")))
    pids: dict[str, list[int]] = {}
    for scheduler, d in daemons:
        pids.setdefault(scheduler, []).append(d.pid)
    env = {**os.environ, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "FFSTATE_TOKEN": token,
           "FFSTATE_BENCH_DAEMON_PIDS": json.dumps(pids),
           "FFSTATE_JOB_ID": f"overhead-{parallel}", "FFSTATE_BENCH_PORTS": ",".join(f"{k}:{v}" for k, v in ports.items()),
           "OMP_NUM_THREADS": "1", "TMPDIR": str(work), **({"FFSTATE_BENCH_CPUS": pin[0]} if pin else {})}
    worker = ["-m", "ffstate.bench._overhead_worker", "--out", str(out), "--parallel", parallel, "--modes",
              ",".join(modes), "--steps", str(steps), "--repeats", str(repeats), "--size", size, "--batch", str(batch),
              "--hook", hook]
    try:
        if link is None:
            env["FFSTATE_SIMULATED_NODES"] = str(NODES)
            with open(work / f"torchrun-{tag}.log", "w") as f:
                proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                                       str(NODES * per_node), *worker], stdout=f, stderr=subprocess.STDOUT, env=env,
                                      timeout=3600)
            failed = [proc.returncode] if proc.returncode else []
            logs = [(work / f"torchrun-{tag}.log").read_text()]
        else:
            results = netns.torchrun_two_nodes(link, worker, env, nproc=per_node, timeout=3600, restarts=0)
            failed = [r.returncode for r in results if r.returncode]
            logs = [r.stdout for r in results]
        if failed:
            tail = "".join("".join(text.splitlines(keepends=True)[-20:]) for text in logs)
            raise SystemExit(f"the {tag} job failed (exit {failed}):\n{tail}")
    finally:
        for _, d in daemons:
            d.terminate()
        for _, d in daemons:
            try:
                d.wait(30)
            except subprocess.TimeoutExpired:
                d.kill()
    return [json.loads((out / f"overhead-rank{r}.json").read_text()) for r in range(NODES * per_node)]


def cpu_list(text: str) -> set[int]:
    """The CPUs of a taskset-style list ("0", "0-3,6"); empty if it is not one."""
    cpus: set[int] = set()
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        if not lo.isdigit() or (hi and not hi.isdigit()):
            return set()
        cpus.update(range(int(lo), int(hi or lo) + 1))
    return cpus


def summarize(parallel: str, ranks: list[dict], modes: list[str], repeats: int = 1) -> dict:
    from ffstate.bench._overhead_worker import MODES

    out, phases = {}, {}
    for mode in modes:
        per_rank = [r["results"][mode] for r in ranks]
        # A step takes as long as its slowest rank: the median over steps of the per-step maximum.
        steps = [max(ts) for ts in zip(*(p["step_seconds"] for p in per_rank))]
        row = {"step_seconds": statistics.median(steps)}
        if all(p.get("train_steps") for p in per_rank):  # the training's all-reduce payload, per rank and step
            row["train_bytes_per_step_per_rank"] = statistics.median(p["train_bytes"] / p["train_steps"] for p in per_rank)
        # Where the step's time goes: the forward, backward and optimizer step, each the slowest rank's, median.
        if all(p.get("part_seconds") for p in per_rank):
            row["part_seconds"] = [statistics.median(max(ps[i] for ps in step_parts)
                                                     for step_parts in zip(*(p["part_seconds"] for p in per_rank)))
                                   for i in range(3)]
        n = len(steps) // repeats if repeats and len(steps) % repeats == 0 else 0
        phases[mode] = [statistics.median(steps[i * n:(i + 1) * n]) for i in range(repeats)] if n else []
        if any("saved" in p for p in per_rank):  # async-save, persist: versions written to disk
            row["saved"] = sum(p.get("saved", 0) for p in per_rank)
            row["skipped"] = sum(p.get("skipped", 0) for p in per_rank)
        if mode == "async-save" and all(p.get("commit_seconds") for p in per_rank):  # the save's hold on the loop
            row["commit_seconds"] = statistics.median(max(cs) for cs in zip(*(p["commit_seconds"] for p in per_rank)))
        if mode not in ("off", "async-save"):
            wire = [p["wire_bytes"] / p["wire_versions"] for p in per_rank if p["wire_versions"]]
            row["wire_bytes_per_step_per_rank"] = statistics.median(wire) if wire else 0  # local: nothing sent
            row["replicated_bytes_per_rank"] = statistics.median(p["shard_bytes"] for p in per_rank)
            if all(p.get("commit_seconds") for p in per_rank):  # the part of the step ffstate holds the loop
                row["commit_seconds"] = statistics.median(max(cs) for cs in zip(*(p["commit_seconds"] for p in per_rank)))
            if all(p.get("commit_cpu_seconds") for p in per_rank):  # the commit's own CPU (ranks sharing cores wait)
                row["commit_cpu_seconds"] = statistics.median(c for p in per_rank for c in p["commit_cpu_seconds"])
            row["state_bytes_per_rank"] = statistics.median(p["state_bytes"] for p in per_rank)
            # The slowest rank's lag when a phase's last step was committed, median over phases (none without replicas).
            if MODES[mode][2] and all(p.get("lag_at_end") for p in per_rank):
                row["lag_at_end"] = statistics.median(max(ls) for ls in zip(*(p["lag_at_end"] for p in per_rank)))
                row["drain_seconds"] = statistics.median(
                    max(ds) for ds in zip(*(p["drain_seconds"] for p in per_rank)))
            # Counted by each node's daemon: one rank per node (its local rank 0) reports it.
            leaders = [r["results"][mode] for r in ranks if r.get("local_rank", 0) == 0]
            row["collectives"] = sum(p.get("collectives", 0) for p in leaders)
            row["collisions"] = sum(p.get("collisions", 0) for p in leaders)
            # Seconds replication shared the link with the training's collectives, both nodes, per step.
            row["overlap_seconds_per_step"] = (sum(p.get("overlap_seconds", 0.0) for p in leaders)
                                               / max(1, per_rank[0].get("steps_run", 0)))
            # Both nodes' daemons of this mode's policy over its timed steps (read from /proc by rank 0 as they
            # began and ended), per step, and per MB of state replicated (every rank's share, raw).
            timed = ranks[0]["results"][mode]
            if timed.get("daemon_cpu_steps"):
                row["daemon_cpu_seconds_per_step"] = timed["daemon_cpu_seconds"] / timed["daemon_cpu_steps"]
                row["daemon_cpu_ms_per_step_by_thread"] = {  # by the threads' names (ffstate/daemon/threads.py)
                    k: v * 1e3 / timed["daemon_cpu_steps"] for k, v in timed.get("daemon_cpu_by_thread", {}).items()}
                replicated = row["replicated_bytes_per_rank"] * len(ranks) if MODES[mode][2] else 0
                if replicated:
                    row["daemon_cpu_seconds_per_mb"] = row["daemon_cpu_seconds_per_step"] / (replicated / 1e6)
        out[mode] = row
    for mode, row in out.items():
        row["step_ratio"] = row["step_seconds"] / out["off"]["step_seconds"] if "off" in out else None
        # Paired: each phase against the off phase of the same repeat (a few phases before or after it), so
        # that the machine's slow drift (other jobs on a shared host) cancels; the median over repeats.
        if phases.get("off") and phases[mode]:
            row["step_ratio_per_repeat"] = [m / o for m, o in zip(phases[mode], phases["off"])]
            row["step_ratio_paired"] = statistics.median(row["step_ratio_per_repeat"])
    return out


def run(parallels: list[str], modes: list[str], steps: int, repeats: int, size: str, links: list[str],
        out_dir: Path, per_node: int = 2, batch: int = 8, share: float = 0.5, nice: int | str = 19,
        measure_link: bool = False, pin: tuple[str, str] | None = None, persist_nice: int | str = "idle",
        hook: str = "none") -> dict:
    result = {"benchmark": "overhead", "environment": environment("cpu"),
              "config": {"parallel": parallels, "modes": modes, "steps_per_phase": steps, "repeats": repeats,
                         "size": size, "batch": batch, "link_share": share, "daemon_nice": nice,
                         "persist_nice": persist_nice,
                         "link_bandwidth": "measured" if measure_link else "given", "ranks": NODES * per_node,
                         "pin": ":".join(pin) if pin else None,
                         "nodes": NODES, "replicas": 1, "links": links, "hook": hook},
              "jobs": {}}
    with kept_on_failure("overhead") as tmp:
        for where in links:
            for parallel in parallels:
                opts = dict(per_node=per_node, batch=batch, share=share, nice=nice, measure_link=measure_link, pin=pin,
                            persist_nice=persist_nice, hook=hook)
                if where == "loopback":
                    ranks = run_job(parallel, modes, steps, repeats, size, tmp, None, **opts)
                else:
                    with netns.shaped_link(where) as link:
                        ranks = run_job(parallel, modes, steps, repeats, size, tmp, link, **opts)
                result["jobs"][f"{parallel} @ {where}"] = summarize(parallel, ranks, modes, repeats)
    return publish(out_dir, "overhead", result, report, plot)


def report(result: dict) -> str:
    rows = []
    for parallel, job in result["jobs"].items():
        full = job.get("razor-off", {}).get("wire_bytes_per_step_per_rank")  # the razor's comparison
        for mode, row in job.items():
            wire = row.get("wire_bytes_per_step_per_rank")
            train = row.get("train_bytes_per_step_per_rank")
            rows.append([parallel, mode, f"{row['step_seconds'] * 1e3:.0f}",
                         f"{row['step_ratio']:.3f}" if row.get("step_ratio") else "-",
                         f"{row['step_ratio_paired']:.3f}" if row.get("step_ratio_paired") else "-",
                         " / ".join(f"{s * 1e3:.1f}" for s in row["part_seconds"]) if "part_seconds" in row else "-",
                         (f"{row['commit_seconds'] * 1e3:.1f}" if "commit_seconds" in row else "-")
                         + (f" ({row['commit_cpu_seconds'] * 1e3:.2f})" if "commit_cpu_seconds" in row else ""),
                         f"{train / 1e6:.3f}" if train else "-",
                         f"{wire / 1e6:.3f}" if wire else "-",
                         f"{wire / full:.2f}" if wire and full else "-",
                         f"{row['replicated_bytes_per_rank'] / 1e6:.2f} of {row['state_bytes_per_rank'] / 1e6:.2f}"
                         if "replicated_bytes_per_rank" in row else "-",
                         f"{row['lag_at_end']:g} / {row['drain_seconds'] * 1e3:.0f}" if "lag_at_end" in row else "-",
                         f"{row['collisions']} of {row['collectives']} / {row['overlap_seconds_per_step'] * 1e3:.1f}"
                         if row.get("collectives") else "-",
                         f"{row['daemon_cpu_seconds_per_step'] * 1e3:.1f}" if "daemon_cpu_seconds_per_step" in row else "-",
                         f"{row['daemon_cpu_seconds_per_mb'] * 1e3:.1f}" if "daemon_cpu_seconds_per_mb" in row else "-",
                         f"{row['saved']} / {row['skipped']}" if "saved" in row else "-"])
    cfg = result["config"]
    head = (f"TinyGPT-{cfg['size']} batch {cfg.get('batch', 8)}, {cfg['ranks']} ranks as {cfg['nodes']} nodes, "
            f"k={cfg['replicas']}, link share {cfg.get('link_share', 0.5)}, link bandwidth "
            f"{cfg.get('link_bandwidth', 'measured')}, daemons at nice {cfg.get('daemon_nice', 0)}"
            f"{', flushing at ' + str(cfg.get('persist_nice', 'idle')) if 'persist' in cfg['modes'] else ''}"
            f"{', cores training:daemons ' + cfg['pin'] if cfg.get('pin') else ''}; "
            f"{cfg['repeats']} interleaved phases of {cfg['steps_per_phase']} steps per mode; gradient compression: "
            f"{cfg.get('hook', 'none')}; medians")
    threads = [f"- {parallel} {mode}: " + ", ".join(f"{k} {v:.1f}" for k, v in sorted(
        row["daemon_cpu_ms_per_step_by_thread"].items(), key=lambda kv: -kv[1]) if v >= 0.05)
        for parallel, job in result["jobs"].items() for mode, row in job.items() if row.get("daemon_cpu_ms_per_step_by_thread")]
    return "\n".join([head, "", table(rows, ["job @ link", "mode", "step ms", "x off", "x off paired",
                                             "fwd / bwd / opt ms", "commit ms (its CPU)", "training all-reduce MB/step/rank",
                                             "replication wire MB/step/rank",
                                             "x razor-off", "replicated MB of state MB",
                                             "lag at end steps / drain ms", "collectives met a chunk / overlap ms/step",
                                             "daemon CPU ms/step", "daemon CPU ms/MB", "to disk: written / skipped"]),
                      *(["", "The daemons' CPU ms/step by thread (both nodes):", *threads] if threads else [])])


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
    p.add_argument("--parallel", default="ddp,ddp-zero",
                   help="jobs to run: ddp, ddp-zero, fsdp2, manual (gradients all-reduced by hand) "
                        "(default: ddp,ddp-zero)")
    p.add_argument("--modes", default="off,naive,scheduler,razor-off",
                   help="off (no ffstate), local (commits, no replicas: ffstate's cost before the network), naive "
                        "(razor on, sent at once), scheduler (razor on, paced into idle windows), razor-off "
                        "(scheduler, whole states), unprofiled (scheduler, no profiled timeline), lag4 (scheduler, max_lag 4; "
                        "the scheduler's is 1), lag1 (scheduler, max_lag 1), "
                        "persist (scheduler, every version flushed to the persistent tier), nowatch (scheduler, the "
                        "daemons' watchdog off), async-save (no ffstate: "
                        "dcp.async_save after every step); "
                        "default: "
                        "off,naive,scheduler,razor-off")
    p.add_argument("--link", default="loopback",
                   help="loopback and/or tc rates between 2 network namespaces, e.g. loopback,200mbit (needs root)")
    p.add_argument("--steps", type=int, default=10, help="steps per phase; the first two are not timed (default 10)")
    p.add_argument("--repeats", type=int, default=3, help="interleaved phases per mode (default 3)")
    p.add_argument("--size", choices=sorted(SIZES), default="small", help="TinyGPT size (default: small)")
    p.add_argument("--batch", type=int, default=8,
                   help="sequences per rank per step (default 8): more compute per byte of state")
    p.add_argument("--link-share", type=float, default=0.5,
                   help="share of the link the scheduler lets replication use (the daemons' --link-share; 0.5)")
    p.add_argument("--daemon-nice", type=nice_level, default=19, metavar="N|idle",
                   help="the daemons' --nice (default 19: the training has the cores first, as on a GPU node "
                        "where the daemon's work does not compete with the GPU's; idle: SCHED_IDLE)")
    p.add_argument("--persist-nice", type=nice_level, default="idle", metavar="idle|N",
                   help="the persist mode's daemons' --persist-nice: their flushing processes' priority (default "
                        "idle, the daemon's default)")
    p.add_argument("--measure-link", action="store_true",
                   help="let the daemons measure a shaped link instead of telling them its rate")
    p.add_argument("--ranks-per-node", type=int, choices=(1, 2), default=2,
                   help="training ranks on each of the 2 nodes (default 2; 1 leaves a core per node for its daemon)")
    p.add_argument("--pin", metavar="TRAIN:DAEMONS",
                   help="CPU lists (taskset's syntax) for the training ranks and for the daemons, e.g. 0:1: the daemons "
                        "get cores of their own, as on a GPU node, and what is left is the network's share")
    p.add_argument("--hook", choices=("none", "fp16", "powersgd"), default="none",
                   help="the training's gradient compression (a DDP communication hook, through "
                        "ffstate.register_comm_hook): none, fp16 or powersgd (rank 4); DDP only")
    p.add_argument("--out", type=Path, default=Path("bench/results"), help="results folder (default: bench/results)")


def main(args: argparse.Namespace) -> int:
    from ffstate.bench._overhead_worker import MODES

    parallels = [x for x in args.parallel.split(",") if x]
    modes = [x for x in args.modes.split(",") if x]
    links = [x for x in args.link.split(",") if x]
    if not set(parallels) <= {"ddp", "ddp-zero", "fsdp2", "manual"} or not set(modes) <= {"off", "async-save", *MODES} \
            or args.steps < 4 or args.batch < 1 or not 0 < args.link_share <= 1:
        raise SystemExit(f"--parallel takes ddp, ddp-zero, fsdp2 and/or manual, --modes off, async-save and/or "
                         f"{sorted(MODES)}, --steps >= 4, --batch >= 1, --link-share in (0, 1]")
    if "async-save" in modes and "ddp-zero" in parallels:
        raise SystemExit("--modes async-save needs DCP's get_state_dict, which has no ZeroRedundancyOptimizer: "
                         "use --parallel ddp or fsdp2")
    if any(x != "loopback" for x in links) and netns.unavailable():
        raise SystemExit(f"--link {args.link}: shaped links are not available here: {netns.unavailable()}")
    pin = None
    if args.pin:
        pin = tuple(args.pin.split(":"))
        if len(pin) != 2 or not all(cpu_list(c) for c in pin):
            raise SystemExit(f"--pin takes TRAIN:DAEMONS, two CPU lists such as 0:1 or 0-5:6,7; got {args.pin!r}")
        if shutil.which("taskset") is None:
            raise SystemExit("--pin needs taskset (util-linux) to pin the daemons")
    if args.hook != "none" and set(parallels) - {"ddp", "ddp-zero"}:
        raise SystemExit("--hook is a DDP communication hook: --parallel ddp or ddp-zero")
    run(parallels, modes, args.steps, args.repeats, args.size, links, args.out, args.ranks_per_node, args.batch,
        args.link_share, args.daemon_nice, args.measure_link, pin, args.persist_nice, args.hook)
    return 0


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    raise SystemExit(main(parser.parse_args()))
