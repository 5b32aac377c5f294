"""What cannot be resharded by its bytes gets a rule, never a guess (docs/design.md section 5, at another world size).

A tensor of the model or optimizer has a place in the global state, and DCP re-slices it. The rest of a rank's
state has none: the optimizer's hyperparameters, the LR scheduler, the RNG streams and the extras. Each gets
one of three rules at a resize from N to N' ranks:

- **the same on every old rank: passed through**, checked bit for bit across the N copies (hyperparameters, an
  LR scheduler, a step counter or a global sample count kept as a plain value, a ``GradScaler``);
- **an object with a hook**: an extra whose class has ``reshard_state_dict(states, old_world, new_rank,
  new_world)`` gets the N old ranks' ``state_dict()``s (old rank order) and returns the state this new rank
  loads with ``load_state_dict`` (``ElasticSampler`` in ``data.py`` keeps one global sample position this way);
- **refused, by name**: an object with state and no hook (a data loader's per-rank position), a plain value
  that differs across the old ranks, RNG streams that differ (unless ``Config.resize_rng`` is ``keep``: this
  run's own streams are kept, as a DCP resume keeps them). The error lists every refusal at once, before
  anything is loaded: the copies are untouched and the job can be restarted at its old world size.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from ffstate import capture, codec, extras, razor
from ffstate.errors import FFStateError

log = logging.getLogger("ffstate.elastic")

HOOK = "reshard_state_dict"


@dataclass
class Rest:
    """This new rank's values that are not resharded tensors."""

    groups: list[dict]  # the optimizer's hyperparameters per param group (``params`` left out)
    sched: Any = None
    rng: Any = None  # the RNG states to set (Config.resize_rng "keep": this process's own where the old ranks differ)
    extra: Any = None


def same(values: list[Any]) -> bool:
    """Whether the values are identical, bit for bit (tensors, floats' payloads, nesting and types)."""
    first = _fingerprint(values[0])
    return all(_fingerprint(v) == first for v in values[1:])


def _fingerprint(value: Any) -> tuple[bytes, int]:
    snap = codec.pack(value)
    return snap.manifest.to_json(), snap.checksum


def resolve(states: dict[int, Any], new_rank: int, new_world: int, resize_rng: str, lr_scheduler: Any,
            extra: Any) -> Rest:
    """The rules applied to the old ranks' ``states`` (old rank -> captured state at v*) for this new rank.

    Raises:
        FFStateError: every value refused, named by its path, in one message.
    """
    old_world = len(states)
    olds = [razor.own(states[r]) for r in sorted(states)]
    refused: list[str] = []
    optim = [s["optim"] for s in olds]
    zero = "shard" in optim[0]
    groups = [o["groups"] for o in optim] if zero else \
        [[{k: v for k, v in g.items() if k != "params"} for g in o["param_groups"]] for o in optim]
    _per_param_values([o["shard"]["state"] if zero else o["state"] for o in optim], refused)
    if not same(groups):
        refused.append("optim/param_groups: the optimizer's hyperparameters differ across the old ranks")
    rest = Rest(groups[0])
    if lr_scheduler is not None:
        scheds = [s.get("sched") for s in olds]
        if any(s is None for s in scheds):
            refused.append("sched: the copies hold no LR scheduler state; this run has one")
        elif not same(scheds):
            refused.append("sched: the LR scheduler's state differs across the old ranks")
        else:
            rest.sched = scheds[0]
    rngs = [s["rng"] for s in olds]
    differ = [k for k in rngs[0] if not same([r.get(k) for r in rngs])]
    if not differ:
        rest.rng = rngs[0]
    elif resize_rng == "keep":  # the streams that are the same everywhere are restored, the others kept
        rest.rng = {**capture.rng_state(), **{k: v for k, v in rngs[0].items() if k not in differ}}
        log.warning("rank %d: the RNG streams %s differ across the %d old ranks; keeping this process's own "
                    "(Config.resize_rng = keep)", new_rank, differ, old_world)
    else:
        refused.append(f"rng/{'+'.join(differ)}: per-rank RNG streams (they differ across the old ranks) have no "
                       "place at another world size; seed every rank alike, or set Config.resize_rng = 'keep' "
                       "(FFSTATE_RESIZE_RNG=keep) to keep each new process's own streams, as a DCP resume does")
    if extra is not None:
        rest.extra = _extra(extra, [s.get("extra") for s in olds], "extra", old_world, new_rank, new_world, refused)
    if any("comm_hook" in s for s in olds):
        refused.append("comm_hook: a DDP communication hook's state (PowerSGD's error feedback and factors) is each "
                       "rank's own, for its gradients at the old world size; restart at the old size, or register "
                       "the hook anew (its state starts over) without ffstate.register_comm_hook")
    if refused:
        raise FFStateError(f"cannot resume at world size {new_world} from copies made at {old_world}: "
                           + "; ".join(refused) + ". The copies are untouched: restart at world size "
                           f"{old_world}, or give each refused value a rule (docs/elastic.md)")
    return rest


