"""The persistent tier under real torchrun (2 ranks as 2 simulated nodes, the demo's worker): the whole job lost,
every daemon and every rank SIGKILLed and the nodes' shared memory and run folders removed as on new machines, then
relaunched: it resumes from the persisted versions, never a torn one, skipping a corrupted newest version for the
older one with a warning naming the file, and ends bit-identical to the run without failures. A persisted
version is a real DCP checkpoint: DCP alone loads it into a plain model and optimizer, and (FSDP2) into a model
sharded over another world size (3 ranks: uneven shards)."""

import json
import os
import re
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import torch

from ffstate import persist, razor
from ffstate.persist import read as persist_read
from ffstate.bench._report import free_ports
from ffstate.testing.bitwise import compare_runs
from helpers import assert_bitwise_equal

pytestmark = pytest.mark.timeout(800)
ROOT = Path(__file__).resolve().parents[2]
STEPS = 18
WORLD = 2


def env_for(tmp: Path, job: str, persist_dir: Path | None = None) -> dict:
    env = {**os.environ, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "FFSTATE_SIMULATED_NODES": "2",
           "FFSTATE_JOB_ID": job, "FFSTATE_TOKEN": uuid.uuid4().hex, "FFSTATE_BASE_PORT": str(free_ports(2)),
           "OMP_NUM_THREADS": "1", "TMPDIR": str(tmp)}
    if persist_dir is not None:  # the flushing process at the daemon's priority (not idle): on a machine whose
        # cores the test suite keeps busy, the idle one would get too little CPU to flush the versions tested here
        env.update(FFSTATE_PERSIST_DIR=str(persist_dir), FFSTATE_PERSIST_EVERY="2", FFSTATE_PERSIST_KEEP="3",
                   FFSTATE_PERSIST_NICE="0")
    return env


def torchrun(out: Path, env: dict, *extra: str, steps: int = STEPS, ok: bool = True,
             restarts: int = 0) -> subprocess.CompletedProcess:
    args = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(WORLD), "--max-restarts",
            str(restarts), "-m", "ffstate.demo.worker", "--out", str(out), "--steps", str(steps), *extra]
    proc = subprocess.run(args, capture_output=True, text=True, env=env, timeout=300)
    assert (proc.returncode == 0) == ok, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def new_machines(tmp: Path, job: str) -> None:
    """What a relaunch on other machines finds: no daemon (they were SIGKILLed), nothing in /dev/shm, no run folder.
    A SIGKILLed daemon inside a write or an fsync dies when it returns: it is waited for, as the machines' loss."""
    deadline = time.monotonic() + 30
    for pid_file in (tmp / f"ffstate-{job}").glob("daemon-*.pid"):
        status = Path(f"/proc/{pid_file.read_text().strip()}/status")
        while time.monotonic() < deadline:
            try:
                if "\nState:\tZ" in status.read_text():  # dead, not yet reaped
                    break
            except OSError:  # gone
                break
            time.sleep(0.05)
    for p in Path("/dev/shm").glob(f"*{job}*"):
        p.unlink()
    shutil.rmtree(tmp / f"ffstate-{job}", ignore_errors=True)


def restored(tmp: Path, job: str) -> list[dict]:
    path = tmp / f"ffstate-{job}" / "events.jsonl"
    return [e for e in map(json.loads, path.read_text().splitlines()) if e["event"] == "restored"]


@pytest.fixture
def reference(once) -> Path:
    """The job without failures and without ffstate, made once for the tests that compare against it."""
    made = once("persist-reference", lambda made: torchrun(made / "reference", env_for(made, "reference"), "--no-ffstate"))
    return made / "reference"


