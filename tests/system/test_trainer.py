"""ffstate.replicate around real training: torchrun with 2 ranks as 2 simulated nodes (DDP + ZeRO AdamW,
the demo's worker; 4 ranks in the chaos test), real SIGKILLs of a rank and of a whole node, and a single process;
each run ends bit-identical to the same run without failures. A daemon killed while training goes on, a node lost right after a
rank's restart, and two failures in a row are in the chaos run's test (test_chaos.py); FSDP2 in test_persist.py."""

import json
import os
import re
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import torch

from ffstate import FFStateError, replicate
from ffstate.bench import chaos
from ffstate.bench._report import free_ports
from ffstate.testing.bitwise import compare_runs
from helpers import assert_bitwise_equal, kill_daemons

pytestmark = pytest.mark.timeout(600)
STEPS = 12
WORLD = 2  # ranks, one per simulated node: the properties here need no more, and a 2-core machine runs them twice as fast
ROOT = Path(__file__).resolve().parents[2]


def env_for(tmp: Path, job: str) -> dict:
    return {**os.environ, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "FFSTATE_SIMULATED_NODES": "2",
            "FFSTATE_JOB_ID": job, "FFSTATE_TOKEN": uuid.uuid4().hex, "FFSTATE_BASE_PORT": str(free_ports(2)),
            "OMP_NUM_THREADS": "1", "TMPDIR": str(tmp)}


def torchrun(out: Path, env: dict, *extra: str, ok: bool = True, restarts: int = 3) -> subprocess.CompletedProcess:
    args = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(WORLD), "--max-restarts",
            str(restarts), "-m", "ffstate.demo.worker", "--out", str(out), "--steps", str(STEPS), *extra]
    proc = subprocess.run(args, capture_output=True, text=True, env=env, timeout=500)
    if ok:
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def job_events(tmp: Path, job: str, kind: str) -> list[dict]:
    path = tmp / f"ffstate-{job}" / "events.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    return [e for e in rows if e["event"] == kind]


def restores(tmp: Path, job: str) -> list[dict]:
    path = tmp / f"ffstate-{job}" / "events.jsonl"
    events = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    return [e for e in events if e["event"] == "restored"]


def test_ranks_killed_after_a_commit_mid_step_and_mid_commit_resume_bit_exact(tmp_path):
    """Three kills in one job (the demo's worker, DDP + ZeRO): right after its commit a rank loses nothing; in the
    middle of a step it redoes that step, which it had not committed; inside its commit (its slot half written,
    never published) the job goes back one step. Every restore comes from the nodes' own slots, and the run ends
    bit-identical to the one without failures."""
    schedule = [{"kind": "rank", "step": 4, "rank": 1, "phase": "after-commit"},
                {"kind": "rank", "step": 7, "rank": 0, "phase": "mid-step"},
                {"kind": "rank", "step": 10, "rank": 1, "phase": "mid-commit"}]
    result = chaos.run_schedule(schedule, STEPS, timeout=500, work=tmp_path, world=WORLD)
    assert result["bit_identical"], result["differences"]
    after, mid_step, mid_commit = result["failures"]
    assert after["v_star"] == 4 and after["steps_lost"] == 0, after
    assert mid_step["v_star"] == 6 and mid_step["steps_lost"] == 0, mid_step  # step 7 was never committed
    assert mid_commit["v_star"] == 9 and mid_commit["steps_lost"] == 1, mid_commit  # the others committed 10
    events = [json.loads(line) for line in (tmp_path / "with-failures" / "events.jsonl").read_text().splitlines()]
    restored = [e for e in events if e["event"] == "restored"]
    assert len(restored) == 3 * WORLD and all("local slots" in e["source"] for e in restored)  # memory copies
    finished = [e for e in events if e["event"] == "finished"]
    assert sorted(e["rank"] for e in finished) == list(range(WORLD))
    assert {e["global_committed"] for e in finished} == {STEPS}  # every rank's holders had the last step
    assert "profiled" not in (tmp_path / "with-failures.log").read_text()  # DDP marks its collectives


