"""Jobs that change shape, under real torchrun on one machine (simulated nodes), for FSDP2 and DDP:

- FSDP2: 4 ranks, node 1 SIGKILLed (its ranks and its daemon) -> 3 ranks on node 0 (shrink, from node 0's slots and
  the replicas it held of node 1's ranks; uneven shards) -> every rank SIGKILLed -> 4 ranks (grow 3 -> 4).
- DDP: node 1 lost -> a per-rank extra without a hook is refused by name and loses nothing (the next launch resumes
  from the same copies) -> 2 ranks; the persistent tier's versions follow the job's shape; the whole job lost after
  the resize grows back (2 -> 3) from the persisted versions alone.

At every resize each new rank compares every tensor of what ffstate restored, bit for bit, with what DCP's own
reader loads at the new world size from the job's consolidated copy of v* (tests/procs/elastic.py), and the data
position (an ElasticSampler) goes on from the same global sample. DDP with a ZeRO-sharded optimizer is resized
(4 -> 2 -> 4, and a drain) across two network namespaces under `torchrun --nnodes 1:2` in test_elastic_torchrun.py.
"""

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from ffstate import persist
from ffstate.bench._report import free_ports
from ffstate.client import Client
from helpers import daemons_torch, kill_daemons

pytestmark = pytest.mark.timeout(900)
ROOT = Path(__file__).resolve().parents[2]
WORKER = ROOT / "tests" / "procs" / "elastic.py"


class Job:
    """One job id launched again and again at different world sizes on this machine."""

    def __init__(self, tmp: Path, parallel: str, persist_dir: Path | None = None, *extra: str):
        self.tmp, self.parallel, self.out, self.extra = tmp, parallel, tmp / "out", extra
        self.env = {**os.environ, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "FFSTATE_JOB_ID": f"el-{uuid.uuid4().hex[:6]}",
                    "FFSTATE_TOKEN": uuid.uuid4().hex, "FFSTATE_BASE_PORT": str(free_ports(2)), "OMP_NUM_THREADS": "1",
                    "TMPDIR": str(tmp)}
        if persist_dir is not None:  # every version, flushed at the daemon's priority (the suite keeps the cores busy)
            self.env.update(FFSTATE_PERSIST_DIR=str(persist_dir), FFSTATE_PERSIST_EVERY="1", FFSTATE_PERSIST_KEEP="3",
                            FFSTATE_PERSIST_NICE="0")
        self.job = self.env["FFSTATE_JOB_ID"]

    def run(self, world: int, nodes: int, steps: int, *extra: str, ok: bool = True) -> subprocess.CompletedProcess:
        args = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world),
                "--max-restarts", "0", str(WORKER), "--out", str(self.out), "--parallel", self.parallel,
                "--steps", str(steps), "--check", *self.extra, *extra]
        proc = subprocess.run(args, capture_output=True, text=True, timeout=400,
                              env={**self.env, "FFSTATE_SIMULATED_NODES": str(nodes)})
        assert (proc.returncode == 0) == ok, proc.stdout[-3000:] + proc.stderr[-4000:]
        return proc

    def checks(self, world: int) -> list[dict]:
        """The verdicts of the newest resize to ``world`` ranks, one per rank."""
        files = sorted(self.out.glob(f"check-v*-w{world}-rank*.json"), key=lambda p: p.stat().st_mtime)[-world:]
        got = [json.loads(p.read_text()) for p in files]
        assert len(got) == world and len({g["v"] for g in got}) == 1, got
        return got

    def daemons_without_torch(self) -> bool:
        """Whether the job's daemons are running, none with torch loaded."""
        got = daemons_torch((self.tmp / f"ffstate-{self.job}").glob("daemon-*.pid"))
        assert got, "no daemon of the job is running"
        return not any(got.values())

    def stop_daemons(self) -> None:
        kill_daemons((self.tmp / f"ffstate-{self.job}").glob("daemon-*.pid"))


