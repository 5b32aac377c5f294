"""The benchmarks run end to end (tiny sizes; the numbers are not looked at here, only that they exist)."""

import json
import os
import subprocess
import sys

import pytest


@pytest.mark.timeout(300)
@pytest.mark.parametrize("args, name", [
    (["codec", "--size", "small", "--steps", "2", "--repeats", "1"], "codec-cpu"),
    (["bandwidth", "--size", "1M", "--chunks", "256K", "--repeats", "1"], "bandwidth"),
    (["capture", "--size", "small", "--repeats", "1"], "capture"),
    (["recovery", "--sizes", "small", "--repeats", "1"], "recovery"),
    (["overhead", "--parallel", "ddp", "--modes", "off,naive,scheduler", "--steps", "4", "--repeats", "1"], "overhead"),
])
def test_benchmark_writes_its_results(tmp_path, args, name):
    out = subprocess.run([sys.executable, "-m", "ffstate.cli", "bench", *args, "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=280, env={**os.environ, "MPLBACKEND": "Agg"})
    assert out.returncode == 0, out.stderr
    result = json.loads((tmp_path / f"{name}.json").read_text())
    assert result["benchmark"] == name.split("-")[0]
    assert (tmp_path / f"{name}.png").exists()
