"""Replicate each byte once: state a data-parallel group holds identically is split across the group.

Under DDP every rank of the group holds the same parameters (and, with a plain optimizer, the same
optimizer state), bit for bit; with a ZeroRedundancyOptimizer the parameters are still identical
and only the optimizer shards differ. ``infer`` says which entries of the captured state are
redundant and across which ranks; ``Plan`` cuts their bytes into one contiguous part per rank of
the group (element boundaries, dtype kept, so the codec's byte planes still apply); ``split`` turns a
rank's captured state into what it commits: its own entries, a placeholder where each redundant
entry was, and its part of the redundant bytes. ``assemble`` puts a rank's state back together from
its own shard and every group member's part. The claim "identical" is verified, not trusted:
``checksums`` gives one checksum per redundant entry for the group to compare (the trainer does, at
the first commit and every ``Config.razor_verify_every`` commits), and an entry that differs falls
back to per-rank replication.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from typing import Any

import torch

from ffstate import codec, layout, lazy
from ffstate.config import Config
from ffstate.errors import FFStateError

PLACEHOLDER = "ffstate.razor"  # the key of the dict that stands where a redundant entry was


@dataclass(frozen=True)
class Groups:
    """What ``infer`` found: the ranks that hold ``prefixes`` identically, and why."""

    ranks: tuple[int, ...]
    prefixes: tuple[str, ...]
    reason: str


def infer(model: torch.nn.Module, optimizer: torch.optim.Optimizer, world: int, cfg: Config) -> Groups | None:
    """The redundancy of a job's state, from what it is wrapped in (None: every byte is the rank's own).

    DDP: the model's state across the DDP process group, and the optimizer state too unless the
    optimizer is a ZeroRedundancyOptimizer (its shards are per rank). FSDP2 and a single process:
    nothing. ``Config.razor_identical`` (state path prefixes, e.g. ``"model,optim/state"``) declares
    entries identical across the whole world where this cannot be inferred.
    """
    if cfg.razor == "off" or world == 1:
        return None
    if cfg.razor_identical:
        prefixes = tuple(p.strip().strip("/") for p in cfg.razor_identical.split(",") if p.strip())
        return Groups(tuple(range(world)), prefixes, f"declared identical across the world: {', '.join(prefixes)}")
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        import torch.distributed as dist

        ranks = tuple(sorted(dist.get_process_group_ranks(model.process_group)))
        if len(ranks) < 2:
            return None
        if lazy.is_zero(optimizer):
            return Groups(ranks, ("model",), f"DDP over ranks {list(ranks)}; ZeRO optimizer shards are per rank")
        return Groups(ranks, ("model", "optim/state"), f"DDP over ranks {list(ranks)} with a replicated optimizer")
    return None


def why_not(world: int, cfg: Config) -> str:
    """Why ``infer`` found nothing to split, for the logs and ``ffstate status``."""
    if cfg.razor == "off":
        return "razor off (Config.razor)"
    if world == 1:
        return "one process: nothing to share"
    return ("no state is held identically by a group of ranks (not DDP, or FSDP2 shards); "
            "Config.razor_identical declares such state")


def unmatched(state: Any, prefixes: tuple[str, ...]) -> list[str]:
    """The declared ``prefixes`` that name no entry of ``state`` (a container or a leaf), e.g. a typo."""
    paths: set[str] = set()

    def walk(obj: Any, path: str) -> None:
        paths.add(path)
        if isinstance(obj, dict):
            for k, v in obj.items():
                walk(v, f"{path}/{k}" if path else str(k))
        elif isinstance(obj, (list, tuple)):
            for i, v in enumerate(obj):
                walk(v, f"{path}/{i}" if path else str(i))

    walk(state, "")
    return [p for p in prefixes if not any(_matches(q, (p,)) for q in paths)]


def _matches(path: str, prefixes: tuple[str, ...]) -> bool:
    return any(path == p or path.startswith(p + "/") for p in prefixes)


@dataclass(frozen=True)
class Plan:
    """The redundant entries of a state (paths, dtypes, shapes, in state order) and the group splitting them."""

    group: tuple[int, ...]
    paths: tuple[str, ...]
    dtypes: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]

    @staticmethod
    def of(state: Any, groups: Groups, exclude: frozenset[str] = frozenset()) -> "Plan | None":
        """The plan for ``state`` (None when nothing in it is redundant); ``exclude``: entries that fell back."""
        _, leaves, _ = layout.flatten(state)
        chosen = [(p, t) for p, t in leaves if isinstance(t, torch.Tensor) and p not in exclude
                  and _matches(p, groups.prefixes) and t.numel() and t.is_contiguous() and t.dtype in layout.DTYPE_NAMES]
        if not chosen:
            return None
        return Plan(groups.ranks, tuple(p for p, _ in chosen), tuple(layout.DTYPE_NAMES[t.dtype] for _, t in chosen),
                    tuple(tuple(t.shape) for _, t in chosen))

    @functools.lru_cache(maxsize=4)  # noqa: B019 (plans are few and live as long as the job)
    def to_json(self) -> str:
        return json.dumps([list(self.group), list(self.paths), list(self.dtypes), [list(s) for s in self.shapes]],
                          separators=(",", ":"))

    @staticmethod
    def from_json(text: str) -> "Plan":
        group, paths, dtypes, shapes = json.loads(text)
        return Plan(tuple(group), tuple(paths), tuple(dtypes), tuple(tuple(s) for s in shapes))

    def nbytes(self, i: int) -> int:
        n = layout.DTYPES[self.dtypes[i]].itemsize
        for d in self.shapes[i]:
            n *= d
        return n

    @property
    def total_bytes(self) -> int:
        return sum(self.nbytes(i) for i in range(len(self.paths)))

    @functools.lru_cache(maxsize=4)  # noqa: B019 (called at every commit; plans are few)
    def parts(self) -> list[list[tuple[int, int, int]]]:
        """Per group member, its part: (entry, first element, end element) pieces, in state order.

        The redundant bytes, laid end to end, are cut at 1/G, 2/G, ... of their total, each cut
        rounded down to an element of the entry it falls in, so the parts tile every entry exactly.
        """
        size = len(self.group)
        total = self.total_bytes
        cuts = [total * g // size for g in range(size + 1)]
        out: list[list[tuple[int, int, int]]] = [[] for _ in range(size)]
        offset = 0
        for i in range(len(self.paths)):
            n = self.nbytes(i)
            item = layout.DTYPES[self.dtypes[i]].itemsize
            elems = [min(max((c - offset) // item, 0), n // item) for c in cuts]
            for g in range(size):
                if elems[g] < elems[g + 1]:
                    out[g].append((i, elems[g], elems[g + 1]))
            offset += n
        return out

    @functools.lru_cache(maxsize=8)  # noqa: B019 (called at every commit; plans are few)
    def pieces(self, member: int) -> list[tuple[int, int, int, bool]]:
        """``parts()[member]``, each piece with whether it is its whole entry."""
        return [(i, s, e, s == 0 and e * layout.DTYPES[self.dtypes[i]].itemsize == self.nbytes(i))
                for i, s, e in self.parts()[member]]

    @functools.lru_cache(maxsize=4)  # noqa: B019 (called at every commit; plans are few)
    def specs(self) -> list[tuple[torch.dtype, torch.Size]]:
        """Each redundant entry's dtype and shape, as the tensors say them (what ``split`` checks)."""
        return [(layout.DTYPES[d], torch.Size(s)) for d, s in zip(self.dtypes, self.shapes)]

    def part_bytes(self, member: int) -> int:
        return sum((e - s) * layout.DTYPES[self.dtypes[i]].itemsize for i, s, e in self.parts()[member])


