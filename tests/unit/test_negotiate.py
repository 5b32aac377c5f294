"""How the ranks agree on v* (``recovery.negotiate``), here for one rank (no store to exchange through): what
each failure to agree says."""

from types import SimpleNamespace

import pytest

from ffstate import recovery
from ffstate.errors import FFStateError

ONE_RANK = SimpleNamespace(store=None, world=1)


def test_the_newest_version_that_passes_its_check_is_chosen():
    v, last, _ = recovery.negotiate(ONE_RANK, {4, 8}, seen=8, live=set(), check=lambda versions: set(versions[1:]))
    assert (v, last) == (4, 8)


def test_every_persisted_version_refused_by_its_check_is_blamed_on_the_disk_not_on_lost_nodes():
    with pytest.raises(FFStateError, match=r"persisted versions \[4, 8\] failed their checks") as e:
        recovery.negotiate(ONE_RANK, {4, 8}, seen=8, live=set(), check=lambda versions: set())
    assert "Raise Config.replicas" not in str(e.value) and "lost together" not in str(e.value)


def test_copies_lost_with_their_nodes_are_said_so():
    with pytest.raises(FFStateError, match="lost together.*Raise Config.replicas"):
        recovery.negotiate(ONE_RANK, set(), missing=["rank 1's shard: no live copy"], seen=8)
