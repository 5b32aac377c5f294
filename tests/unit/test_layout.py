"""ffstate/layout.py: nested states <-> manifest + flat buffer, for every leaf kind training produces."""

import collections
import json
import math
import random
import struct

import numpy as np
import pytest
import torch

from ffstate import capture, codec, layout
from ffstate.errors import CodecError
from helpers import assert_bitwise_equal, contiguous_bits

ALL_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32, torch.int16,
              torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128]


def roundtrip(state):
    snap = codec.pack(state)
    return codec.unpack(snap)


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_every_dtype_roundtrips_bitwise_with_0dim_empty_and_noncontiguous(dtype):
    g = torch.Generator().manual_seed(1)
    raw = torch.randint(0, 256, (6 * 10 * dtype.itemsize,), dtype=torch.uint8, generator=g)
    full = raw.view(dtype).reshape(6, 10)
    state = {"full": full, "scalar": full[2, 3].clone(), "empty": full[:0], "t": full.t(), "strided": full[::2, 1::3]}
    assert not state["t"].is_contiguous()
    assert_bitwise_equal(roundtrip(state), {k: contiguous_bits(v) for k, v in state.items()})


def test_special_float_values_keep_their_bits():
    pattern = [0.0, -0.0, float("inf"), -float("inf"), 1e-45, -1e-40, 3.4e38]
    t = torch.tensor(pattern, dtype=torch.float32)
    nan_payloads = torch.from_numpy(np.array([0x7FC00001, 0xFFC12345, 0x7F800001], dtype=np.uint32).view(np.float32))
    py_nan = struct.unpack("<d", struct.pack("<Q", 0x7FF8DEADBEEF0001))[0]
    state = {"t": t, "nan": nan_payloads, "py": [0.0, -0.0, math.inf, py_nan, 5e-324]}
    assert_bitwise_equal(roundtrip(state), state)


def test_python_values_and_container_types_survive():
    od = collections.OrderedDict([("w", torch.ones(2)), ("b", torch.zeros(1))])
    od._metadata = {"": {"version": 1}}
    state = {
        "od": od,
        "tuple": (1, "a", None, True, False, 2**70, -3),
        "list": [b"\x00\xff", 1 + 2j, np.float32(1.5), np.int64(-7)],
        3: {"int key": 1},
        "size": torch.Size([2, 3]),
        "param": torch.nn.Parameter(torch.randn(3)),
    }
    got = roundtrip(state)
    assert_bitwise_equal(got, state)
    assert isinstance(got["param"], torch.nn.Parameter)


def test_training_state_with_rng_states_roundtrips():
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95))
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5**s)
    state = {
        "model": model.state_dict(),
        "optim": opt.state_dict(),
        "sched": sched.state_dict(),
        "rng": {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()},
    }
    got = roundtrip(state)
    assert_bitwise_equal(got, state)
    # The restored RNG states are usable as such.
    np.random.set_state(got["rng"]["numpy"])
    random.setstate(got["rng"]["python"])
    torch.set_rng_state(got["rng"]["torch"])


def test_captured_rng_states_go_back_through_a_snapshot_and_draw_the_same_numbers():
    random.seed(5)
    random.gauss(0, 1)  # leaves a cached Gaussian in Python's state: it must come back too
    np.random.seed(6)
    torch.manual_seed(7)
    snap = codec.pack(capture.rng_state())
    # Python's 625-word state is one array, not 625 scalars (most of a commit's layout walk otherwise).
    assert len(snap.manifest.scalars) < 10
    want = [random.random(), random.gauss(0, 1), np.random.rand(), torch.rand(1).item()]
    capture.set_rng_state(codec.unpack(snap))
    assert [random.random(), random.gauss(0, 1), np.random.rand(), torch.rand(1).item()] == want


