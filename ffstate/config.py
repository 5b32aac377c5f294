"""Every knob of ffstate in one frozen dataclass; ``FFSTATE_<FIELD>`` environment variables override it.

Defaults work on one machine. Later layers (daemon, trainer, scheduler) add their fields here, and
the CLI's flags map onto the same names.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, fields
from typing import Any

KERNEL_CHOICES = ("auto", "triton", "torch")


@dataclass(frozen=True)
class Config:
    """ffstate's configuration.

    Attributes:
        chunk_bytes: size of one encoded segment before compaction (bytes). 1 MiB: the best of
            the chunk sizes `ffstate bench bandwidth` sweeps (min of gRPC push and fetch
            throughput on loopback); per-chunk costs are noise at that size and a resend is cheap.
        kernels: ``auto`` (Triton for CUDA tensors, the reference path for CPU tensors),
            ``triton`` (always; CPU tensors then need ``TRITON_INTERPRET=1``) or ``torch`` (always
            the reference path).
        codec_threads: threads of the CPU codec path; 0 means the number of cores, at most 8.
    """

    chunk_bytes: int = 1 << 20
    kernels: str = "auto"
    codec_threads: int = 0

    def __post_init__(self) -> None:
        if self.kernels not in KERNEL_CHOICES:
            raise ValueError(f"kernels must be one of {KERNEL_CHOICES}, got {self.kernels!r}")
        if self.codec_threads < 0:
            raise ValueError(f"codec_threads must be >= 0, got {self.codec_threads}")

    @classmethod
    def from_env(cls, **overrides: Any) -> "Config":
        """Defaults, then ``FFSTATE_<FIELD>`` variables, then ``overrides``."""
        values: dict[str, Any] = {}
        for f in fields(cls):
            raw = os.environ.get(f"FFSTATE_{f.name.upper()}")
            if raw is not None:
                try:
                    values[f.name] = type(f.default)(raw)
                except ValueError as e:
                    raise ValueError(f"FFSTATE_{f.name.upper()}={raw!r}: expected {type(f.default).__name__}") from e
        values.update(overrides)
        return cls(**values)

    def replace(self, **changes: Any) -> "Config":
        return dataclasses.replace(self, **changes)
