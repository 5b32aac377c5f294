"""A worker's commit into its rank's slots: the captured state packed into the free slot's bytes, then
published (one copy; docs/design.md section 4, step 1). The slots hand out the bytes; the codec packs them, or,
for a state on a GPU, ``staging`` (one Triton gather into a device buffer, one asynchronous copy into the slot)."""

from __future__ import annotations

import logging
import os
from typing import Any

import torch

from ffstate import codec, layout, staging
from ffstate.codec.backend import _kernels_choice
from ffstate.errors import LayoutChanged
from ffstate.shm import Slots

log = logging.getLogger("ffstate.commit")


class SlotWriter:
    """Packs states into ``slots`` (their layout), caching each slot's per-tensor views of its bytes; a state on a
    GPU is staged (decided at the first commit, from where its bytes are; ``FFSTATE_KERNELS=torch`` keeps the
    per-tensor copies)."""

    def __init__(self, slots: Slots):
        self.slots = slots
        self._targets: list[list[torch.Tensor] | None] = [None] * len(slots.data)  # made once per slot
        self._stager: staging.Stager | None = None
        self._decided = False
        self._staged = False  # a staged pack has succeeded (a later failure is not the kernels' absence)

    def commit(self, state: Any, version: int, wait: float = 0.0) -> None:
        """Packs ``state`` into the older slot and publishes it as ``version``; see ``Slots.begin`` for ``wait``.

        Raises:
            SlotError: ``version`` is not newer than the newest committed one.
            CodecError: the state's layout is not the one the slots were made for.
        """
        slots = self.slots
        if not self._decided:
            self._decide(state)
        k = slots.begin(version, wait)
        manifest = None
        if self._stager is not None:
            try:
                manifest = self._stager.pack(state, slots.data[k])
                self._staged = True
            except LayoutChanged:
                raise
            except Exception as e:  # noqa: BLE001 (the first staged pack: Triton missing or unable to compile)
                if self._staged or _kernels_choice(os.environ.get("FFSTATE_KERNELS", "auto")) == "triton":
                    raise  # not the first, or the kernels were asked for by name
                log.warning("the staged commit failed at its first use (%s: %s): commits copy tensor by tensor "
                            "instead (FFSTATE_KERNELS=torch says so from the start)", type(e).__name__, e)
                self.close()
        if manifest is None:
            if self._targets[k] is None:
                self._targets[k] = codec.pack_targets(slots.data[k], slots.manifest)
            manifest = codec.pack_into(state, slots.data[k], slots.manifest, checksum=False,
                                       targets=self._targets[k]).manifest
        slots.publish(k, version, manifest.scalars)

    def _decide(self, state: Any) -> None:
        self._decided = True
        _, leaves = layout.analyze_known(state, self.slots.manifest)
        device = staging.wanted(leaves)
        if device is not None and _kernels_choice(os.environ.get("FFSTATE_KERNELS", "auto")) != "torch":
            try:
                self._stager = staging.Stager(device, self.slots.manifest, list(self.slots.data))
            except (ImportError, RuntimeError) as e:  # no Triton, no room on the device for a second copy of the state
                log.warning("commits cannot be staged on %s (%s: %s): they copy tensor by tensor", device,
                            type(e).__name__, str(e).splitlines()[0][:200])
                return
            log.info("commits are staged on %s: one gather into %.1f MB of device memory, one copy into the slot",
                     device, self.slots.manifest.nbytes / 1e6)

    def close(self) -> None:
        """Gives back what staging took (the device buffer, the slots' registration); before the slots close."""
        if self._stager is not None:
            self._stager.close()
            self._stager = None

    @property
    def wait_timed_out(self) -> bool:
        """Whether the last commit overwrote a version the daemon had not read (see ``Slots.begin``)."""
        return self.slots.wait_timed_out
