"""Test setup: Triton kernels run under the interpreter on a machine without a GPU."""

import os

import torch

if not torch.cuda.is_available():
    # Must be set before triton is first imported; lets the kernels run on CPU tensors (DESIGN.md I7).
    os.environ.setdefault("TRITON_INTERPRET", "1")

from daemons import daemons  # noqa: E402,F401  (the fixture that runs real `ffstate serve` processes)
