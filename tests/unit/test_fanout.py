"""``ffstate.fanout.run_all``, what a restore's fetches run on: results in order, the first failure in order raised
once all are done, and an exception raised into the waiting thread from another (the in-process engine's restart)
landing within a slice of the wait while the items still run, the items not begun never beginning."""

import ctypes
import threading
import time

import pytest

from ffstate.fanout import run_all


class Restart(Exception):
    """Stands in for the engine's ``RankShouldRestart``."""


def test_results_come_in_order_and_the_first_failure_in_order_is_raised_once_all_are_done():
    assert run_all(lambda x: (time.sleep(0.01 * (5 - x)), x * x)[1], range(5), 3, "t") == [0, 1, 4, 9, 16]
    done = []

    def fn(x: int) -> int:
        time.sleep(0.3 if x == 0 else 0.0)
        done.append(x)
        if x in (1, 3):
            raise ValueError(f"item {x}")
        return x

    with pytest.raises(ValueError, match="item 1"):
        run_all(fn, range(4), 4, "t")
    assert sorted(done) == [0, 1, 2, 3]  # the slow one too, before anything was raised


def test_an_exception_raised_into_the_waiting_thread_lands_while_the_items_still_run():
    began, got = [], []
    release = threading.Event()

    def slow(x: int) -> int:
        began.append(x)
        release.wait(30)  # a fetch from a holder that answers slowly
        return x

    def waiting() -> None:
        try:
            run_all(slow, range(6), 2, "t")
        except BaseException as e:  # noqa: BLE001 - what landed is the test's subject
            got.append(e)

    t = threading.Thread(target=waiting)
    t.start()
    time.sleep(1.5)  # inside the wait, past its first slice
    raised = time.monotonic()
    assert ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(t.ident), ctypes.py_object(Restart)) == 1
    t.join(20)
    try:
        assert not t.is_alive() and len(got) == 1 and isinstance(got[0], Restart), got
        assert time.monotonic() - raised < 10, time.monotonic() - raised  # not the items' 30 s
    finally:
        release.set()
    time.sleep(0.2)
    assert sorted(began) == [0, 1], began  # the 4 not begun were cancelled
