"""A process's start: its imports with Python's cyclic collector paused, the objects they made frozen after; and
its end without the interpreter's finalization, where torch's gloo threads can abort it.

Importing torch (or a training script's framework; ffstate's daemon imports neither) makes some 200,000 objects
that live as long as the process. CPython's collector walks them again and again while the imports run (a young
collection every 700 new objects, a full one each time the objects that survived grew by a quarter), and once more
when the interpreter ends. Measured on this project's 2-core machine (5 runs each), `import` of the demo worker's
modules, then exit: 2.96 s of CPU as it is, 1.89 s with the collector paused for the imports and the result frozen
(``gc.freeze``: never walked again, never freed, as a module's objects are not anyway); the daemon's modules 1.97 s,
1.37, when the daemon still imported torch (it no longer does: 0.56 s of CPU to its first idle moment, paused). A
full collection in a process with torch imported walks them all: 88 ms, against microseconds once they are
frozen. The cyclic garbage the imports leave is frozen with the rest, not freed: 8,679 objects in the demo worker,
where collecting them first would cost 0.24 s.

ffstate does this in the processes it starts (``ffstate serve``, the daemon's flushing process) and in its demo's
worker, never in a training process it is imported into: that process's collector is its owner's
(docs/deployment.md says how a training script does the same).

The end: after ``destroy_process_group`` a gloo process group that something still references (a DDP module, an
FSDP2 mesh) keeps its worker threads, and a worker that drops a finished collective's tensors takes the interpreter
lock to release their Python objects. If the main thread is finalizing the interpreter by then, CPython ends that
thread in ``take_gil`` with a forced unwind through a ``noexcept`` destructor, and the process dies with SIGABRT
("terminate called without an active exception") after its work is done (pytorch/pytorch#190489). Seen here in
6 of about 64 3-rank DCP loads into FSDP2 under load whose last step is ``full_tensor``'s all-gathers (a core dump:
``~AsyncAllgatherCoalescedWork`` in ``ProcessGroupGloo::runLoop``). ``exit_now`` skips the finalization: ffstate's
demo worker and its tests' job scripts end by it; a training script can do the same once its files are written.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import sys
from typing import Iterator, NoReturn


def pause() -> bool:
    """The collector off from here (a process's first line, before its imports); whether it was on."""
    was = gc.isenabled()
    gc.disable()
    return was


def imported(was: bool) -> None:
    """After the imports: everything made so far frozen (``gc.freeze``), the collector on again if ``was`` (what
    ``pause`` returned)."""
    gc.freeze()
    if was:
        gc.enable()


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """Python's cyclic collector off for the block (a process's imports), everything it made frozen after, and the
    collector on again if it was."""
    was = pause()
    try:
        yield
    finally:
        imported(was)


def exit_now(code: int = 0) -> NoReturn:
    """End the process with ``code`` once its work is done: the log handlers and the standard streams flushed,
    then ``os._exit``, without the interpreter's finalization (no ``atexit`` handlers, no finalizers), where a gloo
    worker thread still releasing a collective's tensors can abort the process (the module's docstring)."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):  # and the originals where replaced
        if stream is None:
            continue
        try:
            stream.flush()
        except (OSError, ValueError):  # closed, or a broken pipe: nothing more can reach it
            pass
    os._exit(code)
