"""The job's rendezvous stores, hosted by a process of their own on the first node: every training rank and spare
is a client, so that no rank's death takes them away (a store hosted by rank 0 dies with it, and every survivor
waits out its timeout). Two TCPStores: ``MASTER_PORT`` for the training's process groups and ffstate's keys,
``MASTER_PORT + 1`` for the engine's own.

The host is started, once, by the first process of the job on that node to find nothing listening (a lock in the
job's run folder); it runs in a session of its own and exits once no process of the job that registered itself
(a pid file in the run folder) has been alive for ``IDLE_EXIT`` seconds.

    python -m ffstate.inprocess.store HOST PORT RUN_DIR
"""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import logging
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

log = logging.getLogger("ffstate.inprocess")

IDLE_EXIT = 60.0  # seconds with no registered process of the job alive before the stores go
START_WAIT = 60.0  # seconds a process waits for the host to listen
PORTS = 2  # the training's store, the engine's


def pids_dir(run_dir: Path) -> Path:
    return run_dir / "inprocess-pids"


def register(run_dir: Path) -> None:
    """Counts this process among the job's (the host stays while one is alive)."""
    pids_dir(run_dir).mkdir(parents=True, exist_ok=True)
    (pids_dir(run_dir) / str(os.getpid())).touch()


def listening(host: str, port: int) -> bool:
    with contextlib.suppress(OSError), socket.create_connection((host, port), timeout=1.0):
        return True
    return False


def ensure(host: str, port: int, run_dir: Path) -> None:
    """Starts the stores' host at ``host:port`` unless something listens there, and waits for it.

    Raises:
        RuntimeError: it does not listen within ``START_WAIT`` seconds (its log is in the run folder).
    """
    run_dir.mkdir(parents=True, exist_ok=True)
    log_path = run_dir / "stores.log"
    with open(run_dir / "stores.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if not listening(host, port):
                with open(log_path, "a") as out:
                    subprocess.Popen([sys.executable, "-m", "ffstate.inprocess.store", host, str(port), str(run_dir)],
                                     stdin=subprocess.DEVNULL, stdout=out, stderr=out, start_new_session=True,
                                     close_fds=True)
                deadline = time.monotonic() + START_WAIT
                while not listening(host, port):
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"the job's stores did not listen at {host}:{port} within {START_WAIT:.0f}s; "
                                           f"see {log_path}")
                    time.sleep(0.05)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _any_alive(run_dir: Path) -> bool:
    for f in pids_dir(run_dir).glob("*"):
        try:
            os.kill(int(f.name), 0)
            return True
        except (ProcessLookupError, ValueError):
            f.unlink(missing_ok=True)
        except PermissionError:
            return True
    return False


def main(argv: list[str] | None = None) -> int:
    import torch.distributed as dist

    host, port, run_dir = (argv or sys.argv[1:])[:3]
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    stores = [dist.TCPStore(host, int(port) + i, None, is_master=True, wait_for_workers=False, multi_tenant=True,
                            timeout=datetime.timedelta(seconds=300)) for i in range(PORTS)]
    log.info("the job's stores listen at %s:%s-%d", host, port, int(port) + PORTS - 1)
    last_alive = time.monotonic()
    while True:
        time.sleep(1.0)
        if _any_alive(Path(run_dir)):
            last_alive = time.monotonic()
        elif time.monotonic() - last_alive > IDLE_EXIT:
            log.info("no process of the job alive for %.0fs: the stores go", IDLE_EXIT)
            del stores
            return 0


if __name__ == "__main__":
    sys.exit(main())
