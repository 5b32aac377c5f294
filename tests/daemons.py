"""Real ``ffstate serve`` processes for tests, and the fixtures that always clean them up.

Each daemon is a subprocess on loopback with its own node id; its port is read from the line it
prints when it is ready. Failure injection is explicit: ``Daemon.kill()`` is a SIGKILL.
"""

from __future__ import annotations

import contextlib
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from ffstate import shm
from ffstate.bench._report import free_ports
from ffstate.client import Client, Tls
from helpers import torch_loaded

TOKEN = "test-token-" + uuid.uuid4().hex[:8]
READY = re.compile(r"listening on ([\d.]+):(\d+)")
START_TIMEOUT = 30.0


def _ready_line(proc: subprocess.Popen, deadline: float) -> str:
    """The daemon's line that says it listens, or the last line before it exited or ``deadline`` passed: read on a
    thread, so that a daemon that prints nothing and does not exit cannot hold the caller past the deadline."""
    lines: queue.Queue = queue.Queue()

    def read() -> None:
        for got in iter(proc.stdout.readline, ""):
            lines.put(got)
            if READY.search(got):
                return
        lines.put("")  # the pipe closed: the daemon exited

    threading.Thread(target=read, daemon=True).start()
    line = ""
    while (left := deadline - time.monotonic()) > 0:
        try:
            got = lines.get(timeout=left)
        except queue.Empty:
            break
        if READY.search(got):
            return got
        if not got:  # exited, or exiting: its last line
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(max(0.1, deadline - time.monotonic()))
            return line
        line = got
    return line


@dataclass
class Daemon:
    node_id: str
    proc: subprocess.Popen
    address: str
    log_path: Path
    args: list[str] = field(default_factory=list)
    metrics_port: int = 0

    def client(self, token: str = TOKEN, **kw) -> Client:
        return Client(self.address, token, **kw)

    def kill(self) -> None:
        """SIGKILL: no cleanup runs (a crashed daemon)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def terminate(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:  # its server's grace (5 s) and its threads' joins, on a loaded machine: then a SIGKILL
            return self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.send_signal(signal.SIGUSR2)  # its threads' stacks to its log first: where it is stuck
            time.sleep(1.0)
            self.kill()
            raise AssertionError(f"daemon {self.node_id} did not stop within 30 s of SIGTERM; the end of its log, its "
                                 f"stacks last:\n{self.log()[-6000:]}") from None

    def log(self) -> str:
        return self.log_path.read_text()


class DaemonFactory:
    def __init__(self, tmp: Path):
        self.tmp = tmp
        self.daemons: list[Daemon] = []
        self.with_torch: list[str] = []
        self.token_file = tmp / "token"
        self.token_file.write_text(TOKEN)

    def start(self, *extra: str, node_id: str | None = None, port: int = 0, tls: bool = False,
              session: bool = False, metrics: bool = False) -> Daemon:
        """An ``ffstate serve``; with ``session``, in a session (and process group) of its own, as a service manager
        starts one: a signal to its group reaches its children too. With ``metrics``, serving its metrics on a port
        found free (``Daemon.metrics_port``), found again if another process took it before the daemon bound it."""
        if metrics:
            for _ in range(4):
                mport = free_ports(1)
                try:
                    d = self.start(*extra, "--metrics-port", str(mport), node_id=node_id, port=port, tls=tls,
                                   session=session)
                except RuntimeError as e:
                    if "cannot serve metrics" in str(e) and "in use" in str(e):
                        continue
                    raise
                d.metrics_port = mport
                return d
            raise RuntimeError("no free port for a daemon's metrics in 4 tries")
        node_id = node_id or f"n{uuid.uuid4().hex[:8]}"
        log_path = self.tmp / f"{node_id}-{len(self.daemons)}.log"
        args = [sys.executable, "-m", "ffstate.cli", "serve", "--node-id", node_id, "--host", "127.0.0.1", "--port", str(port),
                "--token-file", str(self.token_file), *extra]
        out = open(log_path, "w")
        proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=out, text=True,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"}, start_new_session=session)
        line = _ready_line(proc, time.monotonic() + START_TIMEOUT)
        m = READY.search(line)
        if not m:
            proc.kill()
            proc.wait(10)
            proc.stdout.close()
            out.close()
            raise RuntimeError(f"ffstate serve did not start: {line!r}\n{log_path.read_text()}")
        d = Daemon(node_id, proc, f"{m.group(1)}:{m.group(2)}", log_path, args)
        self.daemons.append(d)
        return d

    def restart(self, d: Daemon) -> Daemon:
        """The same node (id and port) started again after it died."""
        port = d.address.rsplit(":", 1)[1]
        extra = d.args[d.args.index("--token-file") + 2 :]
        return self.start(*extra, node_id=d.node_id, port=int(port))

    def close(self) -> None:
        # Before they stop: a daemon runs without torch (ffstate/codec/host.py), whatever it served or persisted.
        self.with_torch = [d.node_id for d in self.daemons if d.proc.poll() is None and torch_loaded(d.proc.pid)]
        for d in self.daemons:  # all at once: each takes a moment to stop
            if d.proc.poll() is None:
                d.proc.send_signal(signal.SIGTERM)
        for d in self.daemons:
            d.terminate()
        for d in self.daemons:
            d.kill()


def _closed(factory: DaemonFactory) -> None:
    factory.close()
    leaked = [p for d in factory.daemons for p in shm.slots.SHM_DIR.glob(f"ffstate-{d.node_id}-*")]
    for p in leaked:
        p.unlink()
    assert not leaked, f"shared memory left behind: {leaked}"
    assert not factory.with_torch, f"daemons that imported torch: {factory.with_torch}"


@pytest.fixture
def daemons(tmp_path):
    factory = DaemonFactory(tmp_path)
    yield factory
    _closed(factory)


@pytest.fixture(scope="module")
def module_daemons(tmp_path_factory):
    """Daemons shared by a module's tests (for cases that each leave the daemon as they found it)."""
    factory = DaemonFactory(tmp_path_factory.mktemp("daemons"))
    yield factory
    _closed(factory)


def wait_until(predicate, timeout: float = 30.0, what: str = "condition"):
    """Polls ``predicate`` (returning a truthy value) until it holds; fails the test at the timeout."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = predicate()
        if got:
            return got
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def held_version(client: Client, job: str, rank: int) -> int:
    inv = client.inventory(job)
    return next((s.version for s in inv.shards if s.shard.rank == rank and not s.local), 0)


def make_tls(tmp: Path) -> tuple[Tls, Path, Path, Path]:
    """A CA and a server certificate for 127.0.0.1/localhost, made with openssl."""
    ca_key, ca, key, csr, cert = (tmp / n for n in ("ca.key", "ca.pem", "srv.key", "srv.csr", "srv.pem"))
    run = lambda *a: subprocess.run(a, check=True, capture_output=True)  # noqa: E731
    run("openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", ca_key, "-out", ca, "-days", "1",
        "-subj", "/CN=ffstate-test-ca")
    run("openssl", "req", "-newkey", "rsa:2048", "-nodes", "-keyout", key, "-out", csr, "-subj", "/CN=localhost")
    ext = tmp / "ext.cnf"
    ext.write_text("subjectAltName=DNS:localhost,IP:127.0.0.1\n")
    run("openssl", "x509", "-req", "-in", csr, "-CA", ca, "-CAkey", ca_key, "-CAcreateserial", "-out", cert,
        "-days", "1", "-extfile", ext)
    return Tls(ca), cert, key, ca
