"""The daemon's flushing process (ffstate/daemon/flusher.py), in a fresh interpreter as it runs."""

from __future__ import annotations

import json
import subprocess
import sys

import torch

from ffstate import codec, persist

CHILD = """
import json, sys
from pathlib import Path
import numpy as np
import ffstate.daemon.flusher as fl
fl.prepare()
tmp = Path(sys.argv[1])
before = set(sys.modules)
data = np.frombuffer((tmp / "state.bin").read_bytes(), dtype=np.uint8)
copy = fl.Copy(data, {"manifest": (tmp / "manifest.json").read_text(), "keys": {}})
job = {"job": "j", "rank": 0, "world": 1, "version": 2, "checksum": int(sys.argv[2]), "job_dir": str(tmp / "j"),
       "keep": 3, "nbytes": copy.nbytes, "meta_bytes": copy.meta_bytes}
answer = fl._write(job, copy.fd)
print(json.dumps({"answer": answer, "imported": sorted(m for m in set(sys.modules) - before if m.startswith("ffstate"))}))
"""


def test_the_first_flush_finds_every_module_it_needs_imported(tmp_path):
    """The packages load their torch-side modules on first use (the daemon runs without torch); the flushing process
    imports them as it starts, before the collector resumes, not in its first flush: left there they made the first
    flush 0.5-0.9 s where it took 0.1-0.2 on a loaded machine, and the job's versions due meanwhile were skipped."""
    snap = codec.pack({"model": {"w": torch.randn(100), "b": torch.arange(3)}, "optim": {"step": 7}})
    (tmp_path / "state.bin").write_bytes(snap.buffer.numpy().tobytes())
    (tmp_path / "manifest.json").write_text(snap.manifest.to_json().decode())
    got = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path), str(snap.checksum)], capture_output=True,
                         text=True, timeout=120)
    assert got.returncode == 0, got.stderr[-3000:]
    out = json.loads(got.stdout.splitlines()[-1])
    assert out["answer"]["ok"] and out["answer"]["complete"], out
    assert out["imported"] == [], out["imported"]
    assert persist.complete_versions(tmp_path / "j") == [2]


def test_a_version_complete_on_disk_is_not_written_again(tmp_path):
    """A step redone after a restart, flushed by a daemon whose workers do not drop the versions past the one they
    restored (no ``Config.persist_dir``): the complete version's files are left as they are, not overwritten under
    a marker that lists their old sizes and checksums."""
    snap = codec.pack({"model": {"w": torch.randn(100)}, "optim": {"step": 7}})
    (tmp_path / "state.bin").write_bytes(snap.buffer.numpy().tobytes())
    (tmp_path / "manifest.json").write_text(snap.manifest.to_json().decode())
    answers, files = [], []
    for _ in range(2):
        got = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path), str(snap.checksum)], capture_output=True,
                             text=True, timeout=120)
        assert got.returncode == 0, got.stderr[-3000:]
        answers.append(json.loads(got.stdout.splitlines()[-1])["answer"])
        files.append({p: p.stat().st_mtime_ns for p in (tmp_path / "j").rglob("*") if p.is_file()})
    assert answers[0]["complete"] and not answers[0].get("already"), answers
    assert answers[1]["ok"] and answers[1]["complete"] and answers[1]["already"], answers
    assert files[1] == files[0]  # not one file written again
    vdir = persist.version_dir(tmp_path / "j", 2)
    persist.remove_rank(vdir, 0)  # what a failed flush's cleanup does: nothing, to a complete version
    assert {p: p.stat().st_mtime_ns for p in (tmp_path / "j").rglob("*") if p.is_file()} == files[0]
    assert persist.complete_versions(tmp_path / "j") == [2]
