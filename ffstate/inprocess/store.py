"""The job's rendezvous stores, hosted by a process of their own on the first node: every training rank and spare
is a client, so that no rank's death takes them away (a store hosted by rank 0 dies with it, and every survivor
waits out its timeout). Two TCPStores: ``MASTER_PORT`` for the training's process groups and ffstate's keys,
``MASTER_PORT + 1`` for the engine's own.

The host is started, once, by the first process of the job on that node to find nothing listening (a lock in the
job's run folder); it runs in a session of its own and exits once no process of the job, on any node, has sent a
heartbeat for ``IDLE_EXIT`` seconds (each adds to a key of the training's store every ``HEARTBEAT_EVERY`` seconds:
the first node's processes may all be gone, their ranks moved to a spare node, while the job goes on).

    python -m ffstate.inprocess.store [--ready FILE] HOST PORT [IDLE_EXIT]

The host writes ``FILE`` (its pid) once every port listens, and removes it when it goes: the process that started
it waits for that file, or for the host's exit, which it reports at once with the log's last lines (a port held by
another program ends the host after the first port listened: every process then waited out TCPStore's connect).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import fcntl
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from ffstate.daemon import running

log = logging.getLogger("ffstate.inprocess")

IDLE_EXIT = 60.0  # seconds with no heartbeat from any process of the job before the stores go
HEARTBEAT_EVERY = 5.0  # seconds between a process's heartbeats
HEARTBEAT_KEY = "ffstate/inprocess/heartbeats"
START_WAIT = 60.0  # seconds a process waits for the host to listen
PORTS = 2  # the training's store, the engine's
LISTEN_POLL = 0.05  # seconds between looks for a host that does not listen yet


def heartbeat(host: str, port: int, every: float = HEARTBEAT_EVERY) -> None:
    """Counts this process among the job's while it lives, from any node: a thread adds 1 to ``HEARTBEAT_KEY`` of
    the store at ``host:port`` every ``every`` seconds, on a connection of its own.

    A process on another node may get here before the host listens: it connects once `wait_listening` sees it.
    """
    import torch.distributed as dist

    wait_listening(host, port, START_WAIT * 5)
    store = dist.TCPStore(host, port, None, is_master=False, timeout=datetime.timedelta(seconds=START_WAIT * 5))

    def beat() -> None:
        while True:
            try:
                store.add(HEARTBEAT_KEY, 1)
            except Exception as e:  # noqa: BLE001 (the host gone: nothing left to keep alive)
                log.debug("store heartbeat: %s", e)
            time.sleep(every)

    threading.Thread(target=beat, name="ffstate-store-heartbeat", daemon=True).start()


def listening(host: str, port: int) -> bool:
    with contextlib.suppress(OSError), socket.create_connection((host, port), timeout=1.0):
        return True
    return False


def wait_listening(host: str, port: int, timeout: float) -> bool:
    """Looks every ``LISTEN_POLL`` seconds, up to ``timeout``, for something listening at ``host:port``; a client
    connected after it returns True meets the host without delay. TCPStore's own connect retries back off
    exponentially (a client refused for 10 s connected 7.6 s after the host listened, measured): a process that
    started first would meet it seconds late, long enough for a host with a short idle exit to see no beat and go.
    """
    deadline = time.monotonic() + timeout
    while not listening(host, port):
        if time.monotonic() > deadline:
            return False
        time.sleep(LISTEN_POLL)
    return True


def ensure(host: str, port: int, run_dir: Path) -> None:
    """Starts the stores' host at ``host:port`` unless it is up already, and waits until each of its ports listens.

    Raises:
        RuntimeError: the host exited, or was not up within ``START_WAIT`` seconds (with its log's last lines), or
            another program listens at ``host:port``.
    """
    run_dir.mkdir(parents=True, exist_ok=True)
    log_path, ready = run_dir / "stores.log", run_dir / f"stores-{port}.ready"
    with open(run_dir / "stores.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if listening(host, port):
                if not running.alive(_pid(ready)):  # the job's host writes it before anyone may connect, and keeps it
                    raise RuntimeError(f"another program listens at {host}:{port}, MASTER_PORT: the job's stores need "
                                       f"it and the next port free")
                return
            ready.unlink(missing_ok=True)  # a host that was killed leaves it
            with open(log_path, "a") as out:
                start = out.tell()
                proc = subprocess.Popen([sys.executable, "-m", "ffstate.inprocess.store", "--ready", str(ready), host,
                                         str(port)], stdin=subprocess.DEVNULL, stdout=out, stderr=out,
                                        start_new_session=True, close_fds=True)
            deadline = time.monotonic() + START_WAIT
            while not ready.exists():
                if proc.poll() is not None or time.monotonic() > deadline:
                    why = f"its host exited (code {proc.returncode})" if proc.poll() is not None else \
                        f"its host was not up within {START_WAIT:.0f}s"
                    if proc.poll() is None:
                        proc.kill()
                    raise RuntimeError(f"the job's stores did not listen at {host}:{port}-{port + PORTS - 1}: {why} "
                                       f"(MASTER_PORT and the next port must be free); {log_path} says:\n"
                                       f"{_tail(log_path, start)}")
                time.sleep(LISTEN_POLL)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _pid(ready: Path) -> int:
    try:
        return int(ready.read_text())
    except (OSError, ValueError):
        return 0


def _tail(path: Path, start: int, lines: int = 6) -> str:
    with open(path, "rb") as f:
        f.seek(start)
        return "\n".join(f.read(64 << 10).decode(errors="replace").splitlines()[-lines:])


def main(argv: list[str] | None = None) -> int:
    import torch.distributed as dist

    parser = argparse.ArgumentParser(prog="python -m ffstate.inprocess.store")
    parser.add_argument("--ready", type=Path, help="a file written once every port listens, removed at exit")
    parser.add_argument("host")
    parser.add_argument("port", type=int)
    parser.add_argument("idle_exit", type=float, nargs="?", default=IDLE_EXIT)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    stores = []
    for port in range(args.port, args.port + PORTS):
        try:
            stores.append(dist.TCPStore(args.host, port, None, is_master=True, wait_for_workers=False,
                                        multi_tenant=True, timeout=datetime.timedelta(seconds=300)))
        except RuntimeError as e:  # DistNetworkError: the port taken, most often
            log.error("the job's stores cannot listen at %s:%d: %s", args.host, port, e)
            return 1
    if args.ready is not None:
        partial = args.ready.with_name(args.ready.name + ".partial")
        partial.write_text(f"{os.getpid()}\n")
        os.replace(partial, args.ready)  # whole or absent
    log.info("the job's stores listen at %s:%d-%d", args.host, args.port, args.port + PORTS - 1)
    last_alive, beats = time.monotonic(), 0
    try:
        while True:
            time.sleep(min(1.0, args.idle_exit / 4))
            now_beats = stores[0].add(HEARTBEAT_KEY, 0)
            if now_beats != beats:
                last_alive, beats = time.monotonic(), now_beats
            elif time.monotonic() - last_alive > args.idle_exit:
                log.info("no heartbeat from any process of the job for %.0fs: the stores go", args.idle_exit)
                del stores
                return 0
    finally:
        if args.ready is not None and _pid(args.ready) == os.getpid():  # not a later host's
            args.ready.unlink(missing_ok=True)


if __name__ == "__main__":
    sys.exit(main())
