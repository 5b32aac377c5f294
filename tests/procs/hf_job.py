"""A Hugging Face Trainer run under torchrun with ffstate (docs/hf.md's example, made small): a tiny GPT-2 with dropout,
a random dataset, AdamW with warm-up, evaluation every few steps, DDP over gloo on the CPU.

    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --nproc-per-node 2 --max-restarts 2 tests/procs/hf_job.py OUT \
        [--kill-rank R --kill-step S] [--no-ffstate]

Rank R SIGKILLs itself once (a marker in OUT) right before the optimizer step of step S (the others may have done
it). At the end each rank writes OUT/final-rank<R>.pt: the model, the optimizer's and scheduler's state, the step,
the log (its timings aside).
"""

import argparse
from pathlib import Path

from ffstate.startup import collector_paused, exit_now

with collector_paused():  # imports without Python's collector: a process start's CPU (ffstate/startup.py)
    import torch
    import torch.distributed as dist
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

    from ffstate.integrations import hf
    from ffstate.testing.faults import die_once


class Data(torch.utils.data.Dataset):
    def __init__(self, n: int, seed: int):
        self.x = torch.randint(0, 64, (n, 16), generator=torch.Generator().manual_seed(seed))

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.x[i], "labels": self.x[i]}


class Kill(TrainerCallback):
    def __init__(self, out: Path, rank: int, step: int):
        self.out, self.rank, self.step = out, rank, step

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        if dist.get_rank() == self.rank and state.global_step + 1 == self.step:
            die_once(self.out / "killed")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out", type=Path)
    p.add_argument("--kill-rank", type=int, default=-1)
    p.add_argument("--kill-step", type=int, default=0)
    p.add_argument("--no-ffstate", action="store_true")
    a = p.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2,
                                       resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1))
    args = TrainingArguments(output_dir=str(a.out / "hf"), use_cpu=True, ddp_backend="gloo",
                             per_device_train_batch_size=4, num_train_epochs=3, learning_rate=1e-3, warmup_steps=5,
                             logging_steps=5, report_to="none", seed=42, dataloader_num_workers=0, disable_tqdm=True,
                             save_strategy="no", eval_strategy="steps", eval_steps=7, per_device_eval_batch_size=4)
    callbacks = [] if a.no_ffstate else [hf.ReplicationCallback()]
    if a.kill_rank >= 0:
        callbacks.append(Kill(a.out, a.kill_rank, a.kill_step))
    trainer = Trainer(model=model, args=args, train_dataset=Data(120, 0), eval_dataset=Data(16, 1),
                      callbacks=callbacks)
    if a.no_ffstate:
        trainer.train()
    else:
        hf.train(trainer)
    # The log as the run kept it (its timings aside: they differ between any two runs).
    log = [{k: v for k, v in e.items() if "runtime" not in k and "per_second" not in k}
           for e in trainer.state.log_history]
    torch.save({"model": model.state_dict(), "optim": trainer.optimizer.state_dict(),
                "sched": trainer.lr_scheduler.state_dict(), "step": trainer.state.global_step, "log": log},
               a.out / f"final-rank{dist.get_rank()}.pt")


if __name__ == "__main__":
    main()
    exit_now()  # not through the interpreter's finalization, where gloo's threads can abort it
