"""A Lightning fit under torchrun with ffstate's ReplicationCallback (docs/lightning.md's example, made small): a
little model with dropout, AdamW with a per-step and a per-epoch scheduler, a StatefulDataLoader that Lightning gives
a DistributedSampler, validation every few batches with an EarlyStopping on its loss (patient enough never to stop:
its state is what is checked), DDP over gloo.

    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --nproc-per-node 2 --max-restarts 2 tests/procs/lightning_job.py OUT \
        [--kill-rank R --kill-step S[,S...]] [--no-ffstate]

Rank R SIGKILLs itself once (a marker OUT/killed-S) after the optimizer step that makes global step S, for each S. At
the end each rank writes OUT/final-rank<R>.pt: the model, the optimizer's and the schedulers' state, and the loop's
counters; and OUT/callbacks-rank<R>.pt, the EarlyStopping's state.
"""

import argparse
from pathlib import Path

from ffstate.startup import collector_paused, exit_now

with collector_paused():  # imports without Python's collector: a process start's CPU (ffstate/startup.py)
    import lightning as L
    import torch
    from torchdata.stateful_dataloader import StatefulDataLoader

    from ffstate.integrations.lightning import ReplicationCallback
    from ffstate.testing.faults import die_once


class Net(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Dropout(0.2),
                                       torch.nn.Linear(32, 4))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.cross_entropy(self.net(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", torch.nn.functional.cross_entropy(self.net(x), y), sync_dist=True)

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=1e-2)
        step = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.9)
        epoch = torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.95)
        return [opt], [{"scheduler": step, "interval": "step"}, {"scheduler": epoch, "interval": "epoch"}]


def data(n: int, seed: int) -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(seed)
    return torch.utils.data.TensorDataset(torch.randn(n, 16, generator=g), torch.randint(0, 4, (n,), generator=g))


class Kill(L.Callback):
    def __init__(self, out: Path, rank: int, steps: list[int]):
        self.out, self.rank, self.steps = out, rank, steps

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_rank == self.rank and trainer.global_step in self.steps:
            die_once(self.out / f"killed-{trainer.global_step}")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out", type=Path)
    p.add_argument("--kill-rank", type=int, default=-1)
    p.add_argument("--kill-step", default="0")
    p.add_argument("--no-ffstate", action="store_true")
    a = p.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    L.seed_everything(0, workers=True)
    model = Net()
    g = torch.Generator().manual_seed(1)
    train = StatefulDataLoader(data(160, 0), batch_size=4, shuffle=False, generator=g)  # Lightning adds the sampler
    val = StatefulDataLoader(data(16, 1), batch_size=4, generator=torch.Generator().manual_seed(2))
    early = L.pytorch.callbacks.EarlyStopping(monitor="val_loss", patience=1000)
    callbacks = [early] if a.no_ffstate else [ReplicationCallback(), early]
    if a.kill_rank >= 0:
        callbacks.append(Kill(a.out, a.kill_rank, [int(s) for s in a.kill_step.split(",")]))
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_epochs=3, val_check_interval=7,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=callbacks, num_sanity_val_steps=1)
    trainer.fit(model, train, val)
    loop = trainer.fit_loop
    torch.save({"model": model.state_dict(), "optim": trainer.optimizers[0].state_dict(),
                "scheds": [c.scheduler.state_dict() for c in trainer.lr_scheduler_configs],
                "global_step": trainer.global_step, "epoch": loop.epoch_progress.current.processed},
               a.out / f"final-rank{trainer.global_rank}.pt")
    torch.save(early.state_dict(), a.out / f"callbacks-rank{trainer.global_rank}.pt")


if __name__ == "__main__":
    main()
    exit_now()  # not through the interpreter's finalization, where gloo's threads can abort it
