"""A training function that raises again and again with no process lost: the job stops, saying what it raised.

The extension restarts the job whatever a rank raised. A process's death is what in-process restarts are for, and
the spares bound how many the job takes; an exception is often the code's own (a bug in the loop, a configuration
ffstate refuses, no version every rank can be restored from), and raises again at the next entry: such a job
restarted forever, a few entries a second, each making a process group and holding the aborted one. torchrun's
``--max-restarts`` bounds this for its mode.

The first process to raise in an iteration writes what it raised to the job's store (one line), and the first to
enter each iteration writes the time. At each restart the first process to read the records (the extension's, for
the iteration that ended, and these) records the count, and every process takes that one: after ``limit`` restarts
in a row for exceptions alone (no process lost, nothing timed out), none of whose entries ran longer than
``window`` seconds, every process raises ``TrainingRaised`` naming the exception, as ``NoSpareLeft`` ends the job.
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Any

log = logging.getLogger("ffstate.inprocess")

LIMIT = 3  # restarts in a row for exceptions alone before the job stops
WINDOW = 600.0  # seconds: an entry that trained longer than this before it raised starts the count again
RAISED = "ffstate/inprocess/raised/{iteration}"
ENTERED = "ffstate/inprocess/entered/{iteration}"
DECIDED = "ffstate/inprocess/decided/{iteration}"  # "count|what", the first process's


class TrainingRaised(RuntimeError):
    """The training function raised at several entries in a row with no process lost: restarting would not help."""


def entered(store: Any, iteration: int) -> None:
    """The first entry of ``iteration`` to get here records the time (the others find it set)."""
    with contextlib.suppress(Exception):  # the store is the job's: a failure here is not the training's
        store.compare_set(ENTERED.format(iteration=iteration), "", f"{time.time():.3f}")


def raised(store: Any, iteration: int, rank: int, e: BaseException) -> None:
    """Records what rank ``rank`` raised in ``iteration``, unless another rank did first (the first is the cause as a
    rule: the others raise as the abort that follows ends their collectives). Bounded: every process's error has it."""
    with contextlib.suppress(Exception):
        store.compare_set(RAISED.format(iteration=iteration), "", f"rank {rank}: {type(e).__name__}: {e}"[:2000])


class Repeats:
    """Counts the restarts in a row that exceptions alone caused; ``after`` is called by every process at each
    restart, and every process takes the count the first one to get there recorded.

    The first reader decides for all: the records every process reads change as soon as one process stops (the
    extension records a process that leaves as terminated, and its interruption, in the same iteration's store), so a
    process slower to read than another to decide would see a process lost where the first saw none, count no
    repeat, and go on alone into an iteration the others left (seen on a loaded machine)."""

    def __init__(self, store: Any, limit: int = LIMIT, window: float = WINDOW):
        self.store, self.limit, self.window = store, limit, window
        self.count = 0

    def after(self, iteration: int, records: list, lost: set[int]) -> None:
        """At the restart that ends ``iteration``, with its interruption records and the processes lost in it as this
        process read them; the decision is the first process's.

        Raises:
            TrainingRaised: the ``limit``-th such restart in a row.
        """
        mine = f"{self._count(iteration, records, lost)}|{self._what(iteration)}"
        decided = self.store.compare_set(DECIDED.format(iteration=iteration), "", mine)
        count, _, what = (decided.decode(errors="replace") if isinstance(decided, bytes) else decided).partition("|")
        self.count = int(count)
        if not self.count:
            return
        if self.count < self.limit:
            log.warning("iteration %d ended with an exception and no process lost (%d of %d in a row before the job "
                        "stops): %s", iteration, self.count, self.limit, what)
            return
        raise TrainingRaised(f"the training function raised at {self.count} entries in a row with no process lost "
                             f"(the last: {what}): restarting again would not help; the job stops (the limit: "
                             f"restartable(max_raises={self.limit}))")

    def _count(self, iteration: int, records: list, lost: set[int]) -> int:
        """The count after ``iteration`` as this process's reads say (the first process's reads are everyone's)."""
        from nvidia_resiliency_ext.inprocess.attribution import Interruption

        if lost or not records or any(r.interruption != Interruption.EXCEPTION for r in records):
            return 0
        began = self._time(ENTERED.format(iteration=iteration))
        if began is not None and time.time() - began > self.window:
            return 1  # it trained a while before raising: not the same failure at every entry, the count begins again
        return self.count + 1

    def _what(self, iteration: int) -> str:
        key = RAISED.format(iteration=iteration)
        return self.store.get(key).decode(errors="replace") if self.store.check([key]) else "(not recorded)"

    def _time(self, key: str) -> float | None:
        return float(self.store.get(key)) if self.store.check([key]) else None
