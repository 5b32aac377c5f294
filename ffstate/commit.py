"""A worker's commit into its rank's slots: the captured state packed into the free slot's bytes, then
published (one copy; docs/design.md section 4, step 1). The slots hand out the bytes; the codec packs them."""

from __future__ import annotations

from typing import Any

import torch

from ffstate import codec
from ffstate.shm import Slots


class SlotWriter:
    """Packs states into ``slots`` (their layout), caching each slot's per-tensor views of its bytes."""

    def __init__(self, slots: Slots):
        self.slots = slots
        self._targets: list[list[torch.Tensor] | None] = [None] * len(slots.data)  # made once per slot

    def commit(self, state: Any, version: int, wait: float = 0.0) -> None:
        """Packs ``state`` into the older slot and publishes it as ``version``; see ``Slots.begin`` for ``wait``.

        Raises:
            SlotError: ``version`` is not newer than the newest committed one.
            CodecError: the state's layout is not the one the slots were made for.
        """
        slots = self.slots
        k = slots.begin(version, wait)
        if self._targets[k] is None:
            self._targets[k] = codec.pack_targets(slots.data[k], slots.manifest)
        snap = codec.pack_into(state, slots.data[k], slots.manifest, checksum=False, targets=self._targets[k])
        slots.publish(k, version, snap.manifest.scalars)

    @property
    def wait_timed_out(self) -> bool:
        """Whether the last commit overwrote a version the daemon had not read (see ``Slots.begin``)."""
        return self.slots.wait_timed_out
