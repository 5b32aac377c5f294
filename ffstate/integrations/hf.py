"""The Hugging Face Trainer: ``train(trainer)``, used instead of ``trainer.train()``, and the ``ReplicationCallback`` it
needs among the Trainer's callbacks (docs/hf.md). Together they replicate the model, the optimizer, the LR scheduler,
the gradient scaler, the ``TrainerState`` (global step, epoch, logs, the exportable callbacks' states) and every rank's
RNG streams, and resume after a restart at the exact batch, bit for bit.

A callback alone cannot resume a Trainer mid-epoch: the batches to skip are worked out inside its loop, from the
checkpoint folder it is given, and the ``TrainerState`` is made anew there. So ``train`` restores from ffstate first
(model, optimizer, scheduler, scaler, RNG; the Trainer made the optimizer and scheduler the way its loop would), then
hands the Trainer a folder holding only ``trainer_state.json``: the Trainer's own resume then skips to the batch,
and finds nothing else there to load. The callback commits each step once the Trainer is done with it (logs,
evaluation, saves: at the next step's start, the next epoch's start, or the end) and sets the restored RNG again where
the resumed loop reaches the point it was captured at.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import shutil
import tempfile
from typing import Any

import torch
import torch.distributed as dist
from transformers import TrainerCallback
from transformers.trainer_callback import ExportableState

import ffstate
from ffstate import capture
from ffstate.config import Config
from ffstate.errors import FFStateError

log = logging.getLogger("ffstate.integrations.hf")
TRAINER_STATE = "trainer_state.json"  # the one file of the folder the Trainer resumes from


class _TrainerState:
    """The ``TrainerState`` for ffstate: its fields but the log as one JSON string, and the log (``log_history``, which
    grows by an entry per logging step for the whole run) as the JSON lines of its entries in a byte tensor. Each
    entry is serialized once, when it appears; the tensor's bytes before it never change, so a commit's delta of
    the log is the new entries alone, and the tensor's capacity doubles when full (its layout changes that rarely)."""

    MIN_CAPACITY = 4096
    # The Trainer's own bookkeeping between logging steps, on the Trainer (transformers 5): the loss summed since the
    # last log, the sum logged so far, the step of the last log and of the run's start, the FLOPs not yet counted in
    # the state. Restored, the first log and the final ``train_loss`` after a restore are the run's without failure.
    LOGGING = ("_total_loss_scalar", "_globalstep_last_logged", "_initial_global_step", "current_flos")

    def __init__(self) -> None:
        self.trainer: Any = None
        self.restored: dict | None = None
        self._log = torch.zeros(self.MIN_CAPACITY, dtype=torch.uint8)
        self._log_bytes = 0  # of ``_log`` in use
        self._count = 0  # log_history entries serialized so far
        self._last: Any = None  # the last of them (the list's own item: the log goes on from it if it is still there)
        self.restored_tr_loss: torch.Tensor | None = None

    def state_dict(self) -> dict:
        if self.trainer is None:
            return {"json": "", "log": self._log[:0], "log_bytes": 0, "tr_loss": torch.zeros(())}
        trainer_state = self.trainer.state
        state = dataclasses.asdict(dataclasses.replace(trainer_state, log_history=[]))
        del state["log_history"]
        exported: dict = {}  # what the Trainer's own checkpoints keep of its callbacks (EarlyStopping, its control)
        for cb in [*self.trainer.callback_handler.callbacks, self.trainer.control]:
            if isinstance(cb, ExportableState):
                exported.setdefault(type(cb).__name__, []).append(cb.state())
        state["stateful_callbacks"] = {k: v[0] if len(v) == 1 else v for k, v in exported.items()}
        state["ffstate_logging"] = {k: getattr(self.trainer, k) for k in self.LOGGING if hasattr(self.trainer, k)}
        self._append(trainer_state.log_history)
        tr_loss = getattr(self.trainer, "_tr_loss", None)
        return {"json": json.dumps(state, sort_keys=True), "log": self._log, "log_bytes": self._log_bytes,
                "tr_loss": tr_loss if isinstance(tr_loss, torch.Tensor) and tr_loss.dim() == 0 else torch.zeros(())}

    def _append(self, history: list) -> None:
        n = self._count
        if len(history) < n or (n and history[n - 1] is not self._last):  # a new log (a restored TrainerState's)
            self._count, self._log_bytes, n = 0, 0, 0
        if len(history) == n:
            return
        new = "".join(json.dumps(e) + "\n" for e in history[n:]).encode()  # its keys in the order they came
        end = self._log_bytes + len(new)
        if end > self._log.numel():
            grown = torch.zeros(max(2 * self._log.numel(), 1 << (end - 1).bit_length()), dtype=torch.uint8)
            grown[: self._log_bytes] = self._log[: self._log_bytes]
            self._log = grown
        self._log[self._log_bytes : end] = torch.frombuffer(bytearray(new), dtype=torch.uint8)
        self._log_bytes = end
        self._count, self._last = len(history), history[-1]

    def load_state_dict(self, state: dict) -> None:
        if not state["json"]:
            self.restored = None
            return
        self.restored = json.loads(state["json"])
        self.restored_tr_loss = state["tr_loss"]
        text = bytes(state["log"][: state["log_bytes"]].numpy()).decode()
        self.restored["log_history"] = [json.loads(line) for line in text.splitlines()]


