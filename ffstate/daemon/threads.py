"""The daemon's threads under their own names in the operating system, so that ``top -H``, ``ps -L`` and
``perf --sort comm`` say where its CPU goes: the codec's pool (``codec_0``...), each local rank's replicator
(``repl-0``...), the pushes' and the server's pools (``batch_0``, ``rpc_0``...), grpcio's own Python
threads (``_serve``, its server's; ``_run``, each streamed push's request feeder, one a call), the watchdogs. gRPC's
core names its threads itself (``event_engine``). Python before 3.14 leaves every thread with the process's name.

A thread's name is set from its Python name by a profile hook that runs once, at the thread's first call, and takes
itself off: nothing after that.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import re
import sys
import threading

PR_SET_NAME = 15  # prctl(2)
NAME_BYTES = 15  # the kernel keeps 15 bytes and a NUL

_prctl = None


def os_name(name: str) -> str:
    """The short name a Python thread gets: ``ffstate-codec_0`` -> ``codec_0``; ``Thread-7 (_serve)`` -> ``_serve``."""
    short = name.removeprefix("ffstate-")
    target = re.fullmatch(r"Thread-\d+ \((.+)\)", short)
    if target:
        short = target.group(1)
    return short.encode("utf-8", "replace")[:NAME_BYTES].decode("utf-8", "ignore")


def set_current(name: str) -> bool:
    """Gives the calling thread ``os_name(name)`` in the operating system; False where that cannot be done."""
    global _prctl
    if not sys.platform.startswith("linux"):
        return False
    if _prctl is None:
        _prctl = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True).prctl
    return _prctl(PR_SET_NAME, ctypes.c_char_p(os_name(name).encode()), 0, 0, 0) == 0


def _first_call(frame, event, arg) -> None:
    sys.setprofile(None)  # once: this thread runs unprofiled from here on
    set_current(threading.current_thread().name)


def name_new_threads() -> None:
    """Every thread started after this call names itself after its Python name (its first call does)."""
    threading.setprofile(_first_call)
