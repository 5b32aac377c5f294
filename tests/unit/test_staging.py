"""ffstate/staging.py: a commit staged through one device buffer (the GPU path), run here on CPU tensors with the
Triton gather under the interpreter: the slot gets exactly the bytes the CPU path packs, host leaves included."""

import numpy as np
import pytest
import torch

from ffstate import codec, layout
from ffstate.staging import Stager, wanted
from helpers import assert_bitwise_equal, cpu_as_device, train_states


def mixed_state():
    g = torch.Generator().manual_seed(0)
    big = torch.randn(300, 301, generator=g)
    return {"big": big, "t": big[:, :7].t(), "column": big[:, 1], "empty": torch.empty(0, 3),
            "scalar": torch.tensor(3, dtype=torch.int64),
            "bf16": torch.randn(4097, generator=g).to(torch.bfloat16), "bool": torch.rand(77, generator=g) > 0.5,
            "np": np.arange(10, dtype=np.uint32), "lr": 0.5}



def _writer(manifest, job: str = "j"):
    """A rank's slots for ``manifest`` (under the test's SHM_DIR) and a SlotWriter over them."""
    from ffstate import shm
    from ffstate.commit import SlotWriter

    paths = shm.slot_paths("n0", job, 0, 1)
    shm.create_slots(paths, manifest, shm.DEFAULT_SCALARS_CAPACITY)
    slots = shm.Slots(paths, manifest)
    return slots, SlotWriter(slots)


@pytest.fixture
def staged_on_cpu(tmp_path, monkeypatch):
    """Slots under the test's folder, and commits staged with the CPU as the device (the kernels forced)."""
    from ffstate import shm, staging

    monkeypatch.setattr(shm.slots, "SHM_DIR", tmp_path)
    monkeypatch.setenv("FFSTATE_KERNELS", "triton")
    monkeypatch.setattr(staging, "wanted", lambda leaves: torch.device("cpu"))


@cpu_as_device
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


@cpu_as_device
def test_a_slot_writer_stages_a_state_on_the_staging_device_and_publishes_what_the_cpu_path_packs(staged_on_cpu):
    """The commit path as the trainer takes it: SlotWriter decides at its first commit to stage (here on the CPU,
    the device a GPU would be), then every commit's slot holds the bytes codec.pack makes, scalars published."""
    from ffstate.errors import LayoutChanged

    states = list(train_states(3))
    manifest = layout.describe(states[0])
    slots, writer = _writer(manifest)
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


@cpu_as_device
def test_a_staged_commit_returns_before_its_copy_lands_and_is_published_when_it_has(staged_on_cpu, monkeypatch):
    """The training goes on while a staged commit's copy lands: commit returns with the slot unpublished, the
    state may change at once (the optimizer's update, the step counter) without reaching the committed version,
    the copy's landing publishes it, and the next commit, ``flush`` or ``close`` wait for it. A landing that
    fails leaves the version before it published and is raised by the next commit."""
    import threading

    from ffstate import staging

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
    slots, writer = _writer(manifest)
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


