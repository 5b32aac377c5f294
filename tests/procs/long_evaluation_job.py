"""A framework's fit (world 1) whose evaluation takes longer than the hang watchdog's deadline for a step: the
adapters declare it a pause, so the daemon must not take it for a hang (and SIGKILL the rank).

    python tests/procs/long_evaluation_job.py lightning|transformers SECONDS

Lightning validates after step 10 (``val_check_interval``) of 20; the Trainer evaluates and saves at the end of its
first epoch of two (``eval_strategy="epoch"``, ``save_strategy="epoch"``). Each evaluation sleeps SECONDS. Prints
"finished at step 20" at the end.
"""

import sys
import tempfile
import time

from ffstate.startup import collector_paused, exit_now

with collector_paused():  # imports without Python's collector: a process start's CPU (ffstate/startup.py)
    import torch


def data(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 8, generator=g), torch.randint(0, 2, (n,), generator=g)


def lightning(seconds: float) -> int:
    import lightning as L
    from torchdata.stateful_dataloader import StatefulDataLoader

    from ffstate.integrations.lightning import ReplicationCallback

    class Net(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Linear(8, 2)

        def training_step(self, batch, batch_idx):
            time.sleep(0.02)
            x, y = batch
            return torch.nn.functional.cross_entropy(self.net(x), y)

        def validation_step(self, batch, batch_idx):
            time.sleep(seconds)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    train = StatefulDataLoader(torch.utils.data.TensorDataset(*data(80, 0)), batch_size=4)
    val = StatefulDataLoader(torch.utils.data.TensorDataset(*data(4, 1)), batch_size=4)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=1, val_check_interval=10, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        num_sanity_val_steps=0, callbacks=[ReplicationCallback()])
    trainer.fit(Net(), train, val)
    return trainer.global_step


def transformers(seconds: float) -> int:
    from transformers import Trainer, TrainingArguments

    from ffstate.integrations import hf

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(8, 2)

        def forward(self, x, labels):
            time.sleep(0.02 if self.training else seconds)
            return {"loss": torch.nn.functional.cross_entropy(self.lin(x), labels)}

    class Data(torch.utils.data.Dataset):
        def __init__(self, n: int, seed: int):
            self.x, self.y = data(n, seed)

        def __len__(self) -> int:
            return len(self.x)

        def __getitem__(self, i: int) -> dict:
            return {"x": self.x[i], "labels": self.y[i]}

    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(output_dir=out, use_cpu=True, per_device_train_batch_size=4, num_train_epochs=2,
                                 report_to="none", eval_strategy="epoch", save_strategy="epoch", save_only_model=True,
                                 per_device_eval_batch_size=4, disable_tqdm=True, logging_strategy="no")
        trainer = Trainer(model=Net(), args=args, train_dataset=Data(40, 0), eval_dataset=Data(4, 1),
                          callbacks=[hf.ReplicationCallback()])
        hf.train(trainer)
        return trainer.state.global_step


if __name__ == "__main__":
    framework, seconds = sys.argv[1], float(sys.argv[2])
    step = {"lightning": lightning, "transformers": transformers}[framework](seconds)
    print(f"finished at step {step}", flush=True)
    exit_now()  # not through the interpreter's finalization, where gloo's threads can abort it
