"""``ffstate.replicate(model, optimizer, ...)``: the context manager around a training loop, and the one
place that ties capture, the razor, the slots, the lag policy, the pacing signals and recovery together;
nothing below imports it.

Entry finds (or starts) the node's daemon and restores the state at v* when copies exist (``recovery``);
``commit(step)`` captures the state, keeps this rank's share of it (the razor), packs it into the rank's
shared-memory slot (one copy) and checks the replication lag; a clean exit waits for the replicas
(bounded), publishes the job's global committed version and tells the daemons the job is over.
"""

from __future__ import annotations

import contextlib
import faulthandler
import logging
import math
import operator
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import torch

from ffstate import capture, extras, layout, persist, placement, razor, recovery, shm, wire
from ffstate.commit import SlotWriter
from ffstate.config import Config
from ffstate.daemon import launch
from ffstate.daemon.persister import FINAL_WAIT
from ffstate.elastic import rules
from ffstate.elastic.keys import KEYS, keys_tensor
from ffstate.elastic.worker import ShapeWatch
from ffstate.errors import FFStateError, LayoutChanged, ReplicaError
from ffstate.job import Job
from ffstate.lag import LagWatch
from ffstate.scheduling.pacing import PacingSignals
from ffstate.persist import keys as persist_keys
from ffstate.razor_verify import RazorVerifier
from ffstate.reports import NodeReport, Stats

log = logging.getLogger("ffstate.trainer")

SLOT_WAIT = 2.0  # seconds a block-policy commit waits for the daemon to read the slot it overwrites


def replicate(model: torch.nn.Module, optimizer: torch.optim.Optimizer, lr_scheduler: Any = None,
              extra: dict | None = None, config: Config | None = None) -> "Replicated":
    """Replicates a training job's state to peers and restores it after a restart.

    Args:
        model: the model (plain, DDP-wrapped, ...); its ``state_dict()`` is captured and restored in place.
        optimizer: its optimizer; a ``ZeroRedundancyOptimizer`` is captured per rank (its shard and
            its own ``param_groups``).
        lr_scheduler: optional; anything with ``state_dict``/``load_state_dict``.
        extra: optional dict of plain values and tensors (e.g. the data loader's position), captured
            at each commit and updated in place on restore.
        config: knobs; default ``Config.from_env()`` (``FFSTATE_*`` variables).

    Returns:
        The context manager; use ``with ... as ff`` and ``ff.start_step`` / ``ff.commit(step)``; ``ff.pause()``
        around work between commits that is not a step (an evaluation), which the node's watchdog must not
        take for a hang.
    """
    return Replicated(model, optimizer, lr_scheduler, extra, config or Config.from_env())


