"""What every launcher needs to pick its block size."""

import os

# The interpreter pays per program launched (~1 s per 1M elements at 1024-wide blocks, ~0.05 s at
# 65536), so it gets wide blocks; on a GPU a block is one CTA's work and 4096 bytes keeps all SMs busy.
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def block(gpu: int, interpreted: int = 65536) -> int:
    return interpreted if INTERPRETED else gpu
