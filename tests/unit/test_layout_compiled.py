"""The compiled commit walk (``layout/compiled.py``) against the interpreted one it stands in for: on any state, what
it gives is what ``_match_known`` gives, leaf for leaf (the same objects) and scalar for scalar (type and value), or
nothing (the interpreter then decides); on the state its layout was made from, and on new scalar values, it gives."""

import collections
import json

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ffstate import capture, layout
from ffstate.errors import CodecError
from ffstate.layout import compiled

leaves = st.one_of(
    st.builds(lambda n, d: torch.zeros(n, dtype=d), st.integers(0, 3), st.sampled_from([torch.float32, torch.int64,
                                                                                        torch.bool])),
    st.builds(lambda n: np.arange(n, dtype=np.int16), st.integers(0, 3)),
    st.builds(lambda s: torch.Size(s), st.lists(st.integers(0, 4), max_size=3)),
    st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=True), st.text(max_size=4),
    st.binary(max_size=3), st.builds(np.float32, st.floats(width=32)))
keys = st.one_of(st.text(max_size=4), st.integers(-3, 40))


def _ordered(pairs: list, meta: dict | None) -> collections.OrderedDict:
    out = collections.OrderedDict(pairs)
    if meta is not None:
        out._metadata = meta
    return out


states = st.recursive(leaves, lambda children: st.one_of(
    st.dictionaries(keys, children, max_size=4), st.lists(children, max_size=3), st.lists(children, max_size=3).map(tuple),
    st.builds(_ordered, st.lists(st.tuples(st.text(max_size=3), children), max_size=3, unique_by=lambda p: p[0]),
              st.one_of(st.none(), st.dictionaries(st.text(max_size=2), st.dictionaries(st.just("version"),
                                                                                        st.integers(0, 3)), max_size=2)))),
    max_leaves=12)


def _same(got, want) -> bool:
    """The same leaves (by identity) and the same scalars (type and value) in the same order."""
    if got is None or want is None:
        return got is want
    return (len(got[0]) == len(want[0]) and all(a is b for a, b in zip(got[0], want[0]))
            and [(type(s), s) for s in got[1]] == [(type(s), s) for s in want[1]])


def _interpreted(state, manifest):
    try:
        return layout._match_known(state, manifest.tree)
    except Exception:  # noqa: BLE001 (an unusual value: analyze decides)
        return None


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(first=states, second=states, other=leaves)
def test_the_compiled_walk_gives_what_the_interpreted_one_gives_or_nothing(first, second, other):
    manifest = layout.describe({"s": first})
    match = compiled.matcher(manifest)
    # Another state, and the first with one of its values replaced (a new scalar value, a changed kind of leaf).
    _, found, scalars = layout.flatten({"s": first})
    arrays = [a for _, a in found]
    candidates = [{"s": first}, {"s": second}]
    if found:  # its first tensor or array replaced by another leaf
        candidates.append(layout.unflatten(manifest, [other, *arrays[1:]]))
    if scalars and not isinstance(other, (torch.Tensor, np.ndarray, torch.Size)):  # its first scalar, by another
        candidates.append(layout.unflatten(manifest.with_scalars([layout.encode_scalar(other, ""), *scalars[1:]]),
                                           arrays))
    for state in candidates:
        if match is not None:
            got = match(state)
            want = _interpreted(state, manifest)
            assert got is None or _same(got, want), (state, got, want)
    if match is not None and not any(isinstance(x, (bytes, np.generic)) for x in _scalars_of(first)):
        assert _same(match({"s": first}), _interpreted({"s": first}, manifest))  # its own state: always given


def _scalars_of(state):
    if isinstance(state, dict):
        meta = getattr(state, "_metadata", None)
        return [x for v in state.values() for x in _scalars_of(v)] + list(state) + ([] if meta is None else
                                                                                      _scalars_of(meta))
    if isinstance(state, (list, tuple)) and not isinstance(state, torch.Size):
        return [x for v in state for x in _scalars_of(v)]
    return [] if isinstance(state, (torch.Tensor, np.ndarray, torch.Size)) else [state]


def _training_state():
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    return capture.capture(model, opt, None, {"epoch": 0, "offset": 7.5})


