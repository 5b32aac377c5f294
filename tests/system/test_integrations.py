"""The frameworks' adapters (ffstate/integrations/): a PyTorch Lightning fit and a Hugging Face Trainer run, each under
torchrun on 2 ranks (DDP, gloo) with a rank SIGKILLed mid-epoch, end bit-identical to the same run without ffstate and
without the failure (the Trainer's log too, but its timings), restored at the step the job reached."""

import json
import os
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

import pytest
import torch

from ffstate.bench._report import free_ports
from helpers import assert_bitwise_equal

pytestmark = pytest.mark.timeout(600)
PROCS = Path(__file__).resolve().parents[1] / "procs"


def run(job: str, out: Path, *args: str) -> None:
    out.mkdir()
    env = {**os.environ, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "FFSTATE_SIMULATED_NODES": "2",
           "FFSTATE_JOB_ID": f"fw{uuid.uuid4().hex[:6]}", "FFSTATE_TOKEN": uuid.uuid4().hex,
           "FFSTATE_BASE_PORT": str(free_ports(2)), "OMP_NUM_THREADS": "1", "TMPDIR": str(out),
           "PYTHONPATH": os.pathsep.join([str(PROCS.parent), os.environ.get("PYTHONPATH", "")])}
    got = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          "--max-restarts", "2", str(PROCS / f"{job}.py"), str(out), *args], capture_output=True,
                         text=True, env=env, timeout=500)
    assert got.returncode == 0, got.stdout[-3000:] + got.stderr[-5000:]


@pytest.fixture(scope="module")
def references(once):
    """The run of a job without ffstate and without the failures, made once per job for this module's tests."""
    return lambda job: once(f"{job}-reference", lambda made: run(job, made / "reference", "--no-ffstate")) / "reference"


def restores(out: Path) -> list[dict]:
    events = [json.loads(line) for f in out.glob("ffstate-*/events.jsonl") for line in f.read_text().splitlines()]
    return sorted((e for e in events if e["event"] == "restored"), key=lambda e: (e["version"], e["rank"]))


def assert_same_end(out: Path, reference: Path) -> None:
    for r in (0, 1):
        assert_bitwise_equal(torch.load(out / f"final-rank{r}.pt", weights_only=False),
                             torch.load(reference / f"final-rank{r}.pt", weights_only=False))


@pytest.mark.parametrize("framework, job, kill_step", [("lightning", "lightning_job", 27), ("transformers", "hf_job", 20)])
def test_a_framework_s_run_with_a_rank_killed_mid_epoch_ends_bit_identical(tmp_path, references, framework, job,
                                                                           kill_step):
    pytest.importorskip(framework, reason=f"{framework} is not installed (pip install 'ffstate[test]')")
    run(job, tmp_path / "failing", "--kill-rank", "1", "--kill-step", str(kill_step))
    assert list((tmp_path / "failing").glob("killed*"))
    assert_same_end(tmp_path / "failing", references(job))
    restored = restores(tmp_path / "failing")
    assert sorted(e["rank"] for e in restored) == [0, 1] and len({e["version"] for e in restored}) == 1, restored
    assert kill_step - 1 <= restored[0]["version"] <= kill_step and restored[0]["steps_lost"] <= 1, restored


def test_lightning_restored_at_an_epoch_s_end_then_again_mid_epoch_ends_bit_identical(tmp_path, references):
    """The version at an epoch's last batch (20 of 20) restored, then one mid-epoch (35): Lightning took the first for
    a mid-epoch restart and left the next epoch's counters one short, and the second restore then ran that epoch's
    batches from its start again (80 steps, not 60) and skipped an epoch's LR step."""
    pytest.importorskip("lightning", reason="lightning is not installed (pip install 'ffstate[test]')")
    run("lightning_job", tmp_path / "failing", "--kill-rank", "1", "--kill-step", "20,35")
    assert sorted(p.name for p in (tmp_path / "failing").glob("killed*")) == ["killed-20", "killed-35"]
    assert_same_end(tmp_path / "failing", references("lightning_job"))
    assert [(e["rank"], e["version"]) for e in restores(tmp_path / "failing")] == [(0, 20), (1, 20), (0, 35), (1, 35)]
    for r in (0, 1):  # the EarlyStopping's best score and patience count, from before the restores too
        got, want = (torch.load(d / f"callbacks-rank{r}.pt", weights_only=False)
                     for d in (tmp_path / "failing", references("lightning_job")))
        assert_bitwise_equal(got, want)


def test_powersgd_registered_through_ffstate_keeps_its_state_and_a_rank_killed_ends_bit_identical(tmp_path):
    """DDP with PowerSGD (error feedback, warm start) registered by ffstate.register_comm_hook: the hook compresses,
    ffstate marks its collectives and replicates its state (the error feedback and the low-rank factors, its generator
    and its iteration); a rank killed after PowerSGD began ends bit-identical to DDP with the hook and no ffstate."""
    run("hooks_job", tmp_path / "reference", "14", "--no-ffstate")
    run("hooks_job", tmp_path / "failing", "14", "--kill-rank", "1", "--kill-step", "8")
    assert (tmp_path / "failing" / "killed").exists()
    for r in (0, 1):
        got = torch.load(tmp_path / "failing" / f"final-rank{r}.pt", weights_only=False)
        assert got["hook"]["iter"] > 4 and got["hook"]["error_dict"], got["hook"]["iter"]  # PowerSGD did run
        assert_bitwise_equal(got, torch.load(tmp_path / "reference" / f"final-rank{r}.pt", weights_only=False))
    wire = json.loads((tmp_path / "reference" / "wire.json").read_text())
    assert wire["after"] < wire["before"] / 4, wire  # the compression happened


@pytest.mark.parametrize("framework", ["lightning", "transformers"])
def test_an_evaluation_longer_than_the_hang_deadline_is_a_pause_not_a_hang(tmp_path, framework, monkeypatch):
    """Lightning's validation within fit, the Trainer's evaluation and save at an epoch's end: each lasts 8 s where
    the watchdog's deadline for a step is at most 5 s, and the run finishes (the daemon SIGKILLed the rank before).
    The deadline's floor is 2 s: a training step's gap between commits on a loaded machine stays under it."""
    pytest.importorskip(framework, reason=f"{framework} is not installed (pip install 'ffstate[test]')")
    from ffstate.daemon import running

    job = f"ev{uuid.uuid4().hex[:6]}"
    env = {**os.environ, "FFSTATE_JOB_ID": job, "FFSTATE_TOKEN": uuid.uuid4().hex, "FFSTATE_BASE_PORT": str(free_ports(1)),
           "FFSTATE_HANG_FLOOR": "2", "FFSTATE_HANG_MULTIPLE": "2", "FFSTATE_HANG_CEILING": "5", "TMPDIR": str(tmp_path),
           "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(PROCS.parent), os.environ.get("PYTHONPATH", "")])}
    try:
        got = subprocess.run([sys.executable, str(PROCS / "long_evaluation_job.py"), framework, "8"], capture_output=True,
                             text=True, env=env, timeout=240)
    finally:
        monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the job's run folder, where its daemon's pid file is
        running.stop_daemons(job, wait=15, kill=True)  # a rank killed leaves its node's daemon waiting for it
    assert got.returncode == 0 and "finished at step 20" in got.stdout, (got.returncode, got.stdout[-2000:],
                                                                        got.stderr[-4000:])