class ReplicationCallback(TrainerCallback):
    """Commits each optimizer step and puts the restored RNG back at the right point (see the module); ``train``
    enters ffstate and needs this callback among the Trainer's."""

    def __init__(self) -> None:
        self.box = _TrainerState()
        self.ff: Any = None
        self.restored = False
        self._version = 0
        self._rng: dict | None = None
        self._rng_at = ""  # "epoch" (restored at an epoch's end) or "step"
        self._pause = contextlib.ExitStack()

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        trainer, saved = self.box.trainer, self.box.restored
        if self.restored and saved is not None:  # after the Trainer set its logging bookkeeping for a resume
            for k, v in saved.pop("ffstate_logging", {}).items():
                if hasattr(trainer, k):
                    setattr(trainer, k, v)
            if isinstance(getattr(trainer, "_tr_loss", None), torch.Tensor) and self.box.restored_tr_loss is not None:
                trainer._tr_loss = self.box.restored_tr_loss.to(trainer._tr_loss.device)
            restore_exported(saved.get("stateful_callbacks", {}), [*trainer.callback_handler.callbacks, control])
        if self.restored and self.ff is not None and self.ff.cfg.shadow_ddp_step:
            ddp = _ddp_of(self.box.trainer.model_wrapped)  # the DDP module now: its buckets as a run that never stopped
            if ddp is not None:
                capture.shadow_step_on_first_forward(ddp)
            elif dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
                log.warning("rank %d: no DDP module in the Trainer's model (%s): no shadow step after the restore; if "
                            "DDP reduces the gradients, its first step does so in another bucket order and the run is "
                            "not bit-exact from here", dist.get_rank(), type(self.box.trainer.model_wrapped).__name__)

    def _commit(self, state: Any) -> None:
        self._pause.close()
        if self.ff is not None and state.global_step > self._version:
            self.ff.commit(state.global_step)
            self._version = state.global_step

    def on_epoch_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._rng is not None and self._rng_at == "epoch":
            capture.set_rng_state(self._rng)  # before the epoch's iterator draws its seed, as in the run that went on
            self._rng = None
        self._commit(state)

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._rng is not None and self._rng_at == "step":
            capture.set_rng_state(self._rng)  # after the resumed iterator and the skip, before the forward
            self._rng = None
        self._commit(state)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.ff is not None and (control.should_evaluate or control.should_save):
            self._pause.enter_context(self.ff.pause())  # not a step: the watchdog must not take it for a hang

    def on_epoch_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.on_step_end(args, state, control)  # an evaluation or save at the epoch's end (`*_strategy="epoch"`)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._commit(state)


def restore_exported(saved: dict, live: list) -> None:
    """The exportable callbacks' states (``EarlyStoppingCallback``'s patience counter, the ``TrainerControl``'s
    flags) put back into ``live``'s callbacks of the same class, in order, in place: the Trainer's own resume makes
    them anew from their ``args`` and ``attributes`` only with ``args.restore_callback_states_from_checkpoint``, off
    by default. An ``args`` entry is an attribute of the same name (the control's flags are its ``args``)."""
    for name, data in saved.items():
        same = [cb for cb in live if isinstance(cb, ExportableState) and type(cb).__name__ == name]
        for cb, state in zip(same, data if isinstance(data, list) else [data]):
            for attribute, value in state.get("args", {}).items():
                if hasattr(cb, attribute):
                    setattr(cb, attribute, value)
            for attribute, value in state.get("attributes", {}).items():
                setattr(cb, attribute, value)


def _ddp_of(model: Any) -> torch.nn.parallel.DistributedDataParallel | None:
    """The DDP module of the Trainer's wrapped model: itself, or under ``torch.compile`` (``torch_compile=True``:
    accelerate wraps in DDP first, then compiles)."""
    for m in (model, getattr(model, "_orig_mod", None)):
        if isinstance(m, torch.nn.parallel.DistributedDataParallel):
            return m
    return None


