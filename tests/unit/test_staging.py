"""ffstate/staging.py: a commit staged through one device buffer (the GPU path), run here on CPU tensors with the
Triton gather under the interpreter: the slot gets exactly the bytes the CPU path packs, host leaves included."""

import numpy as np
import pytest
import torch

from ffstate import codec, layout
from ffstate.staging import Stager, wanted
from helpers import TinyGPT, assert_bitwise_equal, train_states


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
        got, land = stager.pack(state, out)
        assert not out.any()  # nothing in the slot until it lands: the host values were copied aside
        land()
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
            writer.flush()
            newest, k = slots.committed()[0]
            assert newest == version
            assert torch.equal(slots.data[k][: manifest.nbytes], codec.pack(state).buffer)
        with pytest.raises(LayoutChanged):
            writer.commit({**states[-1], "new": torch.zeros(3)}, len(states) + 1)
    finally:
        writer.close()
        slots.close()


def test_a_staged_commit_returns_before_its_copy_lands_and_is_published_when_it_has(tmp_path, monkeypatch):
    """The training goes on while a staged commit's copy lands: commit returns with the slot unpublished, the
    state may change at once (the optimizer's update, the step counter) without reaching the committed version,
    the copy's landing publishes it, and the next commit, ``flush`` or ``close`` wait for it. A landing that
    fails leaves the version before it published and is raised by the next commit."""
    import threading

    from ffstate import shm, staging
    from ffstate.commit import SlotWriter

    monkeypatch.setattr(shm.slots, "SHM_DIR", tmp_path)
    monkeypatch.setenv("FFSTATE_KERNELS", "triton")
    monkeypatch.setattr(staging, "wanted", lambda leaves: torch.device("cpu"))
    gate, landed, fail = threading.Event(), [], []
    pack = staging.Stager.pack

    def gated_pack(self, state, out):  # the device's copy held until the test lets it land
        manifest, land = pack(self, state, out)

        def late():
            assert gate.wait(60)
            if fail:
                raise RuntimeError("CUDA error: an illegal memory access was encountered")
            land()
            landed.append(threading.current_thread().name)
        return manifest, late

    monkeypatch.setattr(staging.Stager, "pack", gated_pack)
    # Leaves the gather leaves to the host (a numpy array; a tensor not contiguous, as a tensor on another device).
    states = [{**s, "np": np.arange(10, dtype=np.int64) + i, "t": torch.randn(5, 6)[:, :3].t()}
              for i, s in enumerate(train_states(3))]
    manifest = layout.describe(states[0])
    paths = shm.slot_paths("n0", "j", 0, 1)
    shm.create_slots(paths, manifest, shm.DEFAULT_SCALARS_CAPACITY)
    slots = shm.Slots(paths, manifest)
    writer = SlotWriter(slots)
    try:
        gate.set()
        writer.commit(states[0], 1)
        writer.flush()
        assert slots.committed()[0][0] == 1
        gate.clear()
        live = {k: v for k, v in states[1].items()}
        expected = codec.pack(states[1]).buffer.clone()
        writer.commit(live, 2)
        assert slots.committed()[0][0] == 1  # returned, not published
        with torch.no_grad():  # the training goes on: the next step's update and its host counters
            for t in live["model"].values():
                t.add_(1.0)
            for s in live["optim"]["state"].values():
                s["step"].add_(1)
            live["np"] += 7
            live["t"].add_(1.0)
        gate.set()
        writer.flush()
        newest, k = slots.committed()[0]
        assert newest == 2 and torch.equal(slots.data[k][: manifest.nbytes], expected)
        assert landed[-1].startswith("ffstate-publish")  # off the training's thread
        gate.clear()
        fail.append(1)
        writer.commit(states[2], 3)
        gate.set()
        with pytest.raises(RuntimeError, match="illegal memory access"):
            writer.commit(states[2], 4)  # the failed landing of 3 surfaces at the next commit
        assert slots.committed()[0][0] == 2
        fail.clear()
        gate.clear()
        writer.commit(states[2], 4)
        assert slots.committed()[0][0] == 2
        threading.Timer(0.2, gate.set).start()
    finally:
        writer.close()  # waits for 4 to land and publishes it
    newest, k = slots.committed()[0]
    assert newest == 4 and torch.equal(slots.data[k][: manifest.nbytes], codec.pack(states[2]).buffer)
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
        writer.flush()
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


