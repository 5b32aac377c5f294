"""What one rank's committed version becomes in a torch.distributed.checkpoint (DCP) checkpoint: its items.

A version reaches the daemon as a flat buffer and its manifest (``ffstate.layout``). Each tensor of it is
written under the key DCP itself would give it, where the worker could name one at attach (``keys.py``):
the model's parameters and buffers as ``model.<fqn>``, the optimizer's per-parameter state as
``optim.state.<fqn>.<name>``, and ``optim.param_groups.<i>.<key>`` (DCP's ``get_state_dict`` layout), a
DTensor's local shard as its chunk of the global tensor (FSDP2: another world size loads it through DCP's
resharding). Under the razor a rank holds a contiguous run of elements of each redundant tensor: it is
written as the few boxes (DCP chunks) that tile that run, so the redundant state is written once, by the part
owners, as DCP would de-duplicate it. Everything DCP has no key for (RNG states, extras, the optimizer's own
numbering) goes into two entries of the rank's own: ``ffstate.rank<R>.rest`` (their bytes) and
``ffstate.rank<R>.manifest`` (the manifest with the version's scalars). Together the items hold every byte of
the version, so ffstate restores it bit for bit from them.
"""

from __future__ import annotations

import io
import math
from dataclasses import dataclass, field
from typing import Any

import torch

from ffstate import layout, razor
from ffstate.errors import FFStateError
from ffstate.layout import Manifest



@dataclass
class Item:
    """One DCP item of a rank's version: a tensor chunk (``data`` a tensor) or a bytes entry (``data`` bytes).

    ``spec`` and ``start`` say where the item's bytes go back in the rank's buffer (spec index, byte offset in
    it; -1 for items ffstate does not read back, e.g. ``optim.param_groups``); ``rest`` lists the specs whose
    bytes the ``rest`` entry holds, in order; ``path`` is DCP's planner path (the nesting to unflatten to)."""

    fqn: str
    data: Any
    size: tuple[int, ...] = ()
    offsets: tuple[int, ...] = ()
    spec: int = -1
    start: int = 0
    rest: list[int] = field(default_factory=list)
    path: tuple = ()

    @property
    def is_bytes(self) -> bool:
        return not isinstance(self.data, torch.Tensor)


def boxes(shape: tuple[int, ...], start: int, stop: int) -> list[tuple[tuple[int, ...], tuple[int, ...], int]]:
    """The boxes (offsets, sizes, first flat element) that tile the flat elements [start, stop) of a row-major
    tensor of ``shape``, in order; each is a contiguous run of the flat tensor (at most 2 per dimension)."""
    if start >= stop:
        return []
    if not shape:
        return [((), (), 0)]
    if len(shape) == 1:
        return [((start,), (stop - start,), start)]
    inner = math.prod(shape[1:])
    out = []
    row, col = divmod(start, inner)
    if col:  # a partial first row
        end = min(inner, stop - row * inner)
        out += [((row, *o), (1, *s), row * inner + f) for o, s, f in boxes(shape[1:], col, end)]
        start = row * inner + end
    full = (stop - start) // inner
    if full and start < stop:
        first = start // inner
        out.append(((first, *([0] * (len(shape) - 1))), (full, *shape[1:]), start))
        start += full * inner
    if start < stop:  # a partial last row
        row = start // inner
        out += [((row, *o), (1, *s), row * inner + f) for o, s, f in boxes(shape[1:], 0, stop - start)]
    return out


