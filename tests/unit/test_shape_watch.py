"""After a resize, once every rank of the new world has a copy past v*, a node's daemon keeps only the new world's
copies: every older world size's go, not only the one resumed from (4 -> 2, a failure before 2's copies were
safe, then 2 -> 3, left 4's behind). A real daemon; the job's store stood in for by its marks."""

from types import SimpleNamespace

from ffstate import codec
from ffstate.elastic.worker import ShapeWatch
from helpers import train_states


def test_every_older_world_s_copies_are_dropped_once_the_new_one_s_are_safe(daemons):
    d = daemons.start()
    packed = codec.encode_snapshot(codec.pack(next(iter(train_states(1)))))
    with d.client() as c:
        for world in (4, 2, 3):
            for rank in range(2):
                c.push_and_commit("j", rank, world, 1, packed)
        marks = set()
        job = SimpleNamespace(job="j", rank=0, world=3, topology=SimpleNamespace(first_on_node=True, node_id="node0"),
                              mark=marks.add, all_marked=lambda name: name in marks)
        watch = ShapeWatch(job, lambda: c, pause=None)
        watch.resized(2, 5)
        watch.after_commit(6, None, 5)  # nothing past v* copied yet: all kept
        assert sorted({s.shard.world_size for s in c.inventory("j").shards}) == [2, 3, 4]
        watch.after_commit(7, None, 6)
        assert {s.shard.world_size for s in c.inventory("j").shards} == {3} and watch.old_world == 0


def test_a_drop_the_daemon_failed_is_tried_again_at_a_later_commit(daemons, monkeypatch, caplog):
    """A deadline under load, or a daemon restarting: the old world's copies are not left in the daemon's memory for
    the rest of the job (it gave up after one try, and said nothing would follow)."""
    import time

    from ffstate.elastic import worker
    from ffstate.errors import ReplicaError

    d = daemons.start()
    packed = codec.encode_snapshot(codec.pack(next(iter(train_states(1)))))
    with d.client() as c:
        for world in (4, 2):
            c.push_and_commit("j", 0, world, 1, packed)
        drop, fails = c.drop, [ReplicaError("deadline exceeded", "DEADLINE_EXCEEDED")]

        def failing(*a, **kw):
            if fails:
                raise fails.pop()
            return drop(*a, **kw)

        monkeypatch.setattr(c, "drop", failing)
        clock = [1000.0]
        now = SimpleNamespace(monotonic=lambda: clock[0], time=time.time, sleep=time.sleep)
        monkeypatch.setattr(worker, "time", now)  # the module's clock alone
        job = SimpleNamespace(job="j", rank=0, world=2, topology=SimpleNamespace(first_on_node=True, node_id="node0"),
                              mark=lambda name: None, all_marked=lambda name: True)
        watch = ShapeWatch(job, lambda: c, pause=None)
        watch.resized(4, 5)
        with caplog.at_level("WARNING", logger="ffstate.elastic"):
            watch.after_commit(6, None, 6)  # the drop fails: kept for later
        assert "could not drop the copies of world sizes other than 2 (try 1)" in caplog.text, caplog.text
        assert watch.others and {s.shard.world_size for s in c.inventory("j").shards} == {2, 4}
        clock[0] += 1.0
        watch.after_commit(7, None, 7)  # within its back-off (2 s): not tried
        assert {s.shard.world_size for s in c.inventory("j").shards} == {2, 4}
        clock[0] += 1.5
        watch.after_commit(8, None, 8)
        assert {s.shard.world_size for s in c.inventory("j").shards} == {2} and not watch.others
