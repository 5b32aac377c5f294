"""A torchrun job that changes shape: a small model under DDP, DDP + ZeRO or FSDP2, wrapped in ffstate.replicate,
its data position an ``ElasticSampler``; launched again at another world size, it resumes resharded from the copies
the earlier launch left in the daemons.

    torchrun --nproc-per-node N tests/procs/elastic.py --out DIR --parallel ddp|ddp-zero|fsdp2 --steps S
        [--kill-node-after K | --kill-all-after K] [--per-rank-extra plain|hooked] [--check]

Before each commit every rank saves the step with torch.distributed.checkpoint alone (``DIR/ref/step<S>``: a
consolidated copy of the state, the reference). With ``--check``, a rank that resumed from copies of another world
size loads the reference of v* into a twin of its model and optimizer with DCP's own reader at this world size and
compares every tensor's bits with what ffstate restored (``DIR/check-v<v*>-w<N>-rank<R>.json``). ``--kill-node-after K``
SIGKILLs simulated node 1 (its ranks and its daemon) after step K; ``--kill-all-after K`` every rank (the daemons
live on). ``--per-rank-extra plain|hooked`` adds an extra with per-rank state, without or with a reshard hook.
Progress goes to ``DIR/progress.jsonl`` (rank 0: step, world, time).
"""

import argparse
import json
import os
import random
import signal
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from ffstate.startup import collector_paused, exit_now  # noqa: E402

with collector_paused():  # imports without Python's collector: a process start's CPU (ffstate/startup.py)
    import numpy as np
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict, set_state_dict
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP

    import ffstate
    import ffstate.job
    from ffstate import capture
    from ffstate.elastic import ElasticSampler
    from ffstate.persist.keys import canonical
    from ffstate.testing.models import TinyGPT

SAMPLES, BATCH, SEQ, VOCAB = 512, 2, 16, 97  # a vocabulary of 97 rows: uneven shards at 2, 3 and 4 ranks


class Net(torch.nn.Module):
    """TinyGPT and a parameter whose first dimension (3) is smaller than 4 ranks."""

    def __init__(self):
        super().__init__()
        self.gpt = TinyGPT(vocab=VOCAB, dim=40, heads=4, layers=2, seq=SEQ)
        self.tail = torch.nn.Linear(5, 3)

    def forward(self, idx):
        return self.gpt.loss(idx) + 0.01 * self.tail(torch.ones(5)).square().sum()


class PerRank:
    """An extra whose state is this rank's own, with no reshard hook: a resize must refuse it by name."""

    def __init__(self, rank):
        self.rank = rank

    def state_dict(self):
        return {"rank": self.rank}

    def load_state_dict(self, state):
        self.rank = state["rank"]


class PerRankHooked(PerRank):
    """The same, once its author wrote the hook: each new rank takes its own rank."""

    def reshard_state_dict(self, states, old_world, new_rank, new_world):
        assert [s["rank"] for s in states] == list(range(old_world))
        return {"rank": new_rank}


def sample(i: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (SEQ + 1,), generator=torch.Generator().manual_seed(i))


def build(parallel: str):
    """The model, optimizer and scheduler at this world size (the same construction for the twin)."""
    torch.manual_seed(0)
    model = Net()
    if parallel == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for block in model.gpt.blocks:
            fully_shard(block)
        fully_shard(model)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    elif parallel == "ddp":
        model = DDP(model)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    else:
        model = DDP(model)
        opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=3e-3, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    return model, opt, sched


def zero_state(model, zero, shapes=None) -> dict:
    """A ZeRO optimizer's partition as {fqn: {name: tensor}} (its own tensors; or new ones of ``shapes``)."""
    names = {id(p): canonical(n, True) for n, p in model.named_parameters()}
    out = {}
    for p in [p for g in zero.optim.param_groups for p in g["params"]]:
        fqn = names[id(p)]
        if shapes is None:
            out[fqn] = dict(zero.optim.state.get(p, {}))
        else:
            out[fqn] = {k[len(f"optim.state.{fqn}."):]: torch.empty(md.size, dtype=md.properties.dtype)
                        for k, md in shapes.items() if k.startswith(f"optim.state.{fqn}.")}
    return out


def reference(model, opt, sched, parallel: str) -> dict:
    """What the job saves with DCP alone at each step: its consolidated copy."""
    if parallel == "ddp-zero":
        return {"model": get_model_state_dict(model), "optim": {"state": zero_state(model, opt)},
                "sched": sched.state_dict()}
    msd, osd = get_state_dict(model, opt)
    return {"model": msd, "optim": osd, "sched": sched.state_dict()}