def test_manual_data_parallel_gets_a_profiled_timeline_and_resumes_bit_exact(tmp_path):
    """No DDP, no FSDP2: the gradients are all-reduced by hand, so nothing marks the collectives. Each worker
    profiles 3 steps after its second commit and writes the timeline it found into its slot header; after a
    rank is killed the restarted workers keep it; `ffstate status` shows it; the run ends bit-identical."""
    ref = tmp_path / "ref"
    torchrun(ref / "out", env_for(ref, "refman"), "--parallel", "manual", "--no-ffstate")
    job = f"t{uuid.uuid4().hex[:6]}"
    proc = torchrun(tmp_path / "out", env_for(tmp_path, job), "--parallel", "manual", "--kill-rank", "1",
                    "--kill-step", "7", "--status-step", "10")
    out = proc.stdout + proc.stderr
    profiled = re.findall(r"rank (\d): profiled 3 steps for the scheduler .*collectives a step: (\d+), on the wire", out)
    assert sorted(int(r) for r, _ in profiled) == list(range(WORLD)) and all(int(n) >= 1 for _, n in profiled), \
        out[-3000:]
    assert len(re.findall(r"keeps the timeline profiled before the restart", out)) == WORLD  # not profiled again
    assert {e["version"] for e in restores(tmp_path, job)} == {7}
    status = (tmp_path / "out" / "status.txt").read_text()
    assert "profiled timelines" in status, status
    for rank in range(WORLD):  # steps profiled 3, at least one collective a step
        assert re.search(rf"{job} +│ +{rank}/{WORLD} +│ +3 +│ +[1-9]\d* +│", status), status
    assert compare_runs(tmp_path / "out", ref / "out", WORLD) == []


def test_single_process_killed_after_a_commit_resumes_bit_exact(tmp_path):
    """One process, no torchrun, SIGKILLed right after commit 4 returns, resumed, ends bit-identical to a run
    without the kill; and the same on the GPU's commit path with the CPU as the device (``--staged``: Triton under
    the interpreter, each commit returning before its copy lands and a thread publishing it), where the kill leaves
    version 4 or, had it not landed, 3, and the job resumes there."""
    base = {**os.environ, "FFSTATE_TOKEN": uuid.uuid4().hex, "FFSTATE_BASE_PORT": str(free_ports(1)),
            "TMPDIR": str(tmp_path)}
    script = str(ROOT / "tests" / "procs" / "single.py")

    def run(out: str, *args: str, staged: bool = False, job: str = "") -> subprocess.CompletedProcess:
        (tmp_path / out).mkdir(exist_ok=True)
        env = {**base, "FFSTATE_JOB_ID": job or f"s{uuid.uuid4().hex[:6]}",
               **({"FFSTATE_KERNELS": "triton", "TRITON_INTERPRET": "1"} if staged else {})}
        return subprocess.run([sys.executable, script, str(tmp_path / out), "9", *args, *(["--staged"] * staged)],
                              env=env, capture_output=True, text=True, timeout=120)

    job = f"s{uuid.uuid4().hex[:6]}"
    killed = run("a", "--kill-after", "4", job=job)
    assert killed.returncode == -9 and "start 0" in killed.stdout
    resumed = run("a", job=job)
    assert resumed.returncode == 0 and "start 4" in resumed.stdout, resumed.stderr
    # Its daemon (the one the first run started) holds the restore's record, which ff.stats() reports.
    got = re.search(r"restores (\d+) to (\d+) lost (\d+) in ([\d.]+)s", resumed.stdout)
    assert got and got.groups()[:3] == ("1", "4", "0") and float(got.group(4)) > 0, resumed.stdout
    job = f"g{uuid.uuid4().hex[:6]}"
    killed = run("g", "--kill-after", "4", staged=True, job=job)
    assert killed.returncode == -9 and "commits are staged on cpu" in killed.stderr, killed.stderr[-3000:]
    resumed = run("g", staged=True, job=job)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert re.search(r"^start [34]$", resumed.stdout, re.M), resumed.stdout
    clean = run("b")
    assert clean.returncode == 0, clean.stderr
    reference = torch.load(tmp_path / "b" / "final.pt", weights_only=False)
    for out in ("a", "g"):
        assert_bitwise_equal(torch.load(tmp_path / out / "final.pt", weights_only=False), reference)


def test_wrong_use_gets_clear_errors(monkeypatch):
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(FFStateError, match="init_process_group"):
        with replicate(model, opt):
            pass


# ---------------------------------------------------------------- the razor: each byte replicated once per DP group


