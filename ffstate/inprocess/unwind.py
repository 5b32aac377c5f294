"""A bound on how long a survivor may take to leave its step after its process group was aborted.

When a rank of the job dies, the engine aborts the process group of every survivor (``abort.GroupAbort``) and
raises its restart into each survivor's training thread; the thread leaves at its next bytecode and enters again.
A thread that is inside C++ then is not told until the call returns. Nearly always it returns at once: the abort
fails every wait on the group's sockets. One kind does not: gloo never fails a send it had queued on a pair whose
socket went down (``ffstate/inflight.py`` says how ffstate's own collectives avoid it), so a thread waiting on such
a work inside a collective ffstate does not issue (DDP's bucket rebuild or construction, the loop's own
``all_reduce``) waits out the group's timeout, 30 minutes, and the whole job with it: every other rank waits in the
engine's barrier for this one.

``UnwindDeadline`` makes that wait a bounded one. The abort of a process group arms it (``aborted``; not where no
group exists: before the next entry's group is made the ranks wait for each other in Python, where the restart
lands, ``group.py``); the engine's ``finalize``, on the training thread once it left the
step, disarms it (``unwound``). A thread still inside after ``grace`` seconds is not coming back: the process
writes where its threads are to its standard error and SIGKILLs itself, which the engine's monitor process reports
as a death, as it would any other: the job restarts without this process (a spare takes its rank, or the job goes
on smaller where ``Config.min_nodes`` allows, as after any rank's death).

The report is written straight to file descriptor 2 (no ``logging``): a thread stuck this way may hold a handler's
lock (``locks.py``), and the report must not wait for it.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import sys
import threading
import time
from typing import Any

from nvidia_resiliency_ext import inprocess

# Seconds: past ffstate's own longest bounded wait on the training thread (a restore's fetch from a holder, 300 s;
# a gRPC call holds the engine's exception until it returns), a third of gloo's 30-minute timeout.
GRACE = 600.0


class UnwindDeadline:
    """Armed by each abort, disarmed when the training thread reached the engine's restart; a process whose thread
    is still in its step ``grace`` seconds after an abort ends itself (SIGKILL) with a report on its stderr."""

    def __init__(self, grace: float = GRACE, what: str = "") -> None:
        self.grace = grace
        self.what = what  # who this process is, for the report ("rank 2 (process 5, iteration 1)")
        self._lock = threading.Lock()
        self._armed: threading.Event | None = None  # the current abort's: set once the thread unwound

    def aborted(self) -> None:
        """An abort began (the engine's monitor thread): from now the training thread has ``grace`` seconds."""
        with self._lock:
            if self._armed is not None:  # an abort while one is armed: its deadline stands
                return
            done = self._armed = threading.Event()
        threading.Thread(target=self._watch, args=(done, time.monotonic()), name="ffstate-unwind-deadline",
                         daemon=True).start()

    def unwound(self) -> None:
        """The training thread left its step (the engine's finalize, or the engine's end)."""
        with self._lock:
            done, self._armed = self._armed, None
        if done is not None:
            done.set()

    def _watch(self, done: threading.Event, since: float) -> None:
        if done.wait(self.grace):
            return
        main = threading.main_thread().ident
        frame = sys._current_frames().get(main)
        where = f"{frame.f_code.co_filename}:{frame.f_lineno} in {frame.f_code.co_name}" if frame else "unknown"
        report = (f"ffstate.inprocess: {self.what or 'this process'}: the training thread is still in its step "
                  f"{time.monotonic() - since:.0f} s after its process group was aborted (innermost Python frame: "
                  f"{where}); a wait inside C++ the abort did not end (gloo never fails a send it had queued), "
                  "which would hold the whole job until the group's timeout. This process ends now (SIGKILL): the "
                  "engine restarts the job without it, as after any rank's death. Every thread's stack follows.\n")
        try:
            os.write(2, report.encode())
            faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        except (OSError, ValueError, AttributeError):  # no stderr to write to: end anyway
            pass
        os.kill(os.getpid(), signal.SIGKILL)


class Unwound(inprocess.finalize.Finalize):
    """Part of the engine's ``finalize`` (on the training thread, right after it caught the restart): disarms the
    deadline."""

    def __init__(self, deadline: UnwindDeadline) -> None:
        self.deadline = deadline

    def __call__(self, state: Any) -> Any:
        self.deadline.unwound()
        return state
