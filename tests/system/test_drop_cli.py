"""``ffstate drop`` against real ``ffstate serve`` daemons: a job that is active is left as it is, an idle one is
dropped (its replicas and its slots), a job a daemon does not hold is said to be absent."""

import os
import subprocess
import sys

import pytest

from daemons import TOKEN, held_version, wait_until
from ffstate import codec, shm
from helpers import train_states

pytestmark = pytest.mark.timeout(180)
WRITER = os.path.join(os.path.dirname(__file__), "..", "procs", "writer.py")


def drop(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ffstate.cli", "drop", *args], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "FFSTATE_TOKEN": TOKEN, "COLUMNS": "200"})


def test_an_active_job_is_left_and_an_idle_one_dropped_with_its_slots(daemons):
    b = daemons.start()
    a = daemons.start("--peer", b.address)
    w = subprocess.run([sys.executable, WRITER, a.address, "gone", "0", "1", "3"], capture_output=True, text=True,
                       timeout=120, env={**os.environ, "FFSTATE_TOKEN": TOKEN})
    assert w.returncode == 0, w.stderr
    wait_until(lambda: held_version(b.client(), "gone", 0) == 3, what="B at version 3")
    slots = list(shm.slots.SHM_DIR.glob(f"ffstate-{a.node_id}-*"))
    assert slots  # the writer's rank is attached at A: its slots stay for a restart

    out = drop("--job", "gone", "--daemon", a.address, "--daemon", b.address)  # committed and pushed just now
    assert out.returncode == 1 and out.stderr.count("left as it is") == 2, (out.stdout, out.stderr)
    assert "--force" in out.stderr and held_version(b.client(), "gone", 0) == 3 and all(p.exists() for p in slots)

    out = drop("--job", "gone", "--daemon", a.address, "--daemon", b.address, "--idle", "0")
    assert out.returncode == 0, (out.stdout, out.stderr)
    assert f"{b.address} ({b.node_id}): dropped 1 shard(s) of job gone" in out.stdout, out.stdout
    assert f"{a.address} ({a.node_id}): dropped 1 shard(s) of job gone" in out.stdout, out.stdout
    with b.client() as c:
        assert not c.inventory("gone").shards and c.inventory().bytes_used == 0
    with a.client() as c:
        assert not c.inventory("gone").shards
    assert not any(p.exists() for p in slots)  # the slots went with the rank's shard

    out = drop("--job", "gone", "--daemon", b.address)
    assert out.returncode == 0 and "holds nothing of job gone" in out.stdout, (out.stdout, out.stderr)


def test_force_drops_an_active_job_and_a_worker_started_daemon_left_empty_exits(daemons):
    b = daemons.start("--exit-when-empty")  # as the workers start one
    with b.client() as c:  # a push this moment: active
        c.push_and_commit("busy", 0, 1, 1, codec.encode_snapshot(codec.pack(next(iter(train_states(1))))))
    out = drop("--job", "busy", "--daemon", b.address, "--force")
    assert out.returncode == 0 and "dropped 1 shard(s) of job busy" in out.stdout, (out.stdout, out.stderr)
    assert b.proc.wait(20) == 0 and "nothing attached or held after the job's drop" in b.log()