@pytest.fixture(scope="module")
def reference_ddp(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("reference-ddp")
    torchrun(tmp / "out", env_for(tmp, "refddp"), "--parallel", "ddp", "--no-ffstate")
    return tmp / "out"


def test_razor_ddp_rank_then_node_killed_rebuild_from_the_groups_parts_bit_exact(reference_ddp, tmp_path):
    """DDP with a plain AdamW: model and optimizer state are split between the 2 ranks; status shows each
    replicating half. A killed rank's state is put back together from both ranks' parts (the nodes' slots); then
    a whole node is lost and every rank rebuilds from the surviving node's slots and replicas."""
    job = f"t{uuid.uuid4().hex[:6]}"
    torchrun(tmp_path / "out", env_for(tmp_path, job), "--parallel", "ddp", "--kill-rank", "1", "--kill-step", "4",
             "--status-step", "6", "--kill-node", "1", "--kill-node-step", "8")
    restored = job_events(tmp_path, job, "restored")
    rank, node = [e for e in restored if e["attempt"] == 1], [e for e in restored if e["attempt"] == 2]
    assert {e["version"] for e in rank} == {4} and {e["steps_lost"] for e in rank} == {0}
    assert all(sorted(map(int, e["parts_from"])) == [1 - e["rank"]] for e in rank)
    assert len(node) == WORLD and len({e["version"] for e in node}) == 1
    assert all(e["steps_lost"] <= 1 for e in node), node  # within the settle window after the restart: 1
    assert compare_runs(tmp_path / "out", reference_ddp, WORLD) == []
    finished = job_events(tmp_path, job, "finished")
    assert {tuple(e["razor_group"]) for e in finished} == {(0, 1)}
    assert all(e["shard_bytes"] < 0.51 * e["state_bytes"] for e in finished), finished
    status = (tmp_path / "out" / "status.txt").read_text()
    assert "razor" in status and "0,1" in status and " 0.50 " in status, status
    # Each rank's restore, as its worker recorded it in its slots for the daemon: 1 restore, to step 4, 0 lost.
    for r in range(WORLD):
        assert re.search(rf"{job} +│ +{r}/{WORLD} +│ +1 +│ +4 +│ +0 +│", status), status


def test_razor_mismatch_in_a_supposedly_identical_entry_is_detected_and_falls_back(tmp_path):
    """Rank 1's copy of one parameter drifts at step 4 (DDP never re-syncs parameters). The group's checksum
    comparison at commit 4 (every 3 commits here) finds it, that entry goes back to per-rank replication,
    and a later failure restores rank 1's own copy, bit for bit, not the group's."""
    perturb = ("--parallel", "ddp", "--perturb-rank", "1", "--perturb-step", "4")
    ref = tmp_path / "ref"
    torchrun(ref / "out", env_for(ref, "refpert"), *perturb, "--no-ffstate")
    job = f"t{uuid.uuid4().hex[:6]}"
    env = {**env_for(tmp_path, job), "FFSTATE_RAZOR_VERIFY_EVERY": "3"}
    proc = torchrun(tmp_path / "out", env, *perturb, "--kill-rank", "0", "--kill-step", "8")
    assert "RAZOR MISMATCH at step 4" in proc.stdout + proc.stderr
    mismatches = job_events(tmp_path, job, "razor-mismatch")
    assert {e["rank"] for e in mismatches if e["attempt"] == 0} == set(range(WORLD))
    assert {tuple(e["entries"]) for e in mismatches} == {("model/module.pos",)}
    assert {e["version"] for e in job_events(tmp_path, job, "restored")} == {8}
    assert compare_runs(tmp_path / "out", ref / "out", WORLD) == []
    assert all(e["razor_mismatches"] >= 1 for e in job_events(tmp_path, job, "finished"))


def test_razor_part_with_no_live_copy_fails_with_the_precise_error(tmp_path):
    """No replicas (k = 0) and node 1 lost: rank 1's part is gone, so no rank can rebuild its state.
    Every rank refuses, naming the parts and the nodes that kept them, instead of restoring a wrong state
    or starting over."""
    job = f"t{uuid.uuid4().hex[:6]}"
    env = {**env_for(tmp_path, job), "FFSTATE_REPLICAS": "0"}
    proc = torchrun(tmp_path / "out", env, "--parallel", "ddp", "--kill-node", "1", "--kill-node-step", "4",
                    ok=False, restarts=1)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "no live copy of rank 1's shard (it was kept on node1 (slots))" in out
    assert "every member's part" in out
    assert not job_events(tmp_path, job, "restored")
    kill_daemons((tmp_path / f"ffstate-{job}").glob("daemon-*.pid"), signal.SIGTERM)  # the failed job's keep its copies