def test_manifest_is_plain_json_and_round_trips():
    state = {"a": torch.randn(3, 5), "b": [torch.arange(4), 1.25], "c": np.arange(3, dtype=np.uint32)}
    m = layout.describe(state)
    text = m.to_json()
    json.loads(text)  # plain JSON
    again = layout.Manifest.from_json(text)
    assert again == m
    assert all(t.offset % layout.ALIGN == 0 for t in m.tensors)


def test_layout_id_ignores_values_but_not_structure():
    a = {"w": torch.zeros(3), "lr": 0.1}
    assert layout.describe(a).layout_id == layout.describe({"w": torch.ones(3), "lr": 0.2}).layout_id
    for other in ({"w": torch.zeros(4), "lr": 0.1}, {"w": torch.zeros(3, dtype=torch.float64), "lr": 0.1},
                  {"v": torch.zeros(3), "lr": 0.1}, {"w": torch.zeros(3), "lr": 0.1, "x": 1}):
        assert layout.describe(other).layout_id != layout.describe(a).layout_id


@pytest.mark.parametrize(
    "bad",
    [
        {"f": lambda x: x},
        {"s": {1, 2}},
        {"obj": np.array([object()], dtype=object)},
        {"sparse": torch.eye(3).to_sparse()},
    ],
    ids=["function", "set", "object-array", "sparse-tensor"],
)
def test_unsupported_values_raise_codec_error_naming_the_path(bad):
    with pytest.raises(CodecError, match=next(iter(bad))):
        layout.describe(bad)


@pytest.mark.parametrize(
    "mutate",
    [
        lambda o: o["tensors"][0].__setitem__(1, "float128"),
        lambda o: o["tensors"][0].__setitem__(2, [-1]),
        lambda o: o["tensors"][0].__setitem__(3, 4096),
        lambda o: o["tree"].__setitem__("d", [["a", {"T": 7}]]),
        lambda o: o.__setitem__("tree", {"q": 1}),
        lambda o: o.pop("scalars"),
    ],
    ids=["dtype", "shape", "offset", "dangling-slot", "node", "missing-field"],
)
def test_malformed_manifest_is_refused(mutate):
    obj = json.loads(layout.describe({"a": torch.zeros(4), "b": 1.0}).to_json())
    mutate(obj)
    with pytest.raises(CodecError):
        layout.Manifest.from_json(json.dumps(obj).encode())


def test_map_location_moves_tensors():
    state = {"w": torch.randn(4)}
    got = codec.unpack(codec.pack(state), map_location="meta")
    assert got["w"].device.type == "meta"


@pytest.mark.parametrize(
    "text",
    [b"[]", b"{}", b'{"tree": {"d": [1]}, "tensors": [], "scalars": []}', b'{"tree": {"z": ["x"]}, "tensors": [], "scalars": []}',
     b"[" * 100_000, b"\xff"],
    ids=["list", "empty", "bad-pairs", "bad-size", "deep", "not-utf8"],
)
def test_garbage_manifest_bytes_raise_codec_error(text):
    with pytest.raises(CodecError):
        layout.Manifest.from_json(text)


def _commit_like_state():
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    od = collections.OrderedDict([("w", torch.ones(2)), ("flag", torch.tensor([True, False]))])
    od._metadata = {"": {"version": 1}}
    return {"model": model.state_dict(), "optim": opt.state_dict(), "od": od, "t": (1, None, 2.5, b"\x01"),
            "size": torch.Size([2, 3]), 3: {np.int64(4): np.float32(1.5)}, "arr": np.arange(5, dtype=np.int16),
            "param": torch.nn.Parameter(torch.randn(3)), "empty": torch.zeros(0), "rng": capture.rng_state(),
            "flags": {False: torch.zeros(1), 2: "two"}}


def _rekey(d: dict, old, new) -> dict:
    """``d`` with key ``old`` replaced by ``new``, in its place (``new == old`` may hold: True == 1)."""
    return {new if k is old or (type(k) is type(old) and k == old) else k: v for k, v in d.items()}


