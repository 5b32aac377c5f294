"""The job's waits on its store (``Job.wait``, under ``exchange`` and the daemons' addresses): an exception raised
into the waiting thread from another, as the in-process engine raises its restart after a failure elsewhere, lands
within a slice of the wait, not at its end (a restore's exchange waits up to 300 s for the other ranks); a wait that
times out names what was missing."""

import ctypes
import datetime
import threading
import time

import pytest
import torch.distributed as dist

from ffstate.job import Job


class Restart(Exception):
    """Stands in for the engine's ``RankShouldRestart``."""


@pytest.fixture
def job():
    j = object.__new__(Job)  # only what the waits use: the store, this rank, the keys' prefix
    j.store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, timeout=datetime.timedelta(seconds=30))
    j.rank, j.prefix = 0, "ffstate/test/g0"
    return j


def test_an_exchange_returns_what_every_rank_published_once_the_last_did(job):
    other = dist.TCPStore("127.0.0.1", job.store.port, 1, is_master=False)  # another rank's connection
    threading.Timer(1.5, lambda: other.set(job.key("plan", 1), '{"v": 7}')).start()  # past the first slice
    assert job.exchange("plan", {"v": 3}, [0, 1], timeout=30) == [{"v": 3}, {"v": 7}]


def test_a_wait_that_times_out_names_the_keys_missing(job):
    job.store.set(job.key("plan", 0), "{}")
    with pytest.raises(dist.DistStoreError, match=r"rank 0: exchange 'plan': 2 of 3 not in the job's store after 2 s: "
                                                  r"\['1', '2'\]"):
        job.wait([job.key("plan", r) for r in range(3)], 2.0, "exchange 'plan'")


def test_an_exception_raised_into_the_waiting_thread_lands_within_the_wait_not_at_its_end(job):
    got: list[BaseException] = []

    def waiting() -> None:
        try:
            job.wait([job.key("never", 1)], 120.0, "exchange 'never'")
        except BaseException as e:  # noqa: BLE001 - what landed is the test's subject
            got.append(e)

    t = threading.Thread(target=waiting)
    t.start()
    time.sleep(2.5)  # inside the wait, past its first slices
    assert ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(t.ident), ctypes.py_object(Restart)) == 1
    t.join(60)  # one wait of the whole 120 s (what the store's own wait is) would still be under way
    assert not t.is_alive() and len(got) == 1 and isinstance(got[0], Restart), got