def _check_supported(trainer: Any) -> None:
    """What the adapter cannot replicate, refused before anything is committed (docs/hf.md).

    Raises:
        FFStateError: DeepSpeed or FSDP (they replace or rewrap the optimizer the adapter would commit), a
            ``model_init`` or ``auto_find_batch_size`` (the Trainer makes the model or the loader again inside its
            loop), or an ``IterableDataset`` (no position to resume at).
    """
    args = trainer.args
    refused = [why for cond, why in (
        (getattr(trainer, "is_deepspeed_enabled", False), "DeepSpeed (it replaces the optimizer and scheduler)"),
        (getattr(trainer, "is_fsdp_enabled", False), "FSDP (the optimizer is made before the model is wrapped)"),
        (getattr(trainer, "model_init", None) is not None, "model_init (the Trainer makes the model again)"),
        (getattr(args, "auto_find_batch_size", False), "auto_find_batch_size (the loader is made again on an OOM)"),
        (isinstance(getattr(trainer, "train_dataset", None), torch.utils.data.IterableDataset),
         "an IterableDataset (no position a resume can skip to)"),
    ) if cond]
    if refused:
        raise FFStateError(f"ffstate.integrations.hf.train cannot replicate this Trainer: {'; '.join(refused)} "
                           "(docs/hf.md)")


def _callback(trainer: Any) -> ReplicationCallback:
    for cb in trainer.callback_handler.callbacks:
        if isinstance(cb, ReplicationCallback):
            return cb
    raise FFStateError("ffstate.integrations.hf.train needs ReplicationCallback() among the Trainer's callbacks")


def train(trainer: Any, config: Config | None = None, **train_kwargs: Any) -> Any:
    """``trainer.train(**train_kwargs)`` with the job's state replicated, and restored after a restart.

    Args:
        trainer: a ``transformers.Trainer`` with ``ReplicationCallback()`` among its callbacks.
        config: ffstate's knobs (default ``Config.from_env()``). Under DDP the model and optimizer state are declared
            the same on every rank (``razor_identical``: the model is not wrapped yet when ffstate enters), verified.

    Raises:
        FFStateError: ``resume_from_checkpoint`` given (ffstate resumes by itself), no ``ReplicationCallback``, or
            a setup it cannot replicate (``_check_supported``).
    """
    if train_kwargs.get("resume_from_checkpoint"):
        raise FFStateError("ffstate.integrations.hf.train resumes by itself: pass no resume_from_checkpoint")
    cb = _callback(trainer)
    _check_supported(trainer)
    cfg = config or Config.from_env()
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1 and not cfg.razor_identical:
        cfg = cfg.replace(razor_identical="model,optim/state")
    # The optimizer and scheduler as the Trainer's loop makes them (it keeps ones that exist); the schedule's length
    # from the loader, as the loop works it out.
    loader = trainer.get_train_dataloader()
    values = trainer.set_initial_training_values(trainer.args, loader)
    per_epoch, max_steps = values[1], values[-1]
    trainer.create_optimizer()
    trainer.create_scheduler(num_training_steps=max_steps)
    trainer._created_lr_scheduler = False  # else the loop drops this scheduler and makes another
    cb.box.trainer = trainer
    extra: dict = {"trainer_state": cb.box}
    if getattr(trainer.accelerator, "scaler", None) is not None:
        extra["scaler"] = trainer.accelerator.scaler
    with ffstate.replicate(trainer.model, trainer.optimizer, lr_scheduler=trainer.lr_scheduler, extra=extra,
                           config=cfg) as ff:
        cb.ff, cb._version, cb.restored = ff, ff.start_step, ff.restored is not None
        try:
            if not cb.restored or cb.box.restored is None:
                return trainer.train(**train_kwargs)
            state = cb.box.restored
            cb._rng = capture.rng_state()  # restored; the Trainer draws from it before the first step
            cb._rng_at = "epoch" if per_epoch and state["global_step"] % per_epoch == 0 else "step"
            folder = tempfile.mkdtemp(prefix="ffstate-hf-resume-")
            with open(os.path.join(folder, TRAINER_STATE), "w") as f:
                json.dump({k: v for k, v in state.items() if k != "ffstate_logging"}, f)  # the TrainerState's fields
            trainer._load_from_checkpoint = lambda *args, **kwargs: None  # the model is restored; nothing to load
            try:
                return trainer.train(resume_from_checkpoint=folder, **train_kwargs)
            finally:
                del trainer._load_from_checkpoint
                shutil.rmtree(folder, ignore_errors=True)
        finally:
            cb.ff = None
