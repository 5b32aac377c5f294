"""The job's rendezvous stores, hosted by a process of their own on the first node: every training rank and spare
is a client, so that no rank's death takes them away (a store hosted by rank 0 dies with it, and every survivor
waits out its timeout). Two TCPStores: ``MASTER_PORT`` for the training's process groups and ffstate's keys,
``MASTER_PORT + 1`` for the engine's own.

The host is started, once, by the first process of the job on that node to find nothing listening (a lock in the
job's run folder); it runs in a session of its own. Each process counts itself in when it meets the stores
(``join``: one more in ``JOINED_KEY``) and out when the engine returns or gives up (``leave``: its number in
``LEFT_KEY``, with the processes it knows were lost, marked ``~``). The host goes:

- at once when every process that joined has left (a job that ended with no process lost, or stopped with
  ``TrainingRaised``);
- once every process that joined has left or was reported lost by one that left (a job that ended after
  failures, or stopped with ``NoSpareLeft``), and no heartbeat has come for ``QUIET`` seconds (a process reported
  lost may still be on its way out), or at once when the next launch's first process meets them (``join``);
- once no process of the job, on any node, has sent a heartbeat for ``IDLE_EXIT`` seconds (each adds to a key of
  the training's store every ``HEARTBEAT_EVERY`` seconds: the first node's processes may all be gone, their ranks
  moved to a spare node, while the job goes on): a job killed whole.

The stores end by ``JOINED_KEY``'s count swapped for ``ENDED`` (only if no process joined since it was read), by the
host or by the next launch's first process: a process that joins stores that are going gets a negative count, waits
for the host to go, and meets the next one.

    python -m ffstate.inprocess.store [--ready FILE] [--quiet S] HOST PORT [IDLE_EXIT]

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
from typing import Any, Iterable

from ffstate.daemon import running

log = logging.getLogger("ffstate.inprocess")

IDLE_EXIT = 60.0  # seconds with no heartbeat from any process of the job before the stores go
HEARTBEAT_EVERY = 5.0  # seconds between a process's heartbeats
HEARTBEAT_KEY = "ffstate/inprocess/heartbeats"
JOINED_KEY = "ffstate/inprocess/joined"  # how many processes met the stores; ENDED once the host is going
LEFT_KEY = "ffstate/inprocess/left"  # "p," for each process that left, "~p," for each one a leaving process knew lost
ENDED = -(1 << 40)  # JOINED_KEY's value once the host is going (a later join's count stays negative)
QUIET = 2 * HEARTBEAT_EVERY + 1  # seconds without a heartbeat before a host whose processes left or were lost goes
ENDING_WAIT = 30.0  # seconds a process waits for a host that is going to have gone
LEAVE_TIMEOUT = 10.0  # seconds a process's leave may wait for an unreachable host
START_WAIT = 60.0  # seconds a process waits for the host to listen
PORTS = 2  # the training's store, the engine's
LISTEN_POLL = 0.05  # seconds between looks for a host that does not listen yet


def join(host: str, port: int, run_dir: Path, local: bool) -> tuple[Any, threading.Event]:
    """Meets the job's stores at ``host:port`` (starting their host first where ``local``: the host's node), counts
    this process in and starts its heartbeat; returns the training's store and the heartbeat's stop.

    Stores an earlier launch left (every process of it left or was reported lost by one that left) are ended now,
    rather than after their host's quiet time; a host that is going is waited for, and the next one met (started
    here where ``local``).

    Raises:
        RuntimeError: as ``ensure``, or a host that was going did not go within ``ENDING_WAIT`` seconds; torch's
            ``DistStoreError`` when the stores did not listen within ``START_WAIT`` and TCPStore's 300 s.
    """
    import torch.distributed as dist

    deadline = time.monotonic() + ENDING_WAIT
    while True:
        if local:
            ensure(host, port, run_dir)
        # A process on another node may start first: it meets the host as soon as it listens, or goes on to
        # TCPStore's own connect, which retries for its timeout.
        wait_listening(host, port, START_WAIT)
        store = dist.TCPStore(host, port, None, is_master=False, timeout=datetime.timedelta(seconds=300))
        try:
            why, joined = _gone(store, quiet=float("inf"), quiet_for=0.0)
            if why is not None and joined > 0 and _end(store, joined):
                log.info("the job's stores at %s:%d are an earlier launch's (%s): ended, meeting the next", host,
                         port, why)
            elif store.add(JOINED_KEY, 1) > 0:
                return store, heartbeat(host, port)
        except dist.DistNetworkError:  # the host went between the look and the count
            pass
        del store
        log.info("the job's stores at %s:%d are going (an earlier launch's): waiting for them to go", host, port)
        while listening(host, port):
            if time.monotonic() > deadline:
                raise RuntimeError(f"the job's stores at {host}:{port} were going (an earlier launch's) and did not "
                                   f"go within {ENDING_WAIT:.0f}s: launch again once no `ffstate.inprocess.store` "
                                   "process is left, or on another MASTER_PORT")
            time.sleep(LISTEN_POLL)


def leave(store: Any, process: int, lost: Iterable[int], beating: threading.Event | None = None) -> None:
    """Counts process ``process`` out of the job (its engine returned or gave up), with the processes it knows were
    lost, and stops its heartbeat: once every process that joined is out, the host goes."""
    if beating is not None:
        beating.set()
    with contextlib.suppress(Exception):  # the host gone already, or unreachable: nothing to tell
        store.set_timeout(datetime.timedelta(seconds=LEAVE_TIMEOUT))
        store.append(LEFT_KEY, f"{process}," + "".join(f"~{p}," for p in lost))


def heartbeat(host: str, port: int, every: float = HEARTBEAT_EVERY) -> threading.Event:
    """Counts this process among the job's while it lives, from any node: a thread adds 1 to ``HEARTBEAT_KEY`` of
    the store at ``host:port`` every ``every`` seconds, on a connection of its own, until the event returned is set.

    A process on another node may get here before the host listens: it connects once `wait_listening` sees it.
    """
    import torch.distributed as dist

    wait_listening(host, port, START_WAIT * 5)
    store = dist.TCPStore(host, port, None, is_master=False, timeout=datetime.timedelta(seconds=START_WAIT * 5))
    stop = threading.Event()

    def beat() -> None:
        while not stop.is_set():
            try:
                store.add(HEARTBEAT_KEY, 1)
            except Exception as e:  # noqa: BLE001 (the host gone: nothing left to keep alive)
                log.debug("store heartbeat: %s", e)
            stop.wait(every)

    threading.Thread(target=beat, name="ffstate-store-heartbeat", daemon=True).start()
    return stop


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


LEAVE_POLL = 0.25  # seconds between the host's looks at who joined and left


def _gone(store: Any, quiet: float, quiet_for: float) -> tuple[str | None, int]:
    """Why the job's processes are all gone by what they said (None: not all), and how many joined."""
    joined = store.add(JOINED_KEY, 0)
    if joined <= 0:
        return None if joined == 0 else "ended by the next launch (every process of this one was out)", joined
    said = store.get(LEFT_KEY).decode().split(",") if store.check([LEFT_KEY]) else []
    left = {p for p in said if p and not p.startswith("~")}
    lost = {p[1:] for p in said if p.startswith("~")} - left
    if len(left) >= joined:
        return f"every process of the job left ({len(left)})", joined
    if len(left | lost) >= joined and quiet >= quiet_for:
        return (f"every process of the job left ({len(left)}) or was lost ({len(lost)}), and none beat for "
                f"{quiet:.0f}s"), joined
    return None, joined


