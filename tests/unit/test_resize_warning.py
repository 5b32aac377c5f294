"""The warning at a job's first commit of what a resize would refuse (``elastic.rules.warn_early``) gives only the
advice that applies: seeding for RNG streams that differ, a hook for an extra with per-rank state."""

import logging
from types import SimpleNamespace

import pytest
import torch

from ffstate.elastic import rules


class Loader:  # per-rank state, no reshard_state_dict hook
    def state_dict(self):
        return {"offset": 3}

    def load_state_dict(self, state):
        pass


def job(told: list[dict]) -> SimpleNamespace:
    return SimpleNamespace(world=2, rank=0, attempt=0, cfg=SimpleNamespace(connect_timeout=1.0),
                           exchange=lambda name, sums, ranks, timeout: told)


def rng(seed: int) -> dict:
    return {"torch": torch.Generator().manual_seed(seed).get_state()}


@pytest.mark.parametrize("other_seed, extra, says, not_said", [
    (0, {"loader": Loader()}, "give such extras a reshard_state_dict hook", "seed every rank"),
    (1, {}, "seed every rank's generators alike", "hook"),
    (1, {"loader": Loader()}, "seed every rank's generators alike (random, numpy, torch) or set FFSTATE_RESIZE_RNG="
                              "keep; give such extras a reshard_state_dict hook", None),
])
def test_the_advice_is_what_applies(caplog, other_seed, extra, says, not_said):
    from ffstate import codec

    mine = rng(0)
    told = [{k: codec.pack(v).checksum for k, v in mine.items()},
            {k: codec.pack(v).checksum for k, v in rng(other_seed).items()}]
    with caplog.at_level(logging.WARNING, logger="ffstate"):
        rules.warn_early(job(told), {"rng": mine}, extra)
    said = " ".join(r.getMessage() for r in caplog.records if "the resize will be refused" in r.getMessage())
    advice = said.split("To allow it:")[1]
    assert says in advice and (not_said is None or not_said not in advice)


def test_nothing_is_said_where_a_resize_would_go_through(caplog):
    from ffstate import codec

    mine = rng(0)
    sums = {k: codec.pack(v).checksum for k, v in mine.items()}
    with caplog.at_level(logging.INFO, logger="ffstate"):
        rules.warn_early(job([sums, sums]), {"rng": mine}, {})
    assert not [r for r in caplog.records if "resize" in r.getMessage()]
