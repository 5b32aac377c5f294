"""A commit of a state whose tensors live on a GPU (docs/design.md section 4, step 1): one Triton gather packs every
device tensor into a staging buffer on the device, one device-to-host copy on a side stream moves the whole buffer
into the slot, whose pages are registered with CUDA so that the copy runs at the link's full speed, and the few
host values of the state (RNG states, step counters, extras) are copied aside by the CPU and put into the slot
after the device's bytes. The commit does not wait for the copy: the training's next kernels queue behind the
gather on its stream, and the slot is published once the copy's event has fired (``commit.SlotWriter`` waits for
it off the training's thread); the snapshot then survives the process as on a CPU, for about one device-to-host
copy of the state instead of one copy per tensor, none of it on the training's time. And the way back:
``scatter`` moves a restored state's device tensors from the decoded buffer onto the device in host-to-device
copies of up to ``WINDOW_BYTES`` and the scatter kernel.

Thin on purpose: the kernels are the tested part (``kernels/gather.py``, checked against the CPU path under
``TRITON_INTERPRET=1``); what is CUDA's own here is a stream, events and the registration of the slot's pages.
On a CPU (the kernels forced with ``FFSTATE_KERNELS=triton``) the same code runs without them, the copy into the
slot then being what ``land`` does, which is how the tests check the staged layout and its late publication bit
for bit.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
import os
from typing import Any, Callable

import torch

from ffstate import layout
from ffstate.errors import LayoutChanged
from ffstate.layout import Manifest

log = logging.getLogger("ffstate.staging")


def wanted(state_leaves: list[Any]) -> torch.device | None:
    """The device to stage on: the GPU most of the state's bytes are on (None: nothing to stage)."""
    sizes: dict[torch.device, int] = {}
    for t in state_leaves:
        if isinstance(t, torch.Tensor) and t.is_cuda:
            sizes[t.device] = sizes.get(t.device, 0) + t.numel() * t.element_size()
    return max(sizes, key=sizes.get) if sizes else None


MARGIN = 0.05  # of the device's memory, kept free beside the training's peak and the staging buffer (fragmentation)


def check_room(nbytes: int, free: int, total: int, reserved: int, peak: int) -> None:
    """Refuses a staging buffer of ``nbytes`` that would not fit beside the training's peak so far: the device's
    free memory plus what torch's allocator holds (``reserved``), less the most the training has had allocated
    (``peak``: the next step needs it again) and a margin. Taken at the first commit, after a step has run.

    Raises:
        RuntimeError: no room (the caller's commits then copy tensor by tensor, from the device to the slot).
    """
    room = free + reserved - peak - int(MARGIN * total)
    if nbytes > room:
        raise RuntimeError(f"a staging buffer of {nbytes / 1e9:.2f} GB does not fit beside the training's peak of "
                           f"{peak / 1e9:.2f} GB ({free / 1e9:.2f} GB free, {reserved / 1e9:.2f} GB held by torch, "
                           f"{total / 1e9:.2f} GB in all, {MARGIN:.0%} kept free)")


