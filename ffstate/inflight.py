"""The collectives ffstate issues for DDP (the gradient all-reduce of its communication hook, the broadcast of the
module's buffers), made so that an abort of their process group ends the training thread's wait on them at once.

Why: under the in-process engine (``ffstate/inprocess/``) a failure elsewhere aborts the process group of ranks that
are alive, in the middle of whatever collective they are in, by shutting down the group's sockets
(``inprocess/abort.py``). gloo then fails every operation waiting on a pair, except one: a send already queued on
the pair's transmit queue (a large message the socket could not take at once) is never told, and its worker thread
waits out the group's timeout (30 minutes) in ``UnboundBuffer::waitSend``. The training thread waiting on that work
(DDP's ``Reducer::finalize_backward``, or the buffer broadcast at the start of a forward) stays in C++ as long, and
the engine's interruption, raised into that thread once, is never delivered. Reproduced with two processes, gloo
and nothing else (``tests/procs/abort_race.py``, run by ``tests/system/test_abort_race.py``).

What this does: while ``enable()`` is on (the engine turns it on), each such collective is waited on through a
future of ffstate's (``track``), completed by a thread of its own when the work ends, and failed by ``abort()``
(the engine's abort calls it) if the work has not ended by then. The training thread is then released however the
work ends, and no Python callback of ffstate's runs on the training thread while a collective is on the wire: an
exception the engine raises into that thread lands in the training's own code, not in a callback that would turn
it into another error. A work stuck in gloo stays stuck in its worker thread until its timeout; the retired waiting
thread holds the aborted group until then (its destructor would join that worker). Outside the engine, and on
NCCL (whose abort works), nothing here runs: the hooks are the plain ones.
"""

from __future__ import annotations

import logging
import queue
import threading
from typing import Any, Callable, Optional

import torch

_lock = threading.Lock()
_enabled = False
_aborted: Optional[str] = None  # why the current group was aborted; None while it is healthy
_pending: set = set()  # ffstate's futures not completed yet
_waiter: Optional["_Waiter"] = None
log = logging.getLogger("ffstate.inflight")


class Aborted(RuntimeError):
    """A collective ffstate waited on was ended by the abort of its process group."""


def enable(on: bool = True) -> None:
    """Turns the abortable waits on (the in-process engine, at its start) or off."""
    global _enabled
    _enabled = on


def enabled() -> bool:
    return _enabled


def reset() -> None:
    """A new process group: collectives may be issued again (the engine, before each entry's group)."""
    global _aborted
    with _lock:
        _aborted = None


def track(work_future: torch.futures.Future, value: Callable[[Any], Any] = lambda v: v,
          on_end: Optional[Callable[[], None]] = None) -> torch.futures.Future:
    """A future that resolves to ``value`` of ``work_future``'s value when the work ends (or fails with its error),
    or fails with ``Aborted`` at ``abort()``, whichever comes first; ``on_end`` runs once the work has ended, on
    ffstate's waiting thread. What is returned is continued from ffstate's own future by a callback that runs on
    the thread completing it (the waiting thread, or the abort's), never the caller's: an error reaches DDP's C++
    as an error.

    Raises:
        Aborted: the group was aborted already (the collective would never be waited out).
    """
    return _tracked(work_future, value, on_end, continued=True)


def _tracked(work_future: torch.futures.Future, value: Callable[[Any], Any], on_end: Optional[Callable[[], None]],
             continued: bool) -> torch.futures.Future:
    """ffstate's future for the work, or (``continued``) its continuation, made before anyone can complete it: its
    callback then never runs on this thread."""
    ours = torch.futures.Future()
    given = ours.then(_value) if continued else ours
    with _lock:
        if _aborted is not None:
            raise Aborted(_aborted)
        _pending.add(ours)
        _current_waiter().put((work_future, ours, value, on_end))  # under the lock: an abort cannot retire it first
    return given


def _value(f: torch.futures.Future) -> Any:
    return f.value()


def wait(work_future: torch.futures.Future) -> Any:
    """Waits for ``work_future`` as ``track`` does; its value.

    Raises:
        Aborted: the group was aborted before the work ended.
    """
    return _tracked(work_future, lambda v: v, None, continued=False).wait()


def abort(reason: str, keep: Any = None) -> int:
    """Fails every future of ``track`` not completed yet with ``Aborted(reason)``, and refuses new ones until
    ``reset()``; returns how many it failed. The waiting thread, which may be inside a work that never ends, is
    retired (the next group's collectives do not queue behind it) and holds ``keep`` (the aborted group) until the
    works it was given have ended: the group's destructor joins its worker threads, and must not run on the
    training's thread while one of them is stuck."""
    global _aborted, _waiter
    with _lock:  # a future leaves _pending once, under the lock: whoever takes it out completes it
        _aborted = reason
        failed = list(_pending)
        _pending.clear()
        if _waiter is not None:
            _waiter.retire(keep)
            _waiter = None
    for f in failed:
        f.set_exception(Aborted(reason))
    return len(failed)


def _current_waiter() -> "_Waiter":
    global _waiter
    if _waiter is None:
        _waiter = _Waiter()
    return _waiter


class _Waiter:
    """One thread that waits on the works in the order they were issued (a group's collectives end in that order)
    and completes ffstate's futures. Retired at an abort, it finishes the works it was given, then lets go of what
    it was asked to keep."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._kept: Any = None
        self._thread = threading.Thread(target=self._run, name="ffstate-collectives", daemon=True)
        self._thread.start()

    def put(self, item: tuple) -> None:
        self._queue.put(item)

    def retire(self, keep: Any = None) -> None:
        self._kept = keep
        self._queue.put(None)

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            work_future, ours, value, on_end = item
            error: Optional[BaseException] = None
            try:
                result = value(work_future.wait())
            except Exception as e:  # the work's error, given to the waiting thread
                result, error = None, e
            if on_end is not None:
                try:
                    on_end()
                except Exception as e:  # a mark not set is no reason to leave a future uncompleted
                    error = error or e
            with _lock:
                mine = ours in _pending
                _pending.discard(ours)
            if not mine:  # failed by an abort while the work went on
                continue
            try:
                if error is None:
                    ours.set_result(result)
                else:
                    ours.set_exception(error)
            except Exception as e:  # the continuation's own failure: the future is complete either way
                log.warning("completing a collective's future: %s", e)
        self._kept = None
