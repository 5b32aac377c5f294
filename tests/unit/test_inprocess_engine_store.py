"""The in-process engine's store (``ffstate.inprocess.engine.EngineStore``): the termination barrier gets the ranks
that the extension's siblings' heartbeat check passes it as the store's bytes (``get_initial_ranks``: a
``multi_get``) as numbers, and a later barrier call, as every process makes at its exit, still parses them. With
the extension's own store the barrier records ``b'4'``, and that call and every later one raise ``ValueError``. The
whole job, a rank lost with its engine monitor, is ``tests/system/test_inprocess.py``'s."""

import datetime

import pytest

pytest.importorskip("nvidia_resiliency_ext.inprocess", reason="the in-process mode's engine (nvidia-resiliency-ext) "
                    "is not installed")
from nvidia_resiliency_ext.inprocess.store import PrefixStore, TCPStore  # noqa: E402

from ffstate.bench._report import free_ports  # noqa: E402
from ffstate.inprocess.engine import EngineStore  # noqa: E402

ARRIVED = "inprocess_barrier_prefix:reentrant_barrier:termination_barrier:arrived"


@pytest.mark.parametrize("store_class", [EngineStore, TCPStore])
def test_ranks_read_back_as_bytes_reach_the_termination_barrier_as_numbers(monkeypatch, store_class):
    monkeypatch.setenv("RANK", "0")  # the extension's store is hosted by rank 0
    base = store_class(host_name="127.0.0.1", port=free_ports(1), world_size=1)
    siblings = PrefixStore(3, base)  # what the heartbeat check holds: an iteration's prefix over the base store
    siblings.set_initial_rank(4, 4)
    lost = siblings.get_initial_ranks([4])
    assert lost == [b"4"]  # the extension's own reading, unchanged
    if store_class is TCPStore:  # the extension's store as it is: the barrier records b'4' and cannot parse it,
        with pytest.raises(ValueError, match="b'4'"):  # here as at every process's exit after it
            siblings.base_store.termination_barrier(ranks=lost, rendezvous_count=2, timeout=datetime.timedelta(0))
        assert base.get(ARRIVED) == b"b'4',"
        with pytest.raises(ValueError, match="b'4'"):
            base.termination_barrier(ranks=[0], rendezvous_count=2, timeout=datetime.timedelta(seconds=1))
        return
    siblings.base_store.termination_barrier(ranks=lost, rendezvous_count=2, timeout=datetime.timedelta(0))
    assert base.get(ARRIVED) == b"4,"
    base.termination_barrier(ranks=[0], rendezvous_count=2, timeout=datetime.timedelta(seconds=1))  # all arrived


def test_a_launch_meeting_an_earlier_launchs_engine_keys_is_told_so(monkeypatch):
    """The stores' host of a launch whose processes were killed stays a minute: a launch on the same port within it
    found the earlier one's arrivals in the engine's initial barrier, and every process failed with the extension's
    ``BarrierOverflow`` (a count of ranks). It says what happened, and what to do."""
    from ffstate.errors import FFStateError

    monkeypatch.setenv("RANK", "0")
    store = EngineStore(host_name="127.0.0.1", port=free_ports(1), world_size=1)
    store.initial_barrier(ranks=[0], rendezvous_count=1, timeout=datetime.timedelta(seconds=5))  # the first launch
    with pytest.raises(FFStateError, match="an earlier launch's engine keys .* launch again once it has gone"):
        store.initial_barrier(ranks=[0], rendezvous_count=1, timeout=datetime.timedelta(seconds=5))
