"""The pieces of a resize, in one process: old ranks' copies (split by the razor as DDP's would be, or made at
other offsets) read by DCP through the replica reader into a model and optimizer, bit for bit; a copy missing
never loads partially; the rules for what has no byte layout; the elastic sampler's one global position.
(The resize of real jobs under torchrun is tests/system/test_elastic.py.)"""

import random
import warnings

import numpy as np
import pytest
import torch

from ffstate import capture, razor
from ffstate.config import Config
from ffstate.elastic import ElasticSampler, rules, targets
from ffstate.elastic.reader import KEYS, Chunks, keys_of, keys_tensor
from ffstate.errors import FFStateError
from ffstate.persist import keys as persist_keys
from ffstate.testing.bitwise import differences
from ffstate.testing.models import TinyGPT


def trained(seed: int = 0, steps: int = 2):
    torch.manual_seed(seed)
    model = TinyGPT(vocab=37, dim=16, heads=2, layers=1, seq=8)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    for _ in range(steps):
        model.loss(torch.randint(0, 37, (2, 9))).backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def old_ranks(model, opt, world: int) -> dict[int, dict]:
    """What ``world`` DDP ranks of this state would have committed: the razor splits the model and the optimizer
    state into one part per rank; every rank carries its key map."""
    state = capture.capture(model, opt, None, {"step": 2})
    state[KEYS[0]] = {KEYS[1]: keys_tensor(persist_keys.key_map(model, opt))}
    plan = razor.Plan.of(state, razor.Groups(tuple(range(world)), ("model", "optim/state"), "test"))
    return {r: razor.split(state, plan, r) for r in range(world)}


def live(model, opt) -> dict:
    return {"model": model.state_dict(), "optim": opt.state_dict()["state"]}


@pytest.mark.parametrize("world", [1, 3, 4])
def test_razored_copies_load_through_dcp_bit_for_bit(world):
    """Each old rank holds a contiguous run of every redundant tensor's elements (boxes, in DCP's terms); DCP's
    planner reads them back into a fresh model and optimizer, every bit as the job had them."""
    model, opt = trained()
    fresh, fresh_opt = trained(seed=1, steps=1)
    chunks = Chunks(old_ranks(model, opt, world))
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        targets.load(fresh, fresh_opt, chunks, [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups])
    assert differences(live(fresh, fresh_opt), live(model, opt)) == []
    assert not [w for w in said if "torch.distributed" in str(w.message)]  # DCP's one-process warning: by design
    assert fresh_opt.param_groups[0]["lr"] == opt.param_groups[0]["lr"]


def test_a_missing_rank_is_refused_never_loaded_in_part():
    model, opt = trained()
    states = old_ranks(model, opt, 4)
    del states[2]
    with pytest.raises(FFStateError, match="cover .* of its"):
        Chunks(states)


def test_a_copy_without_a_key_map_is_refused_by_rank():
    model, opt = trained()
    state = capture.capture(model, opt, None, None)
    with pytest.raises(FFStateError, match="old rank 5's copy carries no key map"):
        keys_of(state, 5)


def test_a_model_changed_across_the_resize_is_refused():
    model, opt = trained()
    other = torch.nn.Linear(3, 3)
    with pytest.raises(FFStateError, match="the model's tensors differ from the copies'"):
        targets.load(other, torch.optim.AdamW(other.parameters()), Chunks(old_ranks(model, opt, 2)), [{}])


class Tied(torch.nn.Module):
    """A head tied to the embedding by assignment, as Hugging Face models tie them: one parameter, two names."""

    def __init__(self):
        super().__init__()
        self.emb, self.mid = torch.nn.Embedding(11, 4), torch.nn.Linear(4, 4)
        self.head = torch.nn.Linear(4, 11, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, x):
        return self.head(self.mid(self.emb(x)))


