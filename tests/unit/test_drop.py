"""``ffstate drop``'s judgement of whether a job is still active on a daemon, from its Inventory rows."""

from ffstate._proto import replica_pb2 as pb
from ffstate.drop import activity

NOW = 1_000_000.0


def row(local: bool, updated: float = 0.0, since: float | None = None, paused: bool = False, nbytes: int = 10):
    s = pb.ShardInfo(shard=pb.ShardKey(job_id="j", rank=0, world_size=2), local=local, bytes=nbytes,
                     last_update_unix=updated)
    if since is not None:
        s.watch.CopyFrom(pb.WatchInfo(since_seconds=since, paused=paused))
    return s


def test_the_newest_of_commits_and_pushes_is_the_job_s_last_activity():
    got = activity([row(False, updated=NOW - 900), row(True, updated=NOW - 800, since=30.0)], NOW)
    assert (got.shards, got.nbytes, got.last_active) == (2, 20, NOW - 30.0)
    assert activity([row(False, updated=NOW - 900)], NOW).last_active == NOW - 900


def test_a_paused_rank_is_active_now_and_a_job_with_nothing_known_is_unknown():
    assert activity([row(True, since=0.0, paused=True), row(False, updated=NOW - 5000)], NOW).last_active == NOW
    assert activity([row(True)], NOW).last_active is None  # no watch, nothing pushed: nothing says
    assert activity([], NOW).shards == 0
