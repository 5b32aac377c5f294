"""Logging locks a restart's asynchronous exception left held (``ffstate/inprocess/locks.py``): released on the
thread that holds them, after which another thread logs again; a real ``PyThreadState_SetAsyncExc`` landing inside a
handler's lock is reproduced with a handler that holds the window open."""

import ctypes
import logging
import threading
import time

import pytest

pytest.importorskip("nvidia_resiliency_ext.inprocess", reason="the in-process mode's engine is not installed")

from ffstate.inprocess.locks import ReleaseLoggingLocks, release_held_logging_locks  # noqa: E402


def logs_from_another_thread(logger: logging.Logger, seconds: float = 30.0) -> bool:
    """Whether a thread other than this one gets a record through ``logger`` within ``seconds`` (generous where it
    should: a loaded machine may not run the thread at once)."""
    t = threading.Thread(target=logger.warning, args=("from another thread",), daemon=True)
    t.start()
    t.join(seconds)
    return not t.is_alive()


@pytest.fixture
def logger():
    lg = logging.getLogger(f"ffstate.test.locks.{time.monotonic_ns()}")
    lg.propagate = False
    handler = logging.StreamHandler(open("/dev/null", "w"))
    lg.addHandler(handler)
    yield lg, handler
    lg.removeHandler(handler)


def test_a_leaked_handler_lock_is_released_and_another_thread_logs_again(logger):
    lg, handler = logger
    handler.acquire()  # as an exception between acquire() and the try that releases it leaves it
    handler.acquire()  # held twice: both released
    assert not logs_from_another_thread(lg, 0.5)  # the control: the other thread waits
    released = release_held_logging_locks()
    assert any("StreamHandler (2)" in r for r in released), released
    assert logs_from_another_thread(lg)
    assert release_held_logging_locks() == []  # nothing left to release


def test_only_the_calling_threads_holds_are_released(logger):
    lg, handler = logger
    held, done = threading.Event(), threading.Event()

    def other() -> None:
        handler.acquire()
        held.set()
        done.wait(5)
        handler.release()

    t = threading.Thread(target=other, daemon=True)
    t.start()
    held.wait(5)
    try:
        assert release_held_logging_locks() == []  # another thread's hold is its own
    finally:
        done.set()
        t.join(5)


def test_the_engine_s_finalize_releases_them_and_returns_the_state(logger):
    lg, handler = logger
    handler.acquire()
    state = object()
    assert ReleaseLoggingLocks()(state) is state
    assert logs_from_another_thread(lg)


class _SlowHandler(logging.Handler):
    """A handler whose ``acquire`` holds the window between taking the lock and the ``try`` open long enough for an
    asynchronous exception to land in it, as the engine's does by chance."""

    def __init__(self, inside: threading.Event):
        super().__init__()
        self.inside = inside

    def acquire(self) -> None:
        super().acquire()
        if self.inside.is_set():  # the window is held open once, for the main thread's record
            return
        self.inside.set()
        for _ in range(2000):  # bytecodes, where the exception is delivered
            time.sleep(0.001)

    def emit(self, record) -> None:
        pass


class Restart(Exception):
    pass


def test_an_asynchronous_exception_inside_a_handlers_lock_leaves_it_held_until_released():
    lg = logging.getLogger(f"ffstate.test.locks.async.{time.monotonic_ns()}")
    lg.propagate = False
    inside = threading.Event()
    handler = _SlowHandler(inside)
    lg.addHandler(handler)
    try:
        main = threading.get_ident()

        def raise_in_main() -> None:
            inside.wait(5)
            ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(main), ctypes.py_object(Restart))

        threading.Thread(target=raise_in_main, daemon=True).start()
        with pytest.raises(Restart):
            lg.warning("the training's record, when the restart lands")
        assert handler.lock._is_owned()  # leaked: this thread still holds it
        assert not logs_from_another_thread(lg, 0.5)
        assert release_held_logging_locks()
        assert logs_from_another_thread(lg)
    finally:
        lg.removeHandler(handler)


def test_the_codec_pools_lock_left_held_is_released_and_its_workers_and_the_next_commit_go_on():
    """An asynchronous exception landing in the codec pool's ``submit`` (measured: its semaphore's lock left held in 50
    landings of 360) leaves a lock that the next commit or restore, and each worker finishing a task, would wait on
    forever: at exit the process could not join them. The finalize releases it; a pool with nothing held is left."""
    from ffstate.codec import backend

    backend.use_threads(2)
    pool = backend._pool()
    assert ReleaseLoggingLocks()(None) is None and backend._pool() is pool
    lock = pool._idle_semaphore._cond._lock
    done = pool.submit(lambda: time.sleep(0.3) or 7)
    lock.acquire()  # as a landing in the next submit leaves it, this task under way
    assert done.result(10) == 7  # the task ran; its worker now waits for the lock, to count itself idle
    ReleaseLoggingLocks()(None)
    assert not lock.locked() and backend._pool() is pool
    assert backend._map(lambda x: x * 2, range(4)) == [0, 2, 4, 6]
    ended = threading.Thread(target=backend.use_threads, args=(0,))  # shuts the pool down: joins its workers
    ended.start()
    ended.join(10)
    assert not ended.is_alive()
