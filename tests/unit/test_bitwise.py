"""testing/bitwise.py: the one comparison the tests, the demo and the benchmarks trust must see every
difference a restore could make."""

import collections

import numpy as np
import pytest
import torch

from ffstate.testing.bitwise import assert_bitwise_equal, compare_runs, differences, drop_compared


@pytest.mark.parametrize("got, want, what", [
    (torch.tensor([-0.0]), torch.tensor([0.0]), "bits differ"),
    (torch.tensor([0x7FC00001], dtype=torch.int32).view(torch.float32), torch.tensor([float("nan")]),  # NaN payload
     "bits differ"),
    (torch.tensor([2], dtype=torch.uint8).view(torch.bool), torch.tensor([True]), "bits differ"),
    (torch.zeros(2, requires_grad=True), torch.zeros(2), "requires_grad"),
    (torch.zeros(2, dtype=torch.float64), torch.zeros(2), "dtype"),
    ({"b": 1, "a": 2}, {"a": 2, "b": 1}, "keys"),
    ({1: 0}, {1.0: 0}, "type differs"),
    (0.1 + 0.2, 0.3, "bitwise"),
    (np.float32(1.5), np.float64(1.5), "type"),
    ([1, 2], (1, 2), "type"),
])
def test_every_kind_of_difference_is_seen(got, want, what):
    assert any(what in d for d in differences(got, want)), differences(got, want)
    with pytest.raises(AssertionError, match=what):
        assert_bitwise_equal(got, want)


def test_ordered_dict_metadata_counts_and_equal_states_pass():
    a, b = collections.OrderedDict(w=torch.ones(3)), collections.OrderedDict(w=torch.ones(3))
    a._metadata, b._metadata = {"": {"version": 1}}, {"": {"version": 2}}
    assert differences(a, b) == ["<root>: _metadata differs"]
    b._metadata = {"": {"version": 1}}
    assert_bitwise_equal({"s": [a, 1.0, np.arange(3), "x"]}, {"s": [b, 1.0, np.arange(3), "x"]})


def test_compare_runs_names_every_difference_of_every_rank(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    for r in range(2):
        torch.save({"p": torch.arange(4.0), "q": torch.zeros(2)}, tmp_path / "a" / f"final-rank{r}.pt")
        torch.save({"p": torch.arange(4.0) + (r == 1), "q": torch.zeros(2) * (-1.0 if r == 1 else 1.0)},
                   tmp_path / "b" / f"final-rank{r}.pt")
    assert compare_runs(tmp_path / "a", tmp_path / "b", 2) == ["rank 1: /p: bits differ", "rank 1: /q: bits differ"]



def test_drop_compared_removes_the_final_states_and_keeps_the_logs(tmp_path):
    a, b = tmp_path / "with-failures", tmp_path / "reference"
    for d in (a, b):
        d.mkdir()
        torch.save({"w": torch.arange(4.0)}, d / "final-rank0.pt")
        (d / "daemon-node0.log").write_text("log")
    states = sum((d / "final-rank0.pt").stat().st_size for d in (a, b))
    assert compare_runs(a, b, 1) == []
    assert drop_compared(a, b) == states > 0
    assert sorted(p.name for p in a.iterdir()) == sorted(p.name for p in b.iterdir()) == ["daemon-node0.log"]
    torch.save({"w": torch.arange(4.0)}, b / "final-rank1.pt")  # a folder holding nothing else goes with its states
    (b / "daemon-node0.log").unlink()
    assert drop_compared(b) > 0 and not b.exists() and a.exists()
