"""The job of ``ffstate bench downtime`` and of the in-process tests: the README's DDP loop (TinyGPT, AdamW, a
cosine schedule, the data position as an extra), under plain torchrun (``--mode torchrun``: torchrun restarts every
worker after a failure) or in the mode where survivors stay in their processes (``--mode inprocess``: under
``ffstate.inprocess.restartable``, launched as every process of the job, spares included).

    python -m ffstate.bench._downtime_worker OUT STEPS --mode torchrun|inprocess [--kill PROCESS:STEP ...]
        [--kill-after-restore PROCESS] [--step-seconds S] [--dump-steps S,...] [--stuck PROCESS:STEP]
        [--unwind-grace SECONDS] [--kill-at-group PROCESS:ITERATION]

``--kill P:S``: process P (its RANK at launch; under torchrun the rank) SIGKILLs itself right after committing step
S, once (a marker in OUT). ``--kill-after-restore P``: process P SIGKILLs itself right after its first restore in a
restarted entry, before its first step (two failures in a row). ``--stuck P:S``: process P, right after committing
step S of its first entry, waits an hour inside C (``time.sleep``), where the engine's restart cannot reach it: what
a survivor stuck in a wait the abort did not end looks like (``ffstate/inprocess/unwind.py``; ``--unwind-grace``,
the engine's bound on it); a process killed at that step dies only once P is inside that wait (OUT/stuck).
``--kill-at-group P:I``: as process P comes to make the process group of the engine's iteration I, before it says it
has arrived (``ffstate/inprocess/group.py``), it SIGKILLs its engine's monitor process and then itself, as a machine's
loss takes both: a rank lost while the others make the next group, found only by its siblings' heartbeats.
``--step-seconds``: each step sleeps to take at least this long (a job whose steps are not all Python on 2 cores).
Every process appends to OUT/progress.jsonl: ``{"kill": P}`` before it dies; ``{"stuck": P}`` before it waits;
``{"process", "event": "started" | "group" | "restored", "iteration"}`` (the process began, its process group is up,
ffstate restored it); ``{"process", "event": "left", "attempt"}`` once the in-process engine returned (``attempt``:
``FFSTATE_ATTEMPT`` then, None once the engine put its environment back); ``{"process", "rank", "step",
"iteration"}`` at every commit; each with its wall ``time``. At the end each rank writes OUT/final-rank<R>.pt.
``--dump-steps``: each rank of the first entry writes its state at those steps (OUT/step<S>-rank<R>.pt), and every
rank of a later entry the state it was restored to (OUT/restored-it<I>-rank<R>.pt): what a shrink's restore is
checked against.
"""

import time

STARTED = time.time()  # before the imports: a restarted worker's start, as torchrun gives it

