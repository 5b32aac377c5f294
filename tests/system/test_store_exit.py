"""A clean exit's last calls on the job's store: rank 0, whose process may host the store, waits for the other ranks'
last calls (``Job.leave``) however soon its process ends after it; without that wait, a rank still calling gets
"Connection reset by peer" and torchrun restarts a job that had finished. Two real processes, a real TCPStore."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(120)
ROOT = Path(__file__).resolve().parents[2]


def run_pair(out: Path, *flags: str) -> list[subprocess.CompletedProcess]:
    out.mkdir()
    env = {**os.environ, "TMPDIR": str(out), "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, str(ROOT / "tests/procs/store_exit.py"), str(out), str(r), *flags],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env) for r in (0, 1)]
    done = []
    for p in procs:
        stdout, _ = p.communicate(timeout=90)
        done.append(subprocess.CompletedProcess(p.args, p.returncode, stdout))
    return done


def test_rank_0_leaves_the_store_after_the_other_ranks_last_call(tmp_path):
    zero, one = run_pair(tmp_path / "leave")
    assert zero.returncode == 0 and one.returncode == 0, zero.stdout[-2000:] + one.stdout[-3000:]
    assert "rank 1's late call reached the store: True" in zero.stdout


def test_without_the_wait_the_late_rank_loses_the_store(tmp_path):
    """The control: the same two processes without ``leave`` fail as a finished job did under torchrun."""
    zero, one = run_pair(tmp_path / "no-leave", "--no-leave")
    assert zero.returncode == 0 and "reached the store: False" in zero.stdout, zero.stdout[-2000:]
    assert one.returncode != 0 and "DistNetworkError" in one.stdout, one.stdout[-3000:]