@cpu_as_device
def test_a_drain_stops_at_a_staged_commit_once_it_is_published(staged_on_cpu, monkeypatch):
    """A node being drained stops its ranks at a commit, and the daemon takes the node out once every rank's newest
    version is that step: the step a rank says it stopped at must be published by then, though a staged commit
    lands after ``commit`` returns."""
    import contextlib
    import threading
    import time
    from types import SimpleNamespace

    from ffstate import staging
    from ffstate.elastic.worker import ShapeWatch

    gate = threading.Event()
    pack = staging.Stager.pack

    def gated_pack(self, state, out):
        manifest, land = pack(self, state, out)
        return manifest, lambda: (gate.wait(60), land())

    monkeypatch.setattr(staging.Stager, "pack", gated_pack)
    states = list(train_states(2))
    manifest = layout.describe(states[0])
    slots, writer = _writer(manifest)
    said = []
    set_drained = slots.set_drained
    monkeypatch.setattr(slots, "set_drained", lambda step: (said.append((step, slots.committed()[0][0])),
                                                            set_drained(step)))
    job = SimpleNamespace(cfg=SimpleNamespace(drain_hold=0.2), rank=0, topology=SimpleNamespace(node_id="n0"),
                          record=lambda event: None)
    shape = ShapeWatch(job, lambda: None, lambda seconds: contextlib.nullcontext(), writer.flush)
    try:
        gate.set()
        writer.commit(states[0], 1)
        gate.clear()
        writer.commit(states[1], 2)
        assert slots.committed()[0][0] == 1  # landing
        slots.set_drain(time.time())  # the daemon asks
        threading.Timer(0.3, gate.set).start()
        shape.after_commit(2, slots, 1)
        assert said[0] == (2, 2)  # it said it stopped at 2 once 2 was published
    finally:
        gate.set()
        writer.close()
        slots.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_state_on_a_gpu_is_staged_and_its_slot_holds_the_cpu_path_s_bytes(tmp_path, monkeypatch):
    from ffstate import shm

    monkeypatch.setattr(shm.slots, "SHM_DIR", tmp_path)
    host = mixed_state()
    state = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in host.items()}
    manifest = layout.describe(state)
    slots, writer = _writer(manifest)
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
        slots, writer = _writer(manifest, f"j{int(forced)}")
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



def _as_device(monkeypatch, launches):
    """The CPU as the device a restore writes to: ``staging.on_gpu`` takes every tensor leaf, the kernels run under
    the interpreter, and each scatter launch is counted."""
    from ffstate import kernels, staging

    monkeypatch.setenv("FFSTATE_KERNELS", "triton")
    monkeypatch.setattr(staging, "on_gpu", lambda leaf: isinstance(leaf, torch.Tensor))
    scatter = kernels.scatter
    monkeypatch.setattr(kernels, "scatter", lambda buf, placed: (launches.append(len(placed)), scatter(buf, placed)))


@cpu_as_device
def test_a_restore_onto_the_device_scatters_the_decoded_buffer_in_one_launch_bit_for_bit(monkeypatch):
    """A restore's device tensors are not copied out piece by piece from the host: once the buffer is checked, its
    span goes to the device in one copy and the scatter kernel fills every device tensor (the slot's path,
    ``unpack_verified``, and the holders', ``Decoder``); the state equals the reference's bit for bit and the sum
    the buffer's."""
    state = {**mixed_state(), "train": list(train_states(2))[-1]}
    packed = codec.pack(state)
    launches = []
    _as_device(monkeypatch, launches)
    got, total = codec.unpack_verified(packed.manifest, packed.buffer)
    tensors = sum(1 for t in packed.manifest.tensors if t.kind != "ndarray" and t.nbytes)
    assert launches == [tensors]  # one launch for every tensor; the numpy array copied out on the host
    assert total == codec.buffer_checksum(packed.buffer)
    assert_bitwise_equal(got, state)
    full = codec.encode(state, chunk_bytes=64 << 10)
    dec = codec.Decoder()
    for c in reversed(full.chunks):
        dec.add(c)
    assert_bitwise_equal(dec.state(), state)
    assert launches == [tensors, tensors]
    # A state larger than the window goes over in runs: the device never holds a second copy of the whole state.
    from ffstate import staging

    monkeypatch.setattr(staging, "WINDOW_BYTES", 200_000)
    launches.clear()
    got, _ = codec.unpack_verified(packed.manifest, packed.buffer)
    assert_bitwise_equal(got, state)
    assert len(launches) > 3 and sum(launches) == tensors


