"""The README and the pages under docs/ hold together: every relative link resolves, and the elastic page's
example resumes at another world size as written."""

import json
import os
import re
import subprocess
import sys
import uuid
from pathlib import Path

from ffstate import Config
from ffstate.bench._report import free_ports
from ffstate.daemon.running import stop_daemons
from helpers import KILL_WRAPPER

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def test_every_relative_link_in_the_readme_and_docs_resolves():
    broken = []
    for page in PAGES:
        text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)  # links, not code
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target) or target.startswith("#"):
                continue
            path = (page.parent / target.split("#")[0]).resolve()
            if not path.exists() or ROOT not in path.parents and path != ROOT:
                broken.append(f"{page.relative_to(ROOT)}: {target}")
    assert broken == [], broken


def test_the_elastic_page_s_example_resumes_at_another_world_size(tmp_path, monkeypatch):
    """docs/elastic.md's loop, as written: 2 ranks (2 simulated nodes), rank 1 SIGKILLed after step 12; relaunched
    at 1 rank, it resumes resharded from node 0's slots and its replica of rank 1, with the data position of the
    job (an ElasticSampler), and runs to the end. Node 1's daemon, left out of the smaller job, would wait out its
    idle time (600 s) after the test: it is stopped."""
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where the job's run folder is (its TMPDIR)
    job = f"doc{uuid.uuid4().hex[:6]}"
    try:
        _elastic_example(tmp_path, job)
    finally:
        stop_daemons(job, wait=30.0)


def _elastic_example(tmp_path: Path, job: str) -> None:
    text = (ROOT / "docs" / "elastic.md").read_text()
    section = text[text.index("### An elastic-ready data position"):]
    (tmp_path / "train.py").write_text(re.search(r"```python\n(.*?)```", section, re.S).group(1))
    (tmp_path / "kill.py").write_text(KILL_WRAPPER)
    env = {**os.environ, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "OMP_NUM_THREADS": "1", "KILL_AT": "12",
           "KILL_MARKER": str(tmp_path / "killed"), "FFSTATE_JOB_ID": job,
           "FFSTATE_BASE_PORT": str(free_ports(2)), "TMPDIR": str(tmp_path)}
    for world in (2, 1):
        proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                               str(world), "--max-restarts", "0", str(tmp_path / "kill.py"), str(tmp_path / "train.py")],
                              capture_output=True, text=True, timeout=300, cwd=tmp_path,
                              env={**env, "FFSTATE_SIMULATED_NODES": str(world)})
        assert (proc.returncode == 0) == (world == 1), proc.stderr[-3000:]
    run_dir = next(tmp_path.glob("ffstate-doc*"))
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    resized = [e for e in events if e["event"] == "restored"]  # rank 1's copy: its replica, within the lag
    assert [(e["from_world"], e["world"]) for e in resized] == [(2, 1)], resized
    assert 12 - Config().max_lag <= resized[0]["version"] <= 12, resized
    assert [e["step"] for e in events if e["event"] == "finished"] == [40]


def test_the_configuration_page_is_what_the_code_says():
    """docs/configuration.md is generated from Config, DaemonConfig and `ffstate serve`'s flags: every field,
    its environment variable, flag, default and meaning (regenerate: python -m ffstate.configdoc)."""
    from ffstate import configdoc

    assert (ROOT / "docs" / "configuration.md").read_text() == configdoc.table(), \
        "docs/configuration.md is stale: python -m ffstate.configdoc > docs/configuration.md"
