"""The Hugging Face adapter's TrainerState for ffstate (ffstate/integrations/hf.py): the log kept as JSON lines in a
byte tensor that only grows at its end, so that a commit's delta of it is the new entries; a round trip gives the
TrainerState back. (The Trainer run itself, killed and restored under torchrun, is in tests/system/test_integrations.py.)"""

import dataclasses
import json
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("transformers", reason="transformers is not installed (pip install 'ffstate[test]')")
from transformers import TrainerControl, TrainerState  # noqa: E402

from ffstate.integrations.hf import _TrainerState  # noqa: E402


def test_the_log_is_appended_in_place_grows_by_doubling_and_comes_back_whole():
    state = TrainerState(global_step=0, max_steps=10_000)
    box = _TrainerState()
    box.trainer = SimpleNamespace(state=state, callback_handler=SimpleNamespace(callbacks=[]), control=TrainerControl(),
                                  _tr_loss=torch.tensor(2.5), _total_loss_scalar=1.25, _globalstep_last_logged=3,
                                  _initial_global_step=0, current_flos=7.0)
    seen, capacities = b"", set()
    for step in range(1, 400):
        state.global_step = step
        if step % 3 == 0:
            state.log_history.append({"loss": 1.0 / step, "learning_rate": 3e-4 * step, "step": step,
                                      "epoch": step / 97})
        got = box.state_dict()
        log = bytes(got["log"][: got["log_bytes"]].numpy())
        assert log.startswith(seen)  # what was committed never changes: a delta of the log is its new entries
        seen = log
        capacities.add(got["log"].numel())
        assert json.loads(got["json"])["global_step"] == step and "log_history" not in json.loads(got["json"])
    assert sorted(capacities) == [4096, 8192, 16384]  # the layout changed twice in 399 commits
    back = _TrainerState()
    back.load_state_dict(got)
    # The Trainer's logging bookkeeping comes along (put back on the Trainer when its loop begins).
    assert back.restored.pop("ffstate_logging") == {"_total_loss_scalar": 1.25, "_globalstep_last_logged": 3,
                                                    "_initial_global_step": 0, "current_flos": 7.0}
    assert back.restored_tr_loss.item() == 2.5
    assert back.restored == {**dataclasses.asdict(state), "stateful_callbacks": back.restored["stateful_callbacks"]}
    assert back.restored["log_history"] == state.log_history
    # A TrainerState made anew (a restored run's): its log is serialized again from its first entry.
    box.trainer.state = TrainerState(**{**dataclasses.asdict(state), "log_history": [dict(e) for e in state.log_history[:5]]})
    again = box.state_dict()
    assert bytes(again["log"][: again["log_bytes"]].numpy()) == seen[: again["log_bytes"]]
    assert again["log_bytes"] < len(seen)
