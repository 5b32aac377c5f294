"""Every knob of ffstate, in two frozen dataclasses: ``Config`` (a training job's, ``FFSTATE_<FIELD>``
environment variables override it) and ``DaemonConfig`` (a node daemon's: ``ffstate serve``'s flags
map one to one onto its fields, and a daemon a worker starts gets its command line from one).

Defaults work on one machine.
"""

from __future__ import annotations

import argparse
import math
import dataclasses
import re
import socket
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

KERNEL_CHOICES = ("auto", "triton", "torch")
LAG_POLICIES = ("block", "skip")
RAZOR_CHOICES = ("auto", "off")
SCHEDULERS = ("windows", "naive")
HANG_ACTIONS = ("kill", "log", "off")
RESIZE_RNG = ("refuse", "keep")


@dataclass(frozen=True)
class Config:
    """ffstate's configuration.

    Attributes:
        kernels: ``auto`` (Triton for CUDA tensors, the reference path for CPU tensors),
            ``triton`` (always; CPU tensors then need ``TRITON_INTERPRET=1``) or ``torch`` (always
            the reference path). Process-wide: read from ``FFSTATE_KERNELS`` by whatever packs or
            encodes (``replicate(config=...)`` does not change it).
        codec_threads: threads of the CPU codec path; 0 means the number of CPUs the process may run on, at most 8.
            Process-wide, from ``FFSTATE_CODEC_THREADS``, as ``kernels``.
        job_id: the job's id, which names its replicas; default: torchrun's run id (``TORCHELASTIC_RUN_ID``: its
            ``--rdzv-id``, or one it makes up; stable across restarts of one torchrun), else Slurm's job id
            (``SLURM_JOB_ID``), else ``ffstate-job``.
        token: the job's secret, carried by every RPC (``FFSTATE_TOKEN``); default: read from ``token_file``, else
            agreed by the job's ranks through its torch.distributed store (the rendezvous is the job's trust
            boundary) and kept in each node's run folder so that restarts find it; a single process without a
            store uses a per-user secret in ``~/.config/ffstate/token``.
        token_file: a file holding the token (``FFSTATE_TOKEN_FILE``), as ``ffstate serve --token-file`` takes.
        node_id: this node's name; default ``node<GROUP_RANK>`` from torchrun (one per machine).
        simulated_nodes: > 0 splits the ranks of one machine into this many simulated nodes, each
            with its own daemon (for the demo and tests; ranks go to nodes in contiguous blocks).
        replicas: k, how many other nodes hold each rank's replica (ring placement over nodes).
        daemon_host: the address this node's daemon listens on and is reached at by the other nodes; "" finds
            it as the job's own traffic does (``placement.local_address``: the collectives' interface, else the
            route to the rendezvous host, else the host name; 127.0.0.1 for simulated nodes).
        base_port: each node's daemon listens on it (simulated node n's on it + n; a later one when held).
        start_daemon: start the node's daemon when none answers (it outlives worker restarts and
            exits when the job is over or after ``daemon_idle_exit`` seconds without a request or a commit).
        daemon_memory_limit: the started daemon's budget (``--memory-limit``, e.g. ``8G``); "" is its default.
        daemon_idle_exit: seconds without a request or a commit after which a started daemon exits.
        daemon_nice: the started daemon's CPU priority (``--nice``): a niceness 0-19 (default 0), or "idle"
            (SCHED_IDLE: only the CPU nobody else wants; the lag policy then holds commits until replication
            catches up). On 2 cores shared with 4 ranks, 19 against 0 did not change the step (the daemons run
            while the ranks wait in their collectives either way: benchmarks/2026-11-26-daemon-policy.md).
        daemon_cpus: the CPUs the started daemon runs on (``--cpus``), in taskset's list syntax (``60-63``,
            ``0,2,4-7``): cores of its own where the training takes the others (docs/deployment.md, CPU); "" leaves it
            on the CPUs of the rank that starts it.
        max_lag: W, how many versions replication may fall behind the training before the lag
            policy acts; also the deltas each holder keeps to step back. 1 (the default) bounds a node's loss at one
            step: a commit waits, when it must, until every holder that answers has the step before it.
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
        metrics_port: Prometheus metrics of each started daemon on it, moved as far as its own port (base_port); 0: off.
        bulk_port: each started daemon's bulk socket (pushes' and restores' chunks), moved as base_port; 0: a port
            the kernel picks; -1: none. Unreachable, fetches go over gRPC: pin it behind a firewall.
        razor_verify_every: the group compares checksums of the entries it believes identical at
            the first commit and then every this many commits; an entry that differs is logged as
            an error and falls back to per-rank replication.
        hang_action: what the node's daemon does when a local rank has not committed within its
            deadline (``watchdog.py``): ``kill`` (the stacks written, then the hung ranks SIGKILLed, those
            waiting for them in a collective left, so that torchrun or the in-process engine restarts the
            group and it restores from its slots), ``log`` (the stacks and an error only) or ``off``.
        hang_multiple, hang_floor, hang_ceiling: a rank's deadline is ``hang_multiple`` times its
            median step, at least ``hang_floor`` and at most ``hang_ceiling`` seconds.
        hang_startup: the deadline (seconds) until a rank's third commit after it attached: the first
            steps after a start or a restore (compilation, the DDP shadow step, a data loader's
            workers) take their own time.
        pause_limit: how long ``ff.pause()`` declares non-training work (an evaluation, a checkpoint)
            to last at most, by default; the deadline counts from its end.
        straggler_ratio: a rank whose compute time a step (the step less its wait in the
            collectives) stays above this multiple of its node's median is warned about as a
            straggler (reported, never acted on).
        persist_dir: the persistent tier (``ffstate/persist/``): each node's daemon writes its local ranks'
            committed versions here in the torch.distributed.checkpoint format, and a job that finds no live
            copy resumes from the newest complete one. Every node must reach it (a shared filesystem across
            machines); "" is off. Started daemons get it, and the workers read from it.
        persist_every: a version is flushed every this many steps (its number a multiple of it); a flush still
            running when the next is due makes the daemon skip that one (counted and logged).
        persist_keep: complete versions kept per job; older ones, and torn ones, are removed.
        persist_nice: the CPU priority of the daemon's flushing process: "idle" (SCHED_IDLE: only the CPU
            nobody else wants; on a node whose cores are all busy more versions are skipped), or a niceness
            0-19 below the daemon's own ("10": fresher versions, at some CPU taken from the training there).
        resize_rng: at a resize (the job resumed at another world size, ``ffstate/elastic/``), RNG streams that
            differ across the old ranks have no place in the new shape: ``refuse`` (the resize is refused, naming
            them) or ``keep`` (each new process keeps its own streams, as a resume with DCP does). Streams that are
            the same on every old rank are restored either way.
        drain_hold: seconds a rank of a node being drained (``ffstate drain``) waits at its last step for the node
            to be taken out of the job; past it the drain is given up and training goes on.
        spares: warm spare processes launched on each node beside its training ranks, for the mode in which the
            surviving ranks stay in their processes (``ffstate.inprocess``): a rank that dies is taken over by a
            spare of its node, restored from the node's slots.
        spare_nodes: whole nodes of spare processes launched after the training's nodes (``ffstate.inprocess``): a
            node that lost more ranks than it has spares (a node lost) moves to one, restored from the replicas.
        min_nodes: the fewest training nodes an ``ffstate.inprocess`` job may shrink to: a node that lost a rank
            with no spare left for it and no spare node free leaves the job, and the rest go on at the smaller
            world size from the copies (the resize of docs/elastic.md), like ``torchrun --nnodes MIN:MAX``. 0: never
            shrink; the job stops saying why (``NoSpareLeft``).
    """

    kernels: str = "auto"
    codec_threads: int = 0
    job_id: str = ""
    token: str = ""
    token_file: str = ""
    node_id: str = ""
    simulated_nodes: int = 0
    replicas: int = 1
    daemon_host: str = ""
    base_port: int = 7700
    start_daemon: bool = True
    daemon_memory_limit: str = ""
    daemon_idle_exit: float = 600.0
    daemon_nice: str = "0"
    daemon_cpus: str = ""
    max_lag: int = 1
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
    bulk_port: int = 0
    hang_action: str = "kill"
    hang_multiple: float = 10.0
    hang_floor: float = 60.0
    hang_ceiling: float = 600.0
    hang_startup: float = 600.0
    pause_limit: float = 3600.0
    straggler_ratio: float = 1.5
    persist_dir: str = ""
    persist_every: int = 10
    persist_keep: int = 2
    persist_nice: str = "idle"
    resize_rng: str = "refuse"
    drain_hold: float = 300.0
    spares: int = 1
    spare_nodes: int = 0
    min_nodes: int = 0

    def __post_init__(self) -> None:
        check_hang(self)
        check_persist(self)
        priority(self.daemon_nice, "daemon_nice")
        cpu_list(self.daemon_cpus, "daemon_cpus")
        check_bulk_port(self.bulk_port, "bulk_port (FFSTATE_BULK_PORT)")
        for size in ("daemon_memory_limit", "link_bandwidth"):  # a daemon's flag: refused here, not in its start
            if getattr(self, size) and not re.fullmatch(SIZE, getattr(self, size), re.I):
                raise ValueError(f"{size} is a size such as 512M or 8G, got {getattr(self, size)!r}")
        if self.resize_rng not in RESIZE_RNG:
            raise ValueError(f"resize_rng must be one of {RESIZE_RNG}, got {self.resize_rng!r}")
        if not 0 < self.drain_hold < math.inf:
            raise ValueError(f"drain_hold must be a finite number of seconds > 0, got {self.drain_hold}")
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
        if self.spares < 0 or self.spare_nodes < 0 or self.min_nodes < 0:
            raise ValueError(f"spares, spare_nodes and min_nodes must be >= 0, got {self.spares}, {self.spare_nodes}, "
                             f"{self.min_nodes}")
        if self.replicas < 0 or self.max_lag < 1 or self.simulated_nodes < 0:
            raise ValueError(f"replicas >= 0, max_lag >= 1, simulated_nodes >= 0; got {self.replicas}, "
                             f"{self.max_lag}, {self.simulated_nodes}")

    @classmethod
    def from_env(cls, **overrides: Any) -> "Config":
        """Defaults, then ``FFSTATE_<FIELD>`` variables, then ``overrides`` (``ffstate/envconfig.py``)."""
        from ffstate import envconfig

        return envconfig.from_env(cls, overrides)

    def replace(self, **changes: Any) -> "Config":
        return dataclasses.replace(self, **changes)


