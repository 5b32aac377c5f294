"""Repeats: every process of an in-process job stops together once the training function raised at ``limit`` entries
in a row with no process lost, whatever the order in which the processes read the records."""

import time

import pytest
import torch.distributed as dist

pytest.importorskip("nvidia_resiliency_ext")

from nvidia_resiliency_ext.inprocess.attribution import Interruption, InterruptionRecord  # noqa: E402

from ffstate.inprocess.raised import ENTERED, Repeats, TrainingRaised, entered, raised  # noqa: E402

EXCEPTION = [InterruptionRecord(0, Interruption.EXCEPTION)]


def _iteration(store, it: int) -> None:
    entered(store, it)
    raised(store, it, 0, ValueError(f"injected at step {5 + it}"))


def test_a_process_reading_after_another_stopped_stops_too():
    """The extension records a process that stops as terminated, with a BASE_EXCEPTION, in the iteration's store:
    a process that reads the records after another decided sees a process lost. It takes the first reader's count
    and stops too (before, it counted no repeat and went on alone into an iteration the others had left)."""
    store = dist.HashStore()
    fast, slow = Repeats(store, limit=3), Repeats(store, limit=3)
    for it in range(2):
        _iteration(store, it)
        fast.after(it, EXCEPTION, set())
        slow.after(it, EXCEPTION, set())
    assert fast.count == slow.count == 2
    _iteration(store, 2)
    with pytest.raises(TrainingRaised, match=r"raised at 3 entries in a row .*\(the last: rank 0: ValueError: "
                                             r"injected at step 7\)"):
        fast.after(2, EXCEPTION, set())
    stopped = [*EXCEPTION, InterruptionRecord(2, Interruption.BASE_EXCEPTION)]  # what the fast one's exit recorded
    with pytest.raises(TrainingRaised, match="injected at step 7"):
        slow.after(2, stopped, {2})


def test_a_process_lost_or_another_interruption_starts_the_count_again_for_every_process():
    store = dist.HashStore()
    a, b = Repeats(store, limit=2), Repeats(store, limit=2)
    _iteration(store, 0)
    a.after(0, EXCEPTION, set())
    b.after(0, EXCEPTION, set())
    _iteration(store, 1)
    a.after(1, [*EXCEPTION, InterruptionRecord(1, Interruption.TERMINATED)], {1})  # the first reader saw a death
    b.after(1, EXCEPTION, set())  # read later, differently: the first reader's count stands
    assert a.count == b.count == 0
    _iteration(store, 2)
    a.after(2, EXCEPTION, set())
    b.after(2, EXCEPTION, set())
    assert a.count == b.count == 1


def test_an_entry_that_trained_longer_than_the_window_begins_the_count_again():
    store = dist.HashStore()
    r = Repeats(store, limit=3, window=600)
    for it in range(2):
        _iteration(store, it)
        r.after(it, EXCEPTION, set())
    store.set(ENTERED.format(iteration=2), f"{time.time() - 601:.3f}")  # the third entry trained 10 minutes
    raised(store, 2, 0, ValueError("later"))
    r.after(2, EXCEPTION, set())
    assert r.count == 1