def split(state: Any, plan: Plan, rank: int) -> dict:
    """What ``rank`` commits: its own entries (placeholders for the redundant ones) and its part of them."""
    found: list[torch.Tensor | None] = [None] * len(plan.paths)
    trie = _KEY_TRIES.get(plan)
    own = None if trie is None else _substitute_along(state, trie, found)
    if own is None:  # the first split with this plan, or the state's nesting changed: the whole walk
        index = {p: i for i, p in enumerate(plan.paths)}
        where: dict[int, tuple] = {}
        found = [None] * len(plan.paths)
        own = _substitute(state, "", index, found, (), where)
        if len(where) == len(plan.paths):
            _KEY_TRIES[plan] = _trie([where[i] for i in range(len(plan.paths))])
    if any(t is None for t in found):
        missing = [p for p, t in zip(plan.paths, found) if t is None][:3]
        raise FFStateError(f"the state no longer has the redundant entries it was planned with (e.g. {missing})")
    changed = [i for i, (t, (dtype, shape)) in enumerate(zip(found, plan.specs())) if t.dtype != dtype or t.shape != shape]
    if changed:  # cut by the old plan, its parts would be a prefix of the entry, or more than it holds
        i = changed[0]
        raise StalePlan(f"{len(changed)} redundant entries changed dtype or shape since the razor's plan was made, e.g. "
                        f"{plan.paths[i]}: {found[i].dtype} {list(found[i].shape)}, planned {plan.dtypes[i]} "
                        f"{list(plan.shapes[i])}")
    # A piece that is a whole entry (most of them) is the entry flattened, not a slice of it as well
    part = [found[i].reshape(-1) if whole else found[i].reshape(-1)[s:e]
            for i, s, e, whole in plan.pieces(plan.group.index(rank))]
    return {"own": own, "razor": {"plan": plan.to_json(), "part": part}}


class StalePlan(FFStateError):
    """A redundant entry no longer has the dtype or shape its plan was made with: the group plans again."""


def in_part(name: str) -> bool:
    """Whether a tensor of a committed shard (a manifest name) is of its part of the redundant bytes: all that a
    group member's restore needs of another member's shard (``recovery`` fetches just those)."""
    return name.startswith("razor/part/")


def own(shard: Any) -> Any:
    """A committed shard's own entries (the shard itself without the razor)."""
    return shard["own"] if plan_of(shard) is not None else shard