def test_the_commit_walk_gives_what_flatten_gives_without_paths():
    # analyze_known (every commit after the first) walks in step with the known tree: flatten's leaves and scalars.
    state = _commit_like_state()
    tree, leaves, scalars = layout.flatten(state)
    fast = layout._match_known(state, tree)
    assert fast is not None and fast[1] == scalars
    assert len(fast[0]) == len(leaves) and all(a is b for a, (_, b) in zip(fast[0], leaves))
    m = layout.describe(state)
    current, arrays = layout.analyze_known(state, m)
    assert current == m and all(a is b for a, (_, b) in zip(arrays, leaves))
    # Packed through the known layout, then unpacked: every bit back (bools as bytes, arrays, params).
    out = layout.alloc_buffer(m)
    codec.pack_into(state, out, m)
    assert_bitwise_equal(codec.unpack(codec.Snapshot(m, out[: m.nbytes], None)), state)
    # A new value of a scalar is not a new layout: the same layout with the new scalars.
    state["optim"]["param_groups"][0]["lr"] = 0.5
    current, _ = layout.analyze_known(state, m)
    assert current.layout_id == m.layout_id and current.scalars == tuple(layout.flatten(state)[2]) != m.scalars


@pytest.mark.parametrize("change", [
    lambda s: s["model"].__setitem__("0.weight", torch.zeros(3, 5)),  # shape
    lambda s: s["model"].__setitem__("0.bias", torch.zeros(3, dtype=torch.float64)),  # dtype
    lambda s: s.__setitem__("param", s["param"].detach()),  # a Parameter no more
    lambda s: s["model"].__setitem__("0.bias", torch.nn.Parameter(s["model"]["0.bias"])),  # a Parameter now
    lambda s: s.__setitem__("arr", np.arange(5, dtype=np.int32)),  # a numpy dtype
    lambda s: s.__setitem__("arr", torch.arange(5, dtype=torch.int16)),  # an array became a tensor
    lambda s: s["optim"]["param_groups"][0].__setitem__("extra", 1),  # the nesting
    lambda s: s.__setitem__("t", [1, None, 2.5, b"\x01"]),  # a tuple became a list
    lambda s: s.__setitem__("t", (1, None, 2.5)),  # one element fewer
    lambda s: s["model"].__setitem__("extra", s["model"].pop("0.bias")),  # a key renamed (and moved last)
    lambda s: s["od"].__delattr__("_metadata"),  # an OrderedDict without its metadata
    lambda s: s.__setitem__("size", torch.Size([3, 2])),  # a torch.Size
    lambda s: s.__setitem__("t", (torch.ones(1), None, 2.5, b"\x01")),  # a scalar became a tensor
    lambda s: s.__setitem__("empty", 0.0),  # a tensor became a scalar
    lambda s: s["optim"].__setitem__("state", _rekey(s["optim"]["state"], 1, True)),  # an int key became the bool equal to it
    lambda s: s.__setitem__("flags", _rekey(s["flags"], False, 0)),  # and a bool key the int
], ids=["shape", "dtype", "kind", "to-param", "np-dtype", "array-to-tensor", "nesting", "container", "shorter", "key", "metadata",
        "size", "scalar-to-tensor", "tensor-to-scalar", "int-key-to-bool", "bool-key-to-int"])
def test_the_commit_walk_sees_every_layout_change(change):
    state = _commit_like_state()
    m = layout.describe(state)
    change(state)
    current, _ = layout.analyze_known(state, m)
    assert current.layout_id != m.layout_id
    with pytest.raises(CodecError, match="layout changed"):
        codec.pack_into(state, layout.alloc_buffer(m), m)


def test_a_leaf_that_turned_sparse_is_refused_by_its_path_at_the_commit():
    state = _commit_like_state()
    m = layout.describe(state)
    state["model"]["0.bias"] = state["model"]["0.bias"].to_sparse()
    with pytest.raises(CodecError, match="model/0.bias: layout torch.sparse_coo is not supported"):
        layout.analyze_known(state, m)


