"""The examples of the README and of the docs pages run as written."""

import re
from pathlib import Path

from helpers import KILL_WRAPPER


def test_the_internals_page_s_codec_example_runs(capsys):
    text = (Path(__file__).parents[2] / "docs" / "internals.md").read_text()
    codec_section = text[text.index("## The codec"):]
    block = re.search(r"```python\n(.*?)```", codec_section, re.S).group(1)
    exec(compile(block, "README.md", "exec"), {})
    out = capsys.readouterr().out
    assert out.startswith("delta ") and "wrong base" in out


def test_readme_training_example_runs_under_torchrun(tmp_path):
    """The README's train.py, as written, under torchrun with 2 ranks as 2 simulated nodes."""
    import os
    import subprocess
    import sys
    import uuid

    from ffstate.bench._report import free_ports

    text = (Path(__file__).parents[2] / "README.md").read_text()
    section = text[text.index("## Add it to a training loop"):]
    (tmp_path / "train.py").write_text(re.search(r"```python\n(.*?)```", section, re.S).group(1))
    env = {**{k: v for k, v in os.environ.items() if k != "FFSTATE_TOKEN"}, "STEPS": "4",
           "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "FFSTATE_SIMULATED_NODES": "2",
           "FFSTATE_JOB_ID": f"readme-{uuid.uuid4().hex[:6]}",  # no token: the ranks agree on one
           "FFSTATE_BASE_PORT": str(free_ports(2)), "TMPDIR": str(tmp_path), "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          str(tmp_path / "train.py")], capture_output=True, text=True, timeout=240, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "done at step 4, resumed from step 0" in out.stdout
    assert "the resize will be refused" not in out.stderr  # every rank's streams alike: it could be resized
    assert "starting at step 0" in out.stderr  # ffstate's INFO lines are shown, as the README says




def test_the_integration_page_s_loop_resumes_bit_exact_at_an_epochs_end(tmp_path):
    """docs/integration.md's loop, as written, under torchrun (2 ranks): rank 1 SIGKILLed right after the commit that
    ends an epoch (16 batches a rank), and the final parameters equal a run without the failure, bit for bit."""
    import json
    import os
    import subprocess
    import sys
    import uuid

    from ffstate.bench._report import free_ports
    from ffstate.testing.bitwise import compare_runs

    text = (Path(__file__).parents[2] / "docs" / "integration.md").read_text()
    section = text[text.index("## Bit-exact resume"):]
    (tmp_path / "train.py").write_text(re.search(r"```python\n(.*?)```", section, re.S).group(1))
    (tmp_path / "kill.py").write_text(KILL_WRAPPER)
    runs = {}
    for name, kill in (("reference", 0), ("failing", 16)):
        out = tmp_path / name
        out.mkdir()
        env = {**os.environ, "STEPS": "20", "KILL_AT": str(kill), "KILL_MARKER": str(out / "killed"),
               "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "FFSTATE_SIMULATED_NODES": "2", "OMP_NUM_THREADS": "1",
               "FFSTATE_JOB_ID": f"rx{uuid.uuid4().hex[:6]}", "FFSTATE_BASE_PORT": str(free_ports(2)),
               "TMPDIR": str(out)}
        proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                               "--max-restarts", "1", str(tmp_path / "kill.py"), str(tmp_path / "train.py")],
                              cwd=out, capture_output=True, text=True, timeout=240, env=env)
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs[name] = out
    assert (runs["failing"] / "killed").exists() and not (runs["reference"] / "killed").exists()
    events = [json.loads(line) for f in runs["failing"].glob("ffstate-*/events.jsonl") for line in f.read_text().splitlines()]
    assert sorted((e["rank"], e["version"], e["steps_lost"]) for e in events if e["event"] == "restored") == [
        (0, 16, 0), (1, 16, 0)]
    assert compare_runs(runs["failing"], runs["reference"], 2) == []