def _end(store: Any, joined: int) -> bool:
    """Marks the stores as going, unless a process joined since ``joined`` were counted (the host then looks again:
    that process was told nothing, and counts on them)."""
    return int(store.compare_set(JOINED_KEY, str(joined), str(ENDED))) == ENDED


def main(argv: list[str] | None = None) -> int:
    import torch.distributed as dist

    parser = argparse.ArgumentParser(prog="python -m ffstate.inprocess.store")
    parser.add_argument("--ready", type=Path, help="a file written once every port listens, removed at exit")
    parser.add_argument("--quiet", type=float, default=QUIET, help="seconds without a heartbeat before a host whose "
                        "processes all left or were reported lost goes")
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
    last_alive, beats, joined = time.monotonic(), 0, 0
    try:
        while True:
            time.sleep(min(LEAVE_POLL, args.idle_exit / 4))
            now_beats = stores[0].add(HEARTBEAT_KEY, 0)
            why, now_joined = _gone(stores[0], time.monotonic() - last_alive, args.quiet)
            if (now_beats, now_joined) != (beats, joined):  # a beat, or a join (whose first beat comes a moment later)
                last_alive, beats, joined = time.monotonic(), now_beats, now_joined
                continue
            if why is None and time.monotonic() - last_alive > args.idle_exit:
                why = f"no heartbeat from any process of the job for {args.idle_exit:.0f}s"
            if why is not None and _end(stores[0], joined):
                log.info("%s: the stores go", why)
                del stores
                return 0
    finally:
        if args.ready is not None and _pid(args.ready) == os.getpid():  # not a later host's
            args.ready.unlink(missing_ok=True)


if __name__ == "__main__":
    sys.exit(main())
