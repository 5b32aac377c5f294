"""The wire names of ``manifest.DTYPE_SIZES`` as torch's dtypes, and back (the training side's: the daemon never
needs them)."""

from __future__ import annotations

import torch

from ffstate.layout.manifest import DTYPE_SIZES

DTYPES: dict[str, torch.dtype] = {name: getattr(torch, name) for name in DTYPE_SIZES if hasattr(torch, name)}
DTYPE_NAMES: dict[torch.dtype, str] = {v: k for k, v in DTYPES.items()}
