"""DDP with a gradient-compression communication hook under torchrun, with ffstate: PowerSGD (error feedback, warm
start) registered through ffstate.register_comm_hook, so that the scheduler's marks and the hook's state come along.

    torchrun --nproc-per-node 2 --max-restarts 2 tests/procs/hooks_job.py OUT STEPS [--kill-rank R --kill-step S]
        [--no-ffstate]

``--no-ffstate``: the hook registered with DDP itself, no ffstate (the reference). Rank R SIGKILLs itself once after
committing step S. Each rank writes OUT/final-rank<R>.pt (model, optimizer, the hook's state) and OUT/wire.json (the
bytes the hook sent per step, against DDP's plain all-reduce).
"""

import argparse
import json
from pathlib import Path

from ffstate.startup import collector_paused, exit_now

with collector_paused():  # imports without Python's collector: a process start's CPU (ffstate/startup.py)
    import torch
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd

    import ffstate
    from ffstate.hooks import PowerSGDState
    from ffstate.testing.faults import die_once
    from ffstate.testing.models import TinyGPT


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out", type=Path)
    p.add_argument("steps", type=int)
    p.add_argument("--kill-rank", type=int, default=-1)
    p.add_argument("--kill-step", type=int, default=0)
    p.add_argument("--no-ffstate", action="store_true")
    a = p.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(TinyGPT())
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    state = powersgd.PowerSGDState(process_group=None, matrix_approximation_rank=2, start_powerSGD_iter=4,
                                   min_compression_rate=1.0, use_error_feedback=True, warm_start=True, random_seed=0)
    if a.no_ffstate:
        model.register_comm_hook(state, powersgd.powerSGD_hook)
    else:
        ffstate.register_comm_hook(model, state, powersgd.powerSGD_hook)
    data = {"offset": 0}

    def step() -> None:
        g = torch.Generator().manual_seed(data["offset"] * world + rank)
        x = torch.randint(0, 96, (8, 33), generator=g)
        loss = torch.nn.functional.cross_entropy(model(x[:, :-1]).reshape(-1, 96), x[:, 1:].reshape(-1))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        data["offset"] += 1

    if a.no_ffstate:
        for _ in range(a.steps):
            step()
    else:
        with ffstate.replicate(model, optimizer, extra=data) as ff:
            for s in range(ff.start_step, a.steps):
                step()
                ff.commit(s + 1)
                if rank == a.kill_rank and s + 1 == a.kill_step:
                    die_once(a.out / "killed")
    torch.save({"model": model.state_dict(), "optim": optimizer.state_dict(),
                "hook": PowerSGDState(state).state_dict()}, a.out / f"final-rank{rank}.pt")
    if rank == 0:
        (a.out / "wire.json").write_text(json.dumps({"before": state.total_numel_before_compression,
                                                     "after": state.total_numel_after_compression}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    exit_now()  # not through the interpreter's finalization, where gloo's threads can abort it
