"""The torchrun worker of ``ffstate bench overhead``: the same training in interleaved phases, each mode in turn
(in each repeat an order of a balanced Latin square: ``phase_order``).

    torchrun --nproc-per-node 4 -m ffstate.bench._overhead_worker --out DIR --parallel ddp|ddp-zero|fsdp2|manual
        [--modes off,local,naive,scheduler,unprofiled,razor-off] [--steps 10] [--repeats 3]
        [--size small|medium|large] [--batch 8]

Modes (``MODES``): ``off`` (no ffstate); ``local`` (ffstate with no replicas: the commit into the
node's shared memory and the daemon's checksum of it, nothing on the network); ``naive`` (razor on,
sent as soon as captured); ``scheduler`` (razor on, paced into the training's idle windows);
``razor-off`` (the scheduler, every rank's whole state replicated); ``unprofiled`` (the scheduler without
the profiled timeline: where nothing marks the collectives, ``manual``, it then paces by rate alone);
``persist`` (the scheduler, its daemons also flushing every version to the persistent tier, ``--persist-every
1``); ``nowatch`` (the scheduler, its daemons' watchdog off: what the watchdog costs is ``scheduler`` over
it); ``async-save`` (no ffstate: ``torch.distributed.checkpoint.async_save`` of the model and optimizer after
every step, on a process group of its own, the previous save waited for before the next, as torchtitan does).
``manual`` is data parallelism by hand (no wrapper; every gradient all-reduced at once after the
backward), whose collectives the scheduler learns from profiled steps: the first phase that
profiles pays for it in three of its timed steps (a few percent each; the medians barely move). The daemons of each scheduler
policy listen on the base port that ``$FFSTATE_BENCH_PORTS`` names (``naive:7700,windows:7800``).
Each phase is a fresh ffstate job on the same model, so its first commit sends a full version; step
times are taken from the third step on, and the bytes on the wire per step are the daemon's counters
between the second and the last commit (deltas only), as are the training's collectives the node's
daemon saw, those that met a chunk and the seconds chunks overlapped them; ``ff.commit``'s time, and
the forward's, backward's and optimizer step's, are taken per step.
Every rank writes ``DIR/overhead-rank<R>.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP

import ffstate
from ffstate.scheduling.pacing import _comm_marks
from ffstate.bench._report import phase_order
from ffstate.bench.codec import SIZES
from ffstate.demo.worker import allreduce_gradients
from ffstate.testing.models import TinyGPT

FIRST_TIMED = 2  # steps 0 and 1: attach, the full version, the counters' baseline
# mode: (Config.razor, the daemons' scheduler, Config.replicas)
MODES = {"local": ("off", "windows", 0), "naive": ("auto", "naive", 1), "scheduler": ("auto", "windows", 1),
         "razor-off": ("off", "windows", 1), "razor-on": ("auto", "windows", 1), "unprofiled": ("auto", "windows", 1),
         "lag1": ("auto", "windows", 1), "lag4": ("auto", "windows", 1), "persist": ("auto", "windows+persist", 1),
         "nowatch": ("auto", "windows+nowatch", 1)}
PLAIN = ("off", "async-save")  # modes without ffstate
PROFILE_STEPS = {"unprofiled": 0}  # Config.profile_steps where not the default
MAX_LAG = {"lag1": 1, "lag4": 4}  # Config.max_lag where not the default (1)


class AsyncSaver:
    """``dcp.async_save`` of the model and optimizer after each step, as torchtitan does it: their state dicts by
    DCP's ``get_state_dict``, staged by DCP's own async path in the training process, planned on a process group
    of its own (on the default one its collectives interleave with the training's and hang), and the previous
    save waited for before the next (the ranks must agree on which steps save: none is skipped). The two newest
    checkpoints are kept."""

    def __init__(self, model: torch.nn.Module, opt: torch.optim.Optimizer, root: Path, group):
        self.model, self.opt, self.root, self.group = model, opt, root, group
        self.pending, self.saved, self.skipped, self.dirs = None, 0, 0, []

    def after_step(self, step: int) -> None:
        import shutil

        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        if self.pending is not None:
            self.pending.result()
        msd, osd = get_state_dict(self.model, self.opt)
        self.dirs.append(self.root / f"step{step}")
        self.pending = dcp.async_save({"model": msd, "optim": osd}, checkpoint_id=self.dirs[-1],
                                      process_group=self.group)
        self.saved += 1
        while len(self.dirs) > 3 and dist.get_rank() == 0:
            shutil.rmtree(self.dirs.pop(0), ignore_errors=True)

    def close(self) -> None:
        if self.pending is not None:
            self.pending.result()
        dist.barrier()


def _daemons_threads(scheduler: str, process_first: bool) -> dict[str, tuple[str, float]]:
    """The CPU seconds so far of the daemons of ``scheduler`` (``$FFSTATE_BENCH_DAEMON_PIDS``; every node's: one
    machine, or network namespaces of one), from /proc: each process's whole under its pid, with name "" (threads
    that ended count there alone), and each thread by its path, with its name in the operating system (which a
    daemon sets from its Python name: ``ffstate/daemon/threads.py``). A phase's first look reads each process
    before its threads and its last after them, so that the threads' CPU between the two stays within the whole's
    (up to the kernel's rounding: it scales each thread's and the process's ticks apart)."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for pid in json.loads(os.environ.get("FFSTATE_BENCH_DAEMON_PIDS", "{}")).get(scheduler, []):
        tasks = sorted(Path(f"/proc/{pid}/task").iterdir())
        for task in [Path(f"/proc/{pid}"), *tasks] if process_first else [*tasks, Path(f"/proc/{pid}")]:
            try:
                fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
                name = "" if task.parent.name != "task" else (task / "comm").read_text().strip()
            except OSError:  # a thread that ended meanwhile
                continue
            out[str(task)] = (name, (int(fields[11]) + int(fields[12])) / tick)
    return out


def by_thread(before: dict[str, tuple[str, float]], after: dict[str, tuple[str, float]]) -> dict[str, float]:
    """CPU seconds between two ``_daemons_threads`` by thread role (the name less its number: ``codec_0`` and
    ``codec_1`` are ``codec``); ``ended threads``: the rest of the processes' whole, what threads gone by ``after``
    used (a streamed push's feeder, one a call); "whole": the processes' own count. The roles sum to the whole but
    for a few ticks of the kernel's rounding, which can make the rest negative over a few steps: it is then 0."""
    roles: dict[str, float] = {}
    whole = 0.0
    for path, (name, seconds) in after.items():
        used = seconds - before.get(path, (name, 0.0))[1]
        if used < 0:  # its id taken again by a thread that began since
            used = seconds
        if not name:
            whole += used
            continue
        role = re.sub(r"[_-]?\d+$", "", name) or name
        roles[role] = roles.get(role, 0.0) + used
    roles["ended threads"] = max(0.0, whole - sum(roles.values()))
    return {**roles, "whole": whole}


def _count_allreduce() -> list[int]:
    """Counts the bytes handed to ``dist.all_reduce`` from Python (a communication hook's collectives)."""
    sent = [0]
    inner = dist.all_reduce

    def counting(tensor, *args, **kwargs):
        sent[0] += tensor.numel() * tensor.element_size()
        return inner(tensor, *args, **kwargs)

    dist.all_reduce = counting
    return sent


def _register_hook(model: DDP, hook: str) -> None:
    """The training's gradient compression, registered through ffstate (its marks and its state come along)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    if hook == "fp16":
        ffstate.register_comm_hook(model, None, default_hooks.fp16_compress_hook)
        return
    state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=4, start_powerSGD_iter=2,
                                        min_compression_rate=1.0, use_error_feedback=True, warm_start=True)
    ffstate.register_comm_hook(model, state, powerSGD_hook.powerSGD_hook)


def _train_bytes(res: dict, sent: int, steps: int) -> None:
    """The training's all-reduce payload over a phase's timed steps, this rank's: what its collectives sent from
    Python (DDP's gradients through ffstate's marking hook or the loop's compression hook, or all-reduced by hand;
    FSDP2's collectives are not all-reduces)."""
    res["train_bytes"] = res.get("train_bytes", 0) + sent
    res["train_steps"] = res.get("train_steps", 0) + steps


def _persisting(daemon: Any, done: Callable[[Any], Any], what: str, timeout: float = 120.0) -> Any:
    """The daemon's persistent tier's report once ``done`` says so (at most ``timeout`` seconds)."""
    deadline = time.monotonic() + timeout
    while not done(got := daemon.inventory("").persist):
        if time.monotonic() > deadline:
            raise SystemExit(f"waited {timeout:.0f}s for {what}: {got}")
        time.sleep(0.05)
    return got


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--parallel", choices=("ddp", "ddp-zero", "fsdp2", "manual"), default="ddp")
    p.add_argument("--modes", default="off,naive,scheduler,razor-off")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--size", choices=sorted(SIZES), default="small")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--hook", choices=("none", "fp16", "powersgd"), default="none")
    a = p.parse_args()
    if os.environ.get("FFSTATE_BENCH_CPUS"):  # before gloo's threads start: they inherit it
        from ffstate.bench.overhead import cpu_list

        os.sched_setaffinity(0, cpu_list(os.environ["FFSTATE_BENCH_CPUS"]))
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    if a.parallel == "fsdp2":  # each block and the root sharded: all-gathers from the forward's first layer on
        model = TinyGPT(**SIZES[a.size])
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
    elif a.parallel == "manual":
        model = TinyGPT(**SIZES[a.size])
    else:
        model = DDP(TinyGPT(**SIZES[a.size]))
    sent = _count_allreduce()
    if a.hook != "none":
        _register_hook(model, a.hook)
    elif isinstance(model, DDP):  # ffstate's marking hook (DDP's own arithmetic) from the start: every phase alike
        _comm_marks(model, ffstate.Config(), rank)
    if a.parallel != "ddp-zero":
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    else:
        opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-3)
    vocab, seq = SIZES[a.size]["vocab"], SIZES[a.size]["seq"]
    counter = iter(range(1 << 30))

    def train_step() -> list[float]:
        """One step; returns the seconds of its forward, backward and optimizer step (under FSDP2 the
        all-gathers are in the first two, the reduce-scatters in the second)."""
        g = torch.Generator().manual_seed(1_000_003 * next(counter) + rank)
        idx = torch.randint(0, vocab, (a.batch, seq + 1), generator=g)
        t0 = time.perf_counter()
        logits = model(idx[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, vocab), idx[:, 1:].reshape(-1))
        t1 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if a.parallel == "manual":
            allreduce_gradients(model, dist.get_world_size())
        t2 = time.perf_counter()
        opt.step()
        return [t1 - t0, t2 - t1, time.perf_counter() - t2]

    modes = a.modes.split(",")
    ckpt_group = dist.new_group(backend="gloo") if "async-save" in modes else None  # the saves' own collectives
    results: dict[str, dict] = {m: {"step_seconds": [], "wire_bytes": 0, "wire_versions": 0, "lag_at_end": [],
                                    "drain_seconds": [], "collectives": 0, "collisions": 0, "overlap_seconds": 0.0,
                                    "commit_seconds": [], "commit_cpu_seconds": [], "part_seconds": [], "steps_run": 0}
               for m in modes}
    for r in range(a.repeats):
        for mode in phase_order(modes, r):
            res = results[mode]
            dist.barrier()
            sent_before = [sent[0]]  # at the first timed step: the training's bytes over the timed steps
            if mode in PLAIN:
                saver = AsyncSaver(model, opt, a.out / f"async-{r}", ckpt_group) if mode == "async-save" else None
                for i in range(a.steps):
                    if i == FIRST_TIMED:
                        sent_before[0] = sent[0]
                    start = time.perf_counter()
                    parts = train_step()
                    trained = time.perf_counter()
                    if saver is not None:
                        saver.after_step(i + 1)
                    if i >= FIRST_TIMED:
                        res["step_seconds"].append(time.perf_counter() - start)
                        res["part_seconds"].append(parts)
                        if saver is not None:
                            res["commit_seconds"].append(time.perf_counter() - trained)
                _train_bytes(res, sent[0] - sent_before[0], a.steps - FIRST_TIMED)
                if saver is not None:
                    res["saved"], res["skipped"] = res.get("saved", 0) + saver.saved, res.get("skipped", 0) + saver.skipped
                    saver.close()
                continue
            razor, scheduler, replicas = MODES[mode]
            ports = dict(p.split(":") for p in os.environ["FFSTATE_BENCH_PORTS"].split(","))
            cfg = ffstate.Config.from_env(razor=razor, replicas=replicas, start_daemon=False, base_port=int(ports[scheduler]),
                                          profile_steps=PROFILE_STEPS.get(mode, ffstate.Config.profile_steps),
                                          max_lag=MAX_LAG.get(mode, ffstate.Config.max_lag),
                                          job_id=f"{os.environ.get('FFSTATE_JOB_ID', 'overhead')}-{mode}-{r}")
            res["steps_run"] += a.steps
            with ffstate.replicate(model, opt, config=cfg) as ff:
                if mode == "persist":  # its daemon's flushing process ready (it imports DCP as the daemon starts)
                    _persisting(ff.daemon, lambda p: p.flusher_pid, "the flushing process ready")
                    dist.barrier()
                for i in range(a.steps):
                    if i == FIRST_TIMED:
                        sent_before[0] = sent[0]
                    if i == FIRST_TIMED and rank == 0:
                        threads = _daemons_threads(scheduler, process_first=True)
                    start = time.perf_counter()
                    parts = train_step()
                    trained, cpu_before = time.perf_counter(), time.thread_time()
                    ff.commit(i + 1)
                    if i >= FIRST_TIMED:
                        res["commit_cpu_seconds"].append(time.thread_time() - cpu_before)  # its own CPU, no waits
                        res["step_seconds"].append(time.perf_counter() - start)
                        res["commit_seconds"].append(time.perf_counter() - trained)
                        res["part_seconds"].append(parts)
                    if i == 1:
                        before = ff.stats(wait=60)
                if rank == 0:  # the daemons' CPU over the timed steps (what they defer shows as the lag at the end)
                    split = by_thread(threads, _daemons_threads(scheduler, process_first=False))
                    res["daemon_cpu_seconds"] = res.get("daemon_cpu_seconds", 0.0) + split.pop("whole")
                    res["daemon_cpu_steps"] = res.get("daemon_cpu_steps", 0) + a.steps - FIRST_TIMED
                    roles = res.setdefault("daemon_cpu_by_thread", {})
                    for role, seconds in split.items():
                        roles[role] = roles.get(role, 0.0) + seconds
                # What the timed steps left unreplicated (at most max_lag, or commit would have blocked),
                # and how long it takes to drain: pacing that only defers the work would show here.
                end = ff.stats()
                start = time.perf_counter()
                after = ff.stats(wait=60)
                res["lag_at_end"].append(end.version - end.replicated_version)
                res["drain_seconds"].append(time.perf_counter() - start)
                if mode == "persist" and int(os.environ.get("LOCAL_RANK", 0)) == 0:  # its node's daemon's counts
                    got = _persisting(ff.daemon, lambda p: not p.pending, "the copies written")
                    res["saved"], res["skipped"] = got.flushed, got.skipped  # since the daemons started
            _train_bytes(res, sent[0] - sent_before[0], a.steps - FIRST_TIMED)
            res["wire_bytes"] += after.pushed_bytes - before.pushed_bytes
            res["wire_versions"] += after.pushed_versions - before.pushed_versions
            # The node's daemon's counts: the same for each rank of a node.
            for k in ("collectives", "collisions", "overlap_seconds"):
                res[k] += getattr(after, k) - getattr(before, k)
            razor = after.razor
            res["state_bytes"], res["shard_bytes"] = (razor.state_bytes, razor.shard_bytes) if razor else (0, 0)
    (a.out / f"overhead-rank{rank}.json").write_text(json.dumps({"rank": rank, "parallel": a.parallel,
                                                                 "local_rank": int(os.environ.get("LOCAL_RANK", 0)),
                                                                 "results": results}))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
