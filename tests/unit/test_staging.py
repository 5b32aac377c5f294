"""ffstate/staging.py: a commit staged through one device buffer (the GPU path), run here on CPU tensors with the
Triton gather under the interpreter: the slot gets exactly the bytes the CPU path packs, host leaves included."""

import numpy as np
import pytest
import torch

from ffstate import codec, layout
from ffstate.staging import Stager, wanted
from helpers import train_states


def mixed_state():
    g = torch.Generator().manual_seed(0)
    big = torch.randn(300, 301, generator=g)
    return {"big": big, "t": big[:, :7].t(), "empty": torch.empty(0, 3), "scalar": torch.tensor(3, dtype=torch.int64),
            "bf16": torch.randn(4097, generator=g).to(torch.bfloat16), "bool": torch.rand(77, generator=g) > 0.5,
            "np": np.arange(10, dtype=np.uint32), "lr": 0.5}


def test_a_staged_commit_writes_the_bytes_the_cpu_path_packs():
    for state in (mixed_state(), list(train_states(2))[-1]):
        manifest = layout.describe(state)
        out = layout.alloc_buffer(manifest)
        stager = Stager(torch.device("cpu"), manifest, [out])
        got = stager.pack(state, out)
        stager.close()
        assert got.layout_id == manifest.layout_id
        assert torch.equal(out, codec.pack(state).buffer)


def test_staging_goes_where_the_state_s_bytes_are():
    assert wanted([torch.zeros(3), np.zeros(2), 1.0]) is None  # nothing on a GPU: the CPU path


def test_a_slot_writer_stages_a_state_on_the_staging_device_and_publishes_what_the_cpu_path_packs(tmp_path,
                                                                                               monkeypatch):
    """The commit path as the trainer takes it: SlotWriter decides at its first commit to stage (here on the CPU,
    the device a GPU would be), then every commit's slot holds the bytes codec.pack makes, scalars published."""
    from ffstate import shm, staging
    from ffstate.commit import SlotWriter
    from ffstate.errors import LayoutChanged

    monkeypatch.setattr(shm.slots, "SHM_DIR", tmp_path)
    monkeypatch.setenv("FFSTATE_KERNELS", "triton")
    monkeypatch.setattr(staging, "wanted", lambda leaves: torch.device("cpu"))
    states = list(train_states(3))
    manifest = layout.describe(states[0])
    paths = shm.slot_paths("n0", "j", 0, 1)
    shm.create_slots(paths, manifest, shm.DEFAULT_SCALARS_CAPACITY)
    slots = shm.Slots(paths, manifest)
    writer = SlotWriter(slots)
    try:
        for version, state in enumerate(states, 1):
            writer.commit(state, version)
            assert writer._stager is not None
            newest, k = slots.committed()[0]
            assert newest == version
            assert torch.equal(slots.data[k][: manifest.nbytes], codec.pack(state).buffer)
        with pytest.raises(LayoutChanged):
            writer.commit({**states[-1], "new": torch.zeros(3)}, len(states) + 1)
    finally:
        writer.close()
        slots.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_state_on_a_gpu_is_staged_and_its_slot_holds_the_cpu_path_s_bytes(tmp_path, monkeypatch):
    from ffstate import shm
    from ffstate.commit import SlotWriter

    monkeypatch.setattr(shm.slots, "SHM_DIR", tmp_path)
    host = mixed_state()
    state = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in host.items()}
    manifest = layout.describe(state)
    paths = shm.slot_paths("n0", "j", 0, 1)
    shm.create_slots(paths, manifest, shm.DEFAULT_SCALARS_CAPACITY)
    slots = shm.Slots(paths, manifest)
    writer = SlotWriter(slots)
    try:
        writer.commit(state, 1)
        assert writer._stager is not None
        _, k = slots.committed()[0]
        assert torch.equal(slots.data[k][: manifest.nbytes], codec.pack(host).buffer)
        # The same pages registered again fail (already registered); the failure must not stay CUDA's last error,
        # which the next kernel launch's check would raise at an unrelated operation.
        again = Stager(state["big"].device, manifest, list(slots.data))
        assert again._registered == []
        assert (torch.ones(8, device="cuda") + 1).sum().item() == 16
        again.close()
    finally:
        writer.close()
        slots.close()


def test_a_staged_commit_that_cannot_run_its_kernels_falls_back_to_copies_unless_they_were_asked_for(tmp_path,
                                                                                                     monkeypatch,
                                                                                                     caplog):
    """The GPU path without its kernels (Triton missing, or no compiler for its launcher): the first staged commit
    fails, the writer says so and copies tensor by tensor from then on, the slot right; with FFSTATE_KERNELS=triton
    the same failure is raised."""
    from ffstate import kernels, shm, staging
    from ffstate.commit import SlotWriter

    def no_triton(*args, **kwargs):
        raise ImportError("No module named 'triton'")

    monkeypatch.setattr(shm.slots, "SHM_DIR", tmp_path)
    monkeypatch.setattr(staging, "wanted", lambda leaves: torch.device("cpu"))
    monkeypatch.setattr(kernels, "gather", no_triton)
    states = list(train_states(2))
    manifest = layout.describe(states[0])
    for forced in (False, True):
        if forced:
            monkeypatch.setenv("FFSTATE_KERNELS", "triton")
        else:
            monkeypatch.delenv("FFSTATE_KERNELS", raising=False)
        paths = shm.slot_paths("n0", f"j{int(forced)}", 0, 1)
        shm.create_slots(paths, manifest, shm.DEFAULT_SCALARS_CAPACITY)
        slots = shm.Slots(paths, manifest)
        writer = SlotWriter(slots)
        try:
            if forced:
                with pytest.raises(ImportError):
                    writer.commit(states[0], 1)
                continue
            for version, state in enumerate(states, 1):
                writer.commit(state, version)
                assert writer._stager is None
                newest, k = slots.committed()[0]
                assert newest == version
                assert torch.equal(slots.data[k][: manifest.nbytes], codec.pack(state).buffer)
            assert "copy tensor by tensor" in caplog.text
        finally:
            writer.close()
            slots.close()


def test_clearing_cuda_s_last_error_is_a_no_op_without_the_cuda_runtime():
    from ffstate.staging import clear_cuda_error

    if torch.version.cuda:
        pytest.skip("a CUDA build of torch: its runtime is loaded (the GPU test registers slots)")
    assert clear_cuda_error() is False  # no libcudart in a CPU build's process: nothing to clear, nothing raised
