"""ffstate/inprocess/abort.py: which sockets the gloo abort shuts down, on real loopback TCP connections standing in
for a process group's (the engine's runs with real process groups are in tests/system/test_inprocess.py)."""

import socket

import pytest

pytest.importorskip("nvidia_resiliency_ext.inprocess", reason="the in-process mode's engine "
                    "(nvidia-resiliency-ext) is not installed")
from ffstate import inflight  # noqa: E402
from ffstate.inprocess.abort import GroupAbort, new_sockets, open_sockets  # noqa: E402


@pytest.fixture
def connect():
    """Makes loopback TCP connections; returns (our end, the peer's end) and closes whatever is left at the end."""
    made = []
    server = socket.create_server(("127.0.0.1", 0))

    def make():
        ours = socket.create_connection(server.getsockname())
        theirs, _ = server.accept()
        made.extend([ours, theirs])
        return ours, theirs

    yield make
    for s in made:
        s.close()
    server.close()
    inflight.reset()  # the abort refused further waits on its group: not on the next test's


def test_a_group_socket_on_a_reused_descriptor_number_is_found_and_shut_down(connect):
    # The previous group's socket is open when the engine looks before init_process_group, and freed during it: the
    # new group's socket gets its number. Counted by numbers, it was taken for one that was there before and left
    # open, and a peer's collective waited on it until the watchdog killed the process.
    old, _ = connect()
    number = old.fileno()
    before = open_sockets()
    old.close()
    ours, theirs = connect()
    if ours.fileno() != number:
        pytest.skip("the kernel did not give the closed number to the next socket")
    assert number in new_sockets(before)
    abort = GroupAbort()
    abort.opened(new_sockets(before))
    abort(None)  # no process group here: only the sockets
    with pytest.raises(BrokenPipeError):  # shut down for writing
        ours.send(b"x")
    ours.settimeout(2)
    assert ours.recv(1) == b""  # and for reading


def test_a_descriptor_number_given_to_another_socket_since_is_left_alone(connect):
    # A group's socket closed after init, its number given to another connection (a gRPC channel's): the abort must
    # not shut down the connection that now has the number.
    before = open_sockets()
    mine, _ = connect()
    number = mine.fileno()
    opened = new_sockets(before)
    assert number in opened
    abort = GroupAbort()
    abort.opened(opened)
    mine.close()
    other, peer = connect()
    if other.fileno() != number:
        pytest.skip("the kernel did not give the closed number to the next socket")
    abort(None)
    other.sendall(b"x")
    peer.settimeout(2)
    assert peer.recv(1) == b"x"  # still connected both ways
    peer.sendall(b"y")
    other.settimeout(2)
    assert other.recv(1) == b"y"


def test_an_aborted_group_is_held_for_its_timeout_then_let_go_on_a_thread_of_its_own():
    # gloo's destructor joins a worker that may be stuck in a send until the group's timeout: the training's thread
    # (the engine's gc.collect() between entries) must never be the one that drops an aborted group
    import threading
    import time

    from ffstate.inprocess import abort

    dropped: list[str] = []

    class Group:
        def __del__(self):
            dropped.append(threading.current_thread().name)

    abort.hold(Group(), 0.0)
    abort.hold(Group(), 3600.0)
    deadline = time.monotonic() + 10
    while not dropped and time.monotonic() < deadline:
        time.sleep(0.01)
    assert dropped == ["ffstate-aborted-groups"] and abort.held() == 1
    with abort._held_lock:
        abort._held.clear()  # the hour-long one: its reaper drops it within a minute


def test_groups_still_held_at_the_interpreters_exit_are_left_to_the_os(tmp_path):
    # released by the module's teardown on the main thread, a group whose worker is stuck in a send would hold the
    # process's exit until its timeout: the exit leaks them (control: without that, the teardown releases the group)
    import subprocess
    import sys

    script = """
import sys
from ffstate.inprocess import abort
class Group:
    def __del__(self):
        sys.__stdout__.write("released\\n"); sys.__stdout__.flush()
{control}
abort.hold(Group(), 3600.0)
print("held", flush=True)
"""
    for control, want in (("", "held\n"), ("abort._exit_registered = True", "held\nreleased\n")):
        out = subprocess.run([sys.executable, "-c", script.format(control=control)], capture_output=True, text=True,
                             timeout=120)
        assert out.returncode == 0 and out.stdout == want, (control, out.stdout, out.stderr[-2000:])
