"""The README's codec example runs as written."""

import re
from pathlib import Path


def test_readme_codec_example_runs(capsys):
    text = (Path(__file__).parents[2] / "README.md").read_text()
    codec_section = text[text.index("## The codec"):]
    block = re.search(r"```python\n(.*?)```", codec_section, re.S).group(1)
    exec(compile(block, "README.md", "exec"), {})
    out = capsys.readouterr().out
    assert out.startswith("delta ") and "wrong base" in out


def test_readme_training_example_runs_under_torchrun(tmp_path):
    """The README's train.py, as written, under torchrun with 2 ranks as 2 simulated nodes."""
    import os
    import random
    import subprocess
    import sys
    import uuid

    text = (Path(__file__).parents[2] / "README.md").read_text()
    section = text[text.index("## Training with ffstate"):]
    (tmp_path / "train.py").write_text(re.search(r"```python\n(.*?)```", section, re.S).group(1))
    env = {**{k: v for k, v in os.environ.items() if k != "FFSTATE_TOKEN"}, "STEPS": "4",
           "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "FFSTATE_SIMULATED_NODES": "2",
           "FFSTATE_JOB_ID": f"readme-{uuid.uuid4().hex[:6]}",  # no token: the ranks agree on one
           "FFSTATE_BASE_PORT": str(random.randint(20000, 60000)), "TMPDIR": str(tmp_path), "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          str(tmp_path / "train.py")], capture_output=True, text=True, timeout=240, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "done at step 4, resumed from step 0" in out.stdout
