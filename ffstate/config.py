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
LAG_POLICIES = ("block", "skip")
RAZOR_CHOICES = ("auto", "off")
SCHEDULERS = ("windows", "naive")


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
        job_id: the job's id, which names its replicas; default: torchrun's run id
            (``TORCHELASTIC_RUN_ID``, stable across restarts of one torchrun), else ``ffstate-job``.
        token: the job's secret, carried by every RPC; default ``$FFSTATE_TOKEN``, else a per-user
            secret in ``~/.config/ffstate/token`` (enough on one machine; set it for multi-node jobs).
        node_id: this node's name; default ``node<GROUP_RANK>`` from torchrun (one per machine).
        simulated_nodes: > 0 splits the ranks of one machine into this many simulated nodes, each
            with its own daemon (for the demo and tests; ranks go to nodes in contiguous blocks).
        replicas: k, how many other nodes hold each rank's replica (ring placement over nodes).
        daemon_host: the address this node's daemon listens on and is reached at.
        base_port: node n's daemon listens on ``base_port + n``.
        start_daemon: start the node's daemon when none answers (it outlives worker restarts and
            exits when the job is over or after ``daemon_idle_exit`` seconds without a request or a commit).
        daemon_memory_limit: the started daemon's budget (``--memory-limit``, e.g. ``8G``); "" is its default.
        daemon_idle_exit: seconds without a request or a commit after which a started daemon exits.
        max_lag: W, how many versions replication may fall behind the training before the lag
            policy acts; also the deltas each holder keeps to step back.
        lag_policy: ``block`` holds ``commit`` until replication is within ``max_lag``; ``skip``
            lets it run ahead (the replicator always jumps to the newest version) and logs it.
        shadow_ddp_step: after a restore under DDP, run one shadow forward/backward on the first
            batch (RNG, buffers and gradients put back after it) so that DDP's gradient buckets
            have their rebuilt layout, as in a run that never stopped; without it the first step
            after a restore reduces gradients in another order and the run is no longer bit-exact.
        exit_timeout: seconds a clean exit waits for the replicas to catch up.
        connect_timeout: seconds to wait for the node's daemon to answer.
        razor: ``auto`` replicates each byte once: state a data-parallel group holds identically
            (DDP's parameters; its optimizer state unless ZeRO shards it) is split across the group
            and each rank replicates only its part; ``off`` replicates every rank's whole state.
        razor_identical: state path prefixes (comma-separated, e.g. ``model,optim/state``) that the
            user declares identical across all ranks, where ``auto`` cannot infer it (a model not
            wrapped in DDP whose gradients are all-reduced by hand). Verified like the inferred ones.
        scheduler: how the node's daemon paces replication: ``windows`` sends into the training's
            idle network windows (marked by DDP's communication hook or at FSDP2's collectives, else
            profiled: ``profile_steps``) under ``link_share`` of the link; ``naive`` sends as soon as a
            version is captured.
        profile_steps: where nothing marks the training's collectives (neither DDP nor FSDP2: gradients
            all-reduced by hand, tensor parallelism), the ``windows`` scheduler learns their timeline
            from this many steps run under ``torch.profiler`` after the first two commits; 0: off
            (replication is then paced by rate alone).
        link_share: share of each link's estimated bandwidth replication may use.
        link_bandwidth: the links' bandwidth in bytes per second (e.g. ``25M`` for 200 Mbit/s) when
            known; "" measures it from the first push and follows it.
        metrics_port: Prometheus metrics of node n's started daemon on ``metrics_port + n``; 0: off.
        razor_verify_every: the group compares checksums of the entries it believes identical at
            the first commit and then every this many commits; an entry that differs is logged as
            an error and falls back to per-rank replication.
    """

    chunk_bytes: int = 1 << 20
    kernels: str = "auto"
    codec_threads: int = 0
    job_id: str = ""
    token: str = ""
    node_id: str = ""
    simulated_nodes: int = 0
    replicas: int = 1
    daemon_host: str = "127.0.0.1"
    base_port: int = 7700
    start_daemon: bool = True
    daemon_memory_limit: str = ""
    daemon_idle_exit: float = 600.0
    max_lag: int = 4
    lag_policy: str = "block"
    shadow_ddp_step: bool = True
    exit_timeout: float = 60.0
    connect_timeout: float = 60.0
    razor: str = "auto"
    razor_identical: str = ""
    razor_verify_every: int = 100
    scheduler: str = "windows"
    profile_steps: int = 3
    link_share: float = 0.5
    link_bandwidth: str = ""
    metrics_port: int = 0

    def __post_init__(self) -> None:
        if self.kernels not in KERNEL_CHOICES:
            raise ValueError(f"kernels must be one of {KERNEL_CHOICES}, got {self.kernels!r}")
        if self.codec_threads < 0:
            raise ValueError(f"codec_threads must be >= 0, got {self.codec_threads}")
        if self.lag_policy not in LAG_POLICIES:
            raise ValueError(f"lag_policy must be one of {LAG_POLICIES}, got {self.lag_policy!r}")
        if self.razor not in RAZOR_CHOICES:
            raise ValueError(f"razor must be one of {RAZOR_CHOICES}, got {self.razor!r}")
        if self.scheduler not in SCHEDULERS:
            raise ValueError(f"scheduler must be one of {SCHEDULERS}, got {self.scheduler!r}")
        if not 0 < self.link_share <= 1:
            raise ValueError(f"link_share must be in (0, 1], got {self.link_share}")
        if self.profile_steps < 0:
            raise ValueError(f"profile_steps must be >= 0, got {self.profile_steps}")
        if self.razor_verify_every < 1:
            raise ValueError(f"razor_verify_every must be >= 1, got {self.razor_verify_every}")
        if self.replicas < 0 or self.max_lag < 1 or self.simulated_nodes < 0:
            raise ValueError(f"replicas >= 0, max_lag >= 1, simulated_nodes >= 0; got {self.replicas}, "
                             f"{self.max_lag}, {self.simulated_nodes}")

    @classmethod
    def from_env(cls, **overrides: Any) -> "Config":
        """Defaults, then ``FFSTATE_<FIELD>`` variables, then ``overrides``."""
        values: dict[str, Any] = {}
        for f in fields(cls):
            raw = os.environ.get(f"FFSTATE_{f.name.upper()}")
            if raw is not None:
                try:
                    values[f.name] = _parse(raw, type(f.default))
                except ValueError as e:
                    raise ValueError(f"FFSTATE_{f.name.upper()}={raw!r}: expected {type(f.default).__name__}") from e
        values.update(overrides)
        return cls(**values)

    def replace(self, **changes: Any) -> "Config":
        return dataclasses.replace(self, **changes)


def _parse(raw: str, kind: type) -> Any:
    if kind is bool:
        if raw.lower() in ("1", "true", "yes", "on"):
            return True
        if raw.lower() in ("0", "false", "no", "off", ""):
            return False
        raise ValueError(raw)
    return kind(raw)