def test_the_whole_job_lost_twice_resumes_from_the_persisted_versions_and_ends_bit_identical(tmp_path, reference):
    job, store = f"persist-{uuid.uuid4().hex[:6]}", tmp_path / "persist"
    env, out, job_dir = env_for(tmp_path, job, store), tmp_path / "out", store / job
    kills = ("--kill-job-steps", "9,14", "--kill-job-persisted", "2")  # each loss finds two versions to choose from

    torchrun(out, env, *kills, ok=False)  # lost after step 9
    new_machines(tmp_path, job)
    done, reached = persist.complete_versions(job_dir), persist.reached(job_dir)
    assert len(done) >= 2 and done[-1] <= reached <= 9, (done, reached)  # reached: noted before each flush
    for v in done:  # daemons SIGKILLed mid-flush leave no version that looks complete and is not
        persist.check(persist.version_dir(job_dir, v), list(range(WORLD)))
    newest, older = done[-1], done[-2]
    bad = persist.version_dir(job_dir, newest) / "__1_0.distcp"
    raw = bytearray(bad.read_bytes())
    raw[len(raw) // 3] ^= 0x01
    bad.write_bytes(raw)

    second = torchrun(out, env, *kills, ok=False)  # resumes at the older version, lost again after step 14
    got = restored(tmp_path, job)
    assert sorted(e["rank"] for e in got) == list(range(WORLD)) and {e["version"] for e in got} == {older}, got
    assert all(e["source"].startswith("persisted ") and e["steps_lost"] == reached - older for e in got), got
    assert re.search(rf"persisted version {newest} cannot be used: \S+__1_0\.distcp: checksum", second.stdout
                     + second.stderr)
    new_machines(tmp_path, job)
    done = persist.complete_versions(job_dir)
    assert done[-1] > older and done[-1] <= persist.reached(job_dir) <= 14, done

    torchrun(out, env, *kills)  # resumes at the newest complete version and finishes
    got = restored(tmp_path, job)
    assert {e["version"] for e in got} == {done[-1]} and all(e["source"].startswith("persisted") for e in got), got
    assert compare_runs(out, reference, WORLD) == []

    # The newest version is a DCP checkpoint: DCP alone (no ffstate) loads it into a plain TinyGPT and AdamW.
    vdir = persist.version_dir(job_dir, persist.complete_versions(job_dir)[-1])
    loaded = tmp_path / "plain.pt"
    subprocess.run([sys.executable, str(ROOT / "tests/procs/dcp_load.py"), str(vdir), "--out", str(loaded), "--plain"],
                   check=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
    plain = torch.load(loaded, weights_only=True)
    shards = {r: persist.read_shard(vdir, r)[0] for r in range(WORLD)}  # ffstate's own reading, checksum-verified
    whole = razor.assemble(shards[0], shards)
    assert_bitwise_equal(plain["model"], {k.removeprefix("module."): v for k, v in whole["model"].items()})
    # ZeRO: every parameter's optimizer state, each from the rank that owns it, under the parameter's name
    params = dict(_model().named_parameters())
    assert {k.rsplit(".", 1)[0] for k in plain["optim"]} == set(params)
    for r, shard in shards.items():
        for it in persist_read.record(vdir, r)["items"]:
            if it["fqn"].startswith("optim.state."):
                fqn, name = it["fqn"][len("optim.state."):].rsplit(".", 1)
                index = int(shard_path(vdir, r, it["spec"]).split("/")[-2])
                assert name == "step" or params[fqn].shape == plain["optim"][f"{fqn}.{name}"].shape
                assert_bitwise_equal(plain["optim"][f"{fqn}.{name}"], shard["own"]["optim"]["shard"]["state"][index][name])



def test_a_job_preempted_by_sigterm_to_every_process_resumes_from_the_versions_its_daemons_wrote_as_they_stopped(
        tmp_path, reference):
    """A cluster's preemption signals every process of the job at once (the agent, the ranks, the daemons): the ranks
    stop wherever they are, up to a step apart, and each daemon, stopping, writes the versions its ranks' slots hold
    (the newest two): one of them is every rank's, so a relaunch on new machines resumes from it where the periodic
    versions (every 100 steps here) had none, and ends bit-identical."""
    job, store = f"preempt-{uuid.uuid4().hex[:6]}", tmp_path / "persist"
    env, out, job_dir = {**env_for(tmp_path, job, store), "FFSTATE_PERSIST_EVERY": "100"}, tmp_path / "out", store / job
    torchrun(out, env, "--preempt-step", "9", ok=False)
    new_machines(tmp_path, job)
    done = persist.complete_versions(job_dir)
    assert done and done[-1] in (8, 9), (done, sorted(p.name for p in job_dir.iterdir()))
    persist.check(persist.version_dir(job_dir, done[-1]), list(range(WORLD)))

    torchrun(out, env)  # on new machines: from the disk, and to the end
    got = restored(tmp_path, job)
    assert sorted(e["rank"] for e in got) == list(range(WORLD)) and {e["version"] for e in got} == {done[-1]}, got
    assert all(e["source"].startswith("persisted ") for e in got), got
    assert compare_runs(out, reference, WORLD) == []

def test_a_step_redone_after_a_restart_is_written_again_and_the_job_s_last_step_is_complete(tmp_path):
    """Rank 1 dies inside its commit of the last step (10), after rank 0's daemon flushed its own version 10: the
    restart resumes at v* = 9, removes the dead run's version 10 from the disk, redoes step 10 and ends there. Node
    0's daemon must write rank 0's new version 10 (it once kept its claim on the old one, said "flushed already",
    and the job ended with version 5 as its newest complete one)."""
    job, store = f"redo-{uuid.uuid4().hex[:6]}", tmp_path / "persist"
    env = {**env_for(tmp_path, job, store), "FFSTATE_PERSIST_EVERY": "5"}
    proc = torchrun(tmp_path / "out", env, "--kill-rank", "1", "--kill-step", "10", "--kill-phase", "mid-commit",
                    steps=10, restarts=1)
    assert [e["version"] for e in restored(tmp_path, job)] == [9, 9], restored(tmp_path, job)
    assert persist.complete_versions(store / job)[-1] == 10, (persist.complete_versions(store / job), proc.stdout[-3000:])
    persist.check(persist.version_dir(store / job, 10), list(range(WORLD)))


def shard_path(vdir: Path, rank: int, spec: int) -> str:
    """The state path of a rank's tensor ``spec`` (its manifest's name)."""
    from ffstate.layout import Manifest

    return Manifest.from_json(persist_read.record(vdir, rank)["manifest"].encode()).tensors[spec].name


def _model():
    from ffstate.demo.worker import MODEL
    from ffstate.testing.models import TinyGPT

    return TinyGPT(**MODEL)


def test_fsdp2_rank_killed_resumes_bit_exact_and_its_persisted_version_loads_through_dcp_at_other_sizes(tmp_path):
    """FSDP2 (fully_shard) on CPU with gloo: DTensor parameters and optimizer state, per-rank shards, nothing for
    the razor to split. A rank killed after a commit resumes from its node's slots, bit-identical; the versions
    the daemons flushed meanwhile are DCP checkpoints that DCP alone loads into FSDP2 at 3 ranks and into a plain
    model, resharded from the 2 ranks' chunks; the job's last step is flushed at its end, due or not."""
    steps, job, store = 9, f"persist-{uuid.uuid4().hex[:6]}", tmp_path / "persist"
    reference, out = tmp_path / "reference", tmp_path / "out"
    torchrun(reference, env_for(tmp_path, "fsdp2ref"), "--parallel", "fsdp2", "--no-ffstate", steps=steps)
    env = {**env_for(tmp_path, job, store), "FFSTATE_PERSIST_EVERY": "4"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                           str(WORLD), "--max-restarts", "1", "-m", "ffstate.demo.worker", "--out", str(out), "--steps",
                           str(steps), "--parallel", "fsdp2", "--kill-rank", "1", "--kill-step", "3"],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    got = restored(tmp_path, job)
    assert {e["version"] for e in got} == {3} and {e["steps_lost"] for e in got} == {0}
    assert all("local slots" in e["source"] for e in got)  # live copies first: the disk is for when none is left
    assert compare_runs(out, reference, WORLD) == []
    events = [json.loads(line) for line in (tmp_path / f"ffstate-{job}" / "events.jsonl").read_text().splitlines()]
    finished = [e for e in events if e["event"] == "finished"]
    assert len(finished) == WORLD and all(e["razor_group"] == [] and e["shard_bytes"] == e["state_bytes"] for e in finished)
    # The job's end flushes its last step, 9, though only multiples of 4 are due: a relaunch resumes where it ended.
    assert persist.complete_versions(store / job)[-1] == steps
    vdir = persist.version_dir(store / job, steps)
    finals = [torch.load(out / f"final-rank{r}.pt", weights_only=True) for r in range(WORLD)]
    for flags, name in (([], "three.pt"), (["--plain"], "one.pt")):
        if flags:
            cmd = [sys.executable, str(ROOT / "tests/procs/dcp_load.py")]
        else:
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "3",
                   str(ROOT / "tests/procs/dcp_load.py")]
        load = subprocess.run([*cmd, str(vdir), "--out", str(tmp_path / name), *flags], timeout=180, text=True,
                              env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True)
        assert load.returncode == 0, load.stdout[-3000:] + load.stderr[-6000:]
    three, one = torch.load(tmp_path / "three.pt", weights_only=True), torch.load(tmp_path / "one.pt", weights_only=True)
    assert_bitwise_equal(three, one)  # resharded from 2 ranks to 3 (uneven shards), and to 1: the same tensors
    for k, v in one["model"].items():  # ...and the job's own: its 2 ranks' shards at the end, laid end to end
        assert_bitwise_equal(v, torch.cat([f["params"][k] for f in finals]).reshape(v.shape))
    for i, (fqn, p) in enumerate(_model().named_parameters()):  # the optimizer's too, by parameter order
        for k in ("exp_avg", "exp_avg_sq"):
            assert_bitwise_equal(one["optim"][f"{fqn}.{k}"],
                                 torch.cat([f["optim"]["state"][i][k] for f in finals]).reshape(p.shape))
        assert_bitwise_equal(one["optim"][f"{fqn}.step"], finals[0]["optim"]["state"][i]["step"])
