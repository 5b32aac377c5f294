"""The daemons that workers started on this machine, as their jobs' run folders describe them: found (``ffstate
status``, ``ffstate drain``, a relaunch comparing its settings), and signalled or stopped through pidfds (the demo,
``bench chaos``, the tests), each checked to be that node's ``ffstate serve`` first."""

from __future__ import annotations

import os
import select
import signal
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from ffstate import placement
from ffstate.errors import FFStateError


def run_dir(job: str) -> Path:
    """``$TMPDIR/ffstate-<job>/``, the job's run folder on this machine (its daemons' addresses, pids, tokens and logs,
    the job's events, the watchdog's stacks), made if missing, and private to this user (mode 0700).

    Raises:
        FFStateError: it belongs to another user (two users' jobs of one name on a shared machine).
    """
    path = Path(tempfile.gettempdir()) / f"ffstate-{job}"
    path.mkdir(mode=0o700, exist_ok=True)
    st = path.stat()
    if st.st_uid != os.getuid():
        raise FFStateError(f"{path}, the run folder of job {job}, belongs to another user (uid {st.st_uid}): name the "
                           "job apart (FFSTATE_JOB_ID, or torchrun's --rdzv-id) or set TMPDIR to a folder of yours")
    if st.st_mode & 0o077:  # made by an earlier ffstate, or by hand
        path.chmod(0o700)
    return path


@dataclass(frozen=True)
class Found:
    """A daemon the workers of a job started on this machine, as its run folder describes it."""

    address: str
    token: str
    job: str
    node_id: str
    pid: int


def local_daemons(job: str = "") -> list[Found]:
    """The daemons workers started on this machine that are alive (of ``job``, or of every job): read from the job
    run folders in the temporary directory (``$TMPDIR/ffstate-<job>/``: the daemon's pid and address files, the
    job's token). A daemon whose address is not one of this machine's (a run folder shared by several machines)
    is left out."""
    out = []
    for run_dir in sorted(Path(tempfile.gettempdir()).glob("ffstate-*")):
        name = run_dir.name[len("ffstate-"):]
        if job and name != job:
            continue
        try:
            kept = (run_dir / "token").read_text().strip()
        except OSError:
            kept = ""
        for pid_file in sorted(run_dir.glob("daemon-*.pid")):
            node_id = pid_file.name[len("daemon-"):-len(".pid")]
            try:
                pid = int(pid_file.read_text().strip())
                address = (run_dir / f"daemon-{node_id}.address").read_text().strip()
            except (OSError, ValueError):
                continue
            try:
                token = (run_dir / f"daemon-{node_id}.token").read_text().strip()
            except OSError:
                token = kept
            if alive(pid) and placement.is_local(address.rsplit(":", 1)[0]):
                out.append(Found(address, token or os.environ.get("FFSTATE_TOKEN", ""), name, node_id, pid))
    return out


def daemon_pidfds(job: str) -> dict[int, int]:
    """{pid: pidfd} of the daemons workers started for ``job`` on this machine (``local_daemons``), each checked,
    once opened, to run that node's ``ffstate serve``: a pid file a SIGKILLed daemon left may name another process
    by now, and a pidfd never reaches a later process with the same pid (``signal.pidfd_send_signal``). The
    caller closes them."""
    fds = {}
    for d in local_daemons(job):
        try:
            fd = os.pidfd_open(d.pid)
        except OSError:  # gone meanwhile
            continue
        try:
            argv = Path(f"/proc/{d.pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            argv = []
        if b"serve" in argv and d.node_id.encode() in argv and not ended(fd):  # that command line was its own
            fds[d.pid] = fd
        else:
            os.close(fd)
    return fds


def ended(pidfd: int) -> bool:
    """Whether the process of ``pidfd`` has ended (a pidfd turns readable then)."""
    return bool(select.select([pidfd], [], [], 0)[0])


def stop_daemons(job: str, wait: float, grace: float = 0.0, kill: bool = False) -> list[int]:
    """Stops the daemons workers started for ``job`` on this machine that are still alive after ``grace`` seconds
    (time to exit on their own, at the job's end): SIGTERM, up to ``wait`` seconds for their clean stop, then, with
    ``kill``, SIGKILL; through ``daemon_pidfds``. Returns the pids it signalled."""
    fds = daemon_pidfds(job)

    def wait_ended(pids: list[int], seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline and not all(ended(fds[p]) for p in pids):
            time.sleep(0.1)

    try:
        wait_ended(list(fds), grace)
        alive = [pid for pid, fd in fds.items() if not ended(fd)]
        for pid in alive:
            signal.pidfd_send_signal(fds[pid], signal.SIGTERM)
        wait_ended(alive, wait)
        for pid in alive:
            if kill and not ended(fds[pid]):
                signal.pidfd_send_signal(fds[pid], signal.SIGKILL)
    finally:
        for fd in fds.values():
            os.close(fd)
    return alive


def alive(pid: int) -> bool:
    """A process that runs (not a zombie: a daemon that died and was not reaped yet does not count)."""
    if pid <= 0:
        return False
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def serve_flags(args: list[str]) -> dict[str, list[str]]:
    """``ffstate serve``'s flags as given: each flag's values (none for a switch)."""
    out: dict[str, list[str]] = {}
    for i, a in enumerate(args):
        if a.startswith("--"):
            value = args[i + 1] if i + 1 < len(args) and not args[i + 1].startswith("--") else None
            out.setdefault(a, []).extend([value] if value is not None else [])
    return out
