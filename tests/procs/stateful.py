"""A training loop as users write it, under torchrun: a StatefulDataLoader over a DistributedSampler that
shuffles, a GradScaler, a user object drawing from its own torch.Generator, a model with dropout and a
head tied to its embedding; all passed to ffstate.replicate as extras, by name.

    torchrun --nproc-per-node 2 tests/procs/stateful.py OUT --parallel ddp|zero|fsdp2 [--kill-rank R --kill-step S]
             [--no-ffstate]

Writes OUT/final-rank{R}.pt: parameters, optimizer state and every extra's state_dict() after STEPS steps.
"""

import argparse
import os
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ffstate.startup import collector_paused, exit_now  # noqa: E402

with collector_paused():  # imports without Python's collector: a process start's CPU (ffstate/startup.py)
    import torch
    import torch.distributed as dist
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import DistributedSampler, TensorDataset
    from torchdata.stateful_dataloader import StatefulDataLoader

    import ffstate
    from ffstate import capture

STEPS, VOCAB, DIM, SEQ, BATCH = 14, 64, 32, 16, 4


class TiedModel(torch.nn.Module):
    """An embedding, one block with dropout, and a head that shares the embedding's Parameter."""

    def __init__(self):
        super().__init__()
        self.tok = torch.nn.Embedding(VOCAB, DIM)
        self.block = torch.nn.TransformerEncoderLayer(DIM, 4, 2 * DIM, dropout=0.1, batch_first=True)
        self.head = torch.nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.tok.weight  # tied: one Parameter under two names

    def forward(self, idx):
        return self.head(self.block(self.tok(idx)))


class Noise:
    """A user's stateful object: input noise from its own generator (Stateful: state_dict / load_state_dict)."""

    def __init__(self, seed: int):
        self.gen = torch.Generator().manual_seed(seed)
        self.draws = 0

    def __call__(self, n: int) -> torch.Tensor:
        self.draws += 1
        return torch.randint(0, VOCAB, (n,), generator=self.gen)

    def state_dict(self) -> dict:
        return {"gen": self.gen.get_state(), "draws": self.draws}

    def load_state_dict(self, state: dict) -> None:
        self.gen.set_state(state["gen"])
        self.draws = state["draws"]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out", type=Path)
    p.add_argument("--parallel", choices=("ddp", "zero", "fsdp2"), required=True)
    p.add_argument("--kill-rank", type=int, default=-1)
    p.add_argument("--kill-step", type=int, default=0)
    p.add_argument("--no-ffstate", action="store_true")
    a = p.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = TiedModel()
    if a.parallel == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        fully_shard(model.block)
        fully_shard(model)  # the tied embedding and head stay together, in the root's group
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    elif a.parallel == "zero":
        model = DDP(model)
        opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=3e-3)
    else:
        model = DDP(model)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    data = TensorDataset(torch.randint(0, VOCAB, (24, SEQ + 1), generator=torch.Generator().manual_seed(1)))
    sampler = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=True, seed=0)
    # generator=: creating an iterator then draws its base seed from the loader's generator, not from the
    # global RNG the dropout masks come from (the README's pitfall).
    loader = StatefulDataLoader(data, batch_size=BATCH, sampler=sampler, generator=torch.Generator().manual_seed(2))
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8, growth_interval=3)
    noise = Noise(seed=100 + rank)
    extra = {"loader": loader, "scaler": scaler, "noise": noise}

    def train(step: int, batch: torch.Tensor) -> None:
        idx = batch[:, :-1].clone()
        idx[:, 0] = noise(idx.shape[0])
        logits = model(idx)
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), batch[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()

    def loop(start: int, commit) -> None:
        step = start
        while step < STEPS:
            sampler.set_epoch(step // len(loader))  # the epoch follows from the step: right after a restore too
            for (batch,) in loader:  # resumes mid-epoch after a restore
                train(step, batch)
                step += 1
                commit(step)
                if step == STEPS:
                    break

    if a.no_ffstate:
        loop(0, lambda step: None)
    else:
        with ffstate.replicate(model, opt, extra=extra) as ff:
            def commit(step: int) -> None:
                ff.commit(step)
                if rank == a.kill_rank and step == a.kill_step and not (a.out / "killed").exists():
                    (a.out / "killed").touch()
                    os.kill(os.getpid(), signal.SIGKILL)

            loop(ff.start_step, commit)
    final = {"params": dict(capture.local(model.state_dict())), "optim": capture.local(capture.optimizer_state(opt)),
             "loader": loader.state_dict(), "scaler": scaler.state_dict(), "noise": noise.state_dict(),
             "rng": torch.get_rng_state()}
    torch.save(final, a.out / f"final-rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    exit_now()  # not through the interpreter's finalization, where gloo's threads can abort it