class Replicated:
    """See ``replicate``. Attributes after entry: ``start_step``, ``restored`` (a ``recovery.Restored``
    or None), ``topology``, ``extra``, ``global_committed`` (the job's global committed version, as
    last seen: the minimum over ranks of what every holder has)."""

    def __init__(self, model, optimizer, lr_scheduler, extra, cfg: Config):
        self.model, self.optimizer, self.lr_scheduler, self.extra, self.cfg = model, optimizer, lr_scheduler, extra, cfg
        self.start_step = 0
        self.restored: recovery.Restored | None = None
        self._restore_report: tuple | None = None  # for the daemon, at the next attach (its metrics, `ffstate status`)
        self._slots: shm.Slots | None = None
        self._writer: SlotWriter | None = None
        self._last, self._t0 = 0, time.perf_counter()
        self._paused_until = 0.0
        self._pauses: list[float] = []  # the deadlines of the pauses open
        self._stacks = None  # the file faulthandler writes this process's stacks to, on the watchdog's SIGUSR1
        self._keys: dict | None = None  # the state's DCP key map (persist/keys.py), carried by every commit
        self._keys_tensor: torch.Tensor | None = None

    @property
    def global_committed(self) -> int:
        return self.job.global_committed

    # ------------------------------------------------------------ entry and exit

    def __enter__(self) -> "Replicated":
        self.job = job = Job(self.cfg, capture.model_device(self.model))
        self.rank, self.world, self.topology = job.rank, job.world, job.topology
        groups = razor.infer(self.model, self.optimizer, job.world, self.cfg)
        self._check_state(groups)
        self.daemon = launch.node_daemon(job)
        launch.check_persist(job, self.daemon)
        holder_nodes = placement.holder_nodes(job.topology.node, job.topology.num_nodes, self.cfg.replicas)
        self.holders = job.daemon_addresses(holder_nodes)
        launch.check_holders(job, holder_nodes, self.holders)
        self.razor = RazorVerifier(job, groups)
        self.pacing = PacingSignals(self.model, self.cfg, job.rank, job.world, bool(self.holders))
        self.lag = LagWatch(job, lambda: self.daemon, self._daemon_lost)
        self.shape = ShapeWatch(job, lambda: self.daemon, self.pause, self.flush)
        self._register_stacks()
        log.info("rank %d: razor: %s", job.rank, groups.reason if groups else razor.why_not(job.world, self.cfg))
        got = recovery.restore(job, self.daemon, self.holders, groups.ranks if groups else (), self._load, self._t0,
                               resize=self._resize_restore, map_location=capture.placement(self.model))
        if got is not None:  # the slots' versions past v* go at attach: the steps about to be redone
            self.restored, self.start_step, self._last, self.lag.replicated = got, got.version, got.version, got.version
            self._restore_report = (got.version, got.steps_lost, got.seconds, got.entry_seconds, got.from_world)
            self.shape.resized(got.from_world, got.version)  # the old shape's copies go once this shape's are safe
        return self

    def _check_state(self, groups: razor.Groups | None) -> None:
        """What can be known before training starts, refused now: an extra whose ``state_dict()`` fails, a value
        the codec cannot hold, a razor declaration that names nothing, state a restore could not put back; each error
        names the entry's path."""
        capture.check_restorable(self.model, self.optimizer)
        state = capture.capture(self.model, self.optimizer, self.lr_scheduler, self.extra)
        layout.describe(state)
        if groups is not None and self.cfg.razor_identical and (lost := razor.unmatched(state, groups.prefixes)):
            raise FFStateError(f"Config.razor_identical names {lost}, which match no entry of the state; its entries "
                               f"are under {sorted({p.split('/')[0] for p in state})} (e.g. model, optim/state)")
        if self.extra is not None:
            extras.warn_pitfalls(self.extra, self.rank)

    def _resize_restore(self, olds: list[int], disk: Any, v_here: int, seen: int) -> Any:
        """A restore from copies made at other world sizes (``ffstate/elastic/``; imported here, at a resize:
        it brings torch.distributed.checkpoint, a second of every worker's start otherwise)."""
        from ffstate.elastic import resize

        return resize.restore(self.job, self.daemon, olds, disk, v_here, seen, self._reshard, self._t0)

    def _reshard(self, states: dict[int, Any], prefer: list[int]) -> None:
        """Copies made at another world size, into this run's objects (``ffstate/elastic/``)."""
        from ffstate.elastic import resize

        resize.load(self.job, self.model, self.optimizer, self.lr_scheduler, self.extra, self.cfg, states, prefer)

    def _load(self, state: dict) -> None:
        capture.restore(self.model, self.optimizer, self.lr_scheduler, self.extra, state)
        if self.cfg.shadow_ddp_step and isinstance(self.model, torch.nn.parallel.DistributedDataParallel):
            capture.shadow_step_on_first_forward(self.model)

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:  # torchrun restarts the group: leave every copy where it is
            alone = "" if self.job.watched_after_error else " (one process, no launcher: not watched for hangs)"
            self._close(self.job.watched_after_error, f"leaving with {_said(exc_type, exc)}; replicas kept for the "
                        f"restart{alone}")
            return
        lag, job = self.lag, self.job
        try:
            self.flush()  # the last commit published (staged on a GPU, it lands after commit returns)
        except Exception as e:  # noqa: BLE001 (its copy failed: the version before it stays the last published)
            log.warning("rank %d: the last commit (step %d) was not published: %s: %s", self.rank, self._last,
                        type(e).__name__, e)
        if self.holders and self._slots is not None:
            lag.wait(self._last, self.cfg.exit_timeout, slots=self._slots)
            if lag.replicated < self._last:
                log.warning("rank %d: leaving with replicas at step %d, the last commit is %d", self.rank,
                            lag.replicated, self._last)
        version = lag.replicated if self.holders else self._last
        lag.publish(version)
        reached = job.barrier("exit")
        try:
            lag.publish(version)
            log.info("rank %d: job %s done at step %d; global committed version %d", self.rank, job.job, self._last,
                     job.global_committed)
            razor_info = self.razor.finished(self._slots.manifest) if self._slots is not None else {}
            job.record({"event": "finished", "step": self._last, "global_committed": job.global_committed,
                        **razor_info})
            if self.topology.first_on_node:
                try:  # the daemon writes the job's last versions to its persistent tier first
                    self.daemon.drop(job.job, timeout=FINAL_WAIT + 30)
                except ReplicaError as e:
                    log.warning("rank %d: could not tell the daemon the job ended: %s", self.rank, e)
            if self.cfg.persist_dir:  # once every node's daemon wrote its last versions (FINAL_WAIT + 30 s each)
                _say_persisted(job, self.cfg.persist_dir, self._last, job.barrier("dropped", FINAL_WAIT + 30))
            self._close()
        finally:  # the last store call: rank 0, which may host the store, returns after the others' last (a node's
            # daemon may take FINAL_WAIT + 30 s to write the job's last versions)
            job.leave(reached - 1, self.cfg.exit_timeout + (FINAL_WAIT + 30 if self.cfg.persist_dir else 0))

    def _register_stacks(self) -> None:
        """Every thread's stack to ``stacks-rank<R>.txt`` in the job's run folder on SIGUSR1, which the node's
        daemon sends before it kills a hung rank (``daemon/watchdog.py``); not where the process handles SIGUSR1
        already."""
        if self.cfg.hang_action == "off":
            return
        if signal.getsignal(signal.SIGUSR1) not in (signal.SIG_DFL, signal.SIG_IGN, None):  # IGN: an earlier entry's
            log.warning("rank %d: SIGUSR1 has a handler already: a hang will be acted on without this rank's stacks",
                        self.rank)
            return
        path = self.job.run_dir / f"stacks-rank{self.rank}.txt"
        self._stacks = open(path, "a")
        faulthandler.register(signal.SIGUSR1, file=self._stacks, all_threads=True, chain=False)

    @contextlib.contextmanager
    def pause(self, seconds: float | None = None) -> Iterator[None]:
        """Declares work between commits that is not a training step (an evaluation, a checkpoint, a long data
        reshuffle): not a hang while it lasts, up to ``seconds`` (default ``Config.pause_limit``, an hour); the
        deadline counts again from its end. Pauses nest, and may end in any order."""
        limit = self.cfg.pause_limit if seconds is None else seconds
        if not (isinstance(limit, (int, float)) and 0 < limit < math.inf):
            raise FFStateError(f"pause(seconds={seconds!r}): seconds must be a finite number > 0 (default "
                               f"Config.pause_limit, {self.cfg.pause_limit} s)")
        until = time.time() + limit
        self._pauses.append(until)  # those open, in whatever order they end (a drain's, a user's on another thread)
        self._paused_until = max(self._pauses)
        if self._slots is not None:
            self._slots.set_paused(self._paused_until)
        try:
            yield
        finally:
            self._pauses.remove(until)
            self._paused_until = max(self._pauses, default=0.0)
            if self._slots is not None:
                self._slots.set_paused(self._paused_until)

    def _close(self, watched: bool = True, said: str = "") -> None:
        if self._slots is not None:  # first: the daemon asks for stacks only where the record names a file, and a
            self._slots.set_left(watched)  # restart raised into the log line below must not leave the step's deadline
        log.warning("rank %d: %s", self.rank, said) if said else None
        if self._stacks is not None:
            _stop_stacks()
            self._stacks.close()
            self._stacks = None
        self.pacing.close()
        if self._writer is not None:
            self._writer.close()
        if self._slots is not None:
            self._slots.close()
        self.job.close()

    # ------------------------------------------------------------ the training loop's side

    def commit(self, step: int) -> None:
        """Captures the state after ``step`` into shared memory; once this returns it survives this process. A state
        on a GPU is staged: this returns once the copy into the slot is queued, and the version survives the process
        once it has landed (``flush``), a device-to-host copy later; the next commit waits for it.

        Raises:
            FFStateError: ``step`` is not an integer, or not larger than the last committed one.
        """
        try:
            step = operator.index(step)  # an int, a numpy integer, a 0-d integer tensor: the version is an int
        except TypeError:
            raise FFStateError(f"commit(step): the step must be an integer, got {type(step).__name__} {step!r}") from None
        if step <= self._last:
            hint = ""
            if self._last == self.start_step:  # this process's first commit: the loop does not count from start_step
                what = "the step restored" if self.start_step else "nothing restored"
                hint = (f"; ff.start_step is {self.start_step} ({what}): the first commit after entry is of a later "
                        "step (for step in range(ff.start_step + 1, ...))")
            raise FFStateError(f"commit({step}) after commit({self._last}): steps must increase{hint}")
        began = time.perf_counter()
        with layout.gc_paused():  # the state's containers, dropped at the end: no collection over the model's objects
            state = capture.capture(self.model, self.optimizer, self.lr_scheduler, self.extra)
            state[KEYS[0]] = {KEYS[1]: self._key_map()}  # so that any copy can be resharded (ffstate/elastic/)
            if self._last == self.start_step:  # this process's first commit
                rules.warn_early(self.job, state, self.extra)
            state = self.razor.shard(state, step, self._new_layout, self._razor_counters)
            if self._writer is None:
                self._attach(state)
            block = self.holders and self.cfg.lag_policy == "block"
            # The daemon reads a slot within milliseconds; seconds without it mean it is overloaded or gone.
            try:
                self._writer.commit(state, step, wait=SLOT_WAIT if block else 0.0)
            except LayoutChanged as e:  # an extra whose state changes structure, e.g.: new slots, a full version
                self._relayout(state, step, e)
            del state
        self._last = step
        self.pacing.on_commit()
        if self.holders:
            self.lag.after_commit(step, self._slots, self._slots.wait_timed_out)
        self.shape.after_commit(step, self._slots, self.lag.replicated if self.holders else step)
        if self._slots is not None:
            self._slots.set_commit_seconds(time.perf_counter() - began)

    def flush(self) -> None:
        """Returns once the last commit is in its slot, published (a staged commit lands after ``commit`` returns)."""
        if self._writer is not None:
            self._writer.flush()

    def _key_map(self) -> torch.Tensor:
        """The DCP key map of the state (made at the first commit, when the optimizer has its state; again at a new
        layout), as the tensor each commit carries."""
        if self._keys_tensor is None:
            self._keys = persist_keys.key_map(self.model, self.optimizer)
            self._keys_tensor = keys_tensor(self._keys)
        return self._keys_tensor

    def stats(self, wait: float = 0.0) -> Stats:
        """What this rank's node daemon reports about it (``reports.Stats``), after waiting up to ``wait`` seconds
        for the replicas to catch up with the last commit."""
        if wait and self.holders and self._slots is not None:
            self.lag.wait(self._last, wait, slots=self._slots)
        report = wire.from_proto(self.daemon.inventory(self.job.job), NodeReport)
        return Stats.of(report, self.rank, self.world, self._last)

    # ------------------------------------------------------------ slots and daemon

    def _attach(self, state: dict) -> None:
        manifest = layout.describe(state)
        # After a restore to v* the steps past it are redone: the daemon un-commits them before it resets
        # replication, so that none of them is replicated from the slots of the run that died.
        resp = self.daemon.attach(self.job.job, self.rank, self.world, manifest, holders=self.holders,
                                  razor=self.razor.report(manifest), discard_after=self._last,
                                  persist_keys=persist_keys.to_json({**self._keys, "timeline": self.job.generation}))
        self._slots = shm.Slots(list(resp.slot_paths), manifest)
        self._writer = SlotWriter(self._slots)
        self._slots.set_razor_counters(self.razor.verified, self.razor.mismatches)
        if self._restore_report is not None:
            self._slots.record_restore(*self._restore_report)
            self._restore_report = None
        self._slots.set_worker(os.getpid(), self._stacks.name if self._stacks is not None else "")
        if self._paused_until:
            self._slots.set_paused(self._paused_until)
        self.pacing.attach(self._slots)

    def _detach(self) -> None:
        if self._slots is not None:
            self.pacing.attach(None)
            if self._writer is not None:
                self._writer.close()
            self._slots.close()
            self._slots = self._writer = None

    def _new_layout(self) -> None:
        """The razor's plan changed: new slots and full versions from the next commit."""
        if self._slots is not None:
            self._detach()
            self.daemon.drop(self.job.job, self.rank, self.world)

    def _relayout(self, state: dict, step: int, change: LayoutChanged) -> None:
        """The state's structure changed since the slots were made: new slots for the new layout, and a full
        version for the holders (the copies of earlier steps stay restorable where they are)."""
        start = time.perf_counter()
        self._new_layout()
        self._keys_tensor = None  # the key map of the new layout
        razor.own(state)[KEYS[0]][KEYS[1]] = self._key_map()
        self._attach(state)
        self._writer.commit(state, step)
        nbytes = self._slots.manifest.nbytes
        log.warning("rank %d: %s at step %d: new slots and a full version (%.1f MB) for its holders; %.0f ms",
                    self.rank, change, step, nbytes / 1e6, (time.perf_counter() - start) * 1e3)
        self.job.record({"event": "layout-changed", "step": step, "change": str(change), "bytes": nbytes})

    def _razor_counters(self, verified: int, mismatches: int) -> None:
        if self._slots is not None:
            self._slots.set_razor_counters(verified, mismatches)

    def _daemon_lost(self, error: Exception) -> None:
        """The node's daemon stopped answering while training runs: bring one back and re-attach.

        The slots this rank wrote died with it (the new daemon makes new ones); the holders keep their
        replicas, and the new daemon re-seeds them with a full version at the next commit.
        """
        log.error("rank %d: the node's daemon is gone (%s); restarting it and re-attaching", self.rank, error)
        self._detach()
        self.daemon = launch.node_daemon(self.job, lost=self.daemon.address)
        self.lag.restart()  # its holders get full versions again
        self.job.record({"event": "daemon-restarted", "step": self._last})