class Stager:
    """Stages commits of one layout on ``device`` into the slot buffers ``outs`` (registered with CUDA while it
    lives; ``close`` gives them back)."""

    def __init__(self, device: torch.device, manifest: Manifest, outs: list[torch.Tensor]):
        self.device, self.manifest = torch.device(device), manifest
        self.cuda = self.device.type == "cuda"
        with self._on_device():
            if self.cuda:  # the training's next step must still fit: refused here, the commits copy tensor by tensor
                free, total = torch.cuda.mem_get_info(self.device)
                check_room(manifest.nbytes, free, total, torch.cuda.memory_reserved(self.device),
                           torch.cuda.max_memory_allocated(self.device))
            self.buf = torch.zeros(manifest.nbytes, dtype=torch.uint8, device=self.device)  # its padding stays zero
            self.stream = torch.cuda.Stream(self.device) if self.cuda else None
            self._registered = [out for out in outs if self.cuda and _register(out)]
        self._copied: Any = None  # the event of the last copy into a slot

    def _on_device(self) -> contextlib.AbstractContextManager:
        """The staging device made current: Triton launches, events and the registration's context follow the
        current device, which need not be the state's (a process that never called ``set_device``)."""
        return torch.cuda.device(self.device) if self.cuda else contextlib.nullcontext()

    def pack(self, state: Any, out: torch.Tensor) -> tuple[Manifest, Callable[[], None]]:
        """Packs ``state`` (of this layout) into ``out``, a slot's bytes, without waiting for the copy; returns the
        state's manifest (its scalars are this version's) and ``land``: a call that returns once ``out`` holds every
        byte (it waits for the device's copy, then puts in the host's values, copied aside here), for the caller to
        run before it publishes the slot, off the training's thread. Call ``land`` before the next ``pack``.

        The training may go on at once: the gather is on the device's current stream, so the next step's kernels
        (the optimizer's update) run after it, and they wait on nothing else; the copy reads the staging buffer
        on a side stream, and the host values are copies.
        """
        from ffstate import kernels

        current, arrays = layout.analyze_known(state, self.manifest)
        if current.layout_id != self.manifest.layout_id:
            raise LayoutChanged(f"the state's layout changed since it was described: "
                                f"{layout.diff_layouts(current, self.manifest)}")
        placed = list(layout.iter_placed(current, arrays))
        here = [(s, a) for s, a in placed if _on(a, self.device)]
        with torch.no_grad():  # the host's values (RNG states, step counters), copied now: the training changes them
            rest = [(s.offset, _host_copy(s, a)) for s, a in placed if s.nbytes and not _on(a, self.device)]
        n = self.manifest.nbytes
        with self._on_device():
            if self.cuda:
                stream = torch.cuda.current_stream(self.device)
                if self._copied is not None:  # the buffer is free once the last copy read it (``land`` waited)
                    stream.wait_event(self._copied)
                kernels.gather(here, self.buf)  # one launch for every device tensor, on the current stream
                gathered = torch.cuda.Event()
                gathered.record(stream)
                with torch.cuda.stream(self.stream):
                    self.stream.wait_event(gathered)
                    out[:n].copy_(self.buf, non_blocking=True)
                    self._copied = copied = torch.cuda.Event(blocking=True)  # its waiter sleeps, not spins
                    copied.record(self.stream)
                device_part = functools.partial(self._synchronize, copied)
            else:  # the CPU as the device (tests): the copy itself is what lands later
                kernels.gather(here, self.buf)
                device_part = functools.partial(out[:n].copy_, self.buf)

        def land() -> None:
            device_part()
            if rest:  # after the device's bytes: its copy covers the host values' places with the buffer's zeros
                torch._foreach_copy_([out[o : o + t.numel()] for o, t in rest], [t for _, t in rest])

        return current, land

    def _synchronize(self, event: Any) -> None:
        with self._on_device():
            event.synchronize()  # the interpreter lock released while it waits

    def close(self) -> None:
        try:  # a sticky device error (making the device current, or the sync): the pages stay registered, and the
            # caller's error, not this one, is what it raises
            with self._on_device():
                if self.stream is not None:
                    self.stream.synchronize()  # no copy still writing a slot's pages when they are unregistered
                for out in self._registered:
                    err = torch.cuda.cudart().cudaHostUnregister(out.data_ptr())
                    if int(err) != 0:
                        log.warning("cudaHostUnregister of a slot returned %s", err)
                        clear_cuda_error()
        except RuntimeError as e:
            log.error("closing the staging stream failed (%s): the slots' pages are left registered", e)
        finally:
            self._registered = []


def _host_copy(spec: Any, a: Any) -> torch.Tensor:
    """A leaf's bytes copied on the host: a value of the host's, a tensor on another device or one without storage
    of its own (each comes over by itself, strided ones made contiguous)."""
    if spec.kind == "ndarray":
        b = layout.array_bytes(a)
    else:  # a strided 1-D view (a column) has no byte view of its own: its elements made contiguous first
        b = layout.leaf_bytes(a if a.is_contiguous() else a.contiguous())
    return b.clone() if b.device.type == "cpu" else b.cpu()


def _on(a: Any, device: torch.device) -> bool:
    """Whether the gather takes the leaf: a tensor on the staging device with storage of its own (the kernel copies
    a contiguous one's raw bytes, bools included, and a copy on the device places a strided one, both on the
    training's stream: no host synchronisation; a wrapper subclass, e.g. a float8 or NF4 weight, has no data pointer
    and comes over by itself)."""
    return isinstance(a, torch.Tensor) and a.device == device and a.data_ptr() != 0


HOST_REGISTER_PORTABLE = 1  # cudaHostRegisterPortable: pinned for every CUDA context, not the current device's alone


def _register(out: torch.Tensor) -> bool:
    """Pins a slot's pages for the GPU's DMA (the slot is a shared mapping: registered, not copied)."""
    if not out.numel() or not out.data_ptr():
        return False
    try:
        err = torch.cuda.cudart().cudaHostRegister(out.data_ptr(), out.numel(), HOST_REGISTER_PORTABLE)
    except RuntimeError as e:
        log.warning("the slot's pages could not be registered with CUDA (%s): the copy runs at pageable speed", e)
        clear_cuda_error()
        return False
    if int(err) != 0:
        log.warning("cudaHostRegister of a slot returned %s: the copy runs at pageable speed", err)
        clear_cuda_error()
        return False
    return True


