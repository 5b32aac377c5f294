"""The in-process stores' host: met as it comes up, not at TCPStore's backed-off next try; up on every port, or
reported at once, when the process that starts it goes on."""

import os
import signal
import socket
import subprocess
import threading
import time

import pytest

from ffstate.inprocess.store import PORTS, START_WAIT, ensure, listening, wait_listening


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_wait_listening_sees_a_listener_that_comes_up_later_and_gives_up_at_its_timeout():
    port = _free_port()
    assert wait_listening("127.0.0.1", port, 0.2) is False  # nothing there: False at the timeout, no exception

    server = socket.socket()
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)

    def listen_later() -> None:
        time.sleep(0.5)
        server.bind(("127.0.0.1", port))
        server.listen()

    t = threading.Thread(target=listen_later)
    t.start()
    try:
        assert wait_listening("127.0.0.1", port, 30) is True
    finally:
        t.join()
        server.close()


def test_a_host_that_cannot_take_the_second_port_is_reported_at_once_with_its_log(tmp_path):
    """The host binds its ports one after the other: with the second held by another program it listened on the
    first and exited, and every process then waited out TCPStore's 300-s connect. The process that starts it now
    waits for the host's ready file, and says at once when it exited, and why."""
    port = _free_port()
    with socket.create_server(("127.0.0.1", port + 1)):
        start = time.monotonic()
        with pytest.raises(RuntimeError, match=r"its host exited \(code 1\)") as caught:
            ensure("127.0.0.1", port, tmp_path)
        assert time.monotonic() - start < START_WAIT  # its exit, not the timeout
    assert f"cannot listen at 127.0.0.1:{port + 1}" in str(caught.value)  # the log's own line, in the error
    assert not listening("127.0.0.1", port)  # nothing left behind
    assert not (tmp_path / f"stores-{port}.ready").exists()


def test_the_host_is_up_on_every_port_when_ensure_returns_and_another_program_on_the_port_is_refused(tmp_path):
    port = _free_port()
    ensure("127.0.0.1", port, tmp_path)
    ready = tmp_path / f"stores-{port}.ready"
    pid = int(ready.read_text())
    try:
        assert all(listening("127.0.0.1", port + i) for i in range(PORTS))
        ensure("127.0.0.1", port, tmp_path)  # up already: nothing started, no error
        assert int(ready.read_text()) == pid
    finally:
        os.kill(pid, signal.SIGKILL)
    other = _free_port()
    gone = subprocess.Popen(["true"])
    gone.wait()
    with socket.create_server(("127.0.0.1", other)):
        with pytest.raises(RuntimeError, match="another program listens"):
            ensure("127.0.0.1", other, tmp_path)
        (tmp_path / f"stores-{other}.ready").write_text(f"{gone.pid}\n")  # a host killed: its file stays
        with pytest.raises(RuntimeError, match="another program listens"):
            ensure("127.0.0.1", other, tmp_path)