def resized(job: Job, world: int, old: int, lost_at_most: int) -> dict:
    """Every rank of the resize to ``world`` restored exactly what DCP loads from the reference of v*."""
    got = job.checks(world)
    for g in got:
        assert g["from_world"] == old and g["world"] == world, g
        assert g["mismatches"] == [] and g["tensors"] > 0, g
        assert g["lost"] <= lost_at_most, g
        # one global data position, as many samples as the steps took in this epoch, as many epochs
        assert g["position"] == g["samples"] and g["epoch"] == g["epochs"], g
    return got[0]


def test_fsdp2_shrinks_to_an_uneven_size_and_grows_back_restoring_what_dcp_loads(tmp_path):
    """FSDP2: 4 -> (node lost) 3 (every DTensor re-sliced, uneven shards; node 1's ranks from their replicas) -> 4
    (grow from the 3 ranks' copies on node 0, uneven too)."""
    from ffstate import Config

    job = Job(tmp_path, "fsdp2")
    try:
        job.run(4, 2, 6, "--kill-node-after", "4", ok=False)
        job.run(3, 1, 8, "--kill-all-after", "8", ok=False)
        shrink = resized(job, 3, 4, Config().max_lag)  # node 1's ranks from their replicas: within the lag
        job.run(4, 2, 11, "--kill-all-after", "11", ok=False)
        grow = resized(job, 4, 3, 0)  # all from node 0's slots
        assert grow["v"] == 8
        with Client(f"127.0.0.1:{job.env['FFSTATE_BASE_PORT']}", job.env["FFSTATE_TOKEN"]) as node0:
            shapes = {s.shard.world_size for s in node0.inventory(job.job).shards}
        assert shapes == {4}, shapes  # the 3-rank copies went once every 4-rank one had a replicated version
        assert job.daemons_without_torch()  # served three shapes' restores, still without torch
    finally:
        job.stop_daemons()
    print("fsdp2", [(s["from_world"], s["world"], s["v"], s["lost"], s["tensors"]) for s in (shrink, grow)])


def test_ddp_resizes_refuse_a_per_rank_extra_follow_the_persistent_tier_and_grow_from_it_after_the_whole_job_lost(
        tmp_path):
    """DDP (the razor's parts put back together): 4 -> (node lost) a refused relaunch -> 2 ranks, the persisted
    versions in the new shape, then the whole job lost and grown back to 3 ranks from the persisted versions alone
    (FSDP2 above; ZeRO in test_elastic_torchrun.py)."""
    from ffstate import Config

    store = tmp_path / "persist"
    job = Job(tmp_path, "ddp", store, "--per-rank-extra", "hooked")
    try:
        job.run(4, 2, 6, "--kill-node-after", "4", ok=False)
        proc = job.run(2, 1, 8, "--per-rank-extra", "plain", ok=False)  # its author has not written the hook yet
        text = proc.stdout + proc.stderr
        assert "cannot resume at world size 2 from copies made at 4" in text, text[-3000:]
        assert "extra/per_rank (PerRank) holds per-rank state" in text and "reshard_state_dict" in text
        assert not list(job.out.glob("check-v*-w2-*.json"))  # refused before anything was loaded
        assert job.daemons_without_torch()  # node 0's persisted every version (its flushing process loads torch)
        job.run(2, 1, 9)  # the same copies, untouched by the refusal; a clean end
        shrink = resized(job, 2, 4, Config().max_lag)
        shapes = persist.worlds(store / job.job)  # the versions after the resize are of its shape
        assert shapes.get(2, 0) == 9 and all(v <= shrink["v"] for w, v in shapes.items() if w != 2), shapes
        job.stop_daemons()  # the whole job lost (its clean end dropped every copy in memory): the persisted ones only
        job.run(3, 1, 12)
        from_disk = resized(job, 3, 2, 0)
        assert from_disk["v"] == 9
    finally:
        job.stop_daemons()
    events = [json.loads(line) for line in (tmp_path / f"ffstate-{job.job}" / "events.jsonl").read_text().splitlines()]
    last = [e for e in events if e["event"] == "restored" and e.get("from_world") == 2]
    assert len(last) == 3 and all(src.startswith("persisted") for e in last for src in e["parts_from"].values()), last
    print("ddp", [(s["from_world"], s["world"], s["v"], s["lost"]) for s in (shrink, from_disk)])


