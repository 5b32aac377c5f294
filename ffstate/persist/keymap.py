"""A worker's key map, as the daemon receives it at attach (``keys.py`` makes it on the worker's side): the DCP key of
each tensor, checked and bounded before the daemon keeps it. Without torch: the daemon runs without it."""

from __future__ import annotations

import json

from ffstate.errors import FFStateError

KEYS_VERSION = 1
MAX_KEYS_BYTES = 16 << 20  # a key map's JSON, like a manifest's


def check_keys(raw: bytes) -> dict:
    """A key map from a worker (bounded, validated): raises FFStateError naming what is wrong."""
    if len(raw) > MAX_KEYS_BYTES:
        raise FFStateError(f"key map of {len(raw)} bytes exceeds {MAX_KEYS_BYTES}")
    try:
        keys = json.loads(raw)
        if keys.get("v") != KEYS_VERSION:
            raise FFStateError(f"key map version {keys.get('v')!r}, expected {KEYS_VERSION}")
        for path, (fqn, size, offset) in keys["tensors"].items():
            if not isinstance(path, str) or not isinstance(fqn, str) or not fqn:
                raise FFStateError(f"key map entry {path!r}: a path and a key are strings")
            for dims in (size, offset):
                if dims is not None and not (isinstance(dims, list) and all(isinstance(d, int) and d >= 0 for d in dims)):
                    raise FFStateError(f"key map entry {path!r}: sizes and offsets are lists of ints >= 0")
        if not isinstance(keys.get("timeline", ""), str) or len(keys.get("timeline", "")) > 64:
            raise FFStateError("key map timeline: a string of at most 64 characters")
        groups = keys.get("param_groups")
        if groups is not None and not (isinstance(groups.get("path"), str) and isinstance(groups.get("params"), list)):
            raise FFStateError("key map param_groups: a path and a list of FQN lists")
    except FFStateError:
        raise
    except (ValueError, TypeError, KeyError, AttributeError) as e:
        raise FFStateError(f"malformed key map: {e!r}") from None
    return keys
