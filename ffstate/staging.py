"""A commit of a state whose tensors live on a GPU (docs/design.md section 4, step 1): one Triton gather packs every
device tensor into a staging buffer on the device, one device-to-host copy on a side stream moves the whole buffer
into the slot, whose pages are registered with CUDA so that the copy runs at the link's full speed, and the few
host values of the state (RNG states, step counters, extras) are copied into the slot by the CPU path. The commit
returns once the slot holds every byte: the snapshot survives the process as on a CPU, for about one
device-to-host copy of the state instead of one copy per tensor.

Thin on purpose: the gather is the tested kernel (``kernels/gather.py``, checked against the CPU path under
``TRITON_INTERPRET=1``); what is CUDA's own here is a stream, an event and the registration of the slot's pages.
On a CPU (the kernels forced with ``FFSTATE_KERNELS=triton``) the same code runs without them, which is how the
tests check the staged layout bit for bit.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
from typing import Any

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


class Stager:
    """Stages commits of one layout on ``device`` into the slot buffers ``outs`` (registered with CUDA while it
    lives; ``close`` gives them back)."""

    def __init__(self, device: torch.device, manifest: Manifest, outs: list[torch.Tensor]):
        self.device, self.manifest = torch.device(device), manifest
        self.cuda = self.device.type == "cuda"
        with self._on_device():
            self.buf = torch.zeros(manifest.nbytes, dtype=torch.uint8, device=self.device)  # its padding stays zero
            self.stream = torch.cuda.Stream(self.device) if self.cuda else None
            self._registered = [out for out in outs if self.cuda and _register(out)]

    def _on_device(self) -> contextlib.AbstractContextManager:
        """The staging device made current: Triton launches, events and the registration's context follow the
        current device, which need not be the state's (a process that never called ``set_device``)."""
        return torch.cuda.device(self.device) if self.cuda else contextlib.nullcontext()

    def pack(self, state: Any, out: torch.Tensor) -> Manifest:
        """Packs ``state`` (of this layout) into ``out``, a slot's bytes; returns the state's manifest (its
        scalars are this version's)."""
        from ffstate import kernels

        current, arrays = layout.analyze_known(state, self.manifest)
        if current.layout_id != self.manifest.layout_id:
            raise LayoutChanged(f"the state's layout changed since it was described: "
                                f"{layout.diff_layouts(current, self.manifest)}")
        placed = list(layout.iter_placed(current, arrays))
        here = [(s, a) for s, a in placed if _on(a, self.device)]
        rest = [(s, a) for s, a in placed if not _on(a, self.device)]
        with self._on_device():
            kernels.gather(here, self.buf)  # one launch for every device tensor, on the device's current stream
            if self.cuda:
                gathered = torch.cuda.Event()
                gathered.record(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(self.stream):
                    self.stream.wait_event(gathered)
                    out[: self.manifest.nbytes].copy_(self.buf, non_blocking=True)
                self.stream.synchronize()
            else:
                out[: self.manifest.nbytes].copy_(self.buf)
        with torch.no_grad():  # the host's values, into their places after the device's bytes landed
            for spec, a in rest:
                if spec.nbytes:
                    target = out[spec.offset: spec.offset + spec.nbytes]
                    target.copy_(layout.array_bytes(a) if spec.kind == "ndarray" else layout.leaf_bytes(a))
        return current

    def close(self) -> None:
        with self._on_device():
            for out in self._registered:
                err = torch.cuda.cudart().cudaHostUnregister(out.data_ptr())
                if int(err) != 0:
                    log.warning("cudaHostUnregister of a slot returned %s", err)
                    clear_cuda_error()
        self._registered = []


def _on(a: Any, device: torch.device) -> bool:
    """Whether the gather takes the leaf: a contiguous tensor on the staging device (the kernel copies raw bytes,
    bools included)."""
    return isinstance(a, torch.Tensor) and a.device == device and a.is_contiguous()


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