def clear_cuda_error() -> bool:
    """Reads back (and so clears) CUDA's last error after a runtime call that failed: torch's bindings of
    ``cudaHostRegister``/``cudaHostUnregister`` return the error and leave it set, and the next kernel launch's check
    would raise it at an unrelated operation. False where the CUDA runtime library is not found in the process (a
    torch that links it statically: the failure may then surface at the next launch)."""
    lib = _cudart()
    if lib is None:
        return False
    lib.cudaGetLastError()
    return True


@functools.lru_cache(maxsize=1)
def _cudart() -> ctypes.CDLL | None:
    """The CUDA runtime this process loaded (torch's), found among its mappings."""
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.split()[-1]
                if "libcudart" in path.rsplit("/", 1)[-1]:
                    lib = ctypes.CDLL(path)
                    lib.cudaGetLastError.restype = ctypes.c_int
                    return lib
    except (OSError, AttributeError):
        pass
    return None


class _Span:
    """Where a tensor's bytes sit in the buffer ``scatter`` copies to the device (what the kernel reads of a spec)."""

    __slots__ = ("offset", "nbytes")

    def __init__(self, offset: int, nbytes: int):
        self.offset, self.nbytes = offset, nbytes


_scatter_said = False


def on_gpu(leaf: Any) -> bool:
    """Whether a restored state's leaf lives on a GPU: filled by ``scatter``, not by copies from the host."""
    return isinstance(leaf, torch.Tensor) and leaf.is_cuda


def scatter(buf: torch.Tensor, placed: list[tuple[Any, torch.Tensor]]) -> None:
    """Copies each spec's bytes of the host buffer ``buf`` (a decoded version, or a slot) into its tensor on one
    device (new, contiguous, the spec's dtype and shape): the span of ``buf`` that holds them goes to the device in
    copies of up to ``WINDOW_BYTES`` (one for a state under that size), and the scatter kernel writes the tensors of
    each in one launch, where copying each tensor's bytes would pay a transfer, and a synchronisation, per tensor.
    Where the kernels cannot run (no Triton, no compiler, no device memory for a window) the first call says so and
    copies tensor by tensor, unless ``FFSTATE_KERNELS=triton`` asked for them; ``FFSTATE_KERNELS=torch`` copies
    tensor by tensor."""
    global _scatter_said
    from ffstate.codec.backend import _kernels_choice

    placed = [(s, t) for s, t in placed if s.nbytes]
    if not placed:
        return
    choice = _kernels_choice(os.environ.get("FFSTATE_KERNELS", "auto"))
    if choice != "torch":
        try:
            _scatter(buf, placed)
            return
        except Exception as e:  # noqa: BLE001 (Triton missing or unable to compile; rewritten below)
            if choice == "triton":
                raise
            if not _scatter_said:
                _scatter_said = True
                log.warning("restoring onto %s through the scatter kernel failed (%s: %s): tensors are copied one by "
                            "one instead", placed[0][1].device, type(e).__name__, (str(e).splitlines() or [""])[0][:200])
    with torch.no_grad():
        for spec, t in placed:
            layout.copy_bits(t, layout.tensor_view(buf, spec))


def _scatter(buf: torch.Tensor, placed: list[tuple[Any, torch.Tensor]]) -> None:
    from ffstate import kernels

    device = placed[0][1].device
    for spec, t in placed:
        if t.device != device or not t.is_contiguous() or t.numel() * t.element_size() != spec.nbytes:
            raise ValueError(f"scatter: {spec.name} ({spec.nbytes} bytes) into a {tuple(t.shape)} {t.dtype} tensor on "
                             f"{t.device}: not one device's contiguous tensors of the spec's size")
    ctx = torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()
    with ctx:
        for window in _windows(sorted(placed, key=lambda p: p[0].offset)):
            lo, hi = window[0][0].offset, max(s.offset + s.nbytes for s, _ in window)
            kernels.scatter(buf[lo:hi], [(_Span(s.offset - lo, s.nbytes), t) for s, t in window])
        if device.type == "cuda":
            torch.cuda.current_stream(device).synchronize()  # the host buffer may go (or be rewritten) after this


WINDOW_BYTES = 256 << 20  # the most of the buffer on the device at once beside the restored tensors (or one tensor)


def _windows(placed: list[tuple[Any, torch.Tensor]]) -> list[list[tuple[Any, torch.Tensor]]]:
    """Tensors sorted by offset, in runs whose span of the buffer is at most ``WINDOW_BYTES`` (a larger tensor is
    a run of its own): the device holds one run's copy of the buffer at a time, not a second copy of the state."""
    out: list[list[tuple[Any, torch.Tensor]]] = []
    lo = 0
    for spec, t in placed:
        if not out or spec.offset + spec.nbytes - lo > WINDOW_BYTES:
            out.append([])
            lo = spec.offset
        out[-1].append((spec, t))
    return out
