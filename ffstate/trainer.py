"""``ffstate.replicate(model, optimizer, ...)``: the context manager around a training loop.

On entry it finds (or starts) the node's daemon, negotiates the consistent version v* with the
other ranks (I3), restores model, optimizer, LR scheduler, RNG states and extras bit for bit when
replicas exist, and sets ``start_step``. ``commit(step)`` packs the state into the rank's
shared-memory slot (one copy) and returns; the daemon replicates it. A clean exit waits for the
replicas (bounded) and tells the daemons the job is over. This is the one place that ties capture,
codec, placement, recovery and the daemons together; nothing below imports it.
"""

from __future__ import annotations

import json
import logging
import os
import re
import secrets
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ffstate import capture, layout, placement, profiling, razor, recovery, shm
from ffstate._proto import replica_pb2 as pb
from ffstate.client import Client
from ffstate.config import Config
from ffstate.errors import FFStateError, ReplicaError, ReplicaUnavailable

log = logging.getLogger("ffstate.trainer")

SLOT_WAIT = 2.0  # seconds a block-policy commit waits for the daemon to read the slot it overwrites
# Seconds between a rank's publications of its replicated version through the job's store (three store
# calls; at every lag check they cost a commit 2-13 ms on a 2-core node). Also published on lag and exit.
PUBLISH_EVERY = 5.0


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
        The context manager; use ``with ... as ff`` and ``ff.start_step`` / ``ff.commit(step)``.
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
        self._last = 0
        self._replicated = 0
        self._published = 0.0  # time.monotonic() of the last publication of self._replicated
        self.global_committed = 0  # min over ranks of the version all their holders have
        self._clients: dict[str, Client] = {}
        self._t0 = time.perf_counter()
        self.razor_groups: razor.Groups | None = None
        self.razor_plan: razor.Plan | None = None
        self.razor_verified = 0  # verifications done by the group
        self.razor_mismatches = 0  # entries found to differ across the group (each now replicated per rank)
        self._razor_excluded: set[str] = set()
        self._commits = 0
        self._state_bytes = 0

    # ------------------------------------------------------------ entry and exit

    def __enter__(self) -> "Replicated":
        cfg = self.cfg
        if dist.is_available() and dist.is_initialized():
            rank, world = dist.get_rank(), dist.get_world_size()
            self._store = dist.distributed_c10d._get_default_store()
        elif int(os.environ.get("WORLD_SIZE", "1")) > 1:
            raise FFStateError("WORLD_SIZE > 1 but no process group: call torch.distributed.init_process_group() "
                               "before ffstate.replicate(...)")
        else:
            rank, world, self._store = 0, 1, None
        _warn_about_torchrun_restarts()
        self.rank, self.world = rank, world
        self.job = _job_id(cfg)
        self.token = cfg.token or _default_token()
        self.topology = placement.topology(rank, world, cfg)
        self._attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        self._prefix = f"ffstate/{self.job}/{self._generation()}"
        self._run_dir = Path(tempfile.gettempdir()) / f"ffstate-{self.job}"
        self._run_dir.mkdir(exist_ok=True)
        self.daemon = self._node_daemon()
        self.holders = self._holder_addresses()
        self.razor_groups = razor.infer(self.model, self.optimizer, world, cfg)
        self._marks = self._comm_marks(rank)
        self._profiler = self._step_profiler()
        log.info("rank %d: razor: %s", rank, self.razor_groups.reason if self.razor_groups else
                 razor.why_not(world, cfg))
        self._restore()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:  # torchrun restarts the group: leave every copy where it is
            log.warning("rank %d: leaving with %s; replicas kept for the restart", self.rank, exc_type.__name__)
            self._close()
            return
        self._wait_replicated(self.cfg.exit_timeout)
        if self.holders and self._replicated < self._last:
            log.warning("rank %d: leaving with replicas at step %d, the last commit is %d", self.rank,
                        self._replicated, self._last)
        self._publish(self._replicated if self.holders else self._last)
        self._barrier("exit")
        self._publish(self._replicated if self.holders else self._last)
        log.info("rank %d: job %s done at step %d; global committed version %d", self.rank, self.job, self._last,
                 self.global_committed)
        razor_info = {}
        if self._slots is not None:
            info = self._razor_info(self._slots.manifest)
            razor_info = {"razor_group": list(info.group), "state_bytes": info.state_bytes,
                          "shard_bytes": info.shard_bytes, "razor_verifications": self.razor_verified,
                          "razor_mismatches": self.razor_mismatches}
        self._record({"event": "finished", "rank": self.rank, "step": self._last,
                      "global_committed": self.global_committed, "attempt": int(self._attempt), **razor_info})
        if self.topology.first_on_node:
            try:
                self.daemon.drop(self.job)
            except ReplicaError as e:
                log.warning("rank %d: could not tell the daemon the job ended: %s", self.rank, e)
        self._close()

    def _close(self) -> None:
        if self._profiler is not None:
            self._profiler.close()
        self._marks.attach(None)
        if self._slots is not None:
            self._slots.close()
        for c in self._clients.values():
            c.close()

    # ------------------------------------------------------------ the training loop's side

    def commit(self, step: int) -> None:
        """Captures the state after ``step`` into shared memory; once this returns it survives this process.

        Raises:
            FFStateError: ``step`` is not larger than the last committed one.
        """
        if step <= self._last:
            raise FFStateError(f"commit({step}) after commit({self._last}): steps must increase")
        with layout.gc_paused():  # the state's containers, dropped at the end: no collection over the model's objects
            state = self._capture(step)
            if self._slots is None:
                self._attach(state)
            block = self.holders and self.cfg.lag_policy == "block"
            # The daemon reads a slot within milliseconds; seconds without it mean it is overloaded or gone.
            self._slots.commit(state, step, wait=SLOT_WAIT if block else 0.0)
            del state
        self._last = step
        if self._profiler is not None:
            self._profiled(self._profiler.on_commit())
        if not self.holders:
            return
        if self._slots.wait_timed_out:
            try:
                self._replicated = self._replicated_version()
            except ReplicaUnavailable as e:
                self._daemon_lost(e)
                return
        else:
            # What the daemon wrote in the slot header; asked of the daemon itself only when lagging. 0 says
            # nothing yet (replication was reset at attach, or a holder is being re-seeded): keep what we knew
            # (v* after a restore), so that a full version's push overlaps the next commits instead of holding
            # the first; if the header stays at 0, the lag passes max_lag and the daemon is asked.
            header = self._slots.replicated()
            if 0 < header <= step:
                self._replicated = header
        if step - self._replicated > self.cfg.max_lag:
            self._lag(step)  # also how a dead daemon is found: its header stops moving
        elif time.monotonic() - self._published > PUBLISH_EVERY:
            self._publish(self._replicated)

    def _lag(self, step: int) -> None:
        try:
            self._replicated = self._replicated_version()
        except ReplicaUnavailable as e:
            self._daemon_lost(e)
            return
        behind = step - self._replicated
        if behind <= self.cfg.max_lag:
            return
        if self.cfg.lag_policy == "skip":
            log.warning("rank %d: replication is %d versions behind (max_lag %d); policy skip: the daemon jumps to "
                        "the newest version", self.rank, behind, self.cfg.max_lag)
            return
        start = time.perf_counter()
        self._wait_replicated(timeout=self.cfg.connect_timeout, within=self.cfg.max_lag)
        held = time.perf_counter() - start
        if step - self._replicated > self.cfg.max_lag:
            log.error("rank %d: replication is stalled %d versions behind (a holder down?); policy block gave up "
                      "after %.0fs and training goes on", self.rank, step - self._replicated, held)
        else:
            log.warning("rank %d: commit of step %d held %.2fs until replication was within %d versions "
                        "(policy block)", self.rank, step, held, self.cfg.max_lag)

    def stats(self, wait: float = 0.0) -> dict:
        """What this rank's node daemon reports about it, after waiting up to ``wait`` seconds for the
        replicas to catch up with the last commit.

        Returns a dict: ``version`` (last commit), ``replicated_version``, ``pushed_bytes`` and
        ``pushed_versions`` (on the wire, counted per holder), ``state_bytes`` (the whole state),
        ``shard_bytes`` (what this rank replicates: with the razor, its own entries and its part),
        ``razor_group``, ``razor_verifications``, ``razor_mismatches``; once a restored rank has
        committed, its restores as its workers recorded them: ``restores`` and the newest one's
        ``restore_version`` (v*), ``restore_steps_lost``, ``restore_seconds``, ``restore_entry_seconds``;
        where this rank profiled its steps for the scheduler (nothing marks its collectives),
        ``profiled_steps``, ``profiled_collectives`` (a step), ``profiled_period_seconds`` (the step) and
        ``profiled_busy_seconds`` (its collectives on the wire); and, for the whole node (its
        daemon's scheduler), ``collectives`` (the training's collectives it saw marked), ``collisions``
        (those that started while a replication chunk was on the wire) and ``overlap_seconds`` (how long
        replication shared the link with them).
        """
        if wait:
            self._wait_replicated(wait)
        resp = self.daemon.inventory(self.job)
        mine = [s for s in resp.shards if s.local and s.shard.rank == self.rank and s.shard.world_size == self.world]
        out = {"version": self._last, "replicated_version": 0, "pushed_bytes": 0, "pushed_versions": 0,
               "collectives": resp.collectives, "collisions": resp.collisions, "overlap_seconds": resp.overlap_seconds}
        if mine:
            s = mine[0]
            out.update(replicated_version=s.replicated_version, pushed_bytes=s.pushed_bytes,
                       pushed_versions=s.pushed_versions, state_bytes=s.razor.state_bytes,
                       shard_bytes=s.razor.shard_bytes, razor_group=list(s.razor.group),
                       razor_verifications=s.razor.verifications, razor_mismatches=s.razor.mismatches)
            if s.HasField("restore"):
                r = s.restore
                out.update(restores=r.restores, restore_version=r.version, restore_steps_lost=r.steps_lost,
                           restore_seconds=r.seconds, restore_entry_seconds=r.entry_seconds)
            if s.HasField("profiled"):
                t = s.profiled
                out.update(profiled_steps=t.steps, profiled_collectives=t.collectives,
                           profiled_period_seconds=t.period_seconds, profiled_busy_seconds=t.busy_seconds)
        return out

    # ------------------------------------------------------------ capture and restore

    def _capture(self, step: int) -> dict:
        state = capture.capture(self.model, self.optimizer, self.lr_scheduler, self.extra)
        if self.razor_groups is None:
            return state
        if self._commits % self.cfg.razor_verify_every == 0:
            self._verify_razor(state, step)
        self._commits += 1
        return state if self.razor_plan is None else razor.split(state, self.razor_plan, self.rank)

    def _verify_razor(self, state: dict, step: int) -> None:
        """The group compares checksums of the entries it believes identical; any that differ fall back to
        per-rank replication (the same decision on every rank: all see the same checksums)."""
        plan = razor.Plan.of(state, self.razor_groups, frozenset(self._razor_excluded))
        if plan is None:
            self.razor_plan = None
            return
        sums = dict(zip(plan.paths, razor.checksums(state, plan)))
        key = f"{self._prefix}/razor/{step}"
        self._store.set(f"{key}/{self.rank}", json.dumps(sums))
        keys = [f"{key}/{r}" for r in plan.group]
        self._store.wait(keys, recovery._timedelta(self.cfg.connect_timeout))
        told = [json.loads(v) for v in self._store.multi_get(keys)]
        differ = sorted({p for p in plan.paths if any(t.get(p) != sums[p] for t in told)})
        self.razor_verified += 1
        if differ:
            self.razor_mismatches += len(differ)
            log.error("rank %d: RAZOR MISMATCH at step %d: %d entries the group %s believed identical differ across "
                      "it (non-deterministic kernels, or a bug?), e.g. %s; they are now replicated per rank",
                      self.rank, step, len(differ), list(plan.group), differ[:3])
            self._record({"event": "razor-mismatch", "rank": self.rank, "step": step, "entries": differ,
                          "attempt": int(self._attempt)})
            self._razor_excluded.update(differ)
            plan = razor.Plan.of(state, self.razor_groups, frozenset(self._razor_excluded))
        if plan != self.razor_plan and self._slots is not None:  # a new layout: new slots, full versions
            self._marks.attach(None)
            self._slots.close()
            self._slots = None
            self.daemon.drop(self.job, self.rank, self.world)
        self._state_bytes = sum(t.numel() * t.element_size() for _, t in layout.flatten(state)[1]
                                if isinstance(t, torch.Tensor))
        if self._slots is not None:
            self._slots.set_razor_counters(self.razor_verified, self.razor_mismatches)
        if plan != self.razor_plan and plan is not None:
            full = self._state_bytes
            log.info("rank %d: razor plan: %d entries (%.1f MB) split over ranks %s, this rank's part %.1f MB; "
                     "state %.1f MB, replicated %.1f MB", self.rank, len(plan.paths), plan.total_bytes / 1e6,
                     list(plan.group), plan.part_bytes(plan.group.index(self.rank)) / 1e6, full / 1e6,
                     (full - plan.total_bytes + plan.part_bytes(plan.group.index(self.rank))) / 1e6)
        self.razor_plan = plan

    def _razor_info(self, manifest: layout.Manifest) -> pb.RazorInfo:
        plan = self.razor_plan
        if self.razor_groups is None or plan is None:
            why = razor.why_not(self.world, self.cfg) if self.razor_groups is None else "nothing redundant in the state"
            return pb.RazorInfo(state_bytes=manifest.nbytes, shard_bytes=manifest.nbytes, reason=why)
        return pb.RazorInfo(group=list(plan.group), state_bytes=self._state_bytes, redundant_bytes=plan.total_bytes,
                            shard_bytes=manifest.nbytes, reason=self.razor_groups.reason)

    def _restore(self) -> None:
        me = self.rank
        needed = sorted({me, *(self.razor_groups.ranks if self.razor_groups else ())})
        lookups = {r: self.daemon.lookup(self.job, r, self.world) if r in self.topology.node_ranks else None
                   for r in needed}
        # This node's daemon counts too: it holds other nodes' ranks' replicas (their parts, under the razor).
        daemons = {a: self._client(a) for a in [self.daemon.address, *self.holders, *self._other_daemons(needed)]}
        available = recovery.survey_ranks(self.job, needed, self.world, lookups, daemons, self.daemon)
        versions = recovery.restorable(available)
        missing = self._missing(available)
        if any(a.versions for a in available.values()):
            log.info("rank %d: copies found (newest versions per shard and source): %s", me,
                     {r: {"slots": sorted(a.local)[-3:], **{s: sorted(v)[-3:] for s, v in a.remote.items()}}
                      for r, a in available.items()})
        if self._store is None:
            v, last = (max(versions), max(versions)) if versions else (0, 0)
        else:
            seen = max((max(a.versions) for a in available.values() if a.versions), default=0)
            v, last, _ = recovery.negotiate(self._store, self._prefix, me, self.world, versions, missing=missing,
                                            seen=seen)
        if v == 0:
            log.info("rank %d: no replicas of job %s: starting at step 0", me, self.job)
            return
        with layout.gc_paused():
            self._load(v, last, needed, available, lookups, daemons)

    def _load(self, v: int, last: int, needed: list[int], available: dict, lookups: dict, daemons: dict) -> None:
        """Fetches version ``v`` of this rank's shard (and its razor group's parts) and loads it."""
        me = self.rank
        start = time.perf_counter()
        shards = recovery.fetch_ranks(self.job, self.world, v, available, lookups, daemons)  # in parallel
        mine = shards[me]
        plan = razor.plan_of(mine[0])
        parts: dict[int, str] = {}  # under the razor: where each group member's part came from
        if plan is None:
            state, nbytes = mine[0], mine[2]
        else:
            if not set(plan.group) <= set(needed):
                raise FFStateError(f"rank {me}: version {v} was split over ranks {list(plan.group)}, this run expects "
                                   f"{needed}: was Config.razor changed across the restart? Restart with the same "
                                   "setting, or under a new job id")
            others = {r: got for r, got in shards.items() if r != me}
            state = razor.assemble(mine[0], {r: got[0] for r, got in shards.items()})
            parts = {r: got[1] for r, got in sorted(others.items())}
            nbytes = mine[2] + sum(got[2] for got in others.values())
        got = recovery.Restored(v, last, mine[1], nbytes, time.perf_counter() - start)
        capture.restore(self.model, self.optimizer, self.lr_scheduler, self.extra, state)
        del state
        self.restored, self.start_step, self._last, self._replicated = got, v, v, v  # slots past v* go at attach
        if self.cfg.shadow_ddp_step and isinstance(self.model, torch.nn.parallel.DistributedDataParallel):
            capture.shadow_step_on_first_forward(self.model)
        elapsed = time.perf_counter() - self._t0
        self._restore_report = (v, got.steps_lost, got.seconds, elapsed)
        log.info("rank %d: restored step %d (v*) of job %s from %s%s: %d steps lost, %.1f MB in %.3fs "
                 "(%.1f MB/s); %.2fs from entry", self.rank, v, self.job, got.source,
                 f", the parts of ranks {sorted(parts)} from {sorted(set(parts.values()))}" if parts else "",
                 got.steps_lost, got.nbytes / 1e6, got.seconds, got.nbytes / 1e6 / max(got.seconds, 1e-9), elapsed)
        self._record({"event": "restored", "rank": self.rank, "version": v, "last_version": last,
                      "steps_lost": got.steps_lost, "source": got.source, "parts_from": parts, "bytes": got.nbytes,
                      "restore_seconds": got.seconds, "entry_seconds": elapsed,
                      "attempt": int(self._attempt)})

    def _attach(self, state: dict) -> None:
        manifest = layout.describe(state)
        # After a restore to v* the steps past it are redone: the daemon un-commits them before it resets
        # replication, so that none of them is replicated from the slots of the run that died.
        resp = self.daemon.attach(self.job, self.rank, self.world, manifest, holders=self.holders,
                                  razor=self._razor_info(manifest), discard_after=self._last)
        self._slots = shm.Slots(list(resp.slot_paths), manifest)
        self._slots.set_razor_counters(self.razor_verified, self.razor_mismatches)
        if self._restore_report is not None:
            self._slots.record_restore(*self._restore_report)
            self._restore_report = None
        self._marks.attach(self._slots)
        if self._timeline is not None:
            self._slots.set_profiled_timeline(self._timeline)
        elif self._profiler is not None and (kept := self._slots.profiled_timeline()) is not None:
            self._profiler = None  # a restarted worker: its slots hold what its previous attempt profiled
            self._timeline = self.model._ffstate_timeline = kept
            log.info("rank %d: the scheduler keeps the timeline profiled before the restart (collectives a step: %d)",
                     self.rank, len(kept.intervals))

    # ------------------------------------------------------------ daemons

    def _comm_marks(self, rank: int) -> shm.CommMarks:
        """The marks of this model's collectives for the scheduler: DDP's gradient all-reduces (DDP takes
        one communication hook per model, ever, so the hook and its marks stay with the model across
        ``replicate`` contexts), or FSDP2's all-gathers and reduce-scatters."""
        model = self.model
        marks = getattr(model, "_ffstate_marks", None)
        if marks is not None:
            return marks
        marks = shm.CommMarks()
        if self.cfg.scheduler == "windows" and isinstance(model, torch.nn.parallel.DistributedDataParallel):
            try:  # the scheduler's timeline: when DDP's gradient buckets are on the wire
                model.register_comm_hook((marks, model.process_group), capture.marked_allreduce)
                model._ffstate_marks = marks
            except (RuntimeError, ValueError) as e:
                log.warning("rank %d: no communication marks for the scheduler (%s); it paces by rate only", rank, e)
        elif self.cfg.scheduler == "windows":  # FSDP2: its all-gathers and reduce-scatters
            if n := capture.mark_fsdp_collectives(model, marks):
                model._ffstate_marks = marks
                log.info("rank %d: the scheduler sees the all-gathers and reduce-scatters of %d FSDP2 modules", rank, n)
        return marks

    def _step_profiler(self) -> profiling.StepProfiler | None:
        """Where nothing marks the training's collectives (neither DDP nor FSDP2) and the daemon paces
        replication into their windows: a few profiled steps give it their timeline (profiling.py). Once per
        model: a timeline found stays with it across ``replicate`` contexts."""
        cfg, model = self.cfg, self.model
        self._timeline: profiling.ProfiledTimeline | None = None
        if (cfg.scheduler != "windows" or not cfg.profile_steps or not self.holders or self.world == 1
                or getattr(model, "_ffstate_marks", None) is not None):
            return None
        self._timeline = getattr(model, "_ffstate_timeline", None)
        if self._timeline is not None:
            return None
        return profiling.StepProfiler(cfg.profile_steps, cuda=any(p.is_cuda for p in model.parameters()))

    def _profiled(self, timeline: profiling.ProfiledTimeline | None) -> None:
        if timeline is None:
            if self._profiler.done:  # it could not run
                self._profiler = None
            return
        self._profiler = None
        self._timeline = self.model._ffstate_timeline = timeline
        self._slots.set_profiled_timeline(timeline)
        if timeline.intervals:
            log.info("rank %d: profiled %d steps for the scheduler (nothing marks this training's collectives): "
                     "collectives a step: %d, on the wire %.0f ms of its %.0f ms", self.rank, timeline.steps,
                     len(timeline.intervals), timeline.busy_seconds * 1e3, timeline.period * 1e3)
        else:
            log.info("rank %d: profiled %d steps for the scheduler and found no gloo or NCCL collectives in them: "
                     "replication is paced by rate only", self.rank, timeline.steps)

    def _generation(self) -> str:
        """A name for this attempt that every rank agrees on: rank 0's random number, broadcast.

        Not torchrun's restart count: in a multi-node job each node's agent counts its own restarts
        (a node that did not fail restarts its workers without counting), so ranks on different nodes
        would read and write different keys, or an earlier attempt's.
        """
        if self._store is None:
            return "0"
        nonce = torch.tensor([secrets.randbits(62) if self.rank == 0 else 0], dtype=torch.int64)
        if dist.get_backend() == "nccl":
            nonce = nonce.cuda()
        dist.broadcast(nonce, 0)
        return f"{int(nonce.item()):x}"

    def _client(self, address: str) -> Client:
        if address not in self._clients:
            self._clients[address] = Client(address, self.token, timeout=30.0)
        return self._clients[address]

    def _node_daemon(self, publish: bool = True) -> Client:
        """This node's daemon: found, or started by the node's first rank, and its address published."""
        topo, cfg = self.topology, self.cfg
        address = placement.daemon_address(topo.node, cfg)
        client = self._client(address)
        if topo.first_on_node and not _answers(client) and cfg.start_daemon:
            self._start_daemon(topo.node_id, address)
        deadline = time.monotonic() + cfg.connect_timeout
        while True:
            try:
                client.inventory(self.job)
                break
            except ReplicaUnavailable:
                if time.monotonic() > deadline:
                    raise ReplicaUnavailable(f"rank {self.rank}: no ffstate daemon answers at {address} for node "
                                             f"{topo.node_id}; run `ffstate serve --port {address.rsplit(':', 1)[1]}` "
                                             "on it, or leave Config.start_daemon on") from None
                time.sleep(0.2)
            except ReplicaError as e:
                if e.code == "UNAUTHENTICATED":
                    raise ReplicaError(f"the daemon at {address} belongs to another job or token ({e}); set "
                                       "FFSTATE_TOKEN to the job's token or FFSTATE_BASE_PORT to free ports",
                                       e.code) from None
                raise
        if publish and self._store is not None:
            self._store.set(f"{self._prefix}/daemon/{topo.node}", address)
        return client

    def _start_daemon(self, node_id: str, address: str) -> None:
        host, port = address.rsplit(":", 1)
        log_path = self._run_dir / f"daemon-{node_id}.log"
        args = [sys.executable, "-m", "ffstate.cli", "serve", "--node-id", node_id, "--host", host, "--port", port,
                "--exit-when-empty", "--idle-exit", str(self.cfg.daemon_idle_exit),
                "--pid-file", str(self._run_dir / f"daemon-{node_id}.pid"), "--keep-deltas", str(self.cfg.max_lag)]
        if self.cfg.daemon_memory_limit:
            args += ["--memory-limit", self.cfg.daemon_memory_limit]
        args += ["--scheduler", self.cfg.scheduler, "--link-share", str(self.cfg.link_share)]
        if self.cfg.link_bandwidth:
            args += ["--link-bandwidth", self.cfg.link_bandwidth]
        if self.cfg.metrics_port:
            args += ["--metrics-port", str(self.cfg.metrics_port + self.topology.node)]
        with open(log_path, "a") as out:
            # A session of its own: the daemon outlives this worker and torchrun's restarts of it.
            subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=out, stderr=out, start_new_session=True,
                             env={**os.environ, "FFSTATE_TOKEN": self.token}, close_fds=True)
        log.info("rank %d: started the daemon of %s at %s (log %s)", self.rank, node_id, address, log_path)

    def _holder_addresses(self) -> list[str]:
        topo = self.topology
        nodes = placement.holder_nodes(topo.node, topo.num_nodes, self.cfg.replicas)
        if self._store is None:
            return [placement.daemon_address(n, self.cfg) for n in nodes]
        keys = [f"{self._prefix}/daemon/{n}" for n in nodes]
        if keys:
            self._store.wait(keys, recovery._timedelta(self.cfg.connect_timeout * 2))
        return [self._store.get(k).decode() for k in keys]

    def _other_daemons(self, ranks: list[int]) -> list[str]:
        """The daemons of the nodes that keep ``ranks``' copies (their own nodes and their holders), this
        node's excepted: where a rank finds its group's parts."""
        topo, nodes = self.topology, set()
        for r in ranks:
            node = placement.topology(r, self.world, self.cfg).node
            nodes.update([node, *placement.holder_nodes(node, topo.num_nodes, self.cfg.replicas)])
        nodes.discard(topo.node)
        if self._store is None or not nodes:
            return []
        keys = [f"{self._prefix}/daemon/{n}" for n in sorted(nodes)]
        self._store.wait(keys, recovery._timedelta(self.cfg.connect_timeout * 2))
        return sorted({self._store.get(k).decode() for k in keys} - set(self.holders))

    def _missing(self, available: dict[int, recovery.Available]) -> list[str]:
        """The shards this rank needs that have no live copy at all, and the nodes that kept them."""
        lost = []
        for r, a in sorted(available.items()):
            if a.versions:
                continue
            node = placement.topology(r, self.world, self.cfg).node
            holders = placement.holder_nodes(node, self.topology.num_nodes, self.cfg.replicas)
            replicas = f" and {', '.join(f'node{n}' for n in holders)} (replicas)" if holders else ""
            lost.append(f"no live copy of rank {r}'s shard (it was kept on node{node} (slots){replicas})")
        if lost and self.razor_groups is not None:
            lost.append("with the razor on, every rank of a data-parallel group needs every member's part of the "
                        "redundant state, so the group's surviving ranks cannot restore either")
        return lost

    def _replicated_version(self) -> int:
        resp = self.daemon.inventory(self.job)
        mine = [s for s in resp.shards if s.local and s.shard.rank == self.rank and s.shard.world_size == self.world]
        if not mine and self._slots is not None:
            # Another daemon answers at the address (a node-mate restarted it): ours is gone, with our slots.
            raise ReplicaUnavailable(f"the daemon at {self.daemon.address} does not know rank {self.rank}: it was "
                                     "restarted")
        version = mine[0].replicated_version if mine else 0
        self._publish(version)
        return version

    def _publish(self, version: int) -> None:
        """Publishes the newest version every holder of this rank has, through the job's store; the job's
        global committed version is the minimum over ranks (DESIGN.md section 4, step 5)."""
        self._published = time.monotonic()
        if self._store is None:
            self.global_committed = version
            return
        self._store.set(f"{self._prefix}/replicated/{self.rank}", str(version))
        keys = [f"{self._prefix}/replicated/{r}" for r in range(self.world)]
        if self._store.check(keys):
            self.global_committed = min(int(v) for v in self._store.multi_get(keys))

    def _daemon_lost(self, error: Exception) -> None:
        """The node's daemon stopped answering while training runs: bring one back and re-attach.

        The slots this rank wrote died with it (the new daemon makes new ones); the holders keep their
        replicas, and the new daemon re-seeds them with a full version at the next commit.
        """
        log.error("rank %d: the node's daemon is gone (%s); restarting it and re-attaching", self.rank, error)
        if self._slots is not None:
            self._marks.attach(None)
            self._slots.close()
            self._slots = None
        self.daemon = self._node_daemon(publish=False)
        self._replicated = 0
        self._record({"event": "daemon-restarted", "rank": self.rank, "step": self._last,
                      "attempt": int(self._attempt)})

    def _wait_replicated(self, timeout: float | None, within: int = 0) -> None:
        if not self.holders or self._slots is None:
            return
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            try:
                self._replicated = self._replicated_version()
            except ReplicaUnavailable as e:
                if deadline is not None:  # leaving: nothing more to wait for
                    log.warning("rank %d: the node's daemon is gone (%s); not waiting for the replicas", self.rank, e)
                    return
                self._daemon_lost(e)
                continue
            if self._last - self._replicated <= within:
                return
            if deadline is not None and time.monotonic() > deadline:
                return
            time.sleep(0.01)

    def _barrier(self, name: str) -> None:
        if self._store is not None:
            key = f"{self._prefix}/barrier/{name}"
            self._store.add(key, 1)
            deadline = time.monotonic() + self.cfg.exit_timeout
            while int(self._store.add(key, 0)) < self.world and time.monotonic() < deadline:
                time.sleep(0.02)

    def _record(self, event: dict) -> None:
        """Appends an event (restore, ...) to the job's run folder, for the demo and for operators."""
        with open(self._run_dir / "events.jsonl", "a") as f:
            f.write(json.dumps(event) + "\n")


