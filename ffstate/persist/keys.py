"""The worker's side of the persistent tier: the DCP key of each tensor of its captured state (the key map).

A worker knows what its daemon cannot see in a flat buffer: which parameter an optimizer state belongs to,
what a DDP wrapper prefixes to every name, and where a DTensor's local shard sits in the global tensor. At
attach it sends, per path of its captured state (``capture.capture``: ``model/...``, ``optim/...``), the key
DCP's ``get_state_dict`` layout gives that tensor, with the global size and offset of a DTensor's shard:

    {"v": 1, "tensors": {"model/module.fc.weight": ["model.fc.weight", null, null],
                         "optim/state/0/exp_avg": ["optim.state.fc.weight.exp_avg", [1024, 64], [256, 0]], ...},
     "param_groups": {"path": "optim/param_groups", "params": [["fc.weight", "fc.bias"]]}}

Paths it cannot name (RNG states, extras) are left out: the daemon keeps their bytes in the rank's own entry.
"""

from __future__ import annotations

import json
from typing import Any

import torch

from ffstate import lazy
from ffstate.persist.keymap import KEYS_VERSION

_WRAPPERS = ("_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module")


def canonical(name: str, ddp: bool) -> str:
    """A parameter's or buffer's name as DCP's ``get_model_state_dict`` gives it: DDP's ``module.``, compile's
    ``_orig_mod.`` and activation checkpointing's wrapper taken out."""
    parts = name.split(".")
    if ddp and parts and parts[0] == "module":
        parts = parts[1:]
    return ".".join(p for p in parts if p not in _WRAPPERS)


def param_names(model: torch.nn.Module) -> dict[int, str]:
    """Each parameter's name by its ``id``, as DCP's ``get_state_dict`` keys its optimizer state: a parameter
    reached under several names (a head tied to the embedding by assignment, as Hugging Face models do) by the
    first one."""
    ddp = isinstance(model, torch.nn.parallel.DistributedDataParallel)
    names: dict[int, str] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), canonical(n, ddp))
    return names


def _global(t: torch.Tensor) -> tuple[list[int] | None, list[int] | None]:
    """(global size, offset of the local shard) of a DTensor (its chunk, as DCP computes it); (None, None) else."""
    from torch.distributed.tensor import DTensor

    if not isinstance(t, DTensor):
        return None, None
    chunk = t.__create_chunk_list__()[0]
    return list(t.shape), list(chunk.offsets)


def key_map(model: torch.nn.Module, optimizer: torch.optim.Optimizer, timeline: str = "") -> dict:
    """The key map of a job's model and optimizer (see the module docstring); ``timeline`` names the attempt (the
    same on every rank): a version is complete only when every rank's record of it comes from one attempt."""
    ddp = isinstance(model, torch.nn.parallel.DistributedDataParallel)
    tensors: dict[str, list[Any]] = {}
    with torch.no_grad():
        for name, t in model.state_dict(keep_vars=True).items():
            if isinstance(t, torch.Tensor):
                tensors[f"model/{name}"] = [f"model.{canonical(name, ddp)}", *_global(t)]
    names = param_names(model)
    if lazy.is_zero(optimizer):
        state_prefix, groups_path, local = "optim/shard/state", "optim/groups", optimizer.optim
    else:
        state_prefix, groups_path, local = "optim/state", "optim/param_groups", optimizer
    params = [p for g in local.param_groups for p in g["params"]]
    for i, p in enumerate(params):
        fqn = names.get(id(p))
        if fqn is None:
            continue
        for k, v in local.state.get(p, {}).items():
            if isinstance(v, torch.Tensor):
                size, offset = _global(v) if v.dim() else (None, None)
                tensors[f"{state_prefix}/{i}/{k}"] = [f"optim.state.{fqn}.{k}", size, offset]
    groups = [[names.get(id(p), "") for p in g["params"]] for g in optimizer.param_groups]
    out: dict[str, Any] = {"v": KEYS_VERSION, "tensors": tensors, "timeline": timeline}
    if all(all(g) for g in groups):
        out["param_groups"] = {"path": groups_path, "params": groups}
    return out


def to_json(keys: dict) -> bytes:
    return json.dumps(keys, separators=(",", ":")).encode()
