"""The persistent tier's format, in one process: a version's DCP items (keys as DCP's own get_state_dict gives
them, the razor's runs of elements as boxes), written through DCP's writer, made complete, read back bit for
bit by ffstate and by torch.distributed.checkpoint itself; a torn or corrupted file named and refused."""

import json
import math
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from ffstate import checksum, codec, persist, razor
from ffstate.capture import capture
from ffstate.config import Config
from ffstate.persist import keys as keymod
from ffstate.persist import read as persist_read
from ffstate.testing.models import TinyGPT
from helpers import assert_bitwise_equal


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 5), min_size=0, max_size=4), st.data())
def test_boxes_tile_a_run_of_elements_exactly_each_a_contiguous_run(shape, data):
    n = math.prod(shape)
    start = data.draw(st.integers(0, n))
    stop = data.draw(st.integers(start, n))
    flat = torch.arange(n).reshape(shape) if shape else torch.tensor(0)
    got = []
    for offsets, sizes, first in persist.boxes(tuple(shape), start, stop):
        box = flat[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))] if shape else flat
        count = math.prod(sizes)
        assert box.reshape(-1).tolist() == list(range(first, first + count))  # contiguous, where it says
        got += box.reshape(-1).tolist()
    assert got == list(range(start, stop))
    assert len(persist.boxes(tuple(shape), start, stop)) <= max(1, 2 * len(shape))


def trained(seed: int = 0):
    torch.manual_seed(seed)
    model = TinyGPT()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(2):
        model.loss(torch.randint(0, model.tok.num_embeddings, (4, model.seq + 1))).backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def flush(tmp: Path, shards: dict[int, dict], keys: dict, version: int = 7) -> Path:
    """Writes each rank's shard as its daemon would and finalizes the version; returns its folder."""
    vdir = persist.version_dir(tmp / "job", version)
    for rank, shard in shards.items():
        snap = codec.pack(shard)
        items = persist.items_of(snap.manifest, snap.buffer, keys, rank, param_groups=rank == 0)
        persist.write_rank(vdir, "job", version, rank, len(shards), snap.manifest, snap.checksum, items)
        assert persist.finalize(vdir, len(shards)) == (rank == len(shards) - 1)
    return vdir


def test_a_version_reads_back_bit_for_bit_and_loads_into_a_plain_model_through_dcp(tmp_path):
    model, opt = trained()
    state = capture(model, opt, None, {"epoch": 3, "pos": torch.tensor([5, 6])})
    keys = keymod.key_map(model, opt)
    assert keys["tensors"]["model/tok.weight"][0] == "model.tok.weight"
    assert keys["tensors"]["optim/state/0/exp_avg"][0].startswith("optim.state.")
    vdir = flush(tmp_path, {0: state}, persist.check_keys(keymod.to_json(keys)))
    assert persist.complete_versions(tmp_path / "job") == [7]
    persist.check(vdir, [0])
    got, nbytes = persist.read_shard(vdir, 0)
    assert_bitwise_equal(got, state)
    # DCP itself, without ffstate: a fresh model and its optimizer, by DCP's own state-dict layout
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    fresh, fresh_opt = trained(seed=1)
    msd, osd = get_state_dict(fresh, fresh_opt)
    dcp.load({"model": msd, "optim": osd}, checkpoint_id=vdir, no_dist=True)
    set_state_dict(fresh, fresh_opt, model_state_dict=msd, optim_state_dict=osd)
    assert_bitwise_equal(fresh.state_dict(), model.state_dict())
    assert_bitwise_equal(fresh_opt.state_dict(), opt.state_dict())
    out = tmp_path / "one.pt"
    dcp_to_torch_save(vdir, out)
    whole = torch.load(out, weights_only=False)
    assert_bitwise_equal(whole["model"], {k: v for k, v in model.state_dict().items()})


def test_the_razor_s_parts_are_written_once_as_boxes_and_each_rank_reads_back_its_own(tmp_path):
    model, opt = trained()
    state = capture(model, opt, None, None)
    groups = razor.Groups((0, 1, 2), ("model",), "test")
    plan = razor.Plan.of(state, groups)
    shards = {r: razor.split(state, plan, r) for r in (0, 1, 2)}
    vdir = flush(tmp_path, shards, keymod.key_map(model, opt))
    for r in (0, 1, 2):
        got, _ = persist.read_shard(vdir, r)
        assert_bitwise_equal(got, shards[r])
    assert_bitwise_equal(razor.assemble(persist.read_shard(vdir, 1)[0], {r: persist.read_shard(vdir, r)[0]
                                                                         for r in (0, 1, 2)}), state)
    fresh = TinyGPT()
    sd = {"model": fresh.state_dict()}
    dcp.load(sd, checkpoint_id=vdir, no_dist=True)
    assert_bitwise_equal(sd["model"], model.state_dict())
    # Each redundant byte is written once, by its part's owner: the model's elements, not three times them.
    model_elements = sum(t.numel() for t in model.state_dict().values())
    written = [math.prod(it["sizes"]) for r in (0, 1, 2) for it in persist_read.record(vdir, r)["items"]
               if it["fqn"].startswith("model.")]
    assert sum(written) == model_elements and len(written) > len(model.state_dict())  # runs cut into boxes


