"""A worker's commit into its rank's slots: the captured state packed into the free slot's bytes, then
published (one copy; docs/design.md section 4, step 1). The slots hand out the bytes; the codec packs them, or,
for a state on a GPU, ``staging`` (one Triton gather into a device buffer, one asynchronous copy into the slot,
published by the writer's thread once it has landed)."""

from __future__ import annotations

import logging
import os
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable

import torch

from ffstate import codec, layout, staging
from ffstate.codec.backend import _kernels_choice
from ffstate.errors import LayoutChanged
from ffstate.shm import Slots

log = logging.getLogger("ffstate.commit")


class SlotWriter:
    """Packs states into ``slots`` (their layout), caching each slot's per-tensor views of its bytes; a state on a
    GPU is staged (decided at the first commit, from where its bytes are; ``FFSTATE_KERNELS=torch`` keeps the
    per-tensor copies), and then published by one thread of the writer's once its copy has landed: a commit
    returns without waiting for it, and the next commit (or ``flush``, ``close``) waits for the one before."""

    def __init__(self, slots: Slots):
        self.slots = slots
        self._targets: list[list[torch.Tensor] | None] = [None] * len(slots.data)  # made once per slot
        self._stager: staging.Stager | None = None
        self._decided = False
        self._staged = False  # a staged pack has succeeded (a later failure is not the kernels' absence)
        self._publisher: ThreadPoolExecutor | None = None
        self._landing: Future | None = None  # the last staged commit's publication

    def commit(self, state: Any, version: int, wait: float = 0.0) -> None:
        """Packs ``state`` into the older slot and publishes it as ``version``; see ``Slots.begin`` for ``wait``. A
        staged commit is published once its copy has landed, after this returns (``flush`` waits for it).

        Raises:
            SlotError: ``version`` is not newer than the newest committed one.
            CodecError: the state's layout is not the one the slots were made for.
        """
        slots = self.slots
        self.flush()  # a step ago: its copy has long landed, and its slot is published before another is chosen
        if not self._decided:
            self._decide(state)
        k = slots.begin(version, wait)
        manifest = land = None
        if self._stager is not None:
            try:
                manifest, land = self._stager.pack(state, slots.data[k])
                self._staged = True
            except LayoutChanged:
                raise
            except Exception as e:  # noqa: BLE001 (the first staged pack: Triton missing or unable to compile)
                if self._staged or _kernels_choice(os.environ.get("FFSTATE_KERNELS", "auto")) == "triton":
                    raise  # not the first, or the kernels were asked for by name
                log.warning("the staged commit failed at its first use (%s: %s): commits copy tensor by tensor "
                            "instead (FFSTATE_KERNELS=torch says so from the start)", type(e).__name__, e)
                self.close()
        if land is not None:
            try:
                raw = slots.encode_scalars(manifest.scalars)  # a state that cannot be published fails here, not later
            except BaseException:
                land()  # the copy into the slot is queued: done before anything may unmap the slot
                raise
            if self._publisher is None:
                self._publisher = ThreadPoolExecutor(1, thread_name_prefix="ffstate-publish")
            self._landing = self._publisher.submit(self._publish, land, k, version, raw, slots.take_held())
            return
        if manifest is None:
            if self._targets[k] is None:
                self._targets[k] = codec.pack_targets(slots.data[k], slots.manifest)
            manifest = codec.pack_into(state, slots.data[k], slots.manifest, checksum=False,
                                       targets=self._targets[k]).manifest
        slots.publish(k, version, manifest.scalars)

    def _publish(self, land: Callable[[], None], k: int, version: int, scalars: bytes, held_ns: int) -> None:
        land()
        self.slots.publish(k, version, scalars, held_ns)

    def flush(self) -> None:
        """Returns once the last commit is published (a staged one, whose copy lands after ``commit`` returned).

        Raises:
            whatever its landing raised (a CUDA error of the copy): that version was not published.
        """
        landing, self._landing = self._landing, None
        if landing is not None:
            landing.result()

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
        """Publishes a staged commit still landing, then gives back what staging took (the device buffer, the slots'
        registration, the publishing thread); before the slots close."""
        try:
            self.flush()
        except Exception as e:  # noqa: BLE001 (closing: the versions before it stay published)
            log.warning("the last staged commit was not published: %s: %s", type(e).__name__, e)
        if self._publisher is not None:
            self._publisher.shutdown()
            self._publisher = None
        if self._stager is not None:
            self._stager.close()
            self._stager = None

    @property
    def wait_timed_out(self) -> bool:
        """Whether the last commit overwrote a version the daemon had not read (see ``Slots.begin``)."""
        return self.slots.wait_timed_out
