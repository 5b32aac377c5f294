"""Failures the tests and benchmarks inject from inside a worker."""

from __future__ import annotations

import os
import re
import signal
from pathlib import Path
from typing import Callable


def die_once(marker: Path, before: Callable[[], None] | None = None) -> None:
    """SIGKILLs this process, once per ``marker`` (a file made exclusively first: torchrun's restart of the worker,
    or another process of the job, passes here again and goes on); ``before()`` runs just before the kill."""
    try:
        os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return
    if before is not None:
        before()
    os.kill(os.getpid(), signal.SIGKILL)


def monitor_pid(run_dir: Path, process: int) -> int:
    """The pid of the in-process engine's monitor process of ``process``: the first line of its log in the job's run
    folder names it (``daemon_pid=``); a machine's loss takes it with the process."""
    from ffstate.inprocess.engine import MONITOR_LOG

    log = run_dir / MONITOR_LOG.format(rank=process)
    return int(re.search(r"daemon_pid=(\d+)", log.read_text()).group(1))