def _say_persisted(job: Job, persist_dir: str, last: int, reached: int) -> None:
    """Rank 0, at a clean exit, once ``reached`` ranks saw their node's daemon write the job's last versions:
    whether the last step is complete in the persistent tier."""
    if job.rank != 0:
        return
    done = persist.complete_versions(Path(persist_dir) / job.job, job.world)
    if last in done:
        log.info("rank 0: the last step, %d, is in the persistent tier (%s)", last, persist_dir)
    else:
        late = f"; {job.world - reached} rank(s) had not come to the end's barrier (a node's daemon still writing, " \
            "or a rank lost after the job's end)" if reached < job.world else ""
        log.warning("rank 0: the last step, %d, is not complete in the persistent tier (newest complete: %s)%s; see "
                    "the daemons' logs", last, done[-1] if done else "none", late)


def _stop_stacks() -> None:
    """faulthandler off SIGUSR1, which is then ignored: the daemon may signal a rank for stacks just after it left
    its step, and the default action would end an in-process survivor (the next entry registers again)."""
    faulthandler.unregister(signal.SIGUSR1)
    if threading.current_thread() is threading.main_thread():  # where signal handlers may be set
        signal.signal(signal.SIGUSR1, signal.SIG_IGN)

def _said(exc_type: type, exc: BaseException | None) -> str:
    """An exception for a log line: its type and the first line of its message (bounded)."""
    try:
        text = str(exc).strip() if exc is not None else ""
    except Exception:  # noqa: BLE001 (a message that cannot be made must not hide the exception leaving)
        text = ""
    first = text.splitlines()[0][:300] if text else ""
    return f"{exc_type.__name__} ({first})" if first else exc_type.__name__
