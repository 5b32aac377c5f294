"""``ffstate bench codec`` runs end to end and writes what its table is made of: the codec beside its entropy stage
alone, each against a plain copy timed among its own phases (the same state of the cache)."""

import json
import subprocess
import sys

import pytest


def test_bench_codec_measures_the_codec_and_its_stage_against_a_copy(tmp_path):
    out = subprocess.run([sys.executable, "-m", "ffstate.cli", "bench", "codec", "--size", "small", "--steps", "2",
                          "--repeats", "1", "--threads", "1", "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads((tmp_path / "codec-cpu.json").read_text())
    assert set(result["states"]) == {"fp32", "bf16"}
    for state in result["states"].values():
        for name in ("lz4", "zstd"):
            way = state["ways"][name]
            assert way["ratio"] > 1.0  # a delta of consecutive AdamW states compresses
            one = way["1"]  # JSON's key for one thread
            assert one["copy_seconds"] > 0 and one["vs_copy"] == one["copy_seconds"] / (
                one["encode_seconds"] + one["decode_seconds"])
            alone = way["stage_alone"]
            assert alone["copy_seconds"] > 0 and alone["vs_copy"] == pytest.approx(alone["copy_seconds"] / (
                alone["compress_seconds"] + alone["decompress_seconds"]), rel=1e-12)  # the same bytes
            assert alone["bytes"] == state["bytes"]  # the segments tile the buffer
    assert "stage alone" in (tmp_path / "codec-cpu.md").read_text()