def _trained(seed: int, steps: int, bool_buffer: bool = True):
    torch.manual_seed(seed)
    model = TinyGPT()
    if bool_buffer:
        model.register_buffer("flags", torch.rand(33) > 0.5)  # a bool buffer: bytes through the kernel
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    for _ in range(steps):
        loss = model.loss(torch.randint(0, model.tok.num_embeddings, (4, model.seq + 1)))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return model, opt


def test_a_restore_onto_the_device_goes_through_one_upload_and_the_scatter_kernel_bit_for_bit(monkeypatch):
    """``capture.restore`` of a state on the device (here the CPU stands for it, the kernels under the
    interpreter): the model's tensors are written in place and the optimizer's made on the device by one scatter
    launch, and every bit equals the state restored by per-tensor copies, a fresh optimizer's state included."""
    from ffstate import capture, kernels, staging

    model, opt = _trained(0, 3)
    host = codec.unpack(codec.pack(capture.capture(model, opt, None, None)))  # the restored state, on the host
    monkeypatch.setenv("FFSTATE_KERNELS", "triton")
    monkeypatch.setattr(staging, "wanted", lambda leaves: torch.device("cpu"))
    launches = []
    scatter = kernels.scatter
    monkeypatch.setattr(kernels, "scatter", lambda buf, placed: (launches.append(len(placed)), scatter(buf, placed)))
    results = []
    for choice in ("triton", "torch"):
        monkeypatch.setenv("FFSTATE_KERNELS", choice)
        fresh, fresh_opt = _trained(1, 0)  # another start, no optimizer state yet: as a replaced rank's process
        before = {k: v.data_ptr() for k, v in fresh.state_dict().items()}
        capture.restore(fresh, fresh_opt, None, None, host)
        assert {k: v.data_ptr() for k, v in fresh.state_dict().items()} == before  # in place: the identity kept
        results.append(capture.capture(fresh, fresh_opt, None, None))
    n_model = len(model.state_dict())
    n_opt = sum(1 for s in opt.state.values() for k in s if k != "step")
    assert launches == [n_model + n_opt]  # one launch, every model tensor and optimizer value but the steps
    for got in results:
        assert_bitwise_equal(got["model"], capture.capture(model, opt, None, None)["model"])
        assert_bitwise_equal(got["optim"], capture.capture(model, opt, None, None)["optim"])
    assert_bitwise_equal(results[0], results[1])


def test_upload_refuses_what_it_cannot_place_and_falls_back_when_the_kernels_cannot_run(monkeypatch, caplog):
    from ffstate import kernels, staging

    monkeypatch.setenv("FFSTATE_KERNELS", "triton")
    with pytest.raises(ValueError, match="same dtype and shape"):
        staging.upload([(torch.zeros(3), torch.zeros(4))])
    with pytest.raises(ValueError, match="contiguous"):
        staging.upload([(torch.zeros(3, 2), torch.zeros(2, 3).t())])

    def no_triton(*args, **kwargs):
        raise ImportError("No module named 'triton'")

    monkeypatch.setattr(kernels, "scatter", no_triton)
    src, dst = torch.randn(1000), torch.zeros(1000)
    with pytest.raises(ImportError):
        staging.upload([(src, dst)])
    monkeypatch.delenv("FFSTATE_KERNELS")
    staging.upload([(src, dst)])
    assert torch.equal(dst, src) and "tensor by tensor" in caplog.text


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_restore_onto_a_gpu_scatters_the_state_into_place_bit_for_bit():
    from ffstate import capture

    model, opt = _trained(0, 3)
    host = codec.unpack(codec.pack(capture.capture(model, opt, None, None)))
    fresh, fresh_opt = _trained(1, 0)
    fresh.cuda()
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=3e-3, weight_decay=0.1)
    capture.restore(fresh, fresh_opt, None, None, host)
    assert all(t.is_cuda for s in fresh_opt.state.values() for k, t in s.items() if k != "step")
    got = capture.capture(fresh, fresh_opt, None, None)
    want = capture.capture(model, opt, None, None)
    assert_bitwise_equal({k: v.cpu() for k, v in got["model"].items()}, want["model"])