@pytest.mark.parametrize("relaunch", [1, 4])
def test_a_node_lost_right_after_a_resize_resumes_from_the_newest_shape_every_rank_can_restore(tmp_path, relaunch):
    """4 ranks (every rank killed after step 6, the daemons live on) -> 2 ranks, resized from the 4 ranks' copies;
    node 1 (rank 1 and its daemon) lost right after its first step at 2, and with it the only copy of that step of
    rank 1 (the one replica dropped here, as if it had not arrived yet). The 2 ranks' copies are the newest seen
    (step 7) but rank 1 has none. Relaunched at 1 rank, the job resumes from the 4 ranks' copies, still kept (a
    resize from the older shape), not stops on the newest; at 4 ranks, from its own shape's copies, and the 2 ranks'
    copies, which no rank can restore from, go once the 4 ranks' new ones are safe."""
    from ffstate import Config

    job = Job(tmp_path, "ddp")
    address = f"127.0.0.1:{job.env['FFSTATE_BASE_PORT']}"
    try:
        job.run(4, 2, 20, "--kill-all-after", "6", ok=False)
        job.run(2, 2, 20, "--kill-node-after", "7", ok=False)
        assert resized(job, 2, 4, 0)["v"] == 6  # from every rank's slots
        with Client(address, job.env["FFSTATE_TOKEN"]) as node0:
            node0.drop(job.job, 1, 2)  # rank 1's step 7 at 2 ranks: now nowhere
            held = {(s.shard.world_size, s.shard.rank): max(s.versions, default=0)
                    for s in node0.inventory(job.job).shards}
        assert held.get((2, 0)) == 7 and (2, 1) not in held, held
        # the 4 ranks' copies are dropped only once every rank at 2 has a replicated version past v*: not yet
        assert all(held.get((4, r), 0) >= 6 - Config().max_lag for r in range(4)), held
        proc = job.run(relaunch, relaunch // 2 or 1, 12, "--kill-all-after", "12", ok=False)
        text = proc.stdout + proc.stderr
        assert "the copies made at world size 2 (seen up to step 7) give no version past" in text, text[-3000:]
        events = [json.loads(line) for line in (tmp_path / f"ffstate-{job.job}" / "events.jsonl").read_text()
                  .splitlines()]
        restored = [e for e in events if e["event"] == "restored" and e.get("world") == relaunch]
        if relaunch == 1:
            older = resized(job, 1, 4, Config().max_lag + 1)  # node 1's ranks from their replicas, counted from 7
            assert 6 - Config().max_lag <= older["v"] <= 6, older
        else:
            assert len(restored) == 4 and not any(e.get("from_world") for e in restored), restored
            assert {e["version"] for e in restored} <= set(range(6 - Config().max_lag, 7)), restored
            assert all(e["steps_lost"] == 7 - e["version"] for e in restored), restored  # counted from step 7
        with Client(address, job.env["FFSTATE_TOKEN"]) as node0:
            shapes = {s.shard.world_size for s in node0.inventory(job.job).shards}
        assert shapes == {relaunch}, shapes  # both older shapes' copies went once the new ones were safe
    finally:
        job.stop_daemons()


def test_a_resize_with_an_old_rank_s_copies_all_lost_names_it(tmp_path):
    """No replicas (Config.replicas 0): node 1's loss takes the only copies of ranks 2 and 3. The job relaunched at 2
    ranks refuses to start, every rank saying which old ranks have no copy anywhere, rather than start over."""
    job = Job(tmp_path, "ddp")
    job.env["FFSTATE_REPLICAS"] = "0"
    try:
        job.run(4, 2, 4, "--kill-node-after", "3", ok=False)
        proc = job.run(2, 1, 6, ok=False)
    finally:
        job.stop_daemons()
    text = proc.stdout + proc.stderr
    for r in (2, 3):
        assert f"no copy of old rank {r}'s state (world size 4)" in text, text[-3000:]
    assert "no copy of old rank 0's" not in text and not list(job.out.glob("check-*.json"))
