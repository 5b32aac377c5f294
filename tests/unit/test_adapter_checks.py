"""What the framework adapters refuse at entry, and put back at a restore, in one process (their runs killed and
restored under torchrun: tests/system/test_integrations.py)."""

from types import SimpleNamespace

import pytest
import torch

from ffstate.errors import FFStateError


def test_lightning_refuses_a_training_loader_that_keeps_no_position():
    """A plain DataLoader has no state: Lightning saves no position for it, and a restore mid-epoch would train on
    the epoch's first batches again (Lightning itself only warns, on rank 0)."""
    pytest.importorskip("lightning", reason="lightning is not installed (pip install 'ffstate[test]')")
    from torchdata.stateful_dataloader import StatefulDataLoader

    from ffstate.integrations.lightning import ReplicationCallback

    data = torch.utils.data.TensorDataset(torch.arange(8.0))

    def trainer(loader):
        return SimpleNamespace(fit_loop=SimpleNamespace(_combined_loader=SimpleNamespace(flattened=[loader])))

    with pytest.raises(FFStateError, match=r"the training loader \(DataLoader\) keeps no position.*StatefulDataLoader"):
        ReplicationCallback()._check_loaders(trainer(torch.utils.data.DataLoader(data, batch_size=2)))
    ReplicationCallback()._check_loaders(trainer(StatefulDataLoader(data, batch_size=2)))


class Stream(torch.utils.data.IterableDataset):
    def __iter__(self):
        return iter(range(4))


def test_hf_puts_the_exportable_callbacks_states_back_and_refuses_what_it_cannot_replicate():
    """EarlyStopping's patience counter (and the control's flags) come back in place: the Trainer restores them only
    with ``restore_callback_states_from_checkpoint``, off by default, and a run that lost its count stops later."""
    pytest.importorskip("transformers", reason="transformers is not installed (pip install 'ffstate[test]')")
    from transformers import EarlyStoppingCallback, TrainerControl

    from ffstate.integrations import hf

    early, control = EarlyStoppingCallback(early_stopping_patience=3), TrainerControl()
    saved = {"EarlyStoppingCallback": {"args": {"early_stopping_patience": 3},
                                       "attributes": {"early_stopping_patience_counter": 2}},
             "TrainerControl": TrainerControl(should_training_stop=True).state()}
    hf.restore_exported(saved, [object(), early, control])
    assert early.early_stopping_patience_counter == 2 and control.should_training_stop

    def trainer(**kw):
        base = dict(is_deepspeed_enabled=False, is_fsdp_enabled=False, model_init=None,
                    args=SimpleNamespace(auto_find_batch_size=False), train_dataset=[1, 2])
        return SimpleNamespace(**{**base, **kw})

    hf._check_supported(trainer())
    for kw, said in ((dict(is_deepspeed_enabled=True), "DeepSpeed"), (dict(is_fsdp_enabled=True), "FSDP"),
                     (dict(model_init=lambda: None), "model_init"),
                     (dict(args=SimpleNamespace(auto_find_batch_size=True)), "auto_find_batch_size"),
                     (dict(train_dataset=Stream()), "IterableDataset")):
        with pytest.raises(FFStateError, match=f"cannot replicate this Trainer: .*{said}"):
            hf._check_supported(trainer(**kw))
