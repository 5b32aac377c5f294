"""Where a restore puts tensors recorded on a GPU: the device a tensor was committed from is the committing
process's (``cuda:63`` there may not exist here, or be another process's GPU). A rank's own shard goes where its
model is (``capture.placement``), its razor group's and an old world's shards to the CPU; decoded either way bit
for bit. Run here without a GPU: the recorded devices are made up, and the decodes that honour them fail."""

import dataclasses

import pytest
import torch

from ffstate import capture, codec, recovery
from ffstate.codec import Snapshot
from helpers import assert_bitwise_equal, train_states


def on_gpu(snapshot: Snapshot, device: str = "cuda:63") -> Snapshot:
    """The snapshot as a process on ``device`` would have committed it (the layout does not include devices)."""
    m = snapshot.manifest
    tensors = tuple(dataclasses.replace(t, device=device) if t.kind != "ndarray" else t for t in m.tensors)
    return Snapshot(dataclasses.replace(m, tensors=tensors), snapshot.buffer, snapshot.checksum)


def cpu_state():
    return list(train_states(1))[-1]


def test_a_decode_honours_the_recorded_device_unless_told_where(monkeypatch):
    state = cpu_state()
    snap = on_gpu(codec.pack(state))
    with pytest.raises((RuntimeError, AssertionError)):  # no cuda:63 here: where a foreign ordinal leads
        codec.unpack_verified(snap.manifest, snap.buffer)
    for where in ("cpu", lambda recorded: "cpu" if recorded == "cuda:63" else recorded):
        got, total = codec.unpack_verified(snap.manifest, snap.buffer, map_location=where)
        assert total == snap.checksum
        assert_bitwise_equal(got, state)
        dec = codec.Decoder(map_location=where)
        for c in codec.encode_snapshot(snap, chunk_bytes=64 << 10).chunks:
            dec.add(c)
        assert_bitwise_equal(dec.state(), state)


def test_a_model_s_one_device_is_where_its_gpu_tensors_go_and_the_cpu_stays():
    assert capture.placement(torch.nn.Linear(2, 2)) is None  # on the CPU: the devices recorded
    place = capture.placement(torch.nn.Linear(2, 2, device="meta"))  # one device that is not the CPU
    assert place("meta") == torch.device("meta") and place("cpu") == "cpu"
    assert place("cuda:63") == "cuda:63"  # another kind of device than the model's: as recorded
    two = torch.nn.Sequential(torch.nn.Linear(2, 2, device="meta"), torch.nn.Linear(2, 2))
    assert capture.placement(two) is not None  # the CPU's tensors do not count


def test_the_razor_group_s_and_an_old_world_s_shards_are_fetched_onto_the_cpu(daemons):
    """Through a real daemon: rank 1's shard, committed on its process's cuda:62, comes to rank 0 on the CPU; rank
    0's own goes where ``map_location`` says."""
    d = daemons.start()
    states = {r: list(train_states(1, seed=r))[-1] for r in (0, 1)}
    with d.client() as c:
        for r, st in states.items():
            c.push_and_commit("j", r, 2, 1, codec.encode_snapshot(on_gpu(codec.pack(st), f"cuda:{61 + r}")))
        available = {r: recovery.Available(remote={d.address: [1]}) for r in (0, 1)}
        with pytest.raises((RuntimeError, AssertionError)):  # rank 0's own, left on its recorded cuda:61 (no such GPU)
            recovery.fetch_ranks("j", 2, 1, available, {}, {d.address: c}, own=0)
        got = recovery.fetch_ranks("j", 2, 1, available, {}, {d.address: c}, own=0,  # rank 1's cuda:62 not mapped here
                                   map_location=lambda recorded: "cpu" if recorded == "cuda:61" else recorded)
    for r, st in states.items():
        assert_bitwise_equal(got[r][0], st)


def test_the_attempt_s_nonce_is_broadcast_from_the_rank_s_own_gpu_under_nccl(monkeypatch):
    """Under NCCL every rank's tensor must be on its own GPU: a process that never called ``set_device`` has cuda:0
    current, and every rank of a node broadcasting from it fails ("Duplicate GPU detected"). The nonce goes on the
    GPU the model is on. (No GPU here: ``Tensor.to`` and the broadcast are stood in for, to see where it goes.)"""
    from types import SimpleNamespace

    import torch.distributed as dist

    from ffstate.job import Job

    went = []
    monkeypatch.setattr(dist, "get_backend", lambda *a: "nccl")
    monkeypatch.setattr(dist, "broadcast", lambda t, src: went.append(("broadcast", t.device)))
    monkeypatch.setattr(torch.Tensor, "to", lambda t, device: (went.append(("to", device)), t)[1])
    job = SimpleNamespace(store=object(), rank=0, device=torch.device("cuda", 3))
    assert int(Job._generation(job), 16) > 0
    assert went[0] == ("to", torch.device("cuda", 3)) and went[1][0] == "broadcast"
    assert capture.model_device(torch.nn.Linear(2, 2, device="meta")) == torch.device("meta")
    assert capture.model_device(torch.nn.Linear(2, 2)) is None
