"""The persistent tier (docs/design.md section 6): each node's daemon flushes its local ranks' committed versions to
``Config.persist_dir`` in the torch.distributed.checkpoint format, off the training path, and a job that finds
no live copy (every node lost, new machines) resumes from the newest complete one, bit for bit.

``keys`` (worker side: the DCP key of each tensor), ``keymap`` (the key map checked, daemon side), ``items`` (a
version's DCP items), ``write`` (a rank's files, the version made complete, retention), ``read`` (checking and
reading a version back).
"""

from typing import TYPE_CHECKING

from ffstate import lazy
from ffstate.persist.keymap import check_keys
from ffstate.persist.write import (COMPLETE, complete_versions, drop_newer, finalize, note_reached, prune, reached,
                                   remove_rank, version_dir, worlds, write_rank)

if TYPE_CHECKING:
    from ffstate.persist.items import Item, boxes, items_of
    from ffstate.persist.read import PersistError, check, read_shard

# Reading and the items need torch, imported on first use: the daemon keeps the tier's directories without it (its
# flushing process writes the files).
_TORCH_SIDE = {"Item": "ffstate.persist.items", "boxes": "ffstate.persist.items", "items_of": "ffstate.persist.items",
               "PersistError": "ffstate.persist.read", "check": "ffstate.persist.read",
               "read_shard": "ffstate.persist.read"}

__getattr__, __dir__ = lazy.attach(globals(), _TORCH_SIDE)


__all__ = ["COMPLETE", "Item", "PersistError", "boxes", "check", "check_keys", "complete_versions", "drop_newer",
           "finalize", "items_of", "note_reached", "prune", "reached", "read_shard", "remove_rank", "version_dir",
           "worlds", "write_rank"]
