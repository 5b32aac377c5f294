"""A job's extras: the plain values (a data position, counters) and the objects with state that a training
loop keeps beside its model and optimizer, by name, at any nesting (``extra={"loader": loader, "scaler":
scaler, "epoch": 0}``).

An object with state follows the ``Stateful`` protocol of ``torch.distributed.checkpoint`` (``state_dict()``
and ``load_state_dict()``), as torchdata's ``StatefulDataLoader``, ``torch.amp.GradScaler``, LR schedulers and
users' own classes do: at a commit its ``state_dict()`` is captured, and after a restore ``load_state_dict()``
gets the restored state back, bit for bit, before ``replicate(...)`` returns. Plain values are captured as
they are and put back in place.
"""

from __future__ import annotations

import logging
from typing import Any

from ffstate.errors import FFStateError

log = logging.getLogger("ffstate.extras")


def is_stateful(obj: Any) -> bool:
    """Whether ``obj`` has state of its own to save and load (the ``Stateful`` protocol)."""
    return (not isinstance(obj, (dict, list, tuple)) and callable(getattr(obj, "state_dict", None))
            and callable(getattr(obj, "load_state_dict", None)))


def capture(extra: Any, path: str = "extra") -> Any:
    """``extra`` with every Stateful object replaced by its ``state_dict()`` (containers without one are
    returned as they are: nothing to copy).

    Raises:
        FFStateError: an object's ``state_dict()`` failed; the message names its path.
    """
    if is_stateful(extra):
        try:
            return extra.state_dict()
        except Exception as e:
            raise FFStateError(f"{path}: {type(extra).__qualname__}.state_dict() failed: {e!r}") from e
    if isinstance(extra, dict):
        got = {k: capture(v, f"{path}/{k}") for k, v in extra.items()}
        if all(got[k] is v for k, v in extra.items()):
            return extra
        out = type(extra)(got) if type(extra) is not dict else got
        return out
    if isinstance(extra, (list, tuple)):
        got = [capture(v, f"{path}/{i}") for i, v in enumerate(extra)]
        if all(g is v for g, v in zip(got, extra)):
            return extra
        return type(extra)(got)
    return extra


def restore(extra: Any, state: Any, path: str = "extra") -> None:
    """Puts a captured ``state`` back into the live ``extra``: Stateful objects by ``load_state_dict``, plain
    values in place (a dict's keys become the state's, in its order; a list's items likewise).

    Raises:
        FFStateError: an object's ``load_state_dict()`` failed, or the state does not fit the extras' shape.
    """
    if is_stateful(extra):
        try:
            extra.load_state_dict(state)
        except Exception as e:
            raise FFStateError(f"{path}: {type(extra).__qualname__}.load_state_dict() failed on the restored "
                               f"state: {e!r}") from e
        return
    if isinstance(extra, dict):
        if not isinstance(state, dict):
            raise FFStateError(f"{path}: restored a {type(state).__name__} into a dict")
        new = {}
        for k, v in state.items():
            live = extra.get(k)
            if live is not None and holds_state(live):
                restore(live, v, f"{path}/{k}")
                new[k] = live
            else:
                new[k] = v
        lost = [k for k, v in extra.items() if k not in state and holds_state(v)]
        if lost:
            raise FFStateError(f"{path}: the restored state has no entry for {lost}; was it added since the copies "
                               "were made? Restart under a new job id to begin without them")
        extra.clear()
        extra.update(new)
        return
    if isinstance(extra, list):
        if not isinstance(state, (list, tuple)) or len(state) != len(extra):
            raise FFStateError(f"{path}: restored {len(state)} items into a list of {len(extra)}")
        for i, (live, v) in enumerate(zip(extra, state)):
            if holds_state(live):
                restore(live, v, f"{path}/{i}")
            else:
                extra[i] = v
        return
    raise FFStateError(f"{path}: a {type(extra).__name__} cannot be restored in place: pass extras as a dict")


def holds_state(obj: Any) -> bool:
    """Whether ``obj`` is, or contains, a Stateful object (what ``restore`` must load in place)."""
    if is_stateful(obj):
        return True
    if isinstance(obj, dict):
        return any(holds_state(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return any(holds_state(v) for v in obj)
    return False


def warn_pitfalls(extra: Any, rank: int, path: str = "extra") -> None:
    """Logs what ffstate can see cheaply that would make a resume differ from a run that never stopped:
    a DataLoader without a ``generator=`` of its own draws each new iterator's base seed from the global
    torch RNG, so the iterator a resumed loop creates shifts every later random draw (dropout masks)."""
    from torch.utils.data import DataLoader

    if isinstance(extra, DataLoader):
        if extra.generator is None:
            log.warning("rank %d: %s is a DataLoader without generator=: each iterator it creates draws its base "
                        "seed from the global torch RNG, so the iterator a resumed loop creates shifts every later "
                        "random draw (dropout) against a run that never stopped. Pass "
                        "generator=torch.Generator().manual_seed(...) (README: bit-exact resume)", rank, path)
        return
    if isinstance(extra, dict):
        for k, v in extra.items():
            warn_pitfalls(v, rank, f"{path}/{k}")
    elif isinstance(extra, (list, tuple)):
        for i, v in enumerate(extra):
            warn_pitfalls(v, rank, f"{path}/{i}")
