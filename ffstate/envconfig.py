"""A ``Config`` from the environment: each ``FFSTATE_<FIELD>`` variable parsed by its field's type. A value the
config refuses names the variable that set it (the fields' checks speak of the fields), and a variable no field
reads (a misspelt knob: ``FFSTATE_MAXLAG``) is named once per process, not silently ignored."""

from __future__ import annotations

import logging
import os
import re
from dataclasses import fields
from typing import Any

log = logging.getLogger("ffstate")

# Read elsewhere, not by Config: the in-process engine's attempt number, the tests' shared-memory folder, the
# benchmarks' own.
OTHERS = frozenset({"FFSTATE_ATTEMPT", "FFSTATE_SHM_DIR", "FFSTATE_BENCH_CPUS", "FFSTATE_BENCH_DAEMON_PIDS",
                    "FFSTATE_BENCH_PORTS"})
_warned: set[str] = set()


def parse(raw: str, kind: type) -> Any:
    if kind is bool:
        if raw.lower() in ("1", "true", "yes", "on"):
            return True
        if raw.lower() in ("0", "false", "no", "off", ""):
            return False
        raise ValueError(raw)
    return kind(raw)


def from_env(cls: type, overrides: dict[str, Any]) -> Any:
    """``cls`` (``Config``) from its defaults, then the environment's ``FFSTATE_<FIELD>`` variables, then
    ``overrides``; ValueError naming the variable whose value was refused."""
    values: dict[str, Any] = {}
    said: dict[str, str] = {}  # field -> the variable and the value that set it
    for f in fields(cls):
        name = f"FFSTATE_{f.name.upper()}"
        raw = os.environ.get(name)
        if raw is None:
            continue
        try:
            values[f.name] = parse(raw, type(f.default))
        except ValueError as e:
            raise ValueError(f"{name}={raw!r}: expected {type(f.default).__name__}") from e
        said[f.name] = f"{name}={raw!r}"
    _name_unknown({f"FFSTATE_{f.name.upper()}" for f in fields(cls)})
    values.update(overrides)
    try:
        return cls(**values)
    except ValueError as e:
        named = [v for k, v in said.items() if k not in overrides and re.search(rf"\b{k}\b", str(e))]
        if not named:
            raise
        raise ValueError(f"{e} (set by {', '.join(named)})") from e


def _name_unknown(known: set[str]) -> None:
    unknown = sorted(k for k in os.environ if k.startswith("FFSTATE_") and k not in known and k not in OTHERS)
    if new := [k for k in unknown if k not in _warned]:
        _warned.update(new)
        log.warning("%s: no such setting, ignored (misspelt? every FFSTATE_ variable is in docs/configuration.md)",
                    ", ".join(new))