def plan_of(shard: Any) -> Plan | None:
    """The plan a committed shard was made with (None: a shard without the razor)."""
    if isinstance(shard, dict) and set(shard) == {"own", "razor"}:
        return Plan.from_json(shard["razor"]["plan"])
    return None


def assemble(mine: dict, parts: dict[int, dict]) -> Any:
    """This rank's whole state from its shard ``mine`` and the shards of every group member (by rank).

    Raises:
        FFStateError: a member's shard is missing or was made with another plan (never a mixed state).
    """
    plan = plan_of(mine)
    assert plan is not None
    text = mine["razor"]["plan"]
    tensors = [torch.empty(shape, dtype=layout.DTYPES[dt]) for dt, shape in zip(plan.dtypes, plan.shapes)]
    for member, pieces in enumerate(plan.parts()):
        rank = plan.group[member]
        shard = parts.get(rank)
        if shard is None or plan_of(shard) is None or shard["razor"]["plan"] != text:
            raise FFStateError(f"rank {rank}'s part of the redundant state is missing or was made with another "
                               "redundancy plan; refusing to assemble a mixed state")
        for (i, s, e), t in zip(pieces, shard["razor"]["part"]):
            layout.copy_bits(tensors[i].reshape(-1)[s:e], t)
    return _fill(mine["own"], tensors)


def checksums(state: Any, plan: Plan) -> list[int]:
    """One fingerprint per redundant entry of ``state`` (the group compares them to verify the plan), computed
    where the tensor is (``codec.fingerprint``: no copy of a GPU tensor to the host)."""
    by_path = dict(layout.flatten(state)[1])
    out = []
    for p in plan.paths:
        out.append(codec.fingerprint(by_path[p].detach().reshape(-1).view(torch.uint8)))
    return out


def _substitute(obj: Any, path: str, index: dict[str, int], found: list[torch.Tensor | None], keys: tuple = (),
                where: dict[int, tuple] | None = None) -> Any:
    """``obj`` with each leaf at a path in ``index`` replaced by a placeholder (paths as ``layout.flatten``); the
    keys that lead to each such leaf go to ``where`` (``_substitute_along`` follows them at later commits)."""
    if isinstance(obj, torch.Tensor):
        i = index.get(path)
        if i is None:
            return obj
        found[i] = obj.detach()
        if where is not None:
            where[i] = keys
        return {PLACEHOLDER: i}
    if isinstance(obj, dict):
        out = type(obj)((k, _substitute(v, f"{path}/{k}" if path else str(k), index, found, (*keys, k), where))
                        for k, v in obj.items())
        if hasattr(obj, "_metadata"):
            out._metadata = obj._metadata
        return out
    if isinstance(obj, (list, tuple)) and type(obj) in (list, tuple):
        # (no keys recorded under a sequence: _substitute_along copies dicts only, and gives up here)
        return type(obj)(_substitute(v, f"{path}/{i}", index, found) for i, v in enumerate(obj))
    return obj


# Per plan, the keys that lead to its redundant entries as a trie (key -> the trie below it, or the entry's index):
# a commit copies the dicts along them, each once, and nothing else.
_KEY_TRIES: dict[Plan, dict] = {}


def _trie(paths: list[tuple]) -> dict:
    root: dict = {}
    for i, keys in enumerate(paths):
        node = root
        for k in keys[:-1]:
            node = node.setdefault(k, {})
        node[keys[-1]] = i
    return root


class _Changed(Exception):
    """The state's nesting is not what the plan's keys say."""


def _substitute_along(state: Any, trie: dict, found: list[torch.Tensor | None]) -> Any | None:
    """What ``_substitute`` gives, made by following the keys to the redundant entries: only the dicts on the way
    are copied, each once (the rest is shared with ``state``, which nobody changes), where the whole walk rebuilt
    every container and named every node (a fifth of a commit under DDP, profiled). None when the state's nesting
    is not what the keys say (the caller walks the whole state)."""
    tensor = torch.Tensor

    def along(d: Any, sub: dict) -> dict:
        if not isinstance(d, dict):
            raise _Changed
        c = type(d)(d)
        if hasattr(d, "_metadata"):
            c._metadata = d._metadata
        for k, below in sub.items():
            x = d[k]
            if type(below) is int:
                if not isinstance(x, tensor):
                    raise _Changed
                found[below] = x.detach() if x.requires_grad else x  # a captured state's leaves are detached
                c[k] = {PLACEHOLDER: below}
            else:
                c[k] = along(x, below)
        return c

    try:
        return along(state, trie)
    except (_Changed, KeyError, TypeError):
        return None


def _fill(obj: Any, tensors: list[torch.Tensor]) -> Any:
    if isinstance(obj, dict):
        if set(obj) == {PLACEHOLDER}:
            return tensors[obj[PLACEHOLDER]]
        out = type(obj)((k, _fill(v, tensors)) for k, v in obj.items())
        if hasattr(obj, "_metadata"):
            out._metadata = obj._metadata
        return out
    if isinstance(obj, (list, tuple)) and type(obj) in (list, tuple):
        return type(obj)(_fill(v, tensors) for v in obj)
    return obj
