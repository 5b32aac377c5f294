"""Stopping a process group that waits on a dead peer, so that the surviving ranks can leave the step at once.

NCCL has an abort, which NVIDIA's resiliency extension calls. gloo has none that works: in torch 2.13 neither
``ProcessGroup.abort()`` nor ``shutdown()`` nor ``destroy_process_group()`` releases a collective blocked on a peer
that died; it waits out its timeout (measured: 5.1 s with a 5 s timeout). Shutting the group's connected sockets
down does: the blocked operation fails at once ("connection closed by peer") and a new group on a fresh store prefix
starts in tens of milliseconds. The sockets are those ``init_process_group`` opened: the process's sockets after it
that were not there before it, told apart by their inodes, not their descriptors' numbers (a number closed meanwhile
is given to the next socket opened, which by its number could pass for one that was there before). At the abort, a
descriptor is shut down only if it still is that socket: gloo closes a pair whose peer shut it down first, and its
number may belong to another connection by then (a gRPC channel's). gloo's listening socket is left alone (shutting
it down aborts the process).

An aborted gloo group is then held, off the training's thread, until its own timeout has passed: a send gloo had
queued on a pair never fails until then, and the group's destructor joins the thread stuck in it. Dropped where the
training drops it (DDP's cycle, collected by the engine's ``gc.collect()`` between two entries), it held that thread
in the collection (seen 3 times in 21 runs of ``tests/system/test_abort_race.py`` under load). One still held when
the interpreter exits is left to the OS (``_leak_at_exit``).
"""

from __future__ import annotations

import atexit
import collections
import ctypes
import datetime
import logging
import os
import socket
import threading
import time
from typing import Any

import torch.distributed as dist
from nvidia_resiliency_ext.inprocess.abort import Abort, AbortTorchDistributed

from ffstate import inflight
from ffstate.inprocess.unwind import UnwindDeadline

log = logging.getLogger("ffstate.inprocess")


def open_sockets() -> dict[int, str]:
    """This process's sockets: each descriptor's number and what it refers to (``socket:[inode]``)."""
    out = {}
    for name in os.listdir("/proc/self/fd"):
        target = _target(int(name))
        if target is not None and target.startswith("socket:"):
            out[int(name)] = target
    return out


def new_sockets(before: dict[int, str]) -> dict[int, str]:
    """The sockets open now that were not open at ``before`` (``open_sockets()``), by inode: a descriptor number
    reused by a new socket counts as new."""
    known = set(before.values())
    return {fd: target for fd, target in open_sockets().items() if target not in known}


def _target(fd: int) -> str | None:
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:  # closed meanwhile
        return None


class GroupAbort(Abort):
    """The engine's abort (it runs in the engine's monitor thread while the training's thread may be inside a
    collective): NCCL groups by the extension's own abort; gloo groups by shutting down their sockets, then the
    group is destroyed."""

    def __init__(self, timeout: datetime.timedelta = datetime.timedelta(minutes=30),
                 unwind: UnwindDeadline | None = None) -> None:
        self._sockets: dict[int, str] = {}
        self._unwind = unwind  # armed at each abort: the training thread must leave its step within its grace
        self._nccl = AbortTorchDistributed()
        self._timeout = timeout.total_seconds()  # the groups' own: how long an aborted one is held

    def opened(self, sockets: dict[int, str]) -> None:
        """The sockets the current process group opened (``new_sockets``)."""
        self._sockets = dict(sockets)

    def __call__(self, state: Any) -> Any:
        if self._unwind is not None and dist.is_available() and dist.is_initialized():
            # A group exists: its collectives are what a survivor may be stuck in. Without one (a rank that died
            # before the next entry's group was made: the others wait for its arrival in Python, where the restart
            # lands, ffstate/inprocess/group.py; or after the function returned and destroyed its group) none is
            # armed.
            self._unwind.aborted()
        if dist.is_available() and dist.is_initialized() and dist.get_backend() == "nccl":
            return self._nccl(state)
        start = time.perf_counter()
        shut = gone = 0
        for fd, target in sorted(self._sockets.items()):
            if _target(fd) != target:  # closed (gloo closes a pair whose peer shut it down), the number maybe reused
                gone += 1
                continue
            try:
                s = socket.socket(fileno=fd)
            except OSError:  # closed meanwhile
                gone += 1
                continue
            try:
                if not s.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                    s.shutdown(socket.SHUT_RDWR)
                    shut += 1
            except OSError:  # not connected any more
                gone += 1
            finally:
                s.detach()  # the descriptor stays gloo's: it closes it when the group goes
        self._sockets = {}
        # gloo never fails a send left on a pair's transmit queue: what the training waits on through ffstate
        # (DDP's gradient all-reduce and buffer broadcast) is ended here instead (ffstate/inflight.py).
        group = dist.distributed_c10d._get_default_group() if dist.is_available() and dist.is_initialized() else None
        ended = inflight.abort("the process group was aborted after a failure elsewhere in the job", keep=group)
        had_group = group is not None
        if had_group:
            hold(group, self._timeout + 60)
        del group
        if dist.is_available() and dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception as e:  # the group is gone either way; say why it did not go cleanly
                log.warning("destroying the process group after a failure: %s", e)
        if not had_group and not shut + gone + ended:  # no group (between two entries, after the function returned)
            log.debug("abort: no process group, nothing to end")
            return state
        log.info("aborted the process group in %.0f ms (%d sockets shut down, %d closed already; %d collectives "
                 "in flight ended)", (time.perf_counter() - start) * 1e3, shut, gone, ended)
        return state


_held: collections.deque = collections.deque()  # (when it may go, an aborted group), in that order
_held_lock = threading.Lock()
_reaper: threading.Thread | None = None
_exit_registered = False


def hold(group: Any, seconds: float) -> None:
    """Keeps ``group`` for ``seconds``, then lets it go on a thread of its own (where its destructor may wait for a
    worker thread that was stuck): never on the thread that drops the group's last other reference."""
    global _reaper, _exit_registered
    with _held_lock:
        _held.append((time.monotonic() + seconds, group))
        if not _exit_registered:
            atexit.register(_leak_at_exit)
            _exit_registered = True
        if _reaper is None:
            _reaper = threading.Thread(target=_reap, name="ffstate-aborted-groups", daemon=True)
            _reaper.start()


def held() -> int:
    """How many aborted groups are held now."""
    with _held_lock:
        return len(_held)


def _reap() -> None:
    global _reaper
    while True:
        with _held_lock:
            now = time.monotonic()
            due = []
            while _held and _held[0][0] <= now:
                due.append(_held.popleft()[1])
            if not _held and not due:
                _reaper = None
                return
            wait = _held[0][0] - now if _held else 0.0
        due.clear()  # the groups go here, on this thread: a destructor that joins a stuck worker waits here
        if wait > 0:
            time.sleep(min(wait, 60.0))


def _leak_at_exit() -> None:
    """At the interpreter's exit the groups still held would go with this module's teardown, on the main thread, where
    a worker still stuck in a send holds the exit until the group's timeout: they are leaked instead (the process is
    ending, its memory and threads with it)."""
    with _held_lock:
        for _, group in _held:
            ctypes.pythonapi.Py_IncRef(ctypes.py_object(group))
