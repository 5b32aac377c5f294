"""What a daemon's persister writes as the daemon stops with ranks still attached (``Persister.close(attached)``):
real slots in shared memory, a real flushing process, the versions read back from disk bit for bit."""

import logging
import time
from types import SimpleNamespace

import pytest
import torch

from ffstate import layout, persist, shm
from ffstate.commit import SlotWriter
from ffstate.daemon.persister import Persister, _one_world
from ffstate.ids import ShardKey
from helpers import assert_bitwise_equal

pytestmark = pytest.mark.timeout(180)


def states(n: int) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    return [{"w": torch.randn(1000, generator=g), "step": torch.tensor(v)} for v in range(1, n + 1)]


@pytest.fixture
def rank_slots(tmp_path, monkeypatch):
    """Rank 0 of 1 of job ``j`` after 3 commits: its slots hold versions 3 and 2; yields (shard, states)."""
    monkeypatch.setattr(shm.slots, "SHM_DIR", tmp_path)
    got = states(3)
    manifest = layout.describe(got[0])
    paths = shm.slot_paths("n0", "j", 0, 1)
    shm.create_slots(paths, manifest, 4096)
    worker, daemon = shm.Slots(paths, manifest), shm.Slots(paths, manifest)
    writer = SlotWriter(worker)
    for v, state in enumerate(got, 1):
        writer.commit(state, v)
    writer.flush()
    try:
        yield SimpleNamespace(key=ShardKey("j", 0, 1), slots=daemon, persist_keys=None), got
    finally:
        worker.close()
        daemon.close()


def persister(root) -> Persister:
    p = Persister(root, every=100, keep=5, reserve=lambda n, what: None, release=lambda n: None, node_id="n0", nice=0)
    deadline = time.monotonic() + 90
    while not p._flusher.ready and time.monotonic() < deadline:  # it imports torch and DCP
        time.sleep(0.05)
    assert p._flusher.ready
    return p


def test_a_stop_writes_both_versions_the_slots_hold_and_a_later_stop_never_rewrites_a_complete_one(
        rank_slots, tmp_path, caplog):
    shard, got = rank_slots
    root = tmp_path / "store"
    with caplog.at_level(logging.INFO, logger="ffstate.daemon.persist"):
        persister(root).close([shard])  # every=100: nothing was due
    job_dir = root / "j"
    assert persist.complete_versions(job_dir) == [2, 3], caplog.text
    for v in (2, 3):
        shard_state, _ = persist.read_shard(persist.version_dir(job_dir, v), 0)
        assert_bitwise_equal(shard_state, got[v - 1])
    files = {p: p.stat().st_mtime_ns for p in job_dir.rglob("*") if p.is_file() and p.parent != job_dir}

    caplog.clear()
    with caplog.at_level(logging.INFO, logger="ffstate.daemon.persist"):
        persister(root).close([shard])  # a daemon started again on the node, stopping under the same ranks
    assert "version 2 is complete on disk already" in caplog.text and "version 3 is complete on disk already" in \
        caplog.text, caplog.text
    assert {p: p.stat().st_mtime_ns for p in files} == files  # not one file written again


def test_a_job_attached_at_two_world_sizes_is_not_written_at_a_stop():
    """A resize under way: the old world's rank 1 of 2 and the new world's rank 1 of 3 would write the same files."""
    old, new = (SimpleNamespace(key=ShardKey("j", 1, w)) for w in (2, 3))
    other = SimpleNamespace(key=ShardKey("k", 0, 1))
    said: list[str] = []
    assert _one_world([old, new, other], said) == [other]
    assert said == ["job j: not written, its ranks are attached at world sizes [2, 3] (a resize)"]
