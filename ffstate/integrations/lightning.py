"""PyTorch Lightning: ``ReplicationCallback``, which replicates what a ``Trainer.fit`` holds and puts it back after a
restart, bit for bit, mid-epoch included (docs/lightning.md).

What is replicated: the (DDP-wrapped) model, every optimizer and LR scheduler, the precision plugin's state (a
``GradScaler``), the fit loop's progress (global step, epoch, batch) with each stateful training loader's position,
the other callbacks' state (as Lightning's checkpoint keeps it), and every rank's own RNG streams. It enters
``ffstate.replicate`` at ``on_fit_start`` (the optimizers exist, the model is wrapped), commits after each optimizer
step (``on_train_batch_end``, where Lightning's own restart logic expects a checkpoint), pauses the watchdog during
validation, and leaves at the end of the fit.

Lightning's own mid-epoch resume is not bit-exact (its checkpoint keeps rank 0's RNG only, and it makes the resumed
iterator before the sampler's epoch is set: Lightning issue #21938), so the loaders are put back here instead, in the
order a run that never stopped goes through: the sampler's epoch, then the loader's position and a new iterator, then
every rank's own RNG (making an iterator draws from it).
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any

import torch
from lightning.fabric.utilities.data import _set_sampler_epoch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.trainer.call import _call_callbacks_load_state_dict as _load_callbacks
from lightning.pytorch.trainer.call import _call_callbacks_state_dict as _callbacks_state

import ffstate
from ffstate import capture
from ffstate.config import Config
from ffstate.errors import CodecError, FFStateError
from ffstate.layout.tree import flatten

log = logging.getLogger("ffstate.integrations.lightning")


class _Schedulers:
    """Every LR scheduler of the fit, as one object with state."""

    def __init__(self, trainer: Any):
        self.trainer = trainer

    def state_dict(self) -> dict:
        return {"schedulers": [c.scheduler.state_dict() for c in self.trainer.lr_scheduler_configs]}

    def load_state_dict(self, state: dict) -> None:
        for config, saved in zip(self.trainer.lr_scheduler_configs, state["schedulers"], strict=True):
            config.scheduler.load_state_dict(saved)


class _Loops:
    """The fit loop's progress and the training loaders' positions. The positions are set aside at a restore and
    given to the loaders in ``on_train_start``, after their sampler's epoch is set."""

    def __init__(self, trainer: Any):
        self.trainer = trainer
        self.loaders: list | None = None  # set aside at a restore
        self.at_epoch_end = False  # the restored version was committed at an epoch's last batch

    def state_dict(self) -> dict:
        return self.trainer.fit_loop.state_dict()

    def load_state_dict(self, state: dict) -> None:
        state = {**state, "state_dict": dict(state.get("state_dict", {}))}
        self.loaders = state["state_dict"].pop("combined_loader", [])
        self.at_epoch_end = bool(state.get("epoch_loop.batch_progress", {}).get("is_last_batch"))
        self.trainer.fit_loop.load_state_dict(state)  # the progress counters; the loops restart from them


class _Precision:
    def __init__(self, trainer: Any):
        self.trainer = trainer

    def state_dict(self) -> dict:
        return self.trainer.precision_plugin.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.trainer.precision_plugin.load_state_dict(state)


class _Callbacks:
    """The fit's other callbacks' state (an ``EarlyStopping``'s patience count and best score, a ``ModelCheckpoint``'s
    best k), as Lightning's own checkpoint keeps it and puts it back: each callback's ``state_dict()`` by its
    ``state_key``, through Lightning's own calls (a callback with no state, as this one, keeps nothing). A callback
    whose state holds a value ffstate cannot copy (a ``set``, a ``Path``, an object of its own) is left out, said once:
    its state starts over after a restore, as before ffstate kept any."""

    def __init__(self, trainer: Any):
        self.trainer = trainer
        self.left_out: set[str] = set()

    def state_dict(self) -> dict:
        states = _callbacks_state(self.trainer)
        for key in [k for k in states if k not in self.left_out]:
            try:
                flatten(states[key])
            except CodecError as e:
                self.left_out.add(key)
                log.warning("rank %d: the state of callback %s is not replicated: %s", self.trainer.global_rank, key, e)
        return {k: v for k, v in states.items() if k not in self.left_out}

    def load_state_dict(self, state: dict) -> None:
        _load_callbacks(self.trainer, {"callbacks": state})


