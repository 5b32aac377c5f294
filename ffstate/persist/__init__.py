"""The persistent tier (docs/design.md section 6): each node's daemon flushes its local ranks' committed versions to
``Config.persist_dir`` in the torch.distributed.checkpoint format, off the training path, and a job that finds
no live copy (every node lost, new machines) resumes from the newest complete one, bit for bit.

``keys`` (worker side: the DCP key of each tensor), ``items`` (a version's DCP items), ``write`` (a rank's
files, the version made complete, retention), ``read`` (checking and reading a version back).
"""

from ffstate.persist.items import Item, boxes, check_keys, items_of
from ffstate.persist.read import PersistError, check, read_shard
from ffstate.persist.write import (COMPLETE, complete_versions, drop_newer, finalize, note_reached, prune, reached,
                                   remove_rank, version_dir, worlds, write_rank)

__all__ = ["COMPLETE", "Item", "PersistError", "boxes", "check", "check_keys", "complete_versions", "drop_newer", "finalize",
           "items_of", "note_reached", "prune", "reached", "read_shard", "remove_rank", "version_dir", "worlds", "write_rank"]
