"""The in-process stores' host: met as it comes up, not at TCPStore's backed-off next try; up on every port, or
reported at once, when the process that starts it goes on."""

import os
import signal
import socket
import subprocess
import threading
import time

import pytest

import torch.distributed as dist

from ffstate.bench._report import free_ports
from ffstate.inprocess.store import (ENDED, JOINED_KEY, PORTS, START_WAIT, _end, _gone, ensure, join, leave, listening,
                                     wait_listening)


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
    port = free_ports(2)
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


def _wait_gone(port: int, timeout: float = 10.0) -> float:
    start = time.monotonic()
    while listening("127.0.0.1", port):
        assert time.monotonic() - start < timeout, f"the stores' host still up {timeout:.0f} s after"
        time.sleep(0.05)
    return time.monotonic() - start


def test_the_host_goes_once_every_process_that_joined_left_and_a_launch_right_after_meets_the_next(tmp_path):
    """The host stayed a minute after a job's last process, and a launch on the same port within that minute met the
    earlier launch's engine keys and stopped. Now each process counts itself out as its engine returns, and the
    host goes once all are out; the next launch's first process starts a new one."""
    port = free_ports(2)  # the host's two, below the range outgoing connections take theirs from
    (a, beat_a), (b, beat_b) = join("127.0.0.1", port, tmp_path, local=True), join("127.0.0.1", port, tmp_path,
                                                                                   local=True)
    pid = int((tmp_path / f"stores-{port}.ready").read_text())
    try:
        leave(a, 0, [], beat_a)
        time.sleep(1.0)  # the host's looks: 4 of them
        assert listening("127.0.0.1", port), "the host went while a process of the job had not left"
        leave(b, 1, [], beat_b)
        _wait_gone(port, 15.0)
        assert "every process of the job left (2): the stores go" in (tmp_path / "stores.log").read_text()
        c, beat_c = join("127.0.0.1", port, tmp_path, local=True)  # the next launch: a new host, its own count
        assert int((tmp_path / f"stores-{port}.ready").read_text()) != pid
        assert c.add(JOINED_KEY, 0) == 1
        leave(c, 0, [], beat_c)
        _wait_gone(port, 15.0)
    finally:
        subprocess.run(["pkill", "-f", f"ffstate.inprocess.store --ready {tmp_path}/stores-{port}.ready "], check=False)


def test_the_next_launch_ends_stores_whose_processes_all_left_or_were_lost_without_waiting_for_their_quiet(tmp_path):
    """After a job that lost a process, its host waits for quiet (a process reported lost may still be on its way out);
    a launch within that time joined it, met the earlier launch's engine keys and stopped. Its first process now ends
    those stores and meets a new host."""
    port = free_ports(2)  # the host's two, below the range outgoing connections take theirs from
    (a, beat_a), (_, beat_b) = (join("127.0.0.1", port, tmp_path, local=True) for _ in range(2))
    pid = int((tmp_path / f"stores-{port}.ready").read_text())
    try:
        beat_b.set()  # process 1 dies (no leave); process 0 ends the job knowing it lost
        leave(a, 0, [1], beat_a)
        c, beat_c = join("127.0.0.1", port, tmp_path, local=True)  # the next launch, within the old host's quiet
        assert int((tmp_path / f"stores-{port}.ready").read_text()) != pid and c.add(JOINED_KEY, 0) == 1
        said = (tmp_path / "stores.log").read_text()  # ended by this join, not after the host's quiet time
        assert "ended by the next launch" in said and "none beat for" not in said, said
        leave(c, 0, [], beat_c)
        _wait_gone(port, 15.0)
    finally:
        subprocess.run(["pkill", "-f", f"ffstate.inprocess.store --ready {tmp_path}/stores-{port}.ready "], check=False)


def test_a_process_that_meets_a_host_that_is_going_waits_for_it_and_meets_the_next(tmp_path):
    """A process that joins between the host's decision to go and its exit is told by its count (negative): it waits
    for that host to go and meets the next one, rather than count on stores about to close."""
    port = free_ports(2)
    going = dist.TCPStore("127.0.0.1", port, None, is_master=True, wait_for_workers=False)  # an earlier launch's host
    going.add(JOINED_KEY, 2)
    assert _end(going, 2)
    joined: list = []
    t = threading.Thread(target=lambda: joined.append(join("127.0.0.1", port, tmp_path, local=False)))
    t.start()
    try:
        time.sleep(1.0)
        assert not joined and t.is_alive(), "a process joined stores that were going"
        del going  # that host goes; the next is started by its node's first process (here: by hand)
        ensure("127.0.0.1", port, tmp_path)
        t.join(30)
        assert joined, "the process did not meet the next host"
        store, beating = joined[0]
        assert store.add(JOINED_KEY, 0) == 1
        leave(store, 0, [], beating)
        _wait_gone(port, 15.0)
    finally:
        t.join(1)
        subprocess.run(["pkill", "-f", f"ffstate.inprocess.store --ready {tmp_path}/stores-{port}.ready "], check=False)


def test_who_is_out_as_the_host_counts_it():
    """Every process that joined left: at once. Some left and the others were reported lost by them: once no
    heartbeat came for the quiet time (a process reported lost may still be on its way out). Otherwise never; and a
    process that joins after the count keeps the host (``_end`` refuses)."""
    store = dist.HashStore()
    for _ in range(3):
        store.add(JOINED_KEY, 1)
    assert _gone(store, quiet=100, quiet_for=11) == (None, 3)  # nobody left
    store.append("ffstate/inprocess/left", "0,~2,")
    assert _gone(store, quiet=100, quiet_for=11)[0] is None  # process 1 neither left nor lost
    store.append("ffstate/inprocess/left", "1,~2,")
    assert _gone(store, quiet=5, quiet_for=11)[0] is None  # 2 reported lost, heartbeats 5 s ago: maybe still going
    why, joined = _gone(store, quiet=12, quiet_for=11)
    assert "left (2) or was lost (1)" in why and joined == 3
    store.add(JOINED_KEY, 1)  # a process joins after the count
    assert not _end(store, joined) and store.add(JOINED_KEY, 0) == 4
    store.append("ffstate/inprocess/left", "3,2,")
    assert _gone(store, quiet=0, quiet_for=11)[0] == "every process of the job left (4)"
    assert _end(store, 4) and store.add(JOINED_KEY, 1) < 0  # going: a later join is told
    assert _gone(store, quiet=0, quiet_for=11)[0].startswith("ended by the next launch")
    assert ENDED < 0
