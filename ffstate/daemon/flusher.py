"""The daemon's flushing process: writes the persistent tier's versions outside the daemon's interpreter.

A flush is mostly Python (DCP's writer, the files' checksums): in the daemon's own process it held the
interpreter lock against the replicator's thread, which then marked a rank's slot taken late, and the
worker's commits waited on it (``bench overhead``: commit 11 -> 52 ms a step at ``persist_every=1``). So the
daemon starts one child, ``python -m ffstate.daemon.flusher``, at the lowest CPU priority by default
(``SCHED_IDLE``, ``--persist-nice``: it takes only the CPU that the training and the daemon leave), and hands
it each copy: the persister copies the version into an anonymous in-memory file (``memfd``) and passes the file's
descriptor over a Unix socket (``SCM_RIGHTS``), with a short header; the copy's layout and key map ride in
the same file, after its bytes. The child maps it, writes the rank's files (``persist.write_rank``), makes
the version complete if every rank's record is there, prunes, and answers with a line of JSON. No path names
the copy: nothing is left in ``/dev/shm`` whoever dies, and its memory is freed when both close it.

The child dies with the daemon (``PR_SET_PDEATHSIG``) and ends when its socket closes. If it dies mid-flush
(the OOM killer, a bug), the flush counts as failed, what it wrote of a version not yet complete is removed, and
the next flush starts a new one. It ignores SIGTERM and SIGINT from its first lines: a stop sent to the daemon's
whole group (systemd's, a terminal's Ctrl-C, Slurm's) stops the daemon, which lets the flush in hand finish and
answer (``Flusher.close`` closes the socket only then, or after its wait). A version complete on disk is never
written again (a restart's redone step: the same bits).
"""

from __future__ import annotations

import json
import logging
import mmap
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

_COLLECTING: bool | None = None  # run as the flushing process: whether the collector was on before its imports
if __name__ == "__main__":  # the flushing process: deaf to its group's signals before its imports (a second)
    for _sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(_sig, signal.SIG_IGN)
    from ffstate import startup

    _COLLECTING = startup.pause()  # torch and DCP imported without the collector (startup.py); main() resumes it

import numpy as np  # noqa: E402

log = logging.getLogger("ffstate.daemon.flusher")

REPLY_BYTES = 64 << 10  # an answer's bound: its message is cut at MESSAGE characters, its paths at PATHS
HEADER_BYTES = 4 << 10  # a flush's header (its layout and key map ride in the copy's file)
MESSAGE, PATHS = 1024, 8
TICK = 0.1  # seconds between the persister's other duties while it waits on the child (the newest step taken)


