"""The daemon's idle exit counts from the moment it listens, not from when its node was made: a start that took
longer than ``--idle-exit`` (a large persistent tier to scan, a loaded machine) must still leave the daemon serving
for its whole idle time."""

import threading
import time

import pytest

from ffstate.client import Client
from ffstate.config import DaemonConfig
from ffstate.daemon.main import _serve
from ffstate.daemon.node import Node

pytestmark = pytest.mark.timeout(60)


def test_the_idle_clock_starts_when_the_daemon_listens(tmp_path):
    cfg = DaemonConfig(node_id=f"idle-{time.monotonic_ns()}", host="127.0.0.1", port=0, token="t" * 32, idle_exit=2.0,
                       memory_limit=64 << 20)
    node = Node(cfg)
    node.last_activity -= 100.0  # as if the node had taken 100 s to start
    listening: list[float] = []
    ended: list[float] = []

    def run() -> None:
        _serve(cfg, lambda port: listening.append((time.monotonic(), port)), node)
        ended.append(time.monotonic())

    before = {t for t in threading.enumerate() if t.name == "ffstate-push-watchdog"}  # other tests' live daemons
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not listening and time.monotonic() < deadline:
        time.sleep(0.05)
    assert listening, "the daemon never listened"
    since, port = listening[0]
    thread.join(1.2)  # before the fix, its first look (0.5 s) found 100 s idle and it left
    assert not ended, f"the daemon left {ended[0] - since:.2f}s after it listened, within its 2-s idle time"
    with Client(f"127.0.0.1:{port}", cfg.token, timeout=10.0, retries=0) as c:  # still serving
        c.inventory()
    thread.join(30)
    assert ended and ended[0] - since >= 2.0  # and then, idle, it leaves
    # and takes its threads with it: the push watchdog ended with the node (it once slept forever, in a test
    # process calling whatever a later test put in place of time.sleep)
    def ours() -> list[threading.Thread]:
        return [t for t in threading.enumerate() if t.name == "ffstate-push-watchdog" and t not in before]

    deadline = time.monotonic() + 5
    while ours() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not ours()


def test_an_attach_that_comes_as_the_node_closes_is_refused_and_leaves_no_slots():
    """A handler still running after the server's grace at a stop reaches the node once it closed: slots made then
    would outlive the daemon in /dev/shm."""
    import uuid
    from pathlib import Path

    import torch

    from ffstate import layout
    from ffstate.errors import ReplicaError
    from ffstate.ids import ShardKey

    node_id = f"closing-{uuid.uuid4().hex[:8]}"
    node = Node(DaemonConfig(node_id=node_id, host="127.0.0.1", port=0, token="t" * 32, memory_limit=64 << 20))
    manifest = layout.analyze({"w": torch.ones(10)})[0]
    node.close()
    with pytest.raises(ReplicaError, match="is stopping") as e:
        node.attach(ShardKey("j", 0, 1), manifest.to_json(), 0, [], None, None)
    assert e.value.code == "UNAVAILABLE"
    assert not list(Path("/dev/shm").glob(f"ffstate-{node_id}-*"))