class ReplicationCallback(Callback):
    """Replicates a ``Trainer.fit`` with ffstate and restores it after a restart (torchrun's, or the in-process
    engine's). Add it to the Trainer's callbacks; ``config``: ffstate's knobs (default ``Config.from_env()``).

    The training loader must give an order that depends on the seed and the epoch alone: a torchdata
    ``StatefulDataLoader`` with ``shuffle=False`` (Lightning then puts a ``DistributedSampler`` in, which shuffles
    by seed and epoch) or with an explicit ``DistributedSampler``; ``generator=`` on the loaders keeps making their
    iterators from drawing the global RNG. Refused at the fit's start: ``ckpt_path`` (Lightning would load it over
    the restored state), a training loader that keeps no position (a plain ``DataLoader``: a restore would start its
    epoch over), and a loader Lightning wraps in a ``DistributedSamplerWrapper`` (a sampler not of torch's, e.g.
    ``StatefulDataLoader(shuffle=True)``: its order depends on a generator no state holds).
    """

    def __init__(self, config: Config | None = None):
        self.config = config
        self.ff: Any = None
        self._ctx: Any = None
        self._loops: _Loops | None = None
        self._rng: dict | None = None  # the restored RNG, set again where the run that never stopped had it
        self._last = 0
        self._pause = contextlib.ExitStack()
        self._shadow = False  # a DDP shadow step is due at the first batch after a restore

    # ------------------------------------------------------------ entry and restore

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        if trainer.ckpt_path:
            raise FFStateError("ReplicationCallback restores the fit itself; Lightning would load ckpt_path over it: "
                               "pass no ckpt_path")
        trainer.fit_loop.setup_data()  # the loaders exist now: their positions are in every version, the first too
        self._check_loaders(trainer)
        optimizers = list(trainer.optimizers)
        if not optimizers:
            raise FFStateError("ReplicationCallback needs the fit's optimizer (configure_optimizers returned none)")
        self._loops = _Loops(trainer)
        before = [type(c).__name__ for c in trainer.callbacks[:trainer.callbacks.index(self)] if c.state_dict()]
        if before:  # their on_fit_start ran before the restore below puts their state back (Lightning's resume: after)
            log.warning("rank %d: callbacks %s come before ReplicationCallback: their on_fit_start sees their state "
                        "before it is restored; list ReplicationCallback first", trainer.global_rank, before)
        extra = {"loops": self._loops, "precision": _Precision(trainer), "optimizers": optimizers[1:],
                 "callbacks": _Callbacks(trainer)}
        # DDP's shadow step after a restore goes through Lightning's own forward (on_train_batch_start), not a hook
        # on the DDP module: Lightning routes the module's forward to training_step for one call at a time.
        cfg = self.config or Config.from_env()
        self._shadow = cfg.shadow_ddp_step
        self._ctx = ffstate.replicate(trainer.strategy.model, optimizers[0], lr_scheduler=_Schedulers(trainer),
                                      extra=extra, config=cfg.replace(shadow_ddp_step=False))
        self.ff = self._ctx.__enter__()
        self._last = self.ff.start_step
        if self.ff.restored is not None:
            self._rng = capture.rng_state()  # what the entry restored; Lightning draws from it before training

    def _check_loaders(self, trainer: Any) -> None:
        for loader in trainer.fit_loop._combined_loader.flattened:
            if not all(callable(getattr(loader, m, None)) for m in ("state_dict", "load_state_dict")):
                raise FFStateError(
                    f"the training loader ({type(loader).__name__}) keeps no position: a restore mid-epoch would start "
                    "the epoch's batches over, and the run would not be the one without a failure. Use torchdata's "
                    "StatefulDataLoader (the same arguments as DataLoader's; docs/lightning.md)")
            sampler = getattr(loader, "sampler", None)
            if type(sampler).__name__ == "DistributedSamplerWrapper":
                inner = type(getattr(sampler, "dataset", sampler)).__name__
                raise FFStateError(
                    f"the training loader's sampler ({inner}, wrapped by Lightning) orders each epoch from a random "
                    "generator whose state no loader keeps: a "
                    "resumed epoch would not see the same batches. Use StatefulDataLoader(shuffle=False) (Lightning "
                    "then shuffles by seed and epoch) or pass a DistributedSampler (docs/lightning.md)")

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        """After a restore, the loaders in the order a run that never stopped has them: the sampler's epoch, the
        position and a new iterator (mid-epoch), the RNG; at an epoch's end, the RNG before the next epoch's iterator."""
        rng, self._rng = self._rng, None
        if rng is None:
            return
        fit_loop = trainer.fit_loop
        combined, fetcher = fit_loop._combined_loader, fit_loop._data_fetcher
        for loader in combined.flattened:
            _set_sampler_epoch(loader, fit_loop.epoch_progress.current.processed)
        fetcher.teardown()  # the iterator Lightning made before the sampler's epoch was set
        if self._loops.at_epoch_end or not self._loops.loaders:
            capture.set_rng_state(rng)  # restored at an epoch's end: the loop has moved to the next epoch already
            iter(fetcher)
            if self._loops.at_epoch_end:
                # Lightning took the version for a mid-epoch one (it was committed at the epoch's last batch) and
                # counted that epoch done: the next one is a fresh epoch, begun as in a run that never stopped (its
                # counters and its on_train_epoch_start hooks), not resumed (they were skipped, and a later restore
                # then took the epoch for finished and ran its batches again).
                fit_loop.reset_restart_stage()
        else:
            combined._load_state_dicts(self._loops.loaders)
            iter(fetcher)  # resumes at the restored position
            capture.set_rng_state(rng)  # last: making the iterator drew from it
        self._loops.loaders = None

    # ------------------------------------------------------------ steps

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if self._shadow and self.ff is not None and self.ff.restored is not None:
            self._shadow = False
            ddp = trainer.strategy.model
            if not isinstance(ddp, torch.nn.parallel.DistributedDataParallel):
                return
            if not pl_module.automatic_optimization:  # its training_step steps the optimizers itself
                log.warning("rank %d: manual optimization: no shadow step after the restore (the training_step would "
                            "step the optimizers); DDP's first step reduces its gradients in another bucket order, so "
                            "the run is not bit-exact from here (docs/lightning.md)", trainer.global_rank)
                return
            capture.shadow_step(ddp, lambda: trainer.strategy.training_step(batch, batch_idx))

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        step = trainer.global_step
        if self.ff is not None and step > self._last:  # an optimizer step was taken (gradient accumulation)
            self.ff.commit(step)
            self._last = step

    def on_validation_start(self, trainer: Any, pl_module: Any) -> None:
        # Not a step: the watchdog must not take it for a hang. (Within fit, Lightning's stage is VALIDATING here,
        # not TRAINING: a `trainer.training` test never paused, and a long validation got every rank SIGKILLed.)
        if self.ff is not None:
            self._pause.enter_context(self.ff.pause())

    def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
        self._pause.close()

    # ------------------------------------------------------------ exit

    def on_fit_end(self, trainer: Any, pl_module: Any) -> None:
        self._leave(None)

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self._leave(exception)

    def _leave(self, exception: BaseException | None) -> None:
        self._pause.close()
        ctx, self._ctx, self.ff = self._ctx, None, None
        if ctx is not None:
            ctx.__exit__(type(exception) if exception else None, exception, exception.__traceback__ if exception
                         else None)
