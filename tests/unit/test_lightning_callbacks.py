"""The Lightning adapter's copy of the fit's other callbacks' state (``lightning._Callbacks``): each callback's
``state_dict()`` by its ``state_key`` through Lightning's own calls, put back by ``load_state_dict()``; a callback
whose state ffstate cannot copy (here a ``set``) is left out, said once, and the others are still kept. The whole
fit, restored twice, is tests/system/test_integrations.py's."""

import logging
import types

import pytest
import torch

pytest.importorskip("lightning", reason="lightning is not installed (pip install 'ffstate[test]')")
from lightning.pytorch.callbacks import Callback, EarlyStopping  # noqa: E402

from ffstate.integrations.lightning import _Callbacks  # noqa: E402


class Seen(Callback):
    """A user's callback whose state holds a set, which ffstate's snapshots do not take."""

    def __init__(self):
        self.seen = {1, 2}

    def state_dict(self):
        return {"seen": self.seen}

    def load_state_dict(self, state):
        self.seen = state["seen"]


def test_callbacks_state_round_trips_and_a_state_ffstate_cannot_copy_is_left_out_once(caplog):
    early, seen = EarlyStopping(monitor="val_loss", patience=7), Seen()
    early.wait_count, early.best_score = 3, torch.tensor(0.25)
    trainer = types.SimpleNamespace(callbacks=[early, seen], global_rank=0)
    copies = _Callbacks(trainer)
    with caplog.at_level(logging.WARNING, logger="ffstate.integrations.lightning"):
        state = copies.state_dict()
        assert list(state) == [early.state_key]
        copies.state_dict()  # said once
    said = [r.getMessage() for r in caplog.records if "is not replicated" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith("rank 0: the state of callback Seen is not replicated: "), said
    assert "unsupported type builtins.set" in said[0], said

    fresh = EarlyStopping(monitor="val_loss", patience=7)
    _Callbacks(types.SimpleNamespace(callbacks=[fresh, Seen()], global_rank=0)).load_state_dict(state)
    assert fresh.wait_count == 3 and torch.equal(fresh.best_score, torch.tensor(0.25))
