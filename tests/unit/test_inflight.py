"""ffstate/inflight.py: the waits an abort of the process group ends. Works are stood in for by plain torch futures
(one never completed is a send gloo never fails); the gloo race itself is tests/system/test_abort_race.py."""

import threading
import time
import weakref

import pytest
import torch

from ffstate import inflight

# A torch future's wait() blocks in C++, where pytest-timeout's signal cannot interrupt it: a regression that left
# one waiting would hold the worker until CI's limit. The thread method dumps the stacks and ends the process.
pytestmark = pytest.mark.timeout(60, method="thread")


@pytest.fixture(autouse=True)
def fresh():
    inflight.reset()
    yield
    inflight.abort("test over")  # retires the waiting thread and fails what a test left pending
    inflight.reset()


def test_a_work_s_value_and_error_reach_the_future_and_its_end_runs_off_the_calling_thread():
    work = torch.futures.Future()
    ended = []
    ours = inflight.track(work, lambda v: v[0] * 2, lambda: ended.append(threading.current_thread().name))
    assert not ours.done()
    work.set_result([torch.tensor(21.0)])
    assert ours.wait().item() == 42.0
    assert ended == ["ffstate-collectives"]

    done = torch.futures.Future()
    done.set_result([torch.tensor(1.0)])  # already complete when tracked: still nothing on this thread
    inflight.track(done, on_end=lambda: ended.append(threading.current_thread().name)).wait()
    assert ended[-1] == "ffstate-collectives"

    failing = torch.futures.Future()
    ours = inflight.track(failing)
    failing.set_exception(RuntimeError("Connection closed by peer"))
    with pytest.raises(RuntimeError, match="Connection closed by peer"):
        ours.wait()


def test_abort_ends_a_wait_on_a_work_that_never_ends_and_the_next_group_is_not_queued_behind_it():
    deadline = time.monotonic() + 5
    while _waiting_threads() and time.monotonic() < deadline:  # the earlier tests' retired threads leave
        time.sleep(0.01)
    threads = _waiting_threads()
    stuck = torch.futures.Future()  # never completed: a send gloo never fails after the sockets went down
    first = ours = inflight.track(stuck)
    got = []
    waiter = threading.Thread(target=lambda: got.append(_outcome(ours)))
    waiter.start()
    time.sleep(0.05)
    assert waiter.is_alive()
    group = _Group()  # what the retired thread keeps until its works have ended (the aborted process group)
    kept = weakref.ref(group)
    assert inflight.abort("the group was aborted", keep=group) == 1
    del group
    waiter.join(5)
    assert not waiter.is_alive()
    assert isinstance(got[0], RuntimeError) and "the group was aborted" in str(got[0]), got
    with pytest.raises(inflight.Aborted, match="the group was aborted"):
        inflight.track(torch.futures.Future())  # nothing more is waited on in an aborted group

    inflight.reset()  # the next entry's group
    work = torch.futures.Future()
    ours = inflight.track(work)
    work.set_result(7)
    assert ours.wait() == 7  # a new waiting thread: the old one still waits on `stuck`
    assert _waiting_threads() == threads + 2
    assert kept() is not None  # held while a work of its group may still be in gloo
    stuck.set_result(0)  # the stuck work ends at last: its old thread leaves and lets the group go
    deadline = time.monotonic() + 5
    while (_waiting_threads() > threads + 1 or kept() is not None) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert _waiting_threads() == threads + 1 and kept() is None
    with pytest.raises(RuntimeError, match="the group was aborted"):
        first.wait()  # the future the abort failed stays so


class _Group:
    pass


def _outcome(fut):
    try:
        return fut.wait()
    except BaseException as e:
        return e


def _waiting_threads() -> int:
    return sum(t.name == "ffstate-collectives" and t.is_alive() for t in threading.enumerate())


def test_wait_returns_the_value_or_raises_the_abort():
    work = torch.futures.Future()
    work.set_result([1, 2])
    assert inflight.wait(work) == [1, 2]
    inflight.abort("gone")
    with pytest.raises(inflight.Aborted, match="gone"):
        inflight.wait(torch.futures.Future())  # issued into an aborted group

    inflight.reset()
    got = []

    def waiting():
        try:
            got.append(inflight.wait(torch.futures.Future()))  # a work that never ends
        except BaseException as e:
            got.append(e)

    waiter = threading.Thread(target=waiting)
    waiter.start()
    time.sleep(0.05)
    inflight.abort("gone again")
    waiter.join(5)
    assert isinstance(got[0], inflight.Aborted) and str(got[0]) == "gone again", got  # the abort's own error
