"""The razor at commit time: each rank commits its own entries and its part of what its data-parallel
group holds identically (``razor.py``), and the group verifies, at the first commit and every
``razor_verify_every`` commits, that those entries really are identical: checksums through the job's
store. An entry that differs is logged, counted and replicated per rank from then on; every rank sees
the same checksums, so all take the same decision (README: the razor)."""

from __future__ import annotations

import logging
from typing import Callable

import torch

from ffstate import layout, razor
from ffstate.job import Job
from ffstate.reports import RazorReport

log = logging.getLogger("ffstate.razor")


class RazorVerifier:
    """This rank's razor plan, kept verified. ``groups``: what ``razor.infer`` found (None: no razor)."""

    def __init__(self, job: Job, groups: razor.Groups | None):
        self.job, self.groups = job, groups
        self.plan: razor.Plan | None = None
        self.verified = 0  # verifications done by the group
        self.mismatches = 0  # entries found to differ across the group (each now replicated per rank)
        self._excluded: set[str] = set()
        self._commits = 0
        self._state_bytes = 0

    def shard(self, state: dict, step: int, on_new_plan: Callable[[], None],
              on_verified: Callable[[int, int], None]) -> dict:
        """What this rank commits of its captured ``state`` at ``step``. A verification that changes the plan
        calls ``on_new_plan()`` first (a new layout: new slots, full versions), then ``on_verified(verified,
        mismatches)``."""
        if self.groups is None:
            return state
        if self._commits % self.job.cfg.razor_verify_every == 0:
            self._verify(state, step, on_new_plan)
            on_verified(self.verified, self.mismatches)
        self._commits += 1
        if self.plan is None:
            return state
        try:
            return razor.split(state, self.plan, self.job.rank)
        except razor.StalePlan as e:  # every member of the group sees it at this step: their entries are identical
            log.warning("rank %d at step %d: %s; the group plans and verifies again", self.job.rank, step, e)
            self._verify(state, step, on_new_plan, f"razor/{step}/again")
            on_verified(self.verified, self.mismatches)
            return state if self.plan is None else razor.split(state, self.plan, self.job.rank)

    def _verify(self, state: dict, step: int, on_new_plan: Callable[[], None], name: str = "") -> None:
        job, rank = self.job, self.job.rank
        plan = razor.Plan.of(state, self.groups, frozenset(self._excluded))
        if plan is None:
            self.plan = None
            return
        sums = dict(zip(plan.paths, razor.checksums(state, plan)))
        told = job.exchange(name or f"razor/{step}", sums, plan.group, job.cfg.connect_timeout)
        differ = sorted({p for p in plan.paths if any(t.get(p) != sums[p] for t in told)})
        self.verified += 1
        if differ:
            self.mismatches += len(differ)
            log.error("rank %d: RAZOR MISMATCH at step %d: %d entries the group %s believed identical differ across "
                      "it (non-deterministic kernels, or a bug?), e.g. %s; they are now replicated per rank",
                      rank, step, len(differ), list(plan.group), differ[:3])
            job.record({"event": "razor-mismatch", "step": step, "entries": differ})
            self._excluded.update(differ)
            plan = razor.Plan.of(state, self.groups, frozenset(self._excluded))
        if plan != self.plan:
            on_new_plan()
        self._state_bytes = sum(t.numel() * t.element_size() for _, t in layout.flatten(state)[1]
                                if isinstance(t, torch.Tensor))
        if plan != self.plan and plan is not None:
            full, mine = self._state_bytes, plan.part_bytes(plan.group.index(rank))
            log.info("rank %d: razor plan: %d entries (%.1f MB) split over ranks %s, this rank's part %.1f MB; "
                     "state %.1f MB, replicated %.1f MB", rank, len(plan.paths), plan.total_bytes / 1e6,
                     list(plan.group), mine / 1e6, full / 1e6, (full - plan.total_bytes + mine) / 1e6)
        self.plan = plan

    def report(self, manifest: layout.Manifest) -> RazorReport:
        """What this rank replicates of its state (``manifest``: what it commits), for its daemon's reports."""
        if self.groups is None or self.plan is None:
            why = razor.why_not(self.job.world, self.job.cfg) if self.groups is None else "nothing redundant in the state"
            return RazorReport(state_bytes=manifest.nbytes, shard_bytes=manifest.nbytes, reason=why)
        return RazorReport(group=list(self.plan.group), state_bytes=self._state_bytes,
                           redundant_bytes=self.plan.total_bytes, shard_bytes=manifest.nbytes, reason=self.groups.reason)

    def finished(self, manifest: layout.Manifest) -> dict:
        """The razor's part of the job's ``finished`` event."""
        info = self.report(manifest)
        return {"razor_group": list(info.group), "state_bytes": info.state_bytes, "shard_bytes": info.shard_bytes,
                "razor_verifications": self.verified, "razor_mismatches": self.mismatches}
