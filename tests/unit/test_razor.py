"""The razor's plan, split and assembly (pure code; the torchrun jobs that use it are in test_trainer.py)."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ffstate import Config, FFStateError, codec, layout
from ffstate.razor import Groups, Plan, assemble, checksums, split
from helpers import assert_bitwise_equal, train_states

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.uint8, torch.bool]


def random_tensor(shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (*shape, torch.empty(0, dtype=dtype).element_size()), dtype=torch.uint8,
                         generator=g).view(dtype).reshape(shape)


@settings(max_examples=40, deadline=None)
@given(shapes=st.lists(st.lists(st.integers(0, 9), min_size=0, max_size=3), min_size=1, max_size=6),
       dtypes=st.lists(st.sampled_from(range(len(DTYPES))), min_size=6, max_size=6),
       group=st.integers(1, 5), seed=st.integers(0, 1000))
def test_parts_tile_every_entry_and_assembly_is_bitwise(shapes, dtypes, group, seed):
    states = []
    for r in range(group):  # every rank: the same model, its own "opt" entry and RNG
        model = {f"w{i}": random_tensor(s, DTYPES[dtypes[i]], seed + i) for i, s in enumerate(shapes)}
        states.append({"model": model, "opt": torch.full((3,), r), "step": 5})
    groups = Groups(tuple(range(group)), ("model",), "test")
    plan = Plan.of(states[0], groups)
    if plan is None:  # every entry empty
        assert all(t.numel() == 0 for t in states[0]["model"].values())
        return
    covered = {i: [] for i in range(len(plan.paths))}
    for member in plan.parts():
        for i, s, e in member:
            covered[i].append((s, e))
    for i, ranges in covered.items():  # the parts tile each entry: no gap, no overlap
        ranges.sort()
        assert ranges[0][0] == 0 and ranges[-1][1] == plan.nbytes(i) // layout.DTYPES[plan.dtypes[i]].itemsize
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
    assert sum(plan.part_bytes(m) for m in range(group)) == plan.total_bytes
    shards = {r: codec.unpack(codec.pack(split(states[r], plan, r))) for r in range(group)}  # through bytes
    for r in range(group):
        assert_bitwise_equal(assemble(shards[r], shards), states[r])


def test_parts_are_balanced_and_a_shard_is_about_a_quarter():
    state = list(train_states(1))[0]
    plan = Plan.of(state, Groups((0, 1, 2, 3), ("model", "optim/state"), "test"))
    sizes = [plan.part_bytes(m) for m in range(4)]
    assert max(sizes) - min(sizes) <= 8  # cut at element boundaries: within one element of 1/4
    whole = layout.describe(state).nbytes
    shard = layout.describe(split(state, plan, 2)).nbytes
    assert plan.part_bytes(2) < shard < 0.26 * whole, (shard, whole)  # its part, plus RNG states and extras


def test_assembly_refuses_a_missing_part_or_another_plan():
    states = [{"model": {"w": torch.arange(100.0) + 0}, "rng": torch.full((4,), r)} for r in range(2)]
    plan = Plan.of(states[0], Groups((0, 1), ("model",), "test"))
    shards = {r: split(states[r], plan, r) for r in range(2)}
    with pytest.raises(FFStateError, match="rank 1's part"):
        assemble(shards[0], {0: shards[0]})
    other = Plan(plan.group, plan.paths, plan.dtypes, ((10, 10),))
    with pytest.raises(FFStateError, match="another"):
        assemble(shards[0], {0: shards[0], 1: split({"model": {"w": torch.zeros(10, 10)}, "rng": states[1]["rng"]},
                                                    other, 1)})


def test_checksums_tell_identical_entries_from_different_ones():
    a = {"model": {"w": torch.arange(10.0), "v": torch.ones(3)}}
    b = {"model": {"w": torch.arange(10.0), "v": torch.ones(3)}}
    b["model"]["v"][1] = 1.0000001
    plan = Plan.of(a, Groups((0, 1), ("model",), "test"))
    sa, sb = checksums(a, plan), checksums(b, plan)
    assert sa[plan.paths.index("model/w")] == sb[plan.paths.index("model/w")]
    assert sa[plan.paths.index("model/v")] != sb[plan.paths.index("model/v")]


def test_declared_identical_entries_and_a_single_process(monkeypatch):
    from ffstate.razor import infer

    model, opt = torch.nn.Linear(2, 2), None
    assert infer(model, opt, 1, Config(razor_identical="model")) is None  # one process: nothing to split
    g = infer(model, opt, 4, Config(razor_identical="model, optim/state"))
    assert g.ranks == (0, 1, 2, 3) and g.prefixes == ("model", "optim/state")
    assert infer(model, opt, 4, Config()) is None  # not DDP, nothing declared: every byte is the rank's own
    assert infer(model, opt, 4, Config(razor="off", razor_identical="model")) is None
    with pytest.raises(ValueError, match="razor"):
        Config(razor="sometimes")


def test_a_later_split_follows_the_keys_and_gives_what_the_whole_walk_gives():
    """From the second split on, only the dicts on the way to each redundant entry are copied: the same layout and
    bytes as the whole walk, the captured state left as it was; a state whose nesting changed takes the whole walk."""
    from ffstate import razor

    state = list(train_states(1))[0]
    plan = Plan.of(state, Groups((0, 1, 2), ("model", "optim/state"), "test"))
    razor._KEY_TRIES.pop(plan, None)
    first = split(state, plan, 1)  # the whole walk, which records the keys
    assert plan in razor._KEY_TRIES
    again = split(state, plan, 1)  # along the keys
    assert again["own"]["model"] is not state["model"] and again["own"]["optim"] is not state["optim"]
    assert again["own"]["optim"]["param_groups"] is state["optim"]["param_groups"]  # off the keys' way: shared
    assert layout.describe(again).layout_id == layout.describe(first).layout_id
    assert_bitwise_equal(codec.unpack(codec.pack(again)), codec.unpack(codec.pack(first)))
    assert all(isinstance(t, torch.Tensor) for t in state["model"].values())  # nothing replaced in the original
    # The same entries under a list now (the same paths, other keys): the keys lead nowhere, the whole walk finds them.
    changed = {**state, "optim": {**state["optim"], "state": list(state["optim"]["state"].values())}}
    assert_bitwise_equal(split(changed, plan, 1)["razor"]["part"], first["razor"]["part"])
    with pytest.raises(FFStateError, match="no longer has the redundant entries"):
        split({**state, "model": {}}, plan, 1)
    # Entries that still track gradients (not captured by ``capture``) are detached on the way, as the whole walk does.
    tracked = {**state, "model": {k: torch.nn.Parameter(v.clone()) if v.is_floating_point() else v
                                  for k, v in state["model"].items()}}
    parts = split(tracked, plan, 1)["razor"]["part"]
    assert not any(t.requires_grad for t in parts)
    assert_bitwise_equal(parts, first["razor"]["part"])


def test_a_dict_reached_by_two_keys_is_split_as_the_whole_walk_splits_it():
    """One dict object under two keys (an aliased entry): each way to it gets its own copy and its own placeholders,
    as the whole walk gives (the old key-following shared one copy, and the last key's placeholders won)."""
    from ffstate import razor

    shared = {"w": random_tensor((6, 5), torch.float32, 1), "v": random_tensor((7,), torch.bfloat16, 2)}
    state = {"model": {"a": shared, "b": shared}, "step": 3}
    plan = Plan.of(state, Groups((0, 1), ("model",), "test"))
    razor._KEY_TRIES.pop(plan, None)
    first = split(state, plan, 0)  # the whole walk
    again = split(state, plan, 0)  # along the keys
    assert first["own"] == again["own"]
    assert again["own"]["model"]["a"] != again["own"]["model"]["b"]  # a placeholder per way
    assert_bitwise_equal(again["razor"]["part"], first["razor"]["part"])


def test_an_entry_that_changed_shape_or_dtype_since_the_plan_is_refused_and_the_group_plans_again():
    """The plan cuts each entry by the shape it had; an entry that grew would be committed as a prefix of itself (or
    more than a part holds). ``split`` refuses it; ``RazorVerifier`` then plans and verifies again at that step."""
    from types import SimpleNamespace

    from ffstate.razor import StalePlan
    from ffstate.razor_verify import RazorVerifier

    state = {"model": {"w": random_tensor((6, 5), torch.float32, 1), "n": random_tensor((4,), torch.float32, 2)}}
    plan = Plan.of(state, Groups((0, 1), ("model",), "test"))
    for changed in (random_tensor((8,), torch.float32, 3), random_tensor((4,), torch.float64, 3)):
        with pytest.raises(StalePlan, match="model/n"):
            split({"model": {**state["model"], "n": changed}}, plan, 0)
    names = []

    def exchange(name, mine, group, timeout):  # the other member holds the same entries
        names.append(name)
        return [mine for _ in group]

    job = SimpleNamespace(rank=0, world=2, cfg=Config(), exchange=exchange, record=lambda event: None)
    verifier, planned = RazorVerifier(job, Groups((0, 1), ("model",), "test")), []
    verifier.shard(state, 1, lambda: planned.append(1), lambda v, m: None)
    grown = {"model": {**state["model"], "n": random_tensor((8,), torch.float32, 3)}}
    shard = verifier.shard(grown, 2, lambda: planned.append(2), lambda v, m: None)
    assert names == ["razor/1", "razor/2/again"] and planned == [1, 2] and verifier.plan.shapes[1] == (8,)
    shards = {0: shard, 1: split(grown, verifier.plan, 1)}
    assert_bitwise_equal(assemble(shard, shards)["model"]["n"], grown["model"]["n"])


def test_a_member_s_part_decodes_from_its_segments_alone_and_assembles_bitwise():
    """A razor restore takes from another member's shard its part only: the header, then the segments that hold
    the part (``Decoder(want=in_part).needed``); the part decodes bit-exact from those, fed in any order with
    repeats and unneeded chunks among them, and the state assembles; a bad chunk it needs is refused."""
    import numpy as np

    from ffstate.codec import Chunk
    from ffstate.errors import CodecError
    from ffstate.razor import in_part

    group = (0, 1, 2)
    model = {"w": random_tensor((301, 7), torch.float32, 1), "e": random_tensor((33,), torch.bfloat16, 2),
             "n": random_tensor((5,), torch.int64, 3)}
    states = [{"model": model, "optim": {"m": random_tensor((2107, 5), torch.float32, 10 + r),
                                         "h": random_tensor((999,), torch.bfloat16, 20 + r)}, "step": 7 + r}
              for r in group]  # ZeRO-like: the model shared, each rank's optimizer its own and larger
    plan = Plan.of(states[0], Groups(group, ("model",), "test"))
    shards = {r: split(states[r], plan, r) for r in group}
    rng = np.random.default_rng(0)
    parts = {}
    for r in (1, 2):
        chunks = list(codec.encode(shards[r], chunk_bytes=4096).chunks)
        dec = codec.Decoder(want=in_part)
        dec.add(chunks[0])
        needed = dec.needed
        assert needed[0] == 0 and len(needed) < len(chunks) / 3, (len(needed), len(chunks))
        sent = [chunks[i] for i in needed[1:]] + [chunks[i] for i in needed[1::2]]  # repeats (a retried stripe)
        sent += [c for c in chunks[1:] if c.index not in needed][:3]  # chunks a part does not need: ignored
        rng.shuffle(sent)
        for c in sent:
            dec.add(c)
        got = dec.state()
        assert dec.part_nbytes == plan.part_bytes(r)
        assert all(t.is_meta for t in layout.flatten(got["own"])[1] if isinstance(t, torch.Tensor))
        parts[r] = got
        bad = bytearray(chunks[needed[-1]].payload)
        bad[len(bad) // 2] ^= 1
        dec = codec.Decoder(want=in_part)
        for c in chunks[: needed[-1]]:
            dec.add(c)
        dec.add(Chunk(needed[-1], len(chunks), chunks[needed[-1]].checksum, memoryview(bytes(bad))))
        with pytest.raises(CodecError, match="corrupted"):
            dec.state()
        dec = codec.Decoder(want=in_part)
        for c in chunks[: needed[-1]]:
            dec.add(c)
        with pytest.raises(CodecError, match="missing"):
            dec.state()
    assert_bitwise_equal(assemble(shards[0], {0: shards[0], **parts}), states[0])