def _per_param_values(states: list[dict], refused: list[str]) -> None:
    """Optimizer state that is per parameter but not a tensor has no key to reshard by: refused."""
    for idx, entry in states[0].items():
        for name, v in entry.items():
            if not isinstance(v, torch.Tensor) and not (isinstance(v, dict) and set(v) == {razor.PLACEHOLDER}):
                refused.append(f"optim/state/{idx}/{name}: a per-parameter value that is not a tensor")
                return


def _is_global(obj: Any) -> bool:
    """Objects with state that is the job's, not the rank's: the same on every rank when the job is data-parallel."""
    from torch.optim.lr_scheduler import LRScheduler, ReduceLROnPlateau

    return isinstance(obj, (LRScheduler, ReduceLROnPlateau, torch.amp.GradScaler))


def _extra(live: Any, olds: list[Any], path: str, old_world: int, new_rank: int, new_world: int,
           refused: list[str]) -> Any:
    """The state this new rank's extra at ``path`` gets (see the module docstring); refusals appended."""
    if extras.is_stateful(live):
        hook = getattr(live, HOOK, None)
        if callable(hook):
            try:
                return hook(olds, old_world, new_rank, new_world)
            except Exception as e:
                refused.append(f"{path}: {type(live).__qualname__}.{HOOK}() failed: {e!r}")
                return None
        if _is_global(live) and same(olds):
            return olds[0]
        refused.append(f"{path} ({type(live).__qualname__}) holds per-rank state (a data position?) and has no "
                       f"{HOOK}(states, old_world, new_rank, new_world) hook"
                       + ("; its state also differs across the old ranks" if _is_global(live) else ""))
        return None
    if isinstance(live, dict) and all(isinstance(o, dict) for o in olds):
        if any(list(o) != list(olds[0]) for o in olds):
            refused.append(f"{path}: the old ranks' extras have different keys")
            return None
        added = [k for k, v in live.items() if k not in olds[0] and extras.holds_state(v)]
        if added:
            refused.append(f"{path}: {added} hold state in this run and are not in the copies (added since?)")
        return {k: _extra(live.get(k), [o[k] for o in olds], f"{path}/{k}", old_world, new_rank, new_world, refused)
                for k in olds[0]}
    if isinstance(live, list) and all(isinstance(o, (list, tuple)) and len(o) == len(live) for o in olds):
        return [_extra(v, [o[i] for o in olds], f"{path}/{i}", old_world, new_rank, new_world, refused)
                for i, v in enumerate(live)]
    if extras.holds_state(live):
        refused.append(f"{path}: the copies do not fit this run's extras")
        return None
    if not same(olds):
        refused.append(f"{path}: a plain value that differs across the old ranks (per-rank?); keep it in an object "
                       f"with a {HOOK} hook, or make it the job's (the same on every rank)")
        return None
    return olds[0]


def warn_early(job: Any, state: dict, extra: Any) -> None:
    """At a job's first commit, says (rank 0, once) what a resize of this job would refuse, while it is cheap to
    change: RNG streams that differ across the ranks (one exchange of their checksums) and extras with per-rank
    state and no hook. A job that never changes shape can ignore it."""
    if job.world < 2:
        return
    sums = {k: codec.pack(v).checksum for k, v in state["rng"].items()}
    try:
        told = job.exchange("resize-readiness", sums, range(job.world), job.cfg.connect_timeout)
    except RuntimeError as e:  # a rank far from its first commit (the store's wait timed out): nothing to say
        log.info("rank %d: the ranks' RNG streams were not compared (%s)", job.rank, e)
        return
    if job.rank != 0:
        return
    rng = [f"rng/{k} differs across the ranks" for k in sums if any(t.get(k) != sums[k] for t in told)]
    hooks = [f"{path} has per-rank state and no {HOOK} hook" for path in _unhooked(extra, "extra")]
    if rng or hooks:  # said at the first attempt; a restart's would say it again. Only the advice that applies.
        do = (["seed every rank's generators alike (random, numpy, torch) or set FFSTATE_RESIZE_RNG=keep"] if rng
              else []) + ([f"give such extras a {HOOK} hook"] if hooks else [])
        say = log.warning if job.attempt == 0 else log.info
        say("rank 0: if this job is ever resumed at another world size (torchrun --nnodes MIN:MAX), the resize "
            "will be refused: %s. To allow it: %s (docs/elastic.md); a job that never changes size can ignore this",
            "; ".join(rng + hooks), "; ".join(do))


def _unhooked(extra: Any, path: str) -> list[str]:
    if extras.is_stateful(extra):
        return [] if callable(getattr(extra, HOOK, None)) or _is_global(extra) else [path]
    if isinstance(extra, dict):
        return [p for k, v in extra.items() for p in _unhooked(v, f"{path}/{k}")]
    if isinstance(extra, (list, tuple)):
        return [p for i, v in enumerate(extra) for p in _unhooked(v, f"{path}/{i}")]
    return []