@pytest.mark.parametrize("bad", [{"s": {1, 2}}, {"dd": collections.defaultdict(int)}, {"f": lambda x: x},
                                 {"nt": collections.namedtuple("P", "x")(1)}],
                         ids=["set", "defaultdict", "function", "namedtuple"])
def test_the_commit_walk_leaves_unusual_values_to_flatten_and_its_error(bad):
    state = {"w": torch.zeros(2)}
    m = layout.describe(state)
    with pytest.raises(CodecError, match=next(iter(bad))):
        layout.analyze_known({**state, **bad}, m)


def test_gc_paused_nests_and_resumes_the_collector_only_if_it_was_on():
    import gc

    assert gc.isenabled()
    with pytest.raises(CodecError):  # an error inside still resumes it
        with layout.gc_paused():
            assert not gc.isenabled()
            with layout.gc_paused():
                assert not gc.isenabled()
            assert not gc.isenabled()  # the inner section found it off: it stays off
            layout.Manifest.from_json(b"{}")
    assert gc.isenabled()
    gc.disable()
    try:
        layout.Manifest.from_json(layout.describe({"w": torch.zeros(2)}).to_json())
        assert not gc.isenabled()  # a user who turned it off keeps it off
    finally:
        gc.enable()


def _same_leaves(got: dict, want: dict) -> None:
    """The same names, in order, and each the same tensor as state_dict() gives: plain, detached, the same storage."""
    assert list(got) == list(want)
    for k, t in want.items():
        g = got[k]
        assert type(g) is type(t) is torch.Tensor, k
        assert (g.requires_grad, g.dtype, g.shape, g.stride(), g.data_ptr()) == \
            (t.requires_grad, t.dtype, t.shape, t.stride(), t.data_ptr()), k


def test_the_commit_captures_the_tensors_state_dict_gives():
    # capture reads state_dict(keep_vars=True) and detaches what needs it: the same dict as state_dict(), for
    # trainable and frozen parameters, persistent buffers (non-persistent ones left out) and a Parameter subclass.
    class Scaled(torch.nn.Parameter):
        pass

    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3), torch.nn.Linear(3, 2))
    model[2].weight.requires_grad_(False)
    model[0].register_buffer("scratch", torch.ones(2), persistent=False)
    model[2].register_parameter("scale", Scaled(torch.ones(1)))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model(torch.randn(5, 4)).sum().backward()
    opt.step()
    got = capture.capture(model, opt, None, None)
    _same_leaves(got["model"], model.state_dict())
    assert "0.scratch" not in got["model"] and got["model"]["2.scale"].dtype == torch.float32
    want = {"model": model.state_dict(), "optim": opt.state_dict(), "rng": got["rng"]}
    assert layout.describe(got).layout_id == layout.describe(want).layout_id
    assert_bitwise_equal(got, want)