class Copy:
    """A version's bytes (a NumPy array: the daemon runs without torch) and its description in one anonymous
    in-memory file (the persister's side)."""

    def __init__(self, data: np.ndarray, meta: dict):
        raw = json.dumps(meta, separators=(",", ":")).encode()
        self.nbytes, self.meta_bytes = data.size, len(raw)
        self.fd = os.memfd_create("ffstate-flush", os.MFD_CLOEXEC)
        try:
            os.ftruncate(self.fd, self.nbytes + len(raw))
            if self.nbytes:
                with mmap.mmap(self.fd, self.nbytes) as m:
                    view = np.frombuffer(m, dtype=np.uint8)
                    try:
                        np.copyto(view, data)
                    finally:
                        del view  # before the map is closed: it exports the map's buffer
            os.pwrite(self.fd, raw, self.nbytes)
        except BaseException:
            os.close(self.fd)
            raise

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class Flusher:
    """The parent's end: starts the child (again, after it died) and hands it one copy at a time."""

    def __init__(self, nice: int | str = "idle") -> None:
        self.nice = nice
        self._proc: subprocess.Popen | None = None
        self._sock: socket.socket | None = None
        self.ready = False  # the child said it is ready (torch.distributed.checkpoint imported)
        self.starts = 0
        self._busy = threading.Lock()  # held through a flush: the daemon's stop waits for its answer
        self._stopping = False

    @property
    def pid(self) -> int:
        """The child's pid once it is ready (0: starting, or not running)."""
        return self._proc.pid if self.ready and self._proc is not None and self._proc.poll() is None else 0

    def start(self, idle: Callable[[], None] = lambda: None) -> None:
        """Starts the child if it is not running, and waits until it is ready (it imports torch and DCP: seconds
        of CPU), calling ``idle`` every ``TICK`` seconds meanwhile. Raises OSError if it ended instead."""
        if self._proc is not None and self._proc.poll() is None and self.ready:
            return
        if self._proc is None or self._proc.poll() is not None or self._sock is None:
            self._spawn()
        assert self._sock is not None and self._proc is not None
        said = self._recv(idle)
        if not said:
            code = self._proc.wait()
            self._close_sock()
            raise OSError(f"the flushing process (pid {self._proc.pid}) ended as it started ({_why(code)}); its "
                          "error is in the daemon's log")
        self.ready = True
        log.info("flushing process %d ready (%s)", self._proc.pid, json.loads(said).get("ready", ""))

    def _recv(self, idle: Callable[[], None]) -> bytes:
        """The child's next message, ``idle`` called every ``TICK`` seconds until it comes; b"": the child is gone."""
        sock = self._sock  # ours: a stop past its wait closes it under this read (which then sees the child gone)
        assert sock is not None
        sock.settimeout(TICK)
        while True:
            try:
                return sock.recv(REPLY_BYTES)
            except TimeoutError:
                idle()
            except OSError:
                return b""

    def _spawn(self) -> None:
        self._close_sock()
        self.ready = False
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            args = [str(theirs.fileno()), str(os.getpid())]
            self._proc = subprocess.Popen([sys.executable, "-m", "ffstate.daemon.flusher", *args],
                                          pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL)
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        self._sock = ours
        self.starts += 1
        try:  # at once, from here: its imports (a second or more of CPU) already run at that priority
            if self.nice == "idle":
                os.sched_setscheduler(self._proc.pid, os.SCHED_IDLE, os.sched_param(0))
            elif self.nice:
                own = os.getpriority(os.PRIO_PROCESS, 0)
                os.setpriority(os.PRIO_PROCESS, self._proc.pid, min(19, own + int(self.nice)))
        except OSError as e:  # it exited already (its error is in the log), or a policy forbids it
            log.warning("the flushing process %d keeps the daemon's CPU priority: %s", self._proc.pid, e)

    def flush(self, copy: Copy, header: dict, idle: Callable[[], None] = lambda: None) -> dict:
        """Writes ``copy`` as ``header`` says; returns the child's answer (``ok``, and ``seconds``, ``complete``,
        ``pruned``; or ``kind`` and ``message``: ``died`` when the child died while writing, ``stopped`` when the
        daemon is stopping). ``idle`` is called every ``TICK`` seconds while it waits."""
        with self._busy:
            if self._stopping:
                return {"ok": False, "kind": "stopped", "message": f"version {header['version']} not flushed: the "
                        "daemon is stopping"}
            return self._flush(copy, header, idle)

    def _flush(self, copy: Copy, header: dict, idle: Callable[[], None]) -> dict:
        self.start(idle)
        sock = self._sock
        assert sock is not None and self._proc is not None
        raw = json.dumps({**header, "nbytes": copy.nbytes, "meta_bytes": copy.meta_bytes}).encode()
        try:
            sock.settimeout(None)
            socket.send_fds(sock, [raw], [copy.fd])
            answer = self._recv(idle)
        except OSError:
            answer = b""
        if answer:
            return json.loads(answer)
        try:
            code = self._proc.wait(10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            code = self._proc.wait()
        self._close_sock()
        if self._stopping:  # the stop's end of it (clean: its answer came too late; else killed at the stop's wait)
            return {"ok": False, "kind": "stopped", "died": code != 0, "message": f"version {header['version']}: the "
                    f"daemon stopped before the flushing process (pid {self._proc.pid}) answered; " + (
                        "it ended cleanly: what it wrote stays (a relaunch checks it)" if code == 0 else
                        f"it was killed at the end of the stop's wait ({_why(code)}): what it wrote of a version not "
                        "yet complete is removed")}
        return {"ok": False, "kind": "died", "message": f"the flushing process (pid {self._proc.pid}) died while "
                                                         f"writing: {_why(code)}", "died": True}

    def stop_starting(self) -> None:
        """Kills the child if it is still starting (it has nothing to finish): the daemon is stopping."""
        proc = self._proc
        if proc is not None and not self.ready and proc.poll() is None:
            proc.kill()

    def close(self, wait: float = 10.0) -> None:
        """Lets the flush in hand finish and answer, then closes the socket (the child ends); kills the child if it
        has not ended ``wait`` seconds after the call. No flush starts after it."""
        deadline = time.monotonic() + wait
        self._stopping = True
        answered = self._busy.acquire(timeout=wait)  # else a flush past the wait: its child is killed below
        try:
            self._close_sock()
        finally:
            if answered:
                self._busy.release()
        if self._proc is not None:
            try:
                self._proc.wait(max(0.5, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("flushing process %d did not end within %gs of the daemon's stop: killed",
                            self._proc.pid, wait)
                self._proc.kill()
                self._proc.wait()

    def _close_sock(self) -> None:
        self.ready = False
        if self._sock is not None:
            self._sock.close()
            self._sock = None


def _why(code: int) -> str:
    return f"killed by signal {-code}" if code < 0 else f"exit code {code}"


# --- the child ---------------------------------------------------------------------------------------------

def _die_with(parent: int) -> None:
    """SIGKILL this process when the daemon dies (Linux); a daemon already gone ends it now."""
    try:
        import ctypes
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent:
        os._exit(0)


def diagnose(path: Path, need: int, error: BaseException) -> str:
    """``error``, and what the filesystem under ``path`` says of it: read-only, or fuller than ``need`` bytes."""
    where = path
    while not where.exists() and where != where.parent:
        where = where.parent
    try:
        st = os.statvfs(where)
    except OSError:
        return str(error)
    if st.f_flag & os.ST_RDONLY:
        return f"{error} (the filesystem at {where} is read-only)"
    free = st.f_bavail * st.f_frsize
    if free < need:
        return f"{error} (no space left on device: {free} bytes free at {where}, the version takes {need})"
    return str(error)


def _write(job: dict, fd: int) -> dict:
    import torch

    from ffstate import persist
    from ffstate.errors import FFStateError
    from ffstate.layout import Manifest

    nbytes, meta_bytes = int(job["nbytes"]), int(job["meta_bytes"])
    meta = json.loads(os.pread(fd, meta_bytes, nbytes))
    data = torch.from_file(f"/proc/self/fd/{fd}", shared=True, size=nbytes, dtype=torch.uint8) if nbytes \
        else torch.empty(0, dtype=torch.uint8)
    rank, world, version = int(job["rank"]), int(job["world"]), int(job["version"])
    job_dir = Path(job["job_dir"])
    vdir = persist.version_dir(job_dir, version)
    if (vdir / persist.COMPLETE).exists():  # a step redone after a restart (the same bits), or an older run's
        return {"ok": True, "seconds": 0.0, "vdir": str(vdir), "complete": True, "already": True}
    start = time.perf_counter()
    try:
        keys, manifest = meta["keys"], Manifest.from_json(meta["manifest"].encode())
        items = persist.items_of(manifest, data, keys, rank, param_groups=rank == 0)
        persist.write_rank(vdir, job["job"], version, rank, world, manifest, int(job["checksum"]), items,
                           str(keys.get("timeline", "")))
    except (OSError, RuntimeError) as e:  # torch.save into a full disk says "unexpected pos": say why
        why = diagnose(vdir, nbytes, e)
        persist.remove_rank(vdir, rank)  # what it wrote of the version would fill the disk for the next
        return {"ok": False, "kind": type(e).__name__,
                "message": f"flushing version {version} to {vdir} failed: {why}"[:MESSAGE]}
    except FFStateError as e:
        return {"ok": False, "kind": "keys", "message": f"version {version} cannot be written: {e}"[:MESSAGE]}
    answer: dict[str, Any] = {"ok": True, "seconds": time.perf_counter() - start, "vdir": str(vdir)}
    try:
        answer["complete"] = persist.finalize(vdir, world)
        if answer["complete"]:
            answer["pruned"] = [str(p)[:MESSAGE] for p in persist.prune(job_dir, int(job["keep"]))][:PATHS]
    except OSError as e:
        answer["complete_error"] = f"completing version {version} failed: {e}"[:MESSAGE]
        answer["complete_kind"] = type(e).__name__
    return answer


def prepare() -> None:
    """Imports what a flush needs before the first: torch.distributed.checkpoint (a second or more), and the modules
    of a version's items, which the packages load on first use (the daemon's side runs without them). Left to the
    first flush they made it 0.5-0.9 s where it took 0.1-0.2 (3 jobs at once on 2 cores), and the versions due
    meanwhile were skipped."""
    from ffstate import persist

    persist.write.prepare()
    import ffstate.layout.buffers  # noqa: F401
    import ffstate.persist.items  # noqa: F401


def main(argv: list[str]) -> int:
    fd, parent = int(argv[0]), int(argv[1])
    # The daemon owns this process: it ends when the daemon closes its socket (after the flush in hand) or dies
    # (PR_SET_PDEATHSIG). A SIGTERM or Ctrl-C sent to the daemon's whole group (systemd's stop, a terminal, Slurm)
    # stops the daemon, which waits for this flush: it must not end the flush half-written. (Ignored already,
    # as the module started; again here for a caller of main.)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)
    _die_with(parent)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from ffstate import startup

    start = time.perf_counter()
    prepare()
    if _COLLECTING is not None:  # paused as the module started: what the imports made frozen, the collector back
        startup.imported(_COLLECTING)
    sock = socket.socket(fileno=fd)
    try:
        sock.send(json.dumps({"ready": f"started in {time.perf_counter() - start:.1f}s"}).encode())
    except OSError:
        return 0
    while True:
        try:
            raw, fds, _, _ = socket.recv_fds(sock, HEADER_BYTES, 1)
        except OSError:
            return 0
        if not raw:
            return 0  # the daemon closed its end (stopped, or gone)
        try:
            if len(fds) != 1:
                answer = {"ok": False, "kind": "bug", "message": f"a flush came with {len(fds)} descriptors"}
            else:
                answer = _write(json.loads(raw), fds[0])
        except Exception as e:  # a bug must not end the flushing process, nor later flushes
            log.exception("flush %s", raw[:200])
            answer = {"ok": False, "kind": "bug", "message": f"flushing failed: {e!r}"[:MESSAGE]}
        finally:
            for f in fds:
                os.close(f)
        try:
            sock.send(json.dumps(answer).encode())
        except OSError:
            return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