# ---------------------------------------------------------------- helpers


def _answers(client: Client) -> bool:
    """Whether anything answers at the client's address (one try, no retries)."""
    try:
        with Client(client.address, client.token, timeout=2.0, retries=0) as once:
            once.inventory()
        return True
    except ReplicaUnavailable:
        return False
    except ReplicaError:
        return True  # someone answers (maybe with another token): reported by the caller


def _job_id(cfg: Config) -> str:
    raw = cfg.job_id or os.environ.get("TORCHELASTIC_RUN_ID", "") or "ffstate-job"
    if raw == "none":
        raw = "ffstate-job"
    return re.sub(r"[^A-Za-z0-9._-]", "-", raw)[:128]


def _default_token() -> str:
    """$FFSTATE_TOKEN, else a per-user secret (created once, mode 0600): enough on one machine."""
    token = os.environ.get("FFSTATE_TOKEN")
    if token:
        return token
    path = Path(os.environ.get("XDG_CONFIG_HOME", Path.home() / ".config")) / "ffstate" / "token"
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(16))
    except FileExistsError:
        pass
    for _ in range(50):  # another rank may be writing it right now
        token = path.read_text().strip()
        if token:
            return token
        time.sleep(0.02)
    raise FFStateError(f"{path} is empty: remove it, or set FFSTATE_TOKEN")


def _warn_about_torchrun_restarts() -> None:
    if os.environ.get("TORCHELASTIC_RUN_ID") and os.environ.get("TORCH_DISABLE_SHARE_RDZV_TCP_STORE") != "1":
        log.warning("torchrun without TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: after a restart, gloo's "
                    "init_process_group hangs or fails ('Gloo connectFullMesh failed', pytorch/pytorch#135712). "
                    "Launch as: TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun ...")
