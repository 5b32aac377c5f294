"""What every launcher needs: its block size, and the tensor's device made current."""

import contextlib
import os

import torch

# The interpreter pays per program launched (~1 s per 1M elements at 1024-wide blocks, ~0.05 s at
# 65536), so it gets wide blocks; on a GPU a block is one CTA's work and 4096 bytes keeps all SMs busy.
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def block(gpu: int, interpreted: int = 65536) -> int:
    return interpreted if INTERPRETED else gpu


def device_of(t: torch.Tensor):
    """``torch.cuda.device(t.device)`` for a CUDA tensor (Triton launches on the current device's current stream);
    nothing for a CPU tensor under the interpreter."""
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()
