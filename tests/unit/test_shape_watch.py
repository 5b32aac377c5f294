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
