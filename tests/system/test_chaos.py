"""The chaos run, bounded: one torchrun job (4 ranks as 2 simulated nodes, DDP + ZeRO) under a seeded schedule of
failures of every kind (a rank at a random point of its step, a whole node, a daemon alone, two in a row), ending
bit-identical to the run without failures, with nothing lost by a worker's failure, the memory the daemons account
back to its level after each recovery, and nothing left behind. `ffstate bench chaos` runs the long one (20+).

Seed 0's schedule: a daemon killed while training goes on (its ranks restart one and re-attach), then a rank at a
random time into a step (restored from the slots the new daemon re-seeded, nothing lost), then a whole node three
steps after that rank's restart (restored from the other node), then a rank inside its commit and another right
after the group's restore."""

import json
import statistics

import pytest

from ffstate import Config
from ffstate.bench import chaos

pytestmark = pytest.mark.timeout(900)
FAILURES, SEED, GAP = 4, 0, 3


def test_a_seeded_schedule_of_every_kind_of_failure_ends_bit_identical_and_leaves_nothing(tmp_path):
    result = chaos.run(FAILURES, SEED, GAP, timeout=600, work=tmp_path)
    result["summary"] = chaos.summary(result)
    print(chaos.report(result))  # the table, in the test's log
    rows = result["failures"]
    assert [r["kind"] for r in rows] == ["daemon", "rank", "node", "double"]
    assert all(r["hit"] for r in rows), [r for r in rows if not r["hit"]]
    assert result["bit_identical"], result["differences"]
    for r in rows:
        if r["kind"] in ("rank", "double"):  # a worker's failure costs no step: its slots hold the last commit,
            # but a kill between the step's all-reduce and the end of its commit (mid-commit, or a timer that landed
            # there) redoes that step: the other ranks may have committed it, the killed rank never did
            late = r["phase"] == "mid-commit" or r.get("landed") == "update"
            assert r["steps_lost"] in ((0, 1) if late else (0,)), r
        elif r["kind"] == "node":  # from the other node's replicas, within the lag bound (max_lag)
            assert r["steps_lost"] is not None and r["steps_lost"] <= Config().max_lag, r
        assert r["downtime"] is not None, r
    events = [json.loads(line) for line in (tmp_path / "with-failures" / "events.jsonl").read_text().splitlines()]
    # The daemon killed alone: its node's two ranks found it gone, started one and re-attached, training on.
    daemon = rows[0]
    assert not daemon["restarted"] and daemon["steps_lost"] == 0, daemon  # nobody waited for it to come back
    assert {e["rank"] for e in events if e["event"] == "daemon-restarted"} == {2 * daemon["node"], 2 * daemon["node"] + 1}
    # The node lost: every rank restored one version (I3) from the surviving node, its slots or its daemon (the
    # lost node's ranks from the replicas there; its own ranks stepped back through the deltas it keeps).
    lost = rows[2]
    restored = [e for e in events if e["event"] == "restored" and e["attempt"] == lost["attempt"]]
    assert sorted(e["rank"] for e in restored) == [0, 1, 2, 3] and len({e["version"] for e in restored}) == 1
    survivor = 1 - lost["node"]
    for e in restored:
        if e["rank"] // 2 == survivor:
            assert e["source"] in (f"local slots of node{survivor}", result["daemons"][survivor]), e
        else:
            assert e["source"] == result["daemons"][survivor], e
    # ZeRO: the parameters are split 4 ways (razor), each rank's optimizer shard is replicated whole.
    finished = [e for e in events if e["event"] == "finished"]
    assert sorted(e["rank"] for e in finished) == [0, 1, 2, 3]
    for e in finished:
        assert e["razor_group"] == [0, 1, 2, 3] and e["shard_bytes"] < 0.6 * e["state_bytes"], e
    # The lost node's ranks took from each other member's shard its part of the parameters alone, not its optimizer
    # shard too (a whole shard each: about twice the rank's state in all, here).
    state_bytes = {e["rank"]: e["state_bytes"] for e in finished}
    for e in restored:
        if e["rank"] // 2 == lost["node"]:
            assert sorted(map(int, e["parts_from"])) == sorted({0, 1, 2, 3} - {e["rank"]}), e
            assert e["bytes"] < 1.1 * state_bytes[e["rank"]], (e, state_bytes)
    # After the job: every daemon exited with nothing accounted, no slot left in /dev/shm, no daemon left.
    assert result["accounted_at_exit"] == [0] * chaos.NODES, result["accounted_at_exit"]  # each node's last daemon
    assert result["shm_left"] == [] and result["daemons_left"] == []
    # While it ran, each daemon's accounted bytes stayed at their level: never above twice the median, a
    # failure's leftovers (a staged push of a dead sender, a dead node's replicas) given back.
    for node, m in result["summary"]["memory"].items():
        acc = [s["accounted"] for s in result["samples"] if s["node"] == node and s["accounted"]]
        assert acc and max(acc) <= 2 * statistics.median(acc), (node, m)