def test_a_plain_optimizers_state_is_captured_without_its_walk_and_a_sharded_ones_is_localized(monkeypatch):
    # torch's optimizers keep plain tensors for plain parameters: the capture skips local()'s rebuild of that state
    # (the same layout, the optimizer's own tensors); a DTensor parameter or a differentiable group is walked
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(5, 4)).sum().backward()
    opt.step()
    assert capture.plain_optimizer(opt)
    got = capture.capture(model, opt, None, None)
    walked = capture.local(capture.optimizer_state(opt))
    assert layout.describe(got["optim"]).layout_id == layout.describe(walked).layout_id
    assert got["optim"]["state"][0] is opt.state[model.weight]  # not rebuilt: the state dict's own entry
    assert_bitwise_equal(got["optim"], walked)

    differentiable = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, differentiable=True)
    assert not capture.plain_optimizer(differentiable)

    class Keeps(torch.optim.SGD):  # not torch's own: it may keep a Parameter in its state, as this one does
        def step(self, closure=None):
            for p in self.param_groups[0]["params"]:
                self.state[p].setdefault("anchor", torch.nn.Parameter(p.detach().clone()))
            return super().step(closure)

    keeps = Keeps(model.parameters(), lr=0.1)
    keeps.step()
    assert not capture.plain_optimizer(keeps)
    anchor = capture.capture(model, keeps, None, None)["optim"]["state"][0]["anchor"]
    assert type(anchor) is torch.Tensor and not anchor.requires_grad  # walked: as state_dict() would give it

    class Sharded(torch.Tensor):  # stands for DTensor: what capture asks of one is isinstance and to_local
        def to_local(self):
            return self.as_subclass(torch.Tensor)

    monkeypatch.setattr(capture, "_DTENSOR", Sharded)
    p = torch.nn.Parameter(torch.ones(3).as_subclass(Sharded))
    sharded = torch.optim.SGD([p], lr=0.1, momentum=0.9)
    p.grad = torch.ones(3).as_subclass(Sharded)
    sharded.step()
    assert not capture.plain_optimizer(sharded)
    leaf = capture.capture(torch.nn.Linear(1, 1), sharded, None, None)["optim"]["state"][0]["momentum_buffer"]
    assert type(leaf) is torch.Tensor


def test_a_commits_walk_leaves_the_optimizers_own_state_as_it_was():
    # the captured state shares the optimizer's per-parameter dicts: the razor's split, the layout check and the
    # pack must read them only (the keys, the values' identities and bits after the commit as before it)
    from ffstate import razor

    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(5, 4)).sum().backward()
    opt.step()
    before = {id(p): {k: (v, v.clone()) for k, v in st.items()} for p, st in opt.state.items()}
    state = capture.capture(model, opt, None, None)
    plan = razor.Plan.of(state, razor.Groups((0, 1), ("model", "optim/state"), "test"))
    for rank in (0, 1, 0):  # the first split walks the whole state, the next ones follow the plan's keys
        shard = razor.split(state, plan, rank)
        m, _ = layout.analyze(shard)
        codec.pack_into(shard, layout.alloc_buffer(m), m)
    for p, st in opt.state.items():
        assert list(st) == list(before[id(p)])
        for k, v in st.items():
            was, bits = before[id(p)][k]
            assert v is was and torch.equal(v, bits), k


def test_is_parameter_knows_parameters_of_every_kind():
    class Sub(torch.Tensor):  # a tensor subclass: nn.Parameter marks the instance (as it does a DTensor)
        pass

    class Scaled(torch.nn.Parameter):
        pass

    marked = torch.nn.Parameter(torch.ones(2).as_subclass(Sub))
    assert type(marked) is Sub and layout.is_parameter(marked)
    assert layout.is_parameter(torch.nn.Parameter(torch.ones(2))) and layout.is_parameter(Scaled(torch.ones(2)))
    assert not layout.is_parameter(torch.ones(2)) and not layout.is_parameter(torch.ones(2).as_subclass(Sub))
    # The layout says so too, on the full walk and on a commit's walk of a known layout.
    state = {"p": marked, "t": torch.ones(2)}
    m = layout.describe(state)
    assert [s.kind for s in m.tensors] == ["param", "tensor"]
    assert layout.analyze_known(state, m)[0] == m
    assert layout.analyze_known({"p": torch.ones(2).as_subclass(Sub), "t": torch.ones(2)}, m)[0].layout_id != m.layout_id


def test_the_daemon_s_dtype_sizes_are_torch_s():
    """The daemon checks manifests and lays out dtype groups by ``DTYPE_SIZES`` without torch: every wire name must
    be torch's dtype of that size, or a daemon would cut a group's segments at the wrong element boundaries."""
    from ffstate.layout.dtypes import DTYPES
    from ffstate.layout.manifest import DTYPE_SIZES

    assert set(DTYPES) == set(DTYPE_SIZES)
    assert {name: DTYPES[name].itemsize for name in DTYPE_SIZES} == DTYPE_SIZES
