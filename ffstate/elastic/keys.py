"""The key map every commit carries (``state["ffstate"]["keys"]``): which DCP key each of the rank's tensors has,
so that any copy can be resharded. Apart from the reader, which needs torch.distributed.checkpoint: a worker
commits key maps at every step and imports DCP only when it resizes."""

from __future__ import annotations

import json

import torch

KEYS = ("ffstate", "keys")  # where a captured state carries its worker's key map (a uint8 tensor of JSON)


def keys_tensor(keys: dict) -> torch.Tensor:
    """A key map as the tensor a commit carries (its JSON bytes; the attempt's timeline left out: it changes at
    every restart, the keys do not)."""
    text = json.dumps({k: v for k, v in keys.items() if k != "timeline"}, separators=(",", ":")).encode()
    return torch.frombuffer(bytearray(text), dtype=torch.uint8)
