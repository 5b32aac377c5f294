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
