"""A schedule of failures, injected from inside the demo's workers (``worker.py --chaos FILE``).

The schedule is a JSON list, one failure each, in step order (``ffstate bench chaos`` draws it from a seed):

- ``{"kind": "rank", "step": S, "rank": R, "phase": P}``: rank R is SIGKILLed at step S, where ``P`` is
  ``after-commit`` (right after committing S), ``mid-step`` (after the backward of step S, before the
  optimizer's), ``mid-commit`` (inside the commit of S: its slot half written, never published) or
  ``timer`` (``"delay": D`` seconds after step S began, wherever the rank is then: noted as ``landed``);
- ``{"kind": "node", "step": S, "node": N}``: node N's daemon and every rank of it, after every rank committed S;
- ``{"kind": "daemon", "step": S, "node": N}``: only node N's daemon, after S; training goes on;
- ``{"kind": "double", "step": S, "rank": R, "phase": P, "then": R2}``: rank R as above, and when the group
  restarted, rank R2 right after its restore, before its first step (two in a row);
- ``{"kind": "hang", "step": S, "rank": R, "phase": P}``: rank R hangs as step S begins, for ever: ``mid-step``
  (asleep in its own code; the others wait in the step's all-reduce) or ``collective`` (in a receive that no
  rank answers); the node's daemon is to find it (``daemon/watchdog.py``);
- ``{"kind": "slow", "step": S, "rank": R, "seconds": X}``: rank R's step S takes X seconds longer, once;
- ``{"kind": "pause", "step": S, "seconds": X}``: after committing S, every rank spends X seconds inside
  ``ff.pause()`` (an evaluation, say);
- ``{"kind": "straggler", "step": S, "rank": R, "seconds": X, "until": U}``: from step S (to U, excluded, if
  given), rank R computes X seconds longer every step.

Each failure happens once (a marker file per index in the output folder, so torchrun's restarts do not
repeat it) and is noted in ``failures.jsonl`` with its wall time; rank 0 notes each commit in
``progress.jsonl`` (step, time, attempt), from which the bench reads the downtime.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

KINDS = ("rank", "node", "daemon", "double")  # the failures the chaos run draws from
PHASES = ("after-commit", "mid-step", "mid-commit", "timer")
HANG_PHASES = ("mid-step", "collective")


class Faults:
    """One worker's view of the schedule: asked at each point of the step whether to die there."""

    def __init__(self, schedule: list[dict], out: Path, rank: int, per_node: int,
                 kill_daemon: Callable[[int], None]):
        self.schedule, self.out, self.rank, self.per_node = schedule, out, rank, per_node
        self.kill_daemon = kill_daemon
        self.pause: Callable | None = None  # ff.pause, once the job entered ffstate.replicate
        self.attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        # Where in its step the rank is (for a ``timer`` kill): ``compute`` (before the backward returned: the
        # step's all-reduce waits for this rank), ``update`` (after it: the other ranks may commit the step this
        # rank never will, one step lost), ``committed`` (its slot holds the step).
        self.at = "compute"

    def _due(self, step: int, kinds: tuple[str, ...]) -> list[tuple[int, dict]]:
        return [(i, f) for i, f in enumerate(self.schedule) if f["step"] == step and f["kind"] in kinds
                and not (self.out / f"chaos-{i}").exists()]

    def _once(self, i: int) -> bool:
        try:
            os.close(os.open(self.out / f"chaos-{i}", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            return False
        return True

    def _note(self, i: int, f: dict, **more) -> None:
        with open(self.out / "failures.jsonl", "a") as out:
            out.write(json.dumps({"index": i, **f, **more, "time": time.time(), "attempt": self.attempt}) + "\n")

    def _die(self) -> None:
        os.kill(os.getpid(), signal.SIGKILL)

    def _die_noting(self, i: int) -> None:
        """A ``timer`` kill: where it landed (``at``) noted first."""
        with open(self.out / "failures.jsonl", "a") as out:
            out.write(json.dumps({"index": i, "kind": "landed", "landed": self.at, "time": time.time(),
                                  "attempt": self.attempt}) + "\n")
        self._die()

    def _mine(self, f: dict) -> bool:
        return f.get("rank") == self.rank

    # ------------------------------------------------------------ the points of a step

    def entered(self) -> None:
        """Right after the restore: the second of a double failure, once its first has happened."""
        for i, f in enumerate(self.schedule):
            second = f"chaos-{i}-then"
            if (f["kind"] == "double" and f["then"] == self.rank and (self.out / f"chaos-{i}").exists()
                    and not (self.out / second).exists()):
                os.close(os.open(self.out / second, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
                self._note(i, {**f, "kind": "double-then"}, killed=self.rank, after_step=f["step"])
                self._die()

    def step_began(self, step: int) -> None:
        """Step ``step`` (1-based: the version its commit makes) starts: arms a ``timer`` failure."""
        for i, f in self._due(step, ("rank", "double")):
            if self._mine(f) and f["phase"] == "timer" and self._once(i):
                self._note(i, f, killed=self.rank, after_step=step - 1)
                threading.Timer(f["delay"], self._die_noting, (i,)).start()
        self.at = "compute"
        for i, f in enumerate(self.schedule):
            if f["kind"] == "straggler" and self._mine(f) and f["step"] <= step < f.get("until", 1 << 62):
                time.sleep(f["seconds"])
        for i, f in self._due(step, ("slow", "hang")):
            if not (self._mine(f) and self._once(i)):
                continue
            self._note(i, f, after_step=step - 1)
            if f["kind"] == "slow":
                time.sleep(f["seconds"])
            elif f["phase"] == "collective":  # a receive nobody answers: stuck inside the process group
                dist.recv(torch.zeros(1), src=(self.rank + 1) % dist.get_world_size())
            else:
                while True:  # stuck in its own code
                    time.sleep(3600)

    def mid_step(self, step: int, phase: str, arm: Callable[[Callable[[], None]], None] | None = None) -> None:
        """After the backward (``mid-step``: dies now) or before the optimizer's step (``mid-commit``: ``arm``
        makes the next commit die half written)."""
        self.at = "update"
        for i, f in self._due(step, ("rank", "double")):
            if self._mine(f) and f["phase"] == phase and self._once(i):
                self._note(i, f, killed=self.rank, after_step=step - 1)
                if arm is None:
                    self._die()
                else:
                    arm(self._die)

    def committed(self, step: int) -> None:
        """Step ``step`` is committed: progress, ``after-commit`` kills, node and daemon losses."""
        self.at = "committed"
        if self.rank == 0:
            with open(self.out / "progress.jsonl", "a") as out:
                out.write(json.dumps({"step": step, "time": time.time(), "attempt": self.attempt}) + "\n")
        for i, f in self._due(step, ("pause",)):
            dist.barrier()
            if self.rank == 0 and self._once(i):
                self._note(i, f, after_step=step)
            assert self.pause is not None, "a pause needs ff.pause"
            with self.pause():
                time.sleep(f["seconds"])
        due = self._due(step, KINDS)
        if not due:
            return
        for i, f in due:
            if f["kind"] == "node":  # every rank has committed the step when the node goes
                dist.barrier()
                mine = self.rank // self.per_node == f["node"]
                if mine and self.rank % self.per_node == 0 and self._once(i):
                    self._note(i, f, after_step=step)
                dist.barrier()
                if mine:
                    if self.rank % self.per_node == 0:
                        self.kill_daemon(f["node"])
                    self._die()
            elif f["kind"] == "daemon":
                if self.rank // self.per_node == f["node"] and self.rank % self.per_node == 0 and self._once(i):
                    self._note(i, f, after_step=step)
                    self.kill_daemon(f["node"])
            elif f["phase"] == "after-commit":
                dist.barrier()  # every rank has committed the step when the rank dies
                if self._mine(f) and self._once(i):
                    self._note(i, f, killed=self.rank, after_step=step)
                    self._die()