_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


SIZE = r"\s*([0-9]+(?:\.[0-9]*)?)\s*([KMGT]?)(i?B)?\s*"


def parse_bytes(text: str) -> int:
    """'8G', '512M', '1.5G' or a plain number of bytes."""
    m = re.fullmatch(SIZE, text, re.I)
    if not m:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (use e.g. 512M, 8G or a number of bytes)")
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])


def check_hang(cfg: "Config | DaemonConfig") -> None:
    """The watchdog's knobs, refused at once when they cannot work."""
    if cfg.hang_action not in HANG_ACTIONS:
        raise ValueError(f"hang_action must be one of {HANG_ACTIONS}, got {cfg.hang_action!r}")
    if not (cfg.hang_multiple > 1 and 0 < cfg.hang_floor <= cfg.hang_ceiling and cfg.hang_startup > 0):
        raise ValueError(f"hang_multiple > 1, 0 < hang_floor <= hang_ceiling, hang_startup > 0; got "
                         f"{cfg.hang_multiple}, {cfg.hang_floor}, {cfg.hang_ceiling}, {cfg.hang_startup}")
    if not cfg.straggler_ratio > 1:
        raise ValueError(f"straggler_ratio must be > 1, got {cfg.straggler_ratio}")
    if not 0 < getattr(cfg, "pause_limit", 1.0) < math.inf:
        raise ValueError(f"pause_limit must be a finite number of seconds > 0, got {cfg.pause_limit}")


