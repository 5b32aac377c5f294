"""The command line as a newcomer meets it: ``ffstate demo`` interrupted by a Ctrl-C (SIGINT to its terminal's
whole process group: the demo, torchrun and the workers; the daemons run in sessions of their own) says so in one
line, and leaves no daemon running."""

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(240)


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] not in "ZX"
    except OSError:
        return False


def test_ctrl_c_in_the_demo_stops_its_daemons_and_says_interrupted(tmp_path):
    out = tmp_path / "demo"
    tmp = tmp_path / "tmp"  # the job's run folder (its daemons' pid files) goes here
    tmp.mkdir()
    base = random.randrange(20000, 30000, 2)
    proc = subprocess.Popen([sys.executable, "-m", "ffstate.cli", "demo", "--out", str(out), "--base-port", str(base)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            env={**os.environ, "TMPDIR": str(tmp)})
    deadline = time.monotonic() + 120
    failures = out / "with-failures" / "failures.jsonl"
    while not (failures.exists() and failures.read_text()) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)  # until the first failure (a rank killed after step 8): both daemons serve by now
    pids = [int(p.read_text()) for p in tmp.glob("ffstate-*/daemon-*.pid")]
    assert proc.poll() is None and len(pids) == 2, (pids, proc.poll())
    os.killpg(proc.pid, signal.SIGINT)
    try:
        stdout, stderr = proc.communicate(timeout=90)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    assert proc.returncode == 130, stderr[-3000:]
    assert stderr.strip().splitlines()[-1] == "ffstate demo: interrupted", stderr[-3000:]
    assert "Traceback" not in stderr, stderr[-3000:]
    deadline = time.monotonic() + 30
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(_alive(p) for p in pids), pids
    logs = sorted((out / "with-failures").glob("daemon-*.log"))  # kept with the demo's logs
    assert len(logs) == 2 and all("stopped" in p.read_text().splitlines()[-1] for p in logs), \
        [p.read_text()[-500:] for p in logs]