def test_a_training_state_is_walked_compiled_and_its_new_values_are_read():
    state = _training_state()
    m = layout.describe(state)
    match = compiled.matcher(m)
    assert match is not None  # str and int keys, OrderedDicts with metadata, tensors, arrays, floats
    assert _same(match(state), layout._match_known(state, m.tree))
    state["optim"]["param_groups"][0]["lr"] = 0.5
    state["extra"]["offset"] = -0.0
    got = match(state)
    assert _same(got, layout._match_known(state, m.tree)) and got[1] == list(layout.flatten(state)[2])


@pytest.mark.parametrize("change, new_layout", [
    (lambda s: s["optim"].__setitem__("state", {True if k == 1 else k: v for k, v in s["optim"]["state"].items()}), True),
    (lambda s: s["model"].__setitem__("extra", s["model"].pop("0.bias")), True),
    (lambda s: s["model"].__delattr__("_metadata"), True),
    (lambda s: s["extra"].__setitem__("epoch", [0]), True),
    (lambda s: s.__setitem__("model", dict(s["model"])), True),
    (lambda s: s["optim"]["param_groups"][0].__setitem__("params", (0, 1, 2, 3)), True),
    (lambda s: s["optim"]["param_groups"][0].__setitem__("lr", np.float64(0.5)), False),  # a float subclass
], ids=["int-key-to-bool", "key", "metadata", "scalar-to-list", "ordered-to-dict", "list-to-tuple", "float-subclass"])
def test_the_compiled_walk_gives_nothing_where_the_state_differs_and_the_interpreter_decides(change, new_layout):
    state = _training_state()
    m = layout.describe(state)
    change(state)
    assert compiled.matcher(m)(state) is None
    current, _ = layout.analyze_known(state, m)
    assert (current.layout_id != m.layout_id) == new_layout
    assert current.scalars == tuple(layout.flatten(state)[2])


def test_layouts_it_does_not_compile_are_walked_by_the_interpreter():
    for state in ({"k": {np.int64(4): 1}}, {"flags": {False: torch.zeros(1)}}):
        m = layout.describe(state)
        assert compiled.matcher(m) is None
        assert layout.analyze_known(state, m)[0] == m



def _from_json(tree: dict, scalars: int):
    return layout.Manifest.from_json(json.dumps({"tree": tree, "tensors": [], "scalars": [0] * scalars}).encode())


@pytest.mark.parametrize("tree, scalars, state", [
    ({"d": [["a", {"S": 0}]], "l": [{"S": 1}]}, 1, [5]),  # a dict node that is also a list node
    ({"l": [{"S": 0, "d": [["a", {"S": 1}]]}, {"S": 2}]}, 3, [5, 6]),
], ids=["dict-and-list", "scalar-and-dict"])
def test_a_tree_flatten_would_not_make_is_not_compiled(tree, scalars, state):
    # A manifest read from JSON may hold a node of two kinds: the interpreter reads it one way, compiled code would
    # have read it another (found in review: it took [5] for {"a": 5}).
    m = _from_json(tree, scalars)
    assert compiled.matcher(m) is None
    assert layout._match_known(state, m.tree) is None


def test_keys_are_compared_by_type_before_value():
    # A tensor as a key: comparing it to the manifest's keys raised; its type is refused first, and the interpreter
    # gives the error it gave (found in review).
    m = layout.describe({1: 1})
    assert compiled.matcher(m)({torch.ones(2): 1}) is None
    with pytest.raises(CodecError, match="unsupported type torch.Tensor"):
        layout.analyze_known({torch.ones(2): 1}, m)


def test_a_layout_it_does_not_compile_is_decided_once(monkeypatch):
    calls = []
    real = compiled._compile
    monkeypatch.setattr(compiled, "_compile", lambda m: calls.append(1) or real(m))
    m = layout.describe({"flags": {True: torch.zeros(1)}, "n": 7})
    for _ in range(3):
        assert compiled.matcher(m) is None and layout.analyze_known({"flags": {True: torch.zeros(1)}, "n": 8}, m)[0].scalars
    assert len(calls) == 1  # refused once, remembered (it was compiled again at every commit)


def test_code_beyond_the_compiler_s_limits_is_left_to_the_interpreter(monkeypatch):
    def refuse(*args, **kwargs):
        raise SyntaxError("too many statically nested blocks")

    monkeypatch.setattr(compiled, "compile", refuse, raising=False)
    m = layout.describe({"a": [1, 2]})
    assert compiled.matcher(m) is None
    assert layout.analyze_known({"a": [1, 3]}, m)[0].scalars == (1, 3)
