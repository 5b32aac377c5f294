"""One process, no torchrun: train with ffstate.replicate, optionally SIGKILL after a commit.

    python tests/procs/single.py OUT STEPS [--kill-after S] [--staged] [--leave-after S --stay SECONDS]

Prints "start S" (the step it resumed at) and, at the end, the restores its daemon reports of it
("restores N to V lost L in Ss"); writes OUT/final.pt. ``--staged``: commits take the GPU's path with the CPU as the
device (the Triton gather into a staging buffer, the copy into the slot landing after ``commit`` returns, published
by the writer's thread); run it with ``FFSTATE_KERNELS=triton TRITON_INTERPRET=1``. ``--leave-after``: an error
leaves ``ffstate.replicate`` after that commit, and the process stays ``--stay`` seconds before it exits 0 (printing
"stayed"), as an in-process restart keeps a rank's process between two entries.
"""

import argparse
import os
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ffstate.startup import collector_paused, exit_now  # noqa: E402

with collector_paused():  # imports without Python's collector: a process start's CPU (ffstate/startup.py)
    import torch

    import ffstate
    import ffstate.reports
    from ffstate.testing.models import TinyGPT


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out", type=Path)
    p.add_argument("steps", type=int)
    p.add_argument("--kill-after", type=int, default=0)
    p.add_argument("--staged", action="store_true")
    p.add_argument("--leave-after", type=int, default=0)
    p.add_argument("--stay", type=float, default=0.0)
    a = p.parse_args()
    if a.leave_after:
        try:
            train(a)
        except InterruptedError:
            time.sleep(a.stay)
            print("stayed", flush=True)
        return
    train(a)


def train(a: argparse.Namespace) -> None:
    if a.staged:
        import logging

        from ffstate import staging

        logging.basicConfig(level=logging.INFO)  # the writer says it stages

        staging.wanted = lambda leaves: torch.device("cpu")
    torch.manual_seed(0)
    model = TinyGPT()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    sched = torch.optim.lr_scheduler.StepLR(opt, 3, gamma=0.5)
    extra = {"seen": 0}
    with ffstate.replicate(model, opt, lr_scheduler=sched, extra=extra) as ff:
        print(f"start {ff.start_step}", flush=True)
        for step in range(ff.start_step, a.steps):
            x = torch.randint(0, 96, (4, 33))
            loss = model.loss(x) + 0.0 * torch.rand(())  # the RNG is part of the state
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
            extra["seen"] += 4
            ff.commit(step + 1)
            if step + 1 == a.kill_after:
                os.kill(os.getpid(), signal.SIGKILL)
            if step + 1 == a.leave_after:
                raise InterruptedError(f"interrupted after step {step + 1}")
        stats = ff.stats()  # the daemon's view of this rank, restores included
        r = stats.restore or ffstate.reports.RestoreReport()
        print(f"restores {r.restores} to {r.version} lost {r.steps_lost} in {r.seconds:.6f}s", flush=True)
    torch.save({"model": model.state_dict(), "optim": opt.state_dict(), "sched": sched.state_dict(),
                "extra": extra, "rng": torch.get_rng_state()}, a.out / "final.pt")


if __name__ == "__main__":
    main()
    exit_now()  # not through the interpreter's finalization, where gloo's threads can abort it
