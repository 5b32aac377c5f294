"""Logging locks that the engine's asynchronous restart left held, released on the training's thread.

The engine (NVIDIA's resiliency extension) ends a training function by raising ``RankShouldRestart`` in the main
thread from its monitor thread (``PyThreadState_SetAsyncExc``): the exception lands between any two bytecodes. In
Python before 3.13 a logging handler takes its lock with ``self.acquire()`` and only then enters the ``try`` whose
``finally`` releases it; an exception landing between the two leaves the lock held by the main thread for good. The
main thread can still log (the lock is reentrant); every other thread that logs through that handler waits forever
— among them the next failure's monitor thread, inside ffstate's own abort, so the job never restarts again.

Seen once in a run of the in-process test (rank 2's process: the root handler's lock owned by its main thread, count
1, while that thread waited for its monitor thread, which waited for the lock inside ``GroupAbort``). After each
restart, on the main thread, where no logging call is under way, the locks it still holds are leaked ones:
``ReleaseLoggingLocks`` releases them, before any other thread needs them; and the codec thread pool's locks held for
``backend.LEAK_WAIT`` (a restart that landed in its ``submit``: measured, 50 landings of 360 in that call left its
semaphore's lock held), which the next commit or restore, and the pool's workers at the process's exit, would wait
on forever.
"""

from __future__ import annotations

import logging
from typing import Any

from nvidia_resiliency_ext import inprocess

log = logging.getLogger(__name__)


def _logging_locks() -> list[tuple[str, Any]]:
    """Every handler's lock of every logger, and logging's module lock (held while loggers are made or configured)."""
    loggers = [logging.getLogger()] + [lg for lg in list(logging.Logger.manager.loggerDict.values())
                                        if isinstance(lg, logging.Logger)]
    locks, seen = [], set()
    for lg in loggers:
        for h in list(lg.handlers):
            if h.lock is not None and id(h.lock) not in seen:
                seen.add(id(h.lock))
                locks.append((f"{lg.name or 'root'}: {type(h).__name__}", h.lock))
    module_lock = getattr(logging, "_lock", None)  # a private name: where it is absent, there is nothing to release
    if module_lock is not None:
        locks.append(("logging's module lock", module_lock))
    return locks


def release_held_logging_locks() -> list[str]:
    """Releases every logging lock the calling thread holds; returns which (with the counts released). Call only
    where this thread is in no logging call: each hold there is a leaked one."""
    released = []
    for name, lock in _logging_locks():
        owned = getattr(lock, "_is_owned", None)  # an RLock's; a plain Lock cannot say who holds it
        count = 0
        while owned is not None and owned():
            lock.release()
            count += 1
        if count:
            released.append(f"{name} ({count})")
    return released


class ReleaseLoggingLocks(inprocess.finalize.Finalize):
    """The engine's ``finalize``: runs on the main thread right after it caught the restart, before the next entry."""

    def __call__(self, state: Any) -> Any:
        released = release_held_logging_locks()
        if released:
            log.warning("released logging locks the restart's asynchronous exception left held on this thread: %s",
                        ", ".join(released))
        from ffstate.codec import backend

        if pool := backend.release_leaked_pool_locks():  # the same hazard, in the codec's thread pool
            log.warning("released the codec pool's %s, which the restart's asynchronous exception left held",
                        " and ".join(pool))
        return state