def local(t):
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def check(ckpt: Path, parallel: str, model, opt, sched) -> dict:
    """Loads ``ckpt`` with DCP's FileSystemReader into a twin at this world size and compares it, bit for bit, with
    the live objects ffstate restored."""
    rng = capture.rng_state()
    twin, twin_opt, twin_sched = build(parallel)
    if parallel == "ddp-zero":
        meta = dcp.FileSystemReader(ckpt).read_metadata().state_dict_metadata
        want = {"model": get_model_state_dict(twin), "optim": {"state": zero_state(twin, twin_opt, meta)},
                "sched": twin_sched.state_dict()}
        dcp.load(want, checkpoint_id=ckpt)
        ref_model, ref_optim = want["model"], want["optim"]["state"]
        live_model, live_optim = get_model_state_dict(model), zero_state(model, opt)
        lrs = ([g["lr"] for g in opt.param_groups], [g["lr"] for g in opt.optim.param_groups])
    else:
        msd, osd = get_state_dict(twin, twin_opt)
        want = {"model": msd, "optim": osd, "sched": twin_sched.state_dict()}
        dcp.load(want, checkpoint_id=ckpt)
        set_state_dict(twin, twin_opt, model_state_dict=want["model"], optim_state_dict=want["optim"])
        ref_model, ref_o = get_state_dict(twin, twin_opt)
        live_model, live_o = get_state_dict(model, opt)
        ref_optim, live_optim = ref_o["state"], live_o["state"]
        lrs = ([g["lr"] for g in live_o["param_groups"]], [g["lr"] for g in ref_o["param_groups"]])
    bad, n = [], 0
    for k in sorted(set(ref_model) | set(live_model)):
        n += 1
        a, b = local(live_model.get(k)), local(ref_model.get(k))
        if a is None or b is None or a.dtype != b.dtype or a.shape != b.shape or not torch.equal(
                a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)):
            bad.append(f"model.{k}")
    for fqn in sorted(set(ref_optim) | set(live_optim)):
        for name in sorted(set(ref_optim.get(fqn, {})) | set(live_optim.get(fqn, {}))):
            n += 1
            a, b = live_optim.get(fqn, {}).get(name), ref_optim.get(fqn, {}).get(name)
            a, b = local(a), local(b)
            if a is None or b is None or not torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)):
                bad.append(f"optim.{fqn}.{name}")
    if sched.state_dict() != want["sched"]:
        bad.append("sched")
    if lrs[0] != lrs[1] and parallel != "ddp-zero":
        bad.append(f"lr {lrs}")
    capture.set_rng_state(rng)
    return {"tensors": n, "mismatches": bad}


def once(marker: Path) -> bool:
    try:
        os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        return True
    except FileExistsError:
        return False


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--parallel", choices=("ddp", "ddp-zero", "fsdp2"), default="ddp")
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--kill-node-after", type=int, default=0)
    p.add_argument("--kill-all-after", type=int, default=0)
    p.add_argument("--per-rank-extra", choices=("", "hooked", "plain"), default="")
    p.add_argument("--check", action="store_true")
    p.add_argument("--step-sleep", type=float, default=0.0, help="seconds each step takes longer (for a test to act)")
    p.add_argument("--stop-file", type=Path, default=None,
                   help="the job ends at the step where this file exists (all ranks agree), or at --steps")
    a = p.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    np.random.seed(0)
    random.seed(0)
    model, opt, sched = build(a.parallel)
    sampler = ElasticSampler(SAMPLES, BATCH, seed=1)
    loader = torch.utils.data.DataLoader([sample(i) for i in range(SAMPLES)], batch_sampler=sampler)
    # The samples the job took in the current epoch, and the epochs it finished: what the sampler's position and
    # epoch must say after any resize (an epoch ends when fewer than a step's worth are left, at the world size then).
    extra = {"data": sampler, "samples": 0, "epochs": 0}
    if a.per_rank_extra:
        extra["per_rank"] = (PerRankHooked if a.per_rank_extra == "hooked" else PerRank)(rank)
    refs = a.out / "ref"
    with ffstate.replicate(model, opt, sched, extra=extra) as ff:
        got = ff.restored
        if got is not None and got.from_world and a.check:
            verdict = check(refs / f"step{got.version}", a.parallel, model, opt, sched)
            verdict.update(v=got.version, from_world=got.from_world, world=world, lost=got.steps_lost,
                           seconds=got.seconds, entry=got.entry_seconds, samples=extra["samples"],
                           position=sampler.position, epochs=extra["epochs"], epoch=sampler.epoch)
            (a.out / f"check-v{got.version}-w{world}-rank{rank}.json").write_text(json.dumps(verdict))
        step = ff.start_step
        while step < a.steps:
            for batch in loader:
                loss = model(batch)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                sched.step()
                time.sleep(a.step_sleep)
                step += 1
                extra["samples"] += BATCH * world
                dcp.save(reference(model, opt, sched, a.parallel), checkpoint_id=refs / f"step{step}")
                ff.commit(step)
                if rank == 0:
                    with open(a.out / "progress.jsonl", "a") as f:
                        f.write(json.dumps({"step": step, "world": world, "time": time.time()}) + "\n")
                if step == a.kill_all_after:
                    dist.barrier()  # every rank's commit of the step is in before the first dies: torchrun stops the rest
                    if once(a.out / f"killed-all-{step}"):
                        os.kill(os.getpid(), signal.SIGKILL)
                if step == a.kill_node_after and rank >= world // 2 and once(a.out / f"killed-rank{rank}-{step}"):
                    if rank == world // 2:
                        job = ffstate.job.job_id(ffstate.Config.from_env())
                        pid = Path(tempfile.gettempdir()) / f"ffstate-{job}" / "daemon-node1.pid"
                        os.kill(int(pid.read_text()), signal.SIGKILL)
                    os.kill(os.getpid(), signal.SIGKILL)
                if a.stop_file is not None and stop_now(a.stop_file):
                    a.steps = step
                if step >= a.steps:
                    break
            else:  # the epoch ended: the sampler begins the next one at position 0
                extra["samples"], extra["epochs"] = 0, extra["epochs"] + 1
    dist.destroy_process_group()


def stop_now(path: Path) -> bool:
    """Whether ``path`` exists, as the whole group sees it (a rank that saw it a step before another would leave
    the others waiting in a collective)."""
    seen = torch.tensor([float(path.exists())])
    dist.all_reduce(seen, op=dist.ReduceOp.MAX)
    return bool(seen.item())


if __name__ == "__main__":
    main()
    exit_now()  # not through the interpreter's finalization, where gloo's threads can abort it