def _saved(value: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(value, buf)
    return buf.getvalue()


def keyed(path: str, tensor: torch.Tensor, names: dict, plan: razor.Plan | None, pieces: list) -> list[tuple]:
    """Where one tensor of a rank's captured state goes in a DCP checkpoint: (key, chunk, global size, offsets,
    first byte of the chunk in ``tensor``) for each chunk, or [] where the key map names no key for it (its bytes
    then go into the rank's own entry). ``path`` is the tensor's path in the captured state (``layout.flatten``);
    ``plan`` and ``pieces`` (this rank's part of it) the razor's, if the state was split.

    Raises:
        FFStateError: a razor part of an entry the key map does not name.
    """
    if plan is not None and path.startswith("razor/part/"):  # a run of a redundant tensor's elements
        i, s, e = pieces[int(path.rsplit("/", 1)[1])]
        key = names.get(plan.paths[i])
        if key is None:
            raise FFStateError(f"the key map names no key for the redundant entry {plan.paths[i]!r}")
        flat = tensor.reshape(-1)
        return [(key[0], flat[first - s: first - s + math.prod(sizes)].view(sizes), tuple(plan.shapes[i]), offsets,
                 (first - s) * tensor.element_size()) for offsets, sizes, first in boxes(plan.shapes[i], s, e)]
    key = names.get(path[4:] if plan is not None and path.startswith("own/") else path)
    if key is None:
        return []
    fqn, global_size, offset = key
    shape = tuple(tensor.shape)
    return [(fqn, tensor, tuple(global_size) if global_size is not None else shape,
             tuple(offset) if offset is not None else (0,) * len(shape), 0)]


def items_of(manifest: Manifest, buffer: torch.Tensor, keys: dict, rank: int, param_groups: bool) -> list[Item]:
    """The DCP items of one rank's version (``buffer``: its bytes, ``manifest``: with the version's scalars);
    ``keys``: the worker's key map (``keys.py``); ``param_groups``: write ``optim.param_groups`` (one rank does).

    Raises:
        FFStateError: the key map does not fit the state (a worker of another version sent it).
    """
    names = keys.get("tensors", {})
    tree = layout.unflatten(manifest, [None] * len(manifest.tensors))
    plan = razor.plan_of(tree)
    pieces = plan.parts()[plan.group.index(rank)] if plan is not None else []
    items: list[Item] = []
    rest: list[int] = []
    for n, spec in enumerate(manifest.tensors):
        data = buffer[spec.offset: spec.offset + spec.nbytes]
        chunks = [] if spec.kind == "ndarray" else \
            keyed(spec.name, data.view(layout.DTYPES[spec.dtype]).view(spec.shape), names, plan, pieces)
        if not chunks:
            rest.append(n)
        items += [Item(fqn, chunk, size, offsets, n, start, path=_path(fqn)) for fqn, chunk, size, offsets, start in chunks]
    blob = torch.cat([buffer[s.offset: s.offset + s.nbytes] for s in (manifest.tensors[n] for n in rest)]) \
        if rest else torch.empty(0, dtype=torch.uint8)
    items.append(Item(f"ffstate.rank{rank}.rest", blob, (blob.numel(),), (0,), rest=rest,
                      path=("ffstate", f"rank{rank}", "rest")))
    items.append(Item(f"ffstate.rank{rank}.manifest", _saved(manifest.to_json().decode()),
                      path=("ffstate", f"rank{rank}", "manifest")))
    if param_groups:
        items += _param_groups(tree, plan is not None, keys.get("param_groups"))
    return items


def _path(fqn: str) -> tuple:
    """DCP's planner path of a key (what ``dcp_to_torch_save`` unflattens to): ``model.<fqn>`` is
    ("model", fqn), ``optim.state.<fqn>.<name>`` is ("optim", "state", fqn, name)."""
    if fqn.startswith("model."):
        return ("model", fqn[6:])
    if fqn.startswith("optim.state."):
        param, name = fqn[12:].rsplit(".", 1)
        return ("optim", "state", param, name)
    return tuple(fqn.split("."))


def _param_groups(tree: Any, razored: bool, spec: dict | None) -> list[Item]:
    """``optim.param_groups.<i>.<key>``, each value as DCP saves it (``torch.save``), ``params`` as FQNs."""
    if not spec:
        return []
    node = tree["own"] if razored else tree
    for part in spec["path"].split("/"):
        node = node.get(part) if isinstance(node, dict) else None
    if not isinstance(node, list) or len(node) != len(spec["params"]):
        return []
    out = []
    for i, (group, params) in enumerate(zip(node, spec["params"])):
        for k, v in {**group, "params": params}.items():
            out.append(Item(f"optim.param_groups.{i}.{k}", _saved(v), path=("optim", "param_groups", i, k)))
    return out
