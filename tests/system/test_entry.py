"""What can be known at entry is refused at entry, with the path of the offending entry, before any daemon is
started or training begins (a real process group for the razor's declaration)."""

import os
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

import pytest
import torch

import ffstate
from ffstate.bench._report import free_ports

pytestmark = pytest.mark.timeout(120)


class Broken:
    def state_dict(self):
        raise RuntimeError("the iterator is gone")

    def load_state_dict(self, state):
        pass


@pytest.mark.parametrize("extra, error, message", [
    ({"hook": lambda: 0}, ffstate.CodecError, r"extra/hook: unsupported type"),
    ({"deep": {"loader": Broken()}}, ffstate.FFStateError, r"extra/deep/loader: Broken.state_dict\(\) failed"),
], ids=["unsupported leaf", "failing state_dict"])
def test_wrong_state_is_refused_at_entry_before_a_daemon_starts(extra, error, message):
    job = f"e{uuid.uuid4().hex[:6]}"
    cfg = ffstate.Config(job_id=job, token="t", base_port=free_ports(1))
    model = torch.nn.Linear(2, 2)
    with pytest.raises(error, match=message):
        with ffstate.replicate(model, torch.optim.SGD(model.parameters(), lr=0.1), extra=extra, config=cfg):
            pytest.fail("entered")
    assert not list((Path(tempfile.gettempdir()) / f"ffstate-{job}").glob("daemon-*"))  # none was started


def test_a_razor_declaration_that_names_nothing_is_refused_at_entry(tmp_path):
    env = {**os.environ, "FFSTATE_JOB_ID": f"r{uuid.uuid4().hex[:6]}", "FFSTATE_TOKEN": "t", "OMP_NUM_THREADS": "1",
           "FFSTATE_BASE_PORT": str(free_ports(1)), "TMPDIR": str(tmp_path)}
    script = Path(__file__).resolve().parents[1] / "procs" / "entry.py"
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(script)], capture_output=True, text=True, env=env, timeout=90)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("refused at entry: Config.razor_identical names ['optim/stat']") == 2, proc.stdout
    assert "entered" not in proc.stdout