def tied(seed: int, steps: int = 2):
    torch.manual_seed(seed)
    model = Tied()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(steps):
        model(torch.randint(0, 11, (5,))).sum().backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def test_a_tied_parameter_is_keyed_by_its_first_name_as_dcp_keys_it_and_resizes_bit_for_bit():
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model, opt = tied(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp_keys = {f"optim.state.{fqn}" for fqn in get_state_dict(model, opt)[1]["state"]}
    keys = persist_keys.key_map(model, opt)
    assert {v[0].rsplit(".", 1)[0] for k, v in keys["tensors"].items() if k.startswith("optim/")} == dcp_keys
    assert keys["param_groups"]["params"] == [["emb.weight", "mid.weight", "mid.bias"]]
    fresh, fresh_opt = tied(1, steps=1)
    targets.load(fresh, fresh_opt, Chunks(old_ranks(model, opt, 2)), [{}])
    assert differences(live(fresh, fresh_opt), live(model, opt)) == []


def test_what_dcp_refuses_comes_out_as_ffstate_s_error_with_the_reason(monkeypatch):
    """DCP wraps a load's failures (the replica reader's own refusals among them) in a CheckpointException, a
    BaseException: it must not slip past, nor hide the reason behind DCP's traceback text."""
    from torch.distributed.checkpoint.api import CheckpointException

    model, opt = trained()
    chunks = Chunks(old_ranks(model, opt, 2))
    for failure, said in ((FFStateError("old rank 1's chunk is short"), "^old rank 1's chunk is short$"),
                          (ValueError("size mismatch"), "could not load the copies .*ValueError: size mismatch")):
        def refuse(*args, failure=failure, **kwargs):
            raise CheckpointException("CheckpointException ranks:dict_keys([0])", {0: (failure, None)})

        monkeypatch.setattr(targets.dcp, "load", refuse)
        with pytest.raises(FFStateError, match=said):
            targets.load(model, opt, chunks, [{}])


def test_a_refusal_on_one_rank_is_raised_on_every_rank():
    from types import SimpleNamespace

    from ffstate.elastic import resize

    told = ["", "the model's tensors differ from the copies'", ""]
    job = SimpleNamespace(world=3, exchange=lambda name, error, ranks, timeout: told)
    with pytest.raises(FFStateError, match="rank 1 refused the resize: the model's tensors differ"):
        resize._agree(job, "resize-loaded", "")
    with pytest.raises(FFStateError, match="^mine$"):
        resize._agree(job, "resize-loaded", "mine")
    resize._agree(SimpleNamespace(world=3, exchange=lambda *a: ["", "", ""]), "resize-loaded", "")


def test_same_compares_bits_not_values():
    assert rules.same([{"a": 1.0, "t": torch.ones(2)}, {"a": 1.0, "t": torch.ones(2)}])
    assert not rules.same([0.0, -0.0])
    nan = torch.tensor([float("nan")])
    other = nan.view(torch.int32).add(1).view(torch.float32)  # another NaN payload
    assert not rules.same([nan, other])


class Hooked:
    def __init__(self, value):
        self.value, self.calls = value, []

    def state_dict(self):
        return {"value": self.value}

    def load_state_dict(self, state):
        self.value = state["value"]

    def reshard_state_dict(self, states, old_world, new_rank, new_world):
        self.calls.append((len(states), old_world, new_rank, new_world))
        return {"value": sum(s["value"] for s in states)}


class PerRank(Hooked):
    reshard_state_dict = None


def olds(extras: list, rng_differs: bool = False) -> dict[int, dict]:
    out = {}
    for r, extra in enumerate(extras):
        torch.manual_seed(0)
        random.seed(r if rng_differs else 0)
        np.random.seed(0)
        out[r] = {"model": {}, "optim": {"state": {}, "param_groups": [{"lr": 0.1, "params": [0]}]},
                  "rng": capture.rng_state(), "extra": extra}
    return out


def test_rules_pass_the_job_s_values_call_hooks_and_refuse_the_rest_by_name():
    hooked = Hooked(0)
    got = rules.resolve(olds([{"step": 7, "h": {"value": 1}}, {"step": 7, "h": {"value": 2}}]), 1, 3, "refuse", None,
                        {"step": 0, "h": hooked})
    assert got.extra == {"step": 7, "h": {"value": 3}} and hooked.calls == [(2, 2, 1, 3)]
    assert got.groups == [{"lr": 0.1}]
    with pytest.raises(FFStateError) as e:
        rules.resolve(olds([{"pos": 1, "p": {"value": 1}}, {"pos": 2, "p": {"value": 1}}], rng_differs=True), 0, 1,
                      "refuse", None, {"pos": 0, "p": PerRank(0)})
    text = str(e.value)
    for name in ("extra/pos: a plain value that differs", "extra/p (PerRank) holds per-rank state",
                 "rng/python: per-rank RNG streams", "The copies are untouched: restart at world size 2"):
        assert name in text, text
    hooked_states = olds([{"step": 7}, {"step": 7}])  # a DDP communication hook's state is each rank's own
    for st in hooked_states.values():
        st["comm_hook"] = {"kind": "powersgd"}
    with pytest.raises(FFStateError, match="comm_hook: a DDP communication hook's state"):
        rules.resolve(hooked_states, 0, 3, "refuse", None, {"step": 0})


def test_resize_rng_keep_restores_the_streams_that_agree_and_keeps_the_others():
    states = olds([{}, {}], rng_differs=True)
    random.seed(1234)
    mine = capture.rng_state()["python"]
    got = rules.resolve(states, 0, 1, "keep", None, {})
    assert differences(got.rng["python"], mine) == []  # this process's own
    assert differences(got.rng["torch"], states[0]["rng"]["torch"]) == []  # the same on every old rank: restored
    with pytest.raises(ValueError):
        Config(resize_rng="guess")


def test_elastic_sampler_keeps_one_global_position_across_a_resize():
    """4 ranks take 3 steps, then 3 ranks go on from the position they left: no sample twice, none skipped."""
    size, batch = 60, 2
    ranks = [ElasticSampler(size, batch, rank=r, world=4, seed=7) for r in range(4)]
    iters = [iter(s) for s in ranks]
    seen = [i for _ in range(3) for it in iters for i in next(it)]
    states = [s.state_dict() for s in ranks]
    assert {s["position"] for s in states} == {24}
    after = [ElasticSampler(size, batch, rank=r, world=3, seed=7) for r in range(3)]
    for r, s in enumerate(after):
        s.load_state_dict(s.reshard_state_dict(states, 4, r, 3))
    rest = [i for s in after for b in s for i in b]  # each rank reads the rest of the epoch
    assert len(seen) + len(rest) == size and sorted(seen + rest) == list(range(size))
    assert all(s.epoch == 1 and s.position == 0 for s in after)
    states[1] = {**states[1], "position": 16}
    with pytest.raises(ValueError, match="positions differ"):
        after[0].reshard_state_dict(states, 4, 0, 3)
