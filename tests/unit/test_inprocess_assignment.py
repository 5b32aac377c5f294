"""ffstate/inprocess/assignment.py: which process holds which rank as processes die (pure code; the engine's runs with
real processes are in tests/system/test_inprocess.py)."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ffstate.inprocess.assignment import Assignment, Layout, NoSpareLeft


def check(a: Assignment) -> None:
    """Every rank held by a live process of the machine its node runs on; no process holds two ranks; no machine
    runs two nodes."""
    per, live = a.layout.per_node, set(a.alive)
    assert len(set(a.holder)) == len(a.holder) == a.world == len(a.node_machine) * per
    assert len(set(a.node_machine)) == len(a.node_machine) >= max(1, a.layout.min_nodes)
    for rank, p in enumerate(a.holder):
        assert p in live and a.machine(p) == a.node_machine[rank // per], (rank, p, a)


def test_the_launch_layout_and_a_first_failure_on_one_node():
    a = Assignment.start(Layout(nodes=2, per_node=2, spares=1, spare_nodes=1))
    assert a.holder == [0, 1, 3, 4] and a.layout.processes == 9 and a.rank_of(2) is None
    a.lose({1})  # rank 1: node 0's spare (process 2) takes it
    assert a.holder == [0, 2, 3, 4] and a.node_machine == [0, 1]
    a.lose({3, 4, 5})  # node 1 with its spare: it moves to the spare machine
    assert a.holder == [0, 2, 6, 7] and a.node_machine == [0, 2] and a.rank_of(8) is None
    check(a)
    with pytest.raises(NoSpareLeft, match="node 0 lost rank"):
        a.lose({0})  # node 0 has no spare left, and the spare machine runs node 1


def test_a_node_without_its_spare_moves_and_its_survivors_become_spares():
    a = Assignment.start(Layout(nodes=2, per_node=2, spares=0, spare_nodes=1))
    a.lose({0})  # no spare on machine 0: node 0 moves whole to machine 2; process 1 idles from now on
    assert a.node_machine == [2, 1] and a.holder[:2] == [4, 5] and a.rank_of(1) is None
    check(a)


def test_no_spare_left_the_node_leaves_when_the_job_may_shrink():
    a = Assignment.start(Layout(nodes=3, per_node=2, min_nodes=2))
    with pytest.raises(NoSpareLeft, match="may not shrink"):
        Assignment.start(Layout(nodes=2, per_node=2)).lose({1})
    a.lose({3})  # node 1 leaves; node 2's ranks are 2 and 3 from now on; process 2 idles
    assert a.holder == [0, 1, 4, 5] and a.node_machine == [0, 2] and a.world == 4 and a.rank_of(2) is None
    check(a)
    with pytest.raises(NoSpareLeft, match="below 2 node"):
        a.lose({0})


@settings(max_examples=300, deadline=None)
@given(nodes=st.integers(1, 3), per=st.integers(1, 3), spares=st.integers(0, 2), spare_nodes=st.integers(0, 2),
       data=st.data())
def test_any_sequence_of_failures_keeps_ranks_on_their_nodes_until_no_spare_is_left(nodes, per, spares, spare_nodes,
                                                                                   data):
    min_nodes = data.draw(st.integers(0, nodes))
    a = Assignment.start(Layout(nodes, per, spares, spare_nodes, min_nodes))
    check(a)
    for _ in range(data.draw(st.integers(1, 6))):
        if not a.alive:
            break
        lost = set(data.draw(st.lists(st.sampled_from(a.alive), min_size=1, max_size=3)))
        before = a.copy()
        try:
            a.lose(lost)
        except NoSpareLeft:
            # Truly none: some node lost a rank, has fewer idle live processes on its machine than ranks lost, and no
            # machine without a node has a node's worth of live processes.
            live = set(before.alive) - lost
            busy = set(before.holder)
            free = [m for m in range(nodes + spare_nodes) if m not in before.node_machine
                    and sum(1 for p in live if before.machine(p) == m) >= per]
            short = [n for n, m in enumerate(before.node_machine)
                     if (dead := sum(1 for r in range(n * per, (n + 1) * per) if before.holder[r] in lost))
                     and sum(1 for p in live - busy if before.machine(p) == m) < dead]
            leaving = len(short) - len(free)
            assert short and leaving > 0, (before, lost)
            assert not min_nodes or len(before.node_machine) - leaving < min_nodes, (before, lost)  # may not shrink
            return
        check(a)
        if len(a.node_machine) < len(before.node_machine):  # a shrink: the nodes that stayed kept their processes
            for new, m in enumerate(a.node_machine):
                if m not in before.node_machine:
                    continue  # a node that moved to a spare machine
                old = before.node_machine.index(m)
                for j in range(per):
                    if (p := before.holder[old * per + j]) not in lost:
                        assert a.holder[new * per + j] == p
            continue
        for rank, p in enumerate(before.holder):  # a rank whose process lives, and whose node stayed, keeps it
            if p not in lost and before.node_machine[rank // per] == a.node_machine[rank // per]:
                assert a.holder[rank] == p


def test_layouts_that_do_not_fit_are_refused_with_the_numbers():
    assert Layout.of(9, nodes=2, spares=1, spare_nodes=1) == Layout(2, 2, 1, 1)
    with pytest.raises(ValueError, match="do not divide evenly"):
        Layout.of(10, nodes=2, spares=1, spare_nodes=1)
    with pytest.raises(ValueError, match="no training rank"):
        Layout.of(4, nodes=2, spares=2, spare_nodes=0)
