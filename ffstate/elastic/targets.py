"""The model and optimizer of this run, at its world size, as DCP loads them: the tensors to read into, and
putting them in place.

DDP, a plain model and FSDP2 go through ``torch.distributed.checkpoint.state_dict``: ``get_state_dict`` gives
their tensors under DCP's keys (FSDP2's as DTensors on this run's mesh, so DCP re-slices every one of them,
uneven shards and first dimensions smaller than the world included), ``set_state_dict`` loads them back. A
``ZeroRedundancyOptimizer`` has no DCP support: its partition at this world size (the parameters its inner
optimizer holds) gets tensors of the sizes the metadata says, and its inner optimizer loads them.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_state_dict, set_model_state_dict,
                                                     set_state_dict)

from ffstate import lazy
from ffstate.elastic.reader import Chunks, ReplicaReader
from ffstate.errors import FFStateError
from ffstate.persist.keys import param_names

OPTIM_STATE = "optim.state."


def load(model: torch.nn.Module, optimizer: torch.optim.Optimizer, chunks: Chunks, groups: list[dict]) -> None:
    """Loads every tensor of ``model`` and ``optimizer`` from ``chunks`` (``dcp.load``, this rank alone), and the
    optimizer's hyperparameters ``groups`` (one dict per param group, without ``params``).

    Raises:
        FFStateError: the model's keys differ from the copies', the param groups do not match, or DCP refused
            (a key of this run missing from the copies).
    """
    if lazy.is_zero(optimizer):
        _load_zero(model, optimizer, chunks, groups)
        return
    msd, osd = get_state_dict(model, optimizer)
    _check_model(msd, chunks)
    state = {fqn: {k: v for k, v in s.items() if isinstance(v, torch.Tensor)} for fqn, s in osd["state"].items()}
    _dcp_load({"model": msd, "optim": {"state": state}}, chunks)
    set_state_dict(model, optimizer, model_state_dict=msd,
                   optim_state_dict={"state": osd["state"], "param_groups": _groups(osd["param_groups"], groups)})


def _load_zero(model: torch.nn.Module, zero: Any, chunks: Chunks, groups: list[dict]) -> None:
    """ZeRO at this world size: the inner optimizer's parameters (this rank's partition) get their state by
    key, ``optim.state.<fqn>.<name>``, each tensor allocated as the metadata describes it."""
    msd = get_model_state_dict(model)
    _check_model(msd, chunks)
    names = param_names(model)
    inner = zero.optim
    params = [p for g in inner.param_groups for p in g["params"]]
    meta = chunks.metadata.state_dict_metadata
    by_param: dict[str, dict[str, torch.Tensor]] = {}
    for p in params:
        fqn = names.get(id(p))
        if fqn is None:
            raise FFStateError("a parameter of the ZeRO partition is not one of the model's named parameters")
        prefix = f"{OPTIM_STATE}{fqn}."
        by_param[fqn] = {key[len(prefix):]: torch.empty(md.size, dtype=md.properties.dtype)
                         for key, md in meta.items() if key.startswith(prefix) and "." not in key[len(prefix):]}
    _dcp_load({"model": msd, "optim": {"state": by_param}}, chunks)
    set_model_state_dict(model, msd)
    own = inner.state_dict()["param_groups"]
    state = {i: by_param[names[id(p)]] for i, p in enumerate(params) if by_param[names[id(p)]]}
    inner.load_state_dict({"state": state, "param_groups": _groups(own, groups)})
    for group, saved in zip(zero.param_groups, groups):
        group.update(saved)


def _groups(live: list[dict], old: list[dict]) -> list[dict]:
    """This run's param groups (their ``params``) with the copies' hyperparameters."""
    if len(live) != len(old):
        raise FFStateError(f"the optimizer has {len(live)} param groups, the copies {len(old)}")
    return [{**{k: v for k, v in saved.items() if k != "params"}, "params": g["params"]} for g, saved in zip(live, old)]


def _check_model(msd: dict, chunks: Chunks) -> None:
    """The model's tensors and the copies' are the same keys: DCP would ignore a key of the copies this model lacks."""
    mine = {f"model.{k}" for k, v in msd.items() if isinstance(v, torch.Tensor)}
    theirs = {fqn for fqn in chunks.fqns if fqn.startswith("model.")}
    if mine != theirs:
        diff = sorted(mine ^ theirs)
        raise FFStateError(f"the model's tensors differ from the copies' ({len(diff)} keys, e.g. {diff[:3]}): was the "
                           "model changed across the resize?")


def _dcp_load(target: dict, chunks: Chunks) -> None:
    """``dcp.load`` of ``target`` from the old ranks' copies; what it refuses, as an ``FFStateError``.

    DCP wraps what failed (ffstate's reader's own refusals included) in a ``CheckpointException``, which derives
    from ``BaseException``: an ``except Exception`` lets it through, with DCP's message rather than the reason."""
    try:
        with warnings.catch_warnings():  # DCP warns that a load with no_dist is one process's: it is, by design
            warnings.filterwarnings("ignore", "torch.distributed is disabled, unavailable or uninitialized",
                                    UserWarning)
            dcp.load(target, storage_reader=ReplicaReader(chunks), no_dist=True)
    except FFStateError:
        raise
    except CheckpointException as e:
        failures = [exc for exc, _ in e.failures.values()]
        ours = next((f for f in failures if isinstance(f, FFStateError)), None)
        if ours is not None:
            raise FFStateError(str(ours)) from ours
        said = "; ".join(f"{type(f).__name__}: {f}" for f in failures) or str(e)
        raise FFStateError(f"torch.distributed.checkpoint could not load the copies at this world size: {said}"
                           ) from None
    except Exception as e:
        raise FFStateError(f"torch.distributed.checkpoint could not load the copies at this world size: {e}") from e
