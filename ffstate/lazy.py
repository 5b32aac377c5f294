"""Names a package loads on first use: those of its modules that need torch, in packages the daemon imports without
it (``ffstate.codec``, ``ffstate.layout``, ``ffstate.persist``). The daemon never touches them; the training side,
which has torch loaded already, pays one import at its first use of each. ``is_zero`` asks a class of a module
without loading it."""

from __future__ import annotations

import importlib
import sys
from typing import Any, Callable

ZERO = "torch.distributed.optim.zero_redundancy_optimizer"


def is_zero(optimizer: Any) -> bool:
    """Whether ``optimizer`` is a ``ZeroRedundancyOptimizer``, without importing ``torch.distributed.optim`` (0.2 s
    of CPU, which every rank's entry paid for this look): an object of that class has its module loaded already."""
    module = sys.modules.get(ZERO)
    return module is not None and isinstance(optimizer, module.ZeroRedundancyOptimizer)


def attach(namespace: dict[str, Any], where: dict[str, str]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """A package's ``__getattr__`` and ``__dir__`` for the names of ``where`` (name -> the module defining it)."""

    def __getattr__(name: str) -> Any:
        if name not in where:
            raise AttributeError(f"module {namespace['__name__']!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(where[name]), name)
        namespace[name] = value  # found directly from now on
        return value

    def __dir__() -> list[str]:
        return sorted({*namespace, *where})

    return __getattr__, __dir__
