"""Running a training function under NVIDIA's resiliency extension (``nvidia_resiliency_ext.inprocess.Wrapper``),
with what ffstate adds: a rank assignment that keeps ranks on their nodes (``assignment.py``), a gloo abort that
works (``abort.py``), stores outside every rank (``store.py``), and a fresh process group on a fresh store prefix
each time the function is entered, made once every rank has arrived (``group.py``). The extension detects a dead
rank (its monitor processes), raises into every surviving rank's training thread, runs the abort, and calls the
function again in the same process; spares wait inside it until they are given a rank. ffstate's restore at entry
does the rest: every rank resumes at v*, the survivors and a same-node spare from their node's slots, a spare node
from the replicas. With no spare left for a node and ``Config.min_nodes`` set, the node leaves and the others go on
at the smaller world size: the entry's restore is then the resize of ``ffstate/elastic/`` (every rank's copy of v*,
resharded as DCP would).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import functools
import gc
import importlib
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from nvidia_resiliency_ext import inprocess
from nvidia_resiliency_ext.inprocess.rank_assignment import RankAssignment, RankAssignmentCtx, RankDiscarded
from nvidia_resiliency_ext.inprocess.state import Mode
from nvidia_resiliency_ext.inprocess.store import BarrierOverflow, TCPStore

from ffstate import inflight, placement
from ffstate.config import Config
from ffstate.daemon import running
from ffstate.errors import FFStateError
from ffstate.inprocess.abort import GroupAbort
from ffstate.inprocess.assignment import Assignment, Layout
from ffstate.inprocess.group import PG_TIMEOUT, make_group
from ffstate.inprocess.locks import ReleaseLoggingLocks
from ffstate.inprocess.raised import LIMIT, Repeats, entered, raised
from ffstate.inprocess.store import IDLE_EXIT, join, leave
from ffstate.inprocess.unwind import GRACE, UnwindDeadline, Unwound
from ffstate.job import job_id

log = logging.getLogger("ffstate.inprocess")

# The engine's intervals: how often its monitor process looks at its training process (a dead rank is found within
# about this), the slices its monitor thread waits on the store in (the wait returns as soon as an interruption is
# recorded, so a slice delays nothing but the thread's stop at the job's end; torch 2.13 logs each slice that ends
# empty: 1 s, not 50 ms), and when it gives up. Its hang timeouts are left long: ffstate's own watchdog finds a hung
# rank and kills it (docs/operations.md), which the engine then sees as a dead one.
_MS = datetime.timedelta(milliseconds=1)
WRAPPER = dict(monitor_thread_interval=1_000 * _MS, monitor_process_interval=50 * _MS, last_call_wait=20 * _MS,
               progress_watchdog_interval=100 * _MS, heartbeat_interval=500 * _MS, heartbeat_timeout=10_000 * _MS,
               soft_timeout=3_600_000 * _MS, hard_timeout=3_660_000 * _MS, barrier_timeout=3_720_000 * _MS,
               completion_timeout=3_720_000 * _MS, termination_grace_time=1_000 * _MS)
MONITOR_LOG = "engine-{rank}.log"  # each process's monitor process's log, in the run folder: its first line, its pid


@dataclass(frozen=True)
class Attempt:
    """What the training function is told at each entry: its ``rank`` and the ``world`` size, the engine's
    ``iteration`` (0 at the start, then one more at each restart), this process (``process``: its rank at launch)
    and the processes lost so far (``failures``)."""

    rank: int
    world: int
    iteration: int
    process: int
    failures: tuple[int, ...]


class NodeSpares(RankAssignment):
    """The engine's rank assignment: ``assignment.Assignment``, for the processes' ranks as the engine numbers them
    (the live processes in launch order)."""

    def __init__(self, layout: Layout, repeats: Repeats):
        self.assignment = Assignment.start(layout)
        self.repeats = repeats
        self.restarts = -1  # the first call assigns the launch's ranks; each later one is a restart

    def __call__(self, ctx: RankAssignmentCtx) -> RankAssignmentCtx:
        a, state = self.assignment, ctx.state
        lost = {a.alive[r] for r in ctx.terminated_ranks}
        self.restarts += 1
        if self.restarts:  # the iteration that ended: its records (TrainingRaised)
            self.repeats.after(state.iteration, ctx.store.get_interruption_records(), lost)
        me = state.initial_rank
        if me in lost:
            raise RankDiscarded(f"process {me} was reported lost")
        if lost:
            world = a.world
            a.lose(lost)  # NoSpareLeft: every process stops, saying so
            if a.world < world and me == a.alive[0]:
                log.warning("processes %s lost with no spare left for their node(s): the job goes on at world size "
                            "%d (was %d) on machines %s, resized from the copies", sorted(lost), a.world, world,
                            a.node_machine)
        rank = a.rank_of(me)
        ctx.state = dataclasses.replace(state, rank=a.alive.index(me), world_size=len(a.alive),
                                        mode=Mode.ACTIVE if rank is not None else Mode.INACTIVE, active_rank=rank,
                                        active_world_size=a.world)
        ctx.terminated_ranks = set()
        return ctx


class EngineStore(TCPStore):
    """The engine's store, with the ranks of its termination barrier taken as numbers. The extension (0.4.1, and its
    main branch in 2026-08) passes them there as the store's bytes when its siblings' heartbeat check finds a rank
    whose monitor process reported nothing (one lost with its monitor, as a machine's loss takes both, or just as it
    entered the function): the barrier records ``b'4'``, and every process's exit then fails to parse it
    (``ValueError``) and hangs."""

    def termination_barrier(self, ranks, *args, **kwargs):
        return super().termination_barrier([int(r) for r in ranks], *args, **kwargs)

    def initial_barrier(self, *args, **kwargs):
        try:
            return super().initial_barrier(*args, **kwargs)
        except BarrierOverflow as e:  # more arrivals than processes: an earlier launch's, kept by the stores' host
            raise FFStateError(f"the job's stores at MASTER_PORT + 1 hold an earlier launch's engine keys ({e}): a "
                               "launch some of whose processes never left the engine (killed) keeps its stores' host "
                               f"up to {IDLE_EXIT:.0f} s after their last heartbeat; launch again once it has gone "
                               "(docs/inprocess.md), or on another MASTER_PORT") from None


def restartable(fn: Callable[..., Any] | None = None, *, config: Config | None = None, backend: str | None = None,
                unwind_grace: float = GRACE, max_raises: int = LIMIT):
    """Runs a training function so that, when a rank dies, the other ranks stay in their processes: the function is
    entered again (a fresh process group each time), a warm spare takes the dead rank's place, and every rank
    resumes at the step the job reached from ffstate's copies.

    The function takes an ``Attempt`` first; it builds what depends on the process group (``DistributedDataParallel``
    around a model built once, outside it) and trains inside ``ffstate.replicate(...)``. Launch every process of
    the job (training ranks and spares, node by node) with ``RANK``, ``WORLD_SIZE`` (all of them; under ``srun``,
    ``SLURM_PROCID`` and ``SLURM_NTASKS``), ``MASTER_ADDR`` and ``MASTER_PORT`` set, by a launcher that does not stop
    the others when one dies (Slurm's ``srun``, or one process each started by hand): torchrun's agent does. Spares
    and spare nodes: ``Config.spares`` and ``Config.spare_nodes``; nodes: ``SLURM_NNODES`` (or ``NNODES``), or
    ``Config.simulated_nodes`` on one machine; with ``Config.min_nodes``, a node with no spare left leaves the job and
    the others go on at the smaller world size (``Attempt.world`` says it; the loop's data must follow it).
    ``unwind_grace``: seconds a survivor's training thread may take to leave its step after its process group was
    aborted; one still inside a wait the abort did not end (gloo's queued sends) then ends its process, which the
    job survives as any rank's death (``ffstate/inprocess/unwind.py``), rather than hold every rank for the group's
    30-minute timeout. ``max_raises``: restarts in a row for exceptions the function raised with no process lost
    (each entry within 10 minutes) before the job stops (``ffstate/inprocess/raised.py``): such an exception is
    most often the code's own, and raises again at every entry.

    Returns:
        The function's return value on a training rank; None on a process that stayed a spare.

    Raises:
        FFStateError: the launch does not match the layout (a variable missing, processes that do not divide).
        raised.TrainingRaised: the function raised at ``max_raises`` entries in a row, with no process lost.
        assignment.NoSpareLeft: a node lost a rank with no spare left for it, no spare node free, and the job may not
            shrink (``Config.min_nodes``).
    """
    def wrap(f: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(f)
        def run(*args: Any, **kwargs: Any) -> Any:
            return _run(f, args, kwargs, config or Config.from_env(), backend, unwind_grace, max_raises)

        return run

    return wrap(fn) if fn is not None else wrap


def layout_of(cfg: Config, processes: int) -> Layout:
    """The launch's layout from the configuration and the environment.

    Raises:
        FFStateError: the numbers do not fit together.
    """
    if cfg.simulated_nodes:
        nodes = cfg.simulated_nodes
    else:
        machines = int(os.environ.get("SLURM_NNODES") or os.environ.get("NNODES") or 1 + cfg.spare_nodes)
        nodes = machines - cfg.spare_nodes
    try:
        return Layout.of(processes, nodes, cfg.spares, cfg.spare_nodes, cfg.min_nodes)
    except ValueError as e:
        raise FFStateError(f"ffstate.inprocess: {e} (WORLD_SIZE counts every process launched, spares included; "
                           "Config.spares per node, Config.spare_nodes, and the nodes from SLURM_NNODES, NNODES or "
                           "Config.simulated_nodes)") from None


def _run(fn: Callable[..., Any], args: tuple, kwargs: dict, cfg: Config, backend: str | None,
         unwind_grace: float, max_raises: int) -> Any:
    for var, slurm in (("RANK", "SLURM_PROCID"), ("WORLD_SIZE", "SLURM_NTASKS")):  # srun sets these
        if var not in os.environ and slurm in os.environ:
            os.environ[var] = os.environ[slurm]
    missing = [v for v in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if v not in os.environ]
    if missing:
        raise FFStateError(f"ffstate.inprocess: {', '.join(missing)} not set: launch each process (training ranks "
                           "and spares) with RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT (srun, or by hand; "
                           "docs/inprocess.md)")
    if dist.is_available() and dist.is_initialized():
        raise FFStateError("ffstate.inprocess makes the process group itself at each entry; do not call "
                           "init_process_group before")
    process, processes = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    layout = layout_of(cfg, processes)
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    run_dir = running.run_dir(job_id(cfg))
    # Counted in until the engine returns or gives up: the stores' host goes once every process is out.
    app_store, beating = join(host, port, run_dir, local=placement.is_local(host))
    known_lost: list[int] = []  # the processes this one knew lost when it left (the host counts them out too)
    try:
        return _engine(fn, args, kwargs, cfg, backend, unwind_grace, max_raises, layout, run_dir, app_store,
                       known_lost)
    finally:
        leave(app_store, process, known_lost, beating)


def _engine(fn: Callable[..., Any], args: tuple, kwargs: dict, cfg: Config, backend: str | None,
            unwind_grace: float, max_raises: int, layout: Layout, run_dir: Path, app_store: Any,
            known_lost: list[int]) -> Any:
    process, processes = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    # A survivor still in its step UnwindDeadline's grace after an abort (a wait in C++ the abort did not end) ends
    # itself rather than hold every rank until the group's timeout (ffstate/inprocess/unwind.py).
    deadline = UnwindDeadline(unwind_grace, what=f"process {process}")
    abort = GroupAbort(PG_TIMEOUT, unwind=deadline)  # an aborted group is held that long, off the training's thread
    assignment = NodeSpares(layout, Repeats(app_store, max_raises))
    # A spare waits warm: what a first entry imports is imported now (DistributedDataParallel's first construction
    # imports torch._dynamo, 1.4 s here; torch.distributed.optim scripts its functional optimizers, 0.4 s; ffstate's
    # restore and capture 0.45 s).
    for module in ("torch._dynamo", "torch.distributed.tensor", "torch.distributed.optim", "ffstate.trainer"):
        importlib.import_module(module)

    # The engine collects garbage until none is left between two entries; with torch loaded that took 0.5-0.7 s
    # per restart here. What exists now lives as long as the process: out of the collector's way.
    gc.collect()
    gc.freeze()
    with _without("LOCAL_RANK"):  # the extension >= 0.5 adds GPU health checks where it is set; none on a CPU
        wrapper = inprocess.Wrapper(store_factory=EngineStore,
                                    store_kwargs={"host_name": host, "port": port + 1, "world_size": processes},
                                    abort=abort, rank_assignment=assignment, health_check=None,
                                    finalize=inprocess.Compose(ReleaseLoggingLocks(), Unwound(deadline)),
                                    monitor_process_logfile=str(run_dir / MONITOR_LOG), **WRAPPER)
    per = layout.per_node

    def attempt(call_wrapper: Optional[inprocess.CallWrapper] = None) -> Any:
        rank, world, it = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), call_wrapper.iteration
        os.environ.update(FFSTATE_ATTEMPT=str(it), LOCAL_WORLD_SIZE=str(per), GROUP_RANK=str(rank // per),
                          LOCAL_RANK=str(rank % per))
        deadline.what = f"rank {rank} (process {process}, iteration {it})"
        if cfg.simulated_nodes:  # after a shrink, fewer nodes than launched (ffstate.replicate reads it)
            os.environ["FFSTATE_SIMULATED_NODES"] = str(world // per)
        start = time.perf_counter()
        inflight.reset()  # this entry's collectives may be waited on again
        # Once every rank has arrived, in a wait the engine's restart reaches (ffstate/inprocess/group.py).
        abort.opened(make_group(backend, app_store, it, rank, world))
        failures = tuple(assignment.assignment.failures)
        if it:
            log.warning("rank %d (process %d): restarted in this process (iteration %d; processes lost so far: %s); "
                        "process group again in %.0f ms", rank, process, it, list(failures),
                        (time.perf_counter() - start) * 1e3)
        entered(app_store, it)
        try:
            got = fn(Attempt(rank, world, it, process, failures), *args, **kwargs)
        except Exception as e:
            raised(app_store, it, rank, e)  # what every process's TrainingRaised names
            raise
        try:
            dist.destroy_process_group()
        finally:
            abort.opened({})  # gone: an abort at the job's end (a process that left first) has nothing of it to end
        return got

    # The extension hands its CallWrapper to the parameter annotated with its class, which it reads as a class, not
    # as the string this module's annotations are.
    attempt.__annotations__["call_wrapper"] = Optional[inprocess.CallWrapper]
    # DDP's collectives through ffstate: waits that the abort ends (ffstate/inflight.py); NCCL's own abort works.
    inflight.enable(backend == "gloo")
    try:
        with _environment_kept(ATTEMPT_VARIABLES):  # the process after the engine is not one of its ranks any more
            return wrapper(attempt)()
    finally:
        deadline.unwound()  # the engine returned or gave up: this thread is out of every step
        inflight.enable(False)
        known_lost += assignment.assignment.failures


# What each entry sets for ffstate.replicate; put back as it was when the engine returns or gives up (an error that
# leaves replicate later in the process is then not taken for an engine's rank, which stays watched for hangs).
# RANK and WORLD_SIZE too: the extension leaves them the last entry's ("None" on a process that stayed a spare).
ATTEMPT_VARIABLES = ("FFSTATE_ATTEMPT", "LOCAL_WORLD_SIZE", "GROUP_RANK", "LOCAL_RANK", "FFSTATE_SIMULATED_NODES",
                     "RANK", "WORLD_SIZE")


@contextlib.contextmanager
def _environment_kept(names: tuple[str, ...]):
    saved = {n: os.environ.get(n) for n in names}
    try:
        yield
    finally:
        for n, value in saved.items():
            if value is None:
                os.environ.pop(n, None)
            else:
                os.environ[n] = value


@contextlib.contextmanager
def _without(name: str):
    saved = os.environ.pop(name, None)
    try:
        yield
    finally:
        if saved is not None:
            os.environ[name] = saved