def check_persist(cfg: "Config | DaemonConfig") -> None:
    """The persistent tier's knobs, refused at once when they cannot work."""
    if cfg.persist_every < 1 or cfg.persist_keep < 1:
        raise ValueError(f"persist_every and persist_keep must be >= 1, got {cfg.persist_every}, {cfg.persist_keep}")
    priority(cfg.persist_nice, "persist_nice")


def priority(value: int | str, what: str = "nice") -> int | str:
    """A CPU priority setting: ``"idle"`` (SCHED_IDLE) or a niceness 0-19 (an int, or its digits)."""
    if value == "idle":
        return value
    try:
        n = int(value)
    except (TypeError, ValueError):
        n = -1
    if not 0 <= n <= 19:
        raise ValueError(f"{what} must be a niceness 0-19 or 'idle', got {value!r}")
    return n


def cpu_list(value: str, what: str = "cpus") -> frozenset[int]:
    """A CPU list in taskset's syntax (``0-3,8``; "" is none: the process stays where it was started)."""
    cpus: set[int] = set()
    for part in value.split(",") if value.strip() else ():
        lo, sep, hi = part.strip().partition("-")
        try:
            first, last = int(lo), int(hi if sep else lo)
        except ValueError:
            first, last = 0, -1
        if not 0 <= first <= last < 1 << 16:
            raise ValueError(f"{what} is a CPU list such as '60-63' or '0,2,4-7', got {value!r}")
        cpus.update(range(first, last + 1))
    return frozenset(cpus)


