"""The in-process stores' host is met as it comes up, not at TCPStore's backed-off next try."""

import socket
import threading
import time

from ffstate.inprocess.store import wait_listening


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


def test_a_host_that_cannot_take_its_second_port_is_an_error_at_once_naming_its_log(tmp_path):
    """The engine's port (MASTER_PORT + 1) held by another program: the host listens on the first, then exits. The
    process that started it says so, with the log, instead of every process waiting 300 s in TCPStore's connect
    (every process of an in-process job did, once, in a fresh clone's suite)."""
    import pytest

    from ffstate.bench._report import free_ports
    from ffstate.inprocess.store import ensure

    port = free_ports(2)
    other = socket.create_server(("", port + 1), family=socket.AF_INET6, dualstack_ipv6=True)  # as the host binds
    try:
        with pytest.raises(RuntimeError, match=r"did not listen at 127\.0\.0\.1:\d+-\d+: its host exited .*stores"):
            ensure("127.0.0.1", port, tmp_path)
        assert "EADDRINUSE" in (tmp_path / "stores.log").read_text()  # the host's own error, in the log named
    finally:
        other.close()
