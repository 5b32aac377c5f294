"""Making each entry's process group so that a rank lost meanwhile cannot hold the others for the group's timeout.

gloo's setup (``init_process_group``) waits inside C++ for every rank's address in the store, as long as the
group's timeout (30 minutes). A rank that dies after the engine's restart and before it publishes its address leaves
the others there, where the engine's next restart (an exception raised into their training threads) is not
delivered, and no abort ends the wait (there is no group yet to abort). So a rank first says it has arrived and
waits for the others in Python, in slices of a second (``ffstate.job.wait_for``), where the restart lands; only when all
have arrived does it make the group, and with a short timeout for its setup alone: a rank that dies in the
milliseconds between its arrival and its address costs the others ``CONNECT_TIMEOUT``, not 30 minutes. The group's
own timeout is then set for its collectives.
"""

from __future__ import annotations

import datetime
import logging

import torch.distributed as dist

from ffstate.inprocess.abort import new_sockets, open_sockets
from ffstate.job import wait_for

log = logging.getLogger("ffstate.inprocess")

PG_TIMEOUT = datetime.timedelta(minutes=30)  # a collective's own timeout: the abort, not this, ends a failed one
# The group's setup once every rank has arrived: each connects to every other (gloo's full mesh). Generous for that,
# and short beside PG_TIMEOUT: what a rank lost in the instant after its arrival costs the others.
CONNECT_TIMEOUT = datetime.timedelta(minutes=2)
# The arrival's wait in slices of at most this (seconds): a restart raised meanwhile lands within one. Ranks arrive
# within milliseconds of each other unless one was lost, so the slices that end empty (torch logs each) are few.
ARRIVAL_SLICE = 1.0


def make_group(backend: str, store: dist.Store, iteration: int, rank: int, world: int) -> dict[int, str]:
    """The default process group of the engine's ``iteration``, on a prefix of ``store`` of its own, once every one
    of its ``world`` ranks has arrived (at most ``PG_TIMEOUT``); returns the sockets it opened (for the abort).

    Raises:
        DistStoreError: a rank did not arrive within ``PG_TIMEOUT`` (the message names it); or gloo's setup failed.
    """
    if dist.is_initialized():  # an earlier entry's, made just as its restart came: the abort did not know it yet
        log.warning("rank %d: the process group of an earlier entry is still here (its restart came as it was made): "
                    "destroyed before this entry's", rank)
        dist.destroy_process_group()
    prefixed = dist.PrefixStore(f"ffstate-attempt-{iteration}", store)
    arrive(prefixed, rank, world, PG_TIMEOUT.total_seconds())
    # torch's own way to change a group's timeout after its setup (a private function in 2.13; gloo's collectives
    # follow it, checked); without it the setup keeps the collectives' timeout.
    set_timeout = getattr(dist.distributed_c10d, "_set_pg_timeout", None)
    before = open_sockets()
    dist.init_process_group(backend, store=prefixed, rank=rank, world_size=world,
                            timeout=CONNECT_TIMEOUT if set_timeout else PG_TIMEOUT)
    if set_timeout:
        set_timeout(PG_TIMEOUT)  # the collectives': the setup's short one was for it alone
    return new_sockets(before)


def arrive(store: dist.Store, rank: int, world: int, timeout: float) -> None:
    """Says that ``rank`` has arrived and waits until all ``world`` ranks have, at most ``timeout`` seconds.

    Raises:
        DistStoreError: some had not (named) at the timeout.
    """
    store.set(f"ffstate-arrived/{rank}", b"1")
    wait_for(store, [f"ffstate-arrived/{r}" for r in range(world)], timeout,
             f"rank {rank}: the ranks' arrival at the process group", longest=ARRIVAL_SLICE)