def check_bulk_port(port: int, what: str) -> None:
    """A bulk socket's port: a TCP port, 0 (one the kernel picks) or -1 (none)."""
    if not -1 <= port <= 65535:
        raise ValueError(f"{what} takes a TCP port, 0 (one the kernel picks) or -1 (none); got {port}")


@dataclass(frozen=True)
class DaemonConfig:
    """A node daemon's configuration: ``ffstate serve --<field>`` for each field (``--peer`` for ``peers``);
    the token comes from ``--token-file`` or ``$FFSTATE_TOKEN``, never from the command line."""

    host: str = ""  # "": this node's address on the training's network, found as the workers find it
    port: int = 7700  # Config.base_port: where the workers look for their node's daemon; 0: any free port
    node_id: str = field(default_factory=lambda: socket.gethostname().split(".")[0] or "node")  # the host name
    peers: tuple[str, ...] = field(default=(), metadata={"flag": "--peer"})
    memory_limit: int = 0  # bytes; 0: a quarter of the host's RAM, or of its cgroup's limit where lower
    token: str = field(default="", metadata={"flag": None}, repr=False)
    tls_cert: Path | None = None
    tls_key: Path | None = None
    tls_client_ca: Path | None = None  # require client certificates signed by this CA (mutual TLS)
    tls_ca: Path | None = None  # the CA to verify peers' certificates when pushing to them
    idle_exit: float = 0.0  # seconds without a request or a commit, counted from when it listens; 0: never
    exit_when_empty: bool = False  # exit once a Drop leaves nothing attached or held (auto-started daemons)
    pid_file: Path | None = None
    # versions a replica can be stepped back: the workers' max_lag W, plus one (between a commit and its lag check
    # a holder can be W + 1 versions behind, and a lost node's replicas with it)
    keep_deltas: int = 2
    max_chunk_bytes: int = 32 << 20
    scalars_capacity: int = field(default=1 << 20, metadata={"flag": None})
    scheduler: str = "windows"  # windows: into the training's idle windows; naive: as soon as captured
    link_share: float = 0.5  # share of each link's estimated bandwidth replication may use
    link_bandwidth: int = 0  # bytes per second of the links when known; 0: measured from the pushes
    metrics_port: int = 0  # Prometheus /metrics on this port; 0: off
    bulk_port: int = 0  # pushes' and restores' chunks outside gRPC (ffstate/bulk/); 0: a port the kernel picks; -1: off
    slot_poll: float = 0.05  # seconds between looks at the slots without a ring of the doorbell
    max_pushes: int = 48  # pushes served at once (streamed or in one call); more are refused, so other calls get threads
    push_idle_timeout: float = 60.0  # seconds a push stream may wait between chunks before it is cut off
    staged_timeout: float = 300.0  # seconds a pushed version may wait for its Commit before it is discarded
    nice: int | str = 0  # the process's CPU priority: a niceness 0-19, or "idle" (SCHED_IDLE)
    cpus: str = ""  # the CPUs it runs on, in taskset's list syntax; "": where it was started
    # The watchdog (watchdog.py; Config's fields of the same names say what each does)
    hang_action: str = "kill"
    hang_multiple: float = 10.0
    hang_floor: float = 60.0
    hang_ceiling: float = 600.0
    hang_startup: float = 600.0
    straggler_ratio: float = 1.5
    # The persistent tier (Config's fields of the same names say what each does)
    persist_dir: Path | None = None
    persist_every: int = 10
    persist_keep: int = 2
    persist_nice: int | str = "idle"  # the flushing process's CPU priority below the daemon's: a niceness, or "idle"

    def __post_init__(self) -> None:
        check_hang(self)
        check_persist(self)
        if self.scheduler not in SCHEDULERS:
            raise ValueError(f"scheduler must be one of {SCHEDULERS}, got {self.scheduler!r}")
        if not 0 < self.link_share <= 1:
            raise ValueError(f"link_share must be in (0, 1], got {self.link_share}")
        if self.max_pushes < 1 or not self.push_idle_timeout > 0:
            raise ValueError(f"max_pushes >= 1 and push_idle_timeout > 0; got {self.max_pushes}, {self.push_idle_timeout}")
        if not 0 < self.slot_poll <= 3600:
            raise ValueError(f"slot_poll (--slot-poll) takes seconds in (0, 3600], got {self.slot_poll}")
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("tls_cert and tls_key (--tls-cert, --tls-key) go together")
        cpu_list(self.cpus, "cpus (--cpus)")
        check_bulk_port(self.bulk_port, "bulk_port (--bulk-port)")
        if self.tls_client_ca and not self.tls_cert:  # it would serve plaintext, asking no client for anything
            raise ValueError("--tls-client-ca needs --tls-cert and --tls-key: mutual TLS is TLS first")
        object.__setattr__(self, "peers", tuple(self.peers))

    @classmethod
    def from_args(cls, args: argparse.Namespace, **overrides: Any) -> "DaemonConfig":
        """The fields an argparse namespace names (``ffstate serve``'s), then ``overrides``."""
        values = {f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)}
        return cls(**{**values, **overrides})

    def to_args(self) -> list[str]:
        """The ``ffstate serve`` flags that give this configuration (fields at their defaults left out)."""
        args: list[str] = []
        default = DaemonConfig()
        for f in fields(self):
            flag = f.metadata.get("flag", "--" + f.name.replace("_", "-"))
            value = getattr(self, f.name)
            if flag is None or value == getattr(default, f.name):
                continue
            if isinstance(value, bool):
                args.append(flag)
            elif isinstance(value, tuple):
                args += [a for v in value for a in (flag, str(v))]
            else:
                args += [flag, str(value)]
        return args
