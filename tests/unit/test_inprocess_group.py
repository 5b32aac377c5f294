"""The in-process mode's arrival before each entry's process group (``ffstate/inprocess/group.py``): every rank
returns once the last has arrived, and a rank waiting for one that was lost takes the engine's restart (an exception
raised into its thread from another) within about a second, in Python, not after a long wait inside the store's C++
(the wait's slices stay at a second; grown as ``Job.wait``'s do, the one under way at 7.5 s would run to 15 s). The
whole job, a rank lost there, is ``tests/system/test_inprocess.py``'s."""

import ctypes
import datetime
import threading
import time

import pytest
import torch.distributed as dist

pytest.importorskip("nvidia_resiliency_ext.inprocess", reason="the in-process mode's engine (nvidia-resiliency-ext) "
                    "is not installed")
from ffstate.inprocess.group import arrive  # noqa: E402


class Restart(Exception):
    """Stands in for the engine's ``RankShouldRestart``."""


def stores(n: int) -> list[dist.Store]:
    """``n`` connections to one fresh store, each under the same entry's prefix, as each rank has."""
    host = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, timeout=datetime.timedelta(seconds=30))
    clients = [host] + [dist.TCPStore("127.0.0.1", host.port, 1, is_master=False) for _ in range(n - 1)]
    return [dist.PrefixStore("ffstate-attempt-1", c) for c in clients]


def run(target, *args) -> tuple[threading.Thread, list]:
    got: list = []

    def body() -> None:
        try:
            target(*args)
            got.append("returned")
        except BaseException as e:  # noqa: BLE001 - what ended the wait is the test's subject
            got.append(e)

    t = threading.Thread(target=body)
    t.start()
    return t, got


def test_every_rank_returns_once_the_last_has_arrived():
    s = stores(3)
    waiting = [run(arrive, s[r], r, 3, 30.0) for r in (0, 1)]
    time.sleep(1.5)  # past the first slice
    assert all(t.is_alive() for t, _ in waiting)
    arrive(s[2], 2, 3, 30.0)
    for t, got in waiting:
        t.join(10)
        assert got == ["returned"]


def test_a_restart_raised_into_a_rank_waiting_for_a_lost_one_lands_within_a_second_or_two():
    s = stores(2)
    t, got = run(arrive, s[0], 0, 2, 120.0)  # rank 1 never comes
    time.sleep(7.5)
    raised = time.monotonic()
    assert ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(t.ident), ctypes.py_object(Restart)) == 1
    t.join(30)
    assert not t.is_alive() and len(got) == 1 and isinstance(got[0], Restart), got
    assert time.monotonic() - raised < 5.5, time.monotonic() - raised
