"""ffstate/extras.py: Stateful objects among a job's extras, captured by state_dict() and loaded back in place."""

import collections
import logging

import pytest
import torch

from ffstate import extras
from ffstate.errors import FFStateError
from ffstate.testing.bitwise import assert_bitwise_equal


class Counter:
    def __init__(self, n=0):
        self.n, self.gen = n, torch.Generator().manual_seed(n)

    def state_dict(self):
        return {"n": self.n, "gen": self.gen.get_state()}

    def load_state_dict(self, state):
        self.n = state["n"]
        self.gen.set_state(state["gen"])


class Broken(Counter):
    def state_dict(self):
        raise RuntimeError("no state today")


def test_stateful_objects_are_captured_by_name_at_any_nesting_and_loaded_back_in_place():
    a, b, scaler = Counter(1), Counter(2), torch.amp.GradScaler("cpu", init_scale=16.0)
    live = {"loader": a, "nested": {"b": b, "epoch": 3}, "list": [Counter(4), 5], "scaler": scaler, "offset": 7}
    state = extras.capture(live)
    assert_bitwise_equal(state["loader"], a.state_dict())
    assert state["nested"]["b"]["n"] == 2 and state["list"][0]["n"] == 4 and state["offset"] == 7
    assert state["scaler"] == scaler.state_dict()
    want = {k: v for k, v in state.items()}
    a.n, b.n, live["nested"]["epoch"], live["offset"] = 10, 20, 30, 70
    torch.rand(5, generator=a.gen)
    scaler.load_state_dict({**scaler.state_dict(), "scale": 2.0})
    keep = (a, b, live["list"][0], scaler)
    extras.restore(live, state)
    assert (live["loader"], live["nested"]["b"], live["list"][0], live["scaler"]) == keep  # the same objects
    assert (a.n, b.n, live["nested"]["epoch"], live["offset"]) == (1, 2, 3, 7)
    assert_bitwise_equal(extras.capture(live), want)
    assert scaler.get_scale() == 16.0


def test_plain_extras_are_passed_through_as_before():
    plain = collections.OrderedDict(epoch=1, offset=torch.tensor([3]))
    assert extras.capture(plain) is plain  # nothing Stateful: the same object, no copy
    live = {"epoch": 0, "gone": 1}
    extras.restore(live, {"epoch": 5, "offset": 6})
    assert live == {"epoch": 5, "offset": 6}
    obj = Counter(3)
    extras.restore(obj, {"n": 9, "gen": torch.Generator().manual_seed(9).get_state()})  # extra= one object
    assert obj.n == 9


def test_failures_name_the_path():
    with pytest.raises(FFStateError, match=r"extra/deep/x: Broken.state_dict\(\) failed: RuntimeError"):
        extras.capture({"deep": {"x": Broken()}})
    with pytest.raises(FFStateError, match=r"extra: the restored state has no entry for \['c'\]"):
        extras.restore({"c": Counter()}, {"d": 1})
    with pytest.raises(FFStateError, match="extra/c: Counter.load_state_dict"):
        extras.restore({"c": Counter()}, {"c": {"wrong": 1}})


def test_a_data_loader_without_its_own_generator_is_warned_about(caplog):
    data = torch.utils.data.TensorDataset(torch.arange(8))
    with caplog.at_level(logging.WARNING, logger="ffstate.extras"):
        extras.warn_pitfalls({"loader": torch.utils.data.DataLoader(data, batch_size=2)}, 0)
        assert "extra/loader is a DataLoader without generator=" in caplog.text
        caplog.clear()
        extras.warn_pitfalls({"loader": torch.utils.data.DataLoader(data, generator=torch.Generator())}, 0)
        assert caplog.text == ""
