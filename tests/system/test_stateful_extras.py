"""Extras as users write them (tests/procs/stateful.py: a StatefulDataLoader over a shuffling
DistributedSampler, a GradScaler, a user object with its own torch.Generator, a model with dropout and a tied
head), under DDP and FSDP2 with real torchrun: a rank SIGKILLed after a commit, and every tensor of the
final state (parameters, optimizer, each extra's state_dict(), the RNG) bit-identical to the run without it."""

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from ffstate.bench._report import free_ports
from ffstate.testing.bitwise import compare_runs
from helpers import kill_daemons

pytestmark = pytest.mark.timeout(300)
SCRIPT = Path(__file__).resolve().parents[1] / "procs" / "stateful.py"


def run(out: Path, parallel: str, *extra: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "FFSTATE_SIMULATED_NODES": "2",
           "FFSTATE_JOB_ID": f"x{uuid.uuid4().hex[:6]}", "FFSTATE_TOKEN": uuid.uuid4().hex,
           "FFSTATE_BASE_PORT": str(free_ports(2)), "OMP_NUM_THREADS": "1", "TMPDIR": str(out.parent)}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           "--max-restarts", "2", str(SCRIPT), str(out), "--parallel", parallel, *extra],
                          capture_output=True, text=True, env=env, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


# ZeRO with extras: the chaos run (DDP + ZeRO, the data position as an extra) and the elastic and persist tests
@pytest.mark.parametrize("parallel, kill_step", [("ddp", 6), ("fsdp2", 4)])
def test_stateful_extras_resume_bit_exact_after_a_rank_is_killed(tmp_path, parallel, kill_step):
    """Kill steps: at an epoch's end (the loader's iterator finished), in its middle, after its first batch."""
    reference = tmp_path / "ref" / "out"
    reference.parent.mkdir()
    run(reference, parallel, "--no-ffstate")
    failing = tmp_path / "fail" / "out"
    failing.parent.mkdir()
    proc = run(failing, parallel, "--kill-rank", "1", "--kill-step", str(kill_step))
    assert (failing / "killed").exists()
    events = [json.loads(line) for p in failing.parent.glob("ffstate-*/events.jsonl") for line in p.read_text().splitlines()]
    restored = [e for e in events if e["event"] == "restored"]
    assert sorted(e["rank"] for e in restored) == [0, 1] and {e["version"] for e in restored} == {kill_step}
    assert {e["steps_lost"] for e in restored} == {0}
    assert compare_runs(failing, reference, 2) == []
    assert "without generator=" not in proc.stdout + proc.stderr  # the loop passes one: no warning


class Growing:
    """A Stateful whose state changes structure as it goes (a loader that starts tracking a shuffle, say)."""

    def __init__(self):
        self.step = 0

    def state_dict(self) -> dict:
        import torch

        state = {"step": self.step}
        if self.step >= 3:
            state["seen"] = torch.arange(self.step * 1000, dtype=torch.int64)  # a new entry, growing
        return state

    def load_state_dict(self, state: dict) -> None:
        self.step = state["step"]
        self.restored = state


def test_an_extra_that_changes_structure_gets_new_slots_and_resumes_from_its_newest_state(tmp_path, caplog):
    """In one process with a real daemon: the extra's layout changes at steps 3, 4 and 5; each commit then
    re-attaches with the new layout (logged, recorded) and the job, left with an exception after step 5 and
    entered again, restores step 5's state into the same object, bit for bit."""
    import logging

    import torch

    import ffstate
    from ffstate.testing.bitwise import assert_bitwise_equal

    job = f"g{uuid.uuid4().hex[:6]}"
    cfg = ffstate.Config(job_id=job, token=uuid.uuid4().hex, base_port=free_ports(1), replicas=0)
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    grow = Growing()
    run_dir = Path(__import__("tempfile").gettempdir()) / f"ffstate-{job}"
    try:
        with caplog.at_level(logging.WARNING, logger="ffstate.trainer"), pytest.raises(RuntimeError, match="crash"):
            with ffstate.replicate(model, opt, extra={"grow": grow}, config=cfg) as ff:
                for step in range(5):
                    grow.step = step + 1
                    ff.commit(step + 1)
                raise RuntimeError("crash")
        assert caplog.text.count("layout changed") == 3 and "new slots and a full version" in caplog.text
        want = grow.state_dict()
        grow.step = 0
        with ffstate.replicate(model, opt, extra={"grow": grow}, config=cfg) as ff:
            assert ff.start_step == 5
            assert_bitwise_equal(grow.restored, want)
        events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
        assert [e["step"] for e in events if e["event"] == "layout-changed"] == [3, 4, 5]
    finally:
        kill_daemons(run_dir.glob("daemon-*.pid"))
