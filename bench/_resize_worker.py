"""The resize benchmark's torchrun worker (``bench/resize.py``): TinyGPT under DDP with AdamW, ffstate.replicate.

``--phase train``: trains ``--steps`` steps at this world size, saving each step with ``dcp.save`` too (the disk
copy a DCP user would resume from), then simulated node 1 is lost (its ranks and its daemon SIGKILLed; the time
goes to ``DIR/killed.json``).
``--phase resize``: at another world size, ``--repeats`` times (interleaved): enters ffstate.replicate, which
resumes from the old world's copies (node 0's slots, the replicas it held of node 1's ranks), resharded, and
leaves again without committing (so the old copies stay); and ``dcp.load`` of the same version from disk into the
same model and optimizer. Then one real entry, one step and its commit: the first step at the new size
(``DIR/resize.json``, rank 0, with every rank's medians).
``--phase elastic``: trains to ``--steps`` under an elastic torchrun, each step taking at least ``--step-seconds``;
rank 0 appends (step, world size, time) to ``DIR/progress.jsonl`` (the drain's downtime is read from it).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.nn.parallel import DistributedDataParallel as DDP

import ffstate
import ffstate.job
from ffstate.bench.codec import SIZES
from ffstate.testing.models import TinyGPT


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--phase", choices=("train", "resize", "elastic"), required=True)
    p.add_argument("--step-seconds", type=float, default=0.0)
    p.add_argument("--size", default="small")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--repeats", type=int, default=5)
    a = p.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    shape = SIZES[a.size]
    model = DDP(TinyGPT(**shape))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    cfg = ffstate.Config.from_env(resize_rng="keep")

    def step(n: int) -> None:
        g = torch.Generator().manual_seed(n * 1000 + rank)
        idx = torch.randint(0, shape["vocab"], (4, shape["seq"] + 1), generator=g)
        logits = model(idx[:, :-1])  # through DDP: its gradients are all-reduced
        torch.nn.functional.cross_entropy(logits.reshape(-1, shape["vocab"]), idx[:, 1:].reshape(-1)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    if a.phase == "elastic":
        with ffstate.replicate(model, opt, config=cfg) as ff:
            for n in range(ff.start_step + 1, a.steps + 1):
                start = time.monotonic()
                step(n)
                time.sleep(max(0.0, a.step_seconds - (time.monotonic() - start)))
                ff.commit(n)
                if rank == 0:
                    with open(a.out / "progress.jsonl", "a") as f:
                        f.write(json.dumps({"step": n, "world": world, "time": time.time()}) + "\n")
        dist.destroy_process_group()
        return

    if a.phase == "train":
        with ffstate.replicate(model, opt, config=cfg) as ff:
            for n in range(ff.start_step + 1, a.steps + 1):
                step(n)
                msd, osd = get_state_dict(model, opt)
                dcp.save({"model": msd, "optim": osd}, checkpoint_id=a.out / "dcp" / f"step{n}")
                ff.commit(n)
            if rank == world // 2:  # node 1 lost: its daemon, then (once every rank is here) its ranks
                (a.out / "killed.json").write_text(json.dumps({"time": time.time(), "step": a.steps}))
                run_dir = Path(tempfile.gettempdir()) / f"ffstate-{ffstate.job.job_id(cfg)}"
                os.kill(int((run_dir / "daemon-node1.pid").read_text()), signal.SIGKILL)
            dist.barrier()
            if rank >= world // 2:
                os.kill(os.getpid(), signal.SIGKILL)
            dist.barrier()  # node 0 waits here for ranks that never come
        return

    times: dict[str, list[float]] = {"ffstate": [], "dcp.load": [], "ffstate restore": []}
    got = None
    for r in range(a.repeats + 1):  # the first round warms both up
        for way in (("ffstate", "dcp.load") if r % 2 == 0 else ("dcp.load", "ffstate")):
            dist.barrier()
            start = time.perf_counter()
            if way == "ffstate":
                ff = ffstate.replicate(model, opt, config=cfg)
                ff.__enter__()
                got = ff.restored
                ff.__exit__(RuntimeError, RuntimeError("measured"), None)  # leaves every copy where it is
            else:
                msd, osd = get_state_dict(model, opt)
                dcp.load({"model": msd, "optim": osd}, checkpoint_id=a.out / "dcp" / f"step{got.version}")
                set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd)
            dist.barrier()
            if r:
                times[way].append(time.perf_counter() - start)
                if way == "ffstate":
                    times["ffstate restore"].append(got.seconds)
    mine = {way: statistics.median(v) for way, v in times.items()}
    mine.update(version=got.version, steps_lost=got.steps_lost, nbytes=got.nbytes)
    with ffstate.replicate(model, opt, config=cfg) as ff:
        step(ff.start_step + 1)
        ff.commit(ff.start_step + 1)
        first_step = time.time()
    everyone = [None] * world
    dist.all_gather_object(everyone, mine)
    if rank == 0:
        (a.out / "resize.json").write_text(json.dumps({"ranks": everyone, "first_step": first_step}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