import argparse  # noqa: E402
import faulthandler  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import os  # noqa: E402
import random  # noqa: E402
import signal  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import ffstate  # noqa: E402
from ffstate.testing.faults import die_once, monitor_pid  # noqa: E402
from ffstate.testing.models import TinyGPT  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out", type=Path)
    p.add_argument("steps", type=int)
    p.add_argument("--mode", choices=("torchrun", "inprocess"), required=True)
    p.add_argument("--kill", action="append", default=[])
    p.add_argument("--kill-after-restore", type=int, default=-1)
    p.add_argument("--stuck", default="")
    p.add_argument("--unwind-grace", type=float, default=None)
    p.add_argument("--kill-at-group", default="")
    p.add_argument("--step-seconds", type=float, default=0.0)
    p.add_argument("--dump-steps", default="")
    p.add_argument("--raise-at", type=int, default=0)  # rank 0 raises at that step and after it, at every entry
    p.add_argument("--loss-all-reduce", action="store_true")  # the loop's own collective at each step's end
    a = p.parse_args()
    # `kill -USR2` writes every thread's stack to the process's log: what a test that waited in vain reports.
    faulthandler.register(signal.SIGUSR2, all_threads=True)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s.%(msecs)03d %(levelname)s %(name)s: %(message)s",
                        datefmt="%H:%M:%S")
    kills = {(int(k.split(":")[0]), int(k.split(":")[1])) for k in a.kill}  # (process, step)
    stuck = tuple(int(x) for x in a.stuck.split(":")) if a.stuck else None
    process = int(os.environ["RANK"])
    torch.manual_seed(0)  # every stream alike on every rank: a shrink (Config.min_nodes) takes them over (docs/elastic.md)
    random.seed(0)
    np.random.seed(0)
    model = TinyGPT()  # built once, before the engine: a spare is warm (torch imported, model built)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=a.steps)
    data = {"offset": 0}
    dumps = {int(x) for x in a.dump_steps.split(",") if x}

    def dump(path: Path) -> None:
        torch.save({"model": model.state_dict(), "optim": optimizer.state_dict(), "sched": sched.state_dict(),
                    "data": dict(data)}, path)

    def note(record: dict, at: float | None = None) -> None:
        with open(a.out / "progress.jsonl", "a") as f:
            f.write(json.dumps({**record, "time": at or time.time()}) + "\n")

    def die(marker: str) -> None:
        die_once(a.out / marker, lambda: note({"kill": process}))

    iteration = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    note({"process": process, "event": "started", "iteration": iteration}, STARTED)

    def train(rank: int, world: int, iteration: int) -> int:
        note({"process": process, "event": "group", "iteration": iteration})
        ddp = torch.nn.parallel.DistributedDataParallel(model)

        def batch(offset: int) -> torch.Tensor:  # synthetic tokens, a function of the position
            g = torch.Generator().manual_seed(offset * world + rank)
            return torch.randint(0, 96, (8, 33), generator=g)

        with ffstate.replicate(ddp, optimizer, lr_scheduler=sched, extra=data) as ff:
            note({"process": process, "event": "restored", "iteration": iteration, "version": ff.start_step})
            if dumps and iteration:
                dump(a.out / f"restored-it{iteration}-rank{rank}.pt")
            if iteration and process == a.kill_after_restore:
                die("killed-after-restore")
            for step in range(ff.start_step, a.steps):
                began = time.perf_counter()
                x = batch(data["offset"])
                logits = ddp(x[:, :-1])
                loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 96), x[:, 1:].reshape(-1))
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                sched.step()
                data["offset"] += 1
                time.sleep(max(0.0, a.step_seconds - (time.perf_counter() - began)))
                ff.commit(step + 1)
                note({"process": process, "rank": rank, "step": step + 1, "iteration": iteration})
                if a.raise_at and step + 1 >= a.raise_at and rank == 0:
                    raise ValueError(f"injected at step {step + 1}")
                if step + 1 in dumps and not iteration:
                    dump(a.out / f"step{step + 1}-rank{rank}.pt")
                if (process, step + 1) in kills:
                    if stuck is not None and stuck[1] == step + 1:  # dies once the stuck one is inside its wait
                        waited = time.monotonic() + 120
                        while not (a.out / "stuck").exists() and time.monotonic() < waited:
                            time.sleep(0.01)
                    die(f"killed-{process}-{step + 1}")
                if (process, step + 1) == stuck and not iteration:
                    note({"stuck": process})
                    (a.out / "stuck").touch()
                    time.sleep(3600)  # in C: the engine's restart is not delivered until it returns
                if a.loss_all_reduce:  # as a loop logs its mean loss: a collective ffstate does not mark
                    dist.all_reduce(loss.detach().clone())
        dump(a.out / f"final-rank{rank}.pt")
        return rank

    if a.mode == "torchrun":
        dist.init_process_group("gloo")
        train(dist.get_rank(), dist.get_world_size(), iteration)
        dist.destroy_process_group()
        return
    from ffstate.daemon import running
    from ffstate.inprocess import group, restartable
    from ffstate.job import job_id

    if a.kill_at_group:
        who, at_iteration = (int(x) for x in a.kill_at_group.split(":"))
        arrive = group.arrive

        def arrive_or_die(*args, **kwargs):
            if process == who and int(os.environ["FFSTATE_ATTEMPT"]) == at_iteration:
                die_once(a.out / f"killed-at-group-{at_iteration}", lambda: (note({"kill": process}), kill_monitor()))
            return arrive(*args, **kwargs)

        def kill_monitor() -> None:  # the engine's monitor process of this one
            os.kill(monitor_pid(running.run_dir(job_id(ffstate.Config.from_env())), process), signal.SIGKILL)

        group.arrive = arrive_or_die

    @restartable(**({} if a.unwind_grace is None else {"unwind_grace": a.unwind_grace}))
    def attempt(at):
        return train(at.rank, at.world, at.iteration)

    attempt()
    note({"process": process, "event": "left", "attempt": os.environ.get("FFSTATE_ATTEMPT")})  # the engine's env gone


if __name__ == "__main__":
    main()
    # Not through the interpreter's finalization, where gloo's threads can abort the process (ffstate/startup.py):
    # the in-process test's job ended once with a SIGABRT there, after its last step and files.
    from ffstate.startup import exit_now

    exit_now()