@pytest.mark.parametrize("damage", ["truncate", "flip", "remove"])
@pytest.mark.parametrize("name", ["__1_0.distcp", "ffstate-rank1.json"])  # rank 1's data, and its record
def test_a_torn_or_corrupted_file_is_named_and_never_read(tmp_path, damage, name):
    model, opt = trained()
    state = capture(model, opt, None, None)
    vdir = flush(tmp_path, {0: state, 1: state}, keymod.key_map(model, opt))
    target = vdir / name
    raw = bytearray(target.read_bytes())
    if damage == "truncate":
        target.write_bytes(raw[: len(raw) // 2])
    elif damage == "flip":
        raw[len(raw) // 2] ^= 0x10
        target.write_bytes(raw)
    else:
        target.unlink()
    persist.check(vdir, [0])  # rank 0's own file is fine
    with pytest.raises(persist.PersistError, match=name.replace(".", r"\.")):
        persist.check(vdir, [0, 1])
    if damage == "flip" and name.endswith(".distcp"):  # the size is right: the checksum of the rebuilt version refuses it too
        with pytest.raises(persist.PersistError, match="checksum"):
            persist.read_shard(vdir, 1)


def test_a_version_of_format_1_is_checked_and_read_by_the_sums_it_was_written_with(tmp_path, monkeypatch):
    """Versions persisted before the checksums moved to XXH3 (format 1: the fingerprint's sums) still resume a job:
    checked and read by their own sums, a flipped byte still refused; a format this ffstate does not know is
    refused by name."""
    model, opt = trained()
    state = capture(model, opt, None, None)
    monkeypatch.setattr(persist.write, "FORMAT", 1)
    vdir = persist.version_dir(tmp_path / "job", 7)
    snap = codec.pack(state)
    items = persist.items_of(snap.manifest, snap.buffer, keymod.key_map(model, opt), 0, param_groups=True)
    persist.write_rank(vdir, "job", 7, 0, 1, snap.manifest, checksum.fingerprint(snap.buffer.numpy()), items)
    assert persist.finalize(vdir, 1)
    monkeypatch.undo()
    persist.check(vdir, [0])
    got, _ = persist.read_shard(vdir, 0)
    assert_bitwise_equal(got, state)
    target = vdir / "__0_0.distcp"
    raw = bytearray(target.read_bytes())
    raw[len(raw) // 2] ^= 0x10
    target.write_bytes(raw)
    with pytest.raises(persist.PersistError, match="__0_0.distcp"):
        persist.check(vdir, [0])
    marker = json.loads((vdir / persist.write.COMPLETE).read_text())
    marker["format"] = 9
    (vdir / persist.write.COMPLETE).write_text(json.dumps(marker))
    with pytest.raises(persist.PersistError, match="format 9"):
        persist.check(vdir, [0])


def test_an_incomplete_version_is_not_listed_and_retention_keeps_the_newest(tmp_path):
    model, opt = trained()
    state = capture(model, opt, None, None)
    keys = keymod.key_map(model, opt)
    for v in (3, 4, 5):
        flush(tmp_path, {0: state}, keys, version=v)
    snap = codec.pack(state)  # version 6: one rank of two flushed, then the node died
    vdir = persist.version_dir(tmp_path / "job", 6)
    persist.write_rank(vdir, "job", 6, 0, 2, snap.manifest, snap.checksum,
                       persist.items_of(snap.manifest, snap.buffer, keys, 0, True))
    assert not persist.finalize(vdir, 2)
    assert persist.complete_versions(tmp_path / "job") == [3, 4, 5]
    persist.prune(tmp_path / "job", keep=2)
    assert persist.complete_versions(tmp_path / "job") == [4, 5] and vdir.exists()  # newer than 5: may be going on
    assert Config().persist_keep >= 1


def test_a_version_is_complete_only_when_every_rank_s_record_comes_from_one_attempt(tmp_path):
    """After a restore to v*, the versions past v* are redone, maybe differently: a record left by the run that
    died never completes a version with the new run's records."""
    model, opt = trained()
    state = capture(model, opt, None, None)
    keys = keymod.key_map(model, opt)
    snap = codec.pack(state)
    vdir = persist.version_dir(tmp_path / "job", 9)

    def write(rank: int, timeline: str) -> None:
        persist.write_rank(vdir, "job", 9, rank, 2, snap.manifest, snap.checksum,
                           persist.items_of(snap.manifest, snap.buffer, keys, rank, True), timeline)

    write(0, "dead")
    write(1, "live")
    assert not persist.finalize(vdir, 2) and persist.complete_versions(tmp_path / "job") == []
    write(0, "live")  # the new run's rank 0 flushes the redone version
    assert persist.finalize(vdir, 2) and persist.complete_versions(tmp_path / "job") == [9]
    assert [v.name for v in persist.drop_newer(tmp_path / "job", 8)] == ["v000000000009"]
    assert persist.complete_versions(tmp_path / "job") == []
