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
