"""The shared memory between a worker and its node's daemon: the snapshot slots (``slots``), their
header page declared as one structure (``header``), the daemon's doorbell (``doorbell``) and the
training's collective marks for the scheduler (``marks``). Nothing here encodes a state: slots hand
out bytes (docs/design.md section 4)."""

from ffstate.errors import SlotError
from ffstate.ids import check_id
from ffstate.shm.doorbell import Bell, Doorbell
from ffstate.shm.header import COMM_RING, PAGE, TIMELINE_MAX, Header
from ffstate.shm.marks import CommMarks
from ffstate.shm.slots import (DEFAULT_SCALARS_CAPACITY, SlotView, Slots, create_slots, reclaim, remove_slots,
                               slot_paths, slot_size)

__all__ = ["Bell", "COMM_RING", "CommMarks", "DEFAULT_SCALARS_CAPACITY", "Doorbell", "Header", "PAGE", "SlotError",
           "SlotView", "Slots", "TIMELINE_MAX", "check_id", "create_slots", "reclaim", "remove_slots", "slot_paths",
           "slot_size"]
