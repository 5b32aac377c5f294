"""The main job, as a torchrun worker: TinyGPT under DDP with a ZeRO-sharded AdamW, wrapped in
``ffstate.replicate``, with failures injected on request.

    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 FFSTATE_SIMULATED_NODES=2 \\
        torchrun --standalone --nproc-per-node 4 --max-restarts 3 -m ffstate.demo.worker --out DIR [--steps 40]
        [--kill-rank R --kill-step S [--kill-phase after-commit|mid-step|mid-commit]]
        [--kill-node N --kill-node-step S] [--kill-daemon N --kill-daemon-step S] [--kill-job-steps S,...]
        [--preempt-step S] [--chaos FILE] [--no-ffstate]

``--kill-rank`` SIGKILLs rank R at step S: right after its commit (default), in the middle of the
step (after backward, before the optimizer step), or in the middle of the commit (the slot half
written). ``--kill-node`` SIGKILLs node N's daemon and every rank of node N after step S.
``--kill-daemon`` SIGKILLs only node N's daemon after step S; training goes on. ``--kill-job-steps``
SIGKILLs every daemon and every rank after each of those steps (the whole job lost); ``--preempt-step``
sends SIGTERM to all of them and the torchrun agent at once (a preemption). Each failure
happens once (a marker file in DIR). ``--chaos`` takes a whole schedule of failures (``faults.py``).
At the end every rank writes its final parameters and optimizer shard to DIR/final-rank{R}.pt.
``ffstate demo`` (``demo/main.py``) runs this twice and compares.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import signal
import tempfile
import time
from pathlib import Path

from ffstate.startup import collector_paused, exit_now

# Run as torchrun's worker, its imports without Python's collector and what they made frozen: a restart's CPU
# (ffstate/startup.py). Imported by another process (a benchmark's worker, a test), that process's collector is left be.
with collector_paused() if __name__ == "__main__" else contextlib.nullcontext():
    import torch
    import torch.distributed as dist
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP

    import ffstate
    import ffstate.job
    import ffstate.persist
    from ffstate import capture
    from ffstate.testing.models import TinyGPT

log = logging.getLogger("ffstate.demo")
MODEL = dict(vocab=256, dim=128, heads=4, layers=2, seq=64)
BATCH = 8


def batch(step: int, rank: int) -> torch.Tensor:
    """The data: a pure function of (step, rank), so the data position is the step."""
    g = torch.Generator().manual_seed(1_000_003 * step + rank)
    return torch.randint(0, MODEL["vocab"], (BATCH, MODEL["seq"] + 1), generator=g)


def once(marker: Path) -> bool:
    """True the first time (creates the marker): a failure is injected once, not at every restart."""
    try:
        fd = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return False
    os.close(fd)
    return True


def kill_daemon(node: int, sig: int = signal.SIGKILL) -> None:
    """SIGKILLs (or ``sig``) simulated node ``node``'s daemon (found by the pid file it writes)."""
    job = ffstate.job.job_id(ffstate.Config.from_env())
    pid_file = Path(tempfile.gettempdir()) / f"ffstate-{job}" / f"daemon-node{node}.pid"
    os.kill(int(pid_file.read_text()), sig)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--kill-rank", type=int, default=-1)
    p.add_argument("--kill-step", type=int, default=0)
    p.add_argument("--kill-phase", choices=("after-commit", "mid-step", "mid-commit"), default="after-commit")
    p.add_argument("--kill-daemon", type=int, default=-1)
    p.add_argument("--kill-daemon-step", type=int, default=0)
    p.add_argument("--kill-node", type=int, default=-1)
    p.add_argument("--kill-node-step", type=int, default=0)
    p.add_argument("--kill-job-steps", default="", help="comma-separated steps after which the whole job is lost "
                   "(every daemon and every rank SIGKILLed), each once; relaunch it as on new machines")
    p.add_argument("--kill-job-persisted", type=int, default=0,
                   help="before each whole-job kill, wait (at most 45 s) until the persistent tier holds this many "
                        "complete versions newer than the step the run started from: what the kill is to find, "
                        "whatever the machine's load let the flushing process write by then")
    p.add_argument("--preempt-step", type=int, default=0,
                   help="after this step, rank 0 sends SIGTERM to the torchrun agent, every rank and every daemon at "
                        "once, as a cluster's preemption does")
    p.add_argument("--chaos", type=Path, help="a JSON schedule of failures (demo/faults.py; ffstate bench chaos)")
    p.add_argument("--no-ffstate", action="store_true", help="the reference run: the same training, no ffstate")
    p.add_argument("--parallel", choices=("ddp-zero", "ddp", "fsdp2", "manual"), default="ddp-zero",
                   help="DDP with a ZeRO-sharded AdamW (default), DDP with a plain AdamW, FSDP2 (fully_shard), or "
                        "no wrapper with the gradients all-reduced by hand (the scheduler profiles its steps)")
    p.add_argument("--perturb-rank", type=int, default=-1,
                   help="after --perturb-step, this rank's copy of one parameter differs from the others' (for "
                        "the razor's verification; the reference run must be given the same)")
    p.add_argument("--perturb-step", type=int, default=0)
    p.add_argument("--status-step", type=int, default=0,
                   help="rank 0 runs `ffstate status` against every node's daemon after this step (DIR/status.txt)")
    a = p.parse_args()
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s rank{os.environ.get('RANK')} %(name)s: %(message)s")
    a.out.mkdir(parents=True, exist_ok=True)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    if a.parallel == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        model = TinyGPT(**MODEL)
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    elif a.parallel == "ddp":
        model = DDP(TinyGPT(**MODEL))
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    elif a.parallel == "manual":  # no wrapper: the gradients are all-reduced by hand (nothing to mark)
        model = TinyGPT(**MODEL)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    else:
        model = DDP(TinyGPT(**MODEL))
        opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=3e-3,
                                      weight_decay=0.1)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=a.steps)
    extra = {"epoch": 0, "samples_seen": 0}
    simulated = int(os.environ.get("FFSTATE_SIMULATED_NODES", "0") or 0)
    per_node = world // simulated if simulated else int(os.environ.get("LOCAL_WORLD_SIZE", world))

    def kill_me(step: int, phase: str) -> bool:
        return (rank == a.kill_rank and step == a.kill_step and a.kill_phase == phase
                and once(a.out / "killed-rank"))

    def die(step: int) -> None:
        _note(a.out, {"failure": "rank", "rank": rank, "after_step": step, "phase": a.kill_phase, "time": time.time()})
        os.kill(os.getpid(), signal.SIGKILL)

    faults = None
    if a.chaos is not None:
        from ffstate.demo.faults import Faults

        faults = Faults(json.loads(a.chaos.read_text()), a.out, rank, per_node, kill_daemon)

    def step_fn(step: int) -> None:
        if faults is not None:
            faults.step_began(step + 1)
        loss = _loss(model, batch(step, rank))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if a.parallel == "manual":
            allreduce_gradients(model, world)
        if kill_me(step + 1, "mid-step"):
            die(step)
        if kill_me(step + 1, "mid-commit"):
            _die_inside_the_next_commit(lambda: die(step))
        if faults is not None:
            faults.mid_step(step + 1, "mid-step")
            faults.mid_step(step + 1, "mid-commit", _die_inside_the_next_commit)
        opt.step()
        sched.step()
        extra["samples_seen"] += BATCH * world
        if rank == a.perturb_rank and step + 1 == a.perturb_step:
            with torch.no_grad():  # DDP never re-syncs parameters: from now on this rank's copy differs
                next(model.parameters()).view(-1)[7] += 1e-3

    if a.no_ffstate:
        for step in range(a.steps):
            step_fn(step)
    else:
        with ffstate.replicate(model, opt, lr_scheduler=sched, extra=extra) as ff:
            if faults is not None:
                faults.pause = ff.pause
                faults.entered()
            for step in range(ff.start_step, a.steps):
                step_fn(step)
                ff.commit(step + 1)
                if faults is not None:
                    faults.committed(step + 1)
                if a.kill_phase == "after-commit" and step + 1 == a.kill_step and a.kill_rank >= 0:
                    due = not (a.out / "killed-rank").exists()
                    dist.barrier()  # every rank has committed this step when the rank dies
                    if due and kill_me(step + 1, "after-commit"):
                        die(step + 1)
                if (step + 1 == a.kill_daemon_step and rank // per_node == a.kill_daemon and rank % per_node == 0
                        and once(a.out / "killed-daemon")):
                    _note(a.out, {"failure": "daemon", "node": a.kill_daemon, "after_step": step + 1,
                                  "time": time.time()})
                    kill_daemon(a.kill_daemon)
                if step + 1 == a.kill_node_step and a.kill_node >= 0:
                    _maybe_kill_node(a, rank, per_node, step + 1)
                if str(step + 1) in a.kill_job_steps.split(","):
                    _maybe_kill_job(a.out, rank, world // per_node, step + 1, a.kill_job_persisted, ff.start_step)
                if step + 1 == a.preempt_step and rank == 0:
                    _preempt(a.out, world // per_node, step + 1)
                if step + 1 == a.status_step and rank == 0:
                    _status(a.out / "status.txt", world // per_node)
    final = {"params": dict(capture.local(model.state_dict())), "optim": capture.local(capture.optimizer_state(opt)),
             "extra": dict(extra)}
    torch.save(final, a.out / f"final-rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


def _maybe_kill_node(a: argparse.Namespace, rank: int, per_node: int, step: int) -> None:
    """Once: every rank has committed ``step``; then node ``a.kill_node`` loses its daemon and its ranks."""
    marker = a.out / "killed-node"
    due = not marker.exists()
    dist.barrier()
    if not due:
        return
    mine = rank // per_node == a.kill_node
    if mine and rank % per_node == 0:
        marker.touch()
        _note(a.out, {"failure": "node", "node": a.kill_node, "after_step": step, "time": time.time()})
    dist.barrier()
    if mine:
        if rank % per_node == 0:
            kill_daemon(a.kill_node)
        os.kill(os.getpid(), signal.SIGKILL)


def _maybe_kill_job(out: Path, rank: int, nodes: int, step: int, persisted: int, start: int) -> None:
    """Once per step: every rank has committed ``step`` (and, with ``persisted``, the persistent tier holds that many
    complete versions newer than ``start``); then every node's daemon and every rank go (SIGKILL)."""
    marker = out / f"killed-job-{step}"
    due = not marker.exists()
    dist.barrier()
    if not due:
        return
    if rank == 0:
        if persisted:
            _wait_persisted(persisted, start)
        marker.touch()
        _note(out, {"failure": "job", "after_step": step, "time": time.time()})
        for node in range(nodes):
            kill_daemon(node)
    dist.barrier()
    os.kill(os.getpid(), signal.SIGKILL)


def _preempt(out: Path, nodes: int, step: int) -> None:
    """Once: SIGTERM to every process of the job at once, as a cluster's preemption sends it (Slurm's to every
    process of the job, a machine's shutdown): the torchrun agent, every rank, every node's daemon. No barrier:
    the other ranks stop wherever they are in their step."""
    if not once(out / "preempted"):
        return
    _note(out, {"failure": "preempt", "after_step": step, "time": time.time()})
    agent = os.getppid()
    ranks = [int(c) for t in Path(f"/proc/{agent}/task").iterdir() for c in (t / "children").read_text().split()]
    for node in range(nodes):
        kill_daemon(node, signal.SIGTERM)
    for pid in [agent, *(r for r in ranks if r != os.getpid()), os.getpid()]:
        os.kill(pid, signal.SIGTERM)


def _wait_persisted(count: int, start: int, timeout: float = 45.0) -> None:
    """Bounded below the watchdog's floor (60 s): every rank waits in a barrier meanwhile, committing nothing."""
    cfg = ffstate.Config.from_env()
    job_dir = Path(cfg.persist_dir) / ffstate.job.job_id(cfg)
    deadline = time.monotonic() + timeout
    while len([v for v in ffstate.persist.complete_versions(job_dir) if v > start]) < count:
        if time.monotonic() > deadline:
            raise SystemExit(f"the persistent tier wrote fewer than {count} versions after {start} in {timeout:.0f} s")
        time.sleep(0.05)


def _status(path: Path, nodes: int) -> None:
    """What an operator sees mid-job: ``ffstate status`` against every node's daemon."""
    import subprocess
    import sys

    from ffstate.placement import daemon_address

    cfg = ffstate.Config.from_env()
    daemons = [arg for n in range(nodes) for arg in ("--daemon", daemon_address(n, cfg))]
    out = subprocess.run([sys.executable, "-m", "ffstate.cli", "status", *daemons], capture_output=True, text=True,
                         timeout=60, env={**os.environ, "COLUMNS": "240"})
    path.write_text(out.stdout + out.stderr)


def _die_inside_the_next_commit(die) -> None:
    """The next commit writes the whole slot, clobbers half of it, and dies before publishing it."""
    from ffstate import codec

    real = codec.pack_into

    def torn(state, out, manifest=None, **kw):
        real(state, out, manifest, **kw)
        out[: out.numel() // 2].zero_()
        die()

    codec.pack_into = torn


def allreduce_gradients(model: torch.nn.Module, world: int) -> None:
    """Data parallelism by hand: every gradient averaged over the ranks, all on the wire at once."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    for work in [dist.all_reduce(g, async_op=True) for g in grads]:
        work.wait()
    for g in grads:
        g.div_(world)


def _loss(model: torch.nn.Module, idx: torch.Tensor) -> torch.Tensor:
    logits = model(idx[:, :-1])
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), idx[:, 1:].reshape(-1))


def _note(out: Path, event: dict) -> None:
    with open(out / "failures.jsonl", "a") as f:
        f.write(json.dumps(event) + "\n")


if __name__ == "__main__":
    main()
    exit_now()  # not through the interpreter's finalization, where gloo's threads can abort it
