"""Names a package loads on first use: those of its modules that need torch, in packages the daemon imports without
it (``ffstate.codec``, ``ffstate.layout``, ``ffstate.persist``). The daemon never touches them; the training side,
which has torch loaded already, pays one import at its first use of each."""

from __future__ import annotations

import importlib
from typing import Any, Callable


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