def test_a_restore_onto_the_device_falls_back_to_copies_when_the_kernels_cannot_run(monkeypatch, caplog):
    from ffstate import kernels, staging

    state = list(train_states(1))[-1]
    packed = codec.pack(state)
    _as_device(monkeypatch, [])

    def no_triton(*args, **kwargs):
        raise ImportError("No module named 'triton'")

    monkeypatch.setattr(kernels, "scatter", no_triton)
    with pytest.raises(ImportError):  # asked for by name
        codec.unpack_verified(packed.manifest, packed.buffer)
    monkeypatch.delenv("FFSTATE_KERNELS")
    monkeypatch.setattr(staging, "_scatter_said", False)
    got, _ = codec.unpack_verified(packed.manifest, packed.buffer)
    assert_bitwise_equal(got, state)
    assert "copied one by one" in caplog.text
    monkeypatch.setenv("FFSTATE_KERNELS", "triton")
    spec = packed.manifest.tensors[0]
    with pytest.raises(ValueError, match="contiguous tensors of the spec's size"):
        staging.scatter(packed.buffer, [(spec, torch.empty(spec.nbytes + 4, dtype=torch.uint8))])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_state_on_a_gpu_is_restored_onto_it_bit_for_bit():
    host = mixed_state()
    state = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in host.items()}
    packed = codec.pack(state)
    got, _ = codec.unpack_verified(packed.manifest, packed.buffer.cpu())  # a slot's bytes, on the host
    assert all(got[k].is_cuda for k, v in state.items() if isinstance(v, torch.Tensor))
    assert_bitwise_equal({k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in got.items()}, host)


def test_a_tensor_without_storage_of_its_own_is_never_gathered_by_address():
    """A wrapper subclass (a float8 or NF4 weight) reports data pointer 0: the kernel would read address 0, a
    sticky device error; it takes the copy of its own instead."""
    from types import SimpleNamespace

    from ffstate import staging
    from ffstate.kernels.gather import _split

    class Wrapped(torch.Tensor):
        @staticmethod
        def __new__(cls, inner):
            return torch.Tensor._make_wrapper_subclass(cls, inner.shape, dtype=inner.dtype, device=inner.device)

        @classmethod
        def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
            raise NotImplementedError(func)

    w, plain = Wrapped(torch.zeros(4)), torch.zeros(4)
    assert w.data_ptr() == 0 and w.is_contiguous()
    assert not staging._on(w, torch.device("cpu")) and staging._on(plain, torch.device("cpu"))
    spec = SimpleNamespace(offset=0, nbytes=16)
    fast, slow = _split(torch.zeros(64, dtype=torch.uint8), [(spec, w), (spec, plain)])
    assert [t for _, t in slow] == [w] and fast == [(plain.data_ptr(), 0, 16)]


def test_a_staging_buffer_must_fit_beside_the_training_s_peak():
    from ffstate.staging import check_room

    gb = 1 << 30
    check_room(4 * gb, free=10 * gb, total=80 * gb, reserved=60 * gb, peak=60 * gb)  # 10 - 4 (margin) = 6 GB of room
    with pytest.raises(RuntimeError, match="a staging buffer of 4.29 GB does not fit beside the training's peak of 68.72 GB"):
        check_room(4 * gb, free=10 * gb, total=80 * gb, reserved=60 * gb, peak=64 * gb + 1)
    with pytest.raises(RuntimeError):  # what the allocator holds counts only beside the peak it served
        check_room(1 * gb, free=0, total=80 * gb, reserved=70 * gb, peak=70 * gb)


def test_a_strided_leaf_off_the_staging_device_comes_over_as_its_elements():
    """Staging on a GPU, a CPU tensor's bytes are copied aside: a column of a matrix (a 1-D view with stride 301)
    has no byte view of its own and raised."""
    from types import SimpleNamespace

    from ffstate.staging import _host_copy

    big = torch.randn(300, 301)
    got = _host_copy(SimpleNamespace(kind="tensor"), big[:, 1])
    assert torch.equal(got, big[:, 1].contiguous().view(torch.uint8))


def test_closing_a_stager_after_a_sticky_device_error_logs_it_and_raises_nothing(caplog):
    """A device error is sticky: making the device current, or the stream's sync, raises it again at the stager's
    close, which runs while the caller's own error (the first) is being raised: the close logs it and gives way."""
    state = mixed_state()
    manifest = layout.describe(state)
    for where in ("device", "stream"):
        stager = Stager(torch.device("cpu"), manifest, [layout.alloc_buffer(manifest)])
        sticky = RuntimeError("CUDA error: an illegal memory access was encountered")

        def fail(*args):
            raise sticky

        if where == "device":
            stager._on_device = fail
        else:
            stager.stream = type("Stream", (), {"synchronize": fail})()
        stager._registered = ["a slot"]
        stager.close()
        assert stager._registered == [] and "illegal memory access" in caplog.text
        caplog.clear()
