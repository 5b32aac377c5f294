"""ffstate/marks.py under real torchrun: FSDP2's collectives marked for the scheduler, without changing a bit."""


def test_fsdp2_collectives_are_marked_without_changing_a_bit(tmp_path):
    """FSDP2 has no DDP hook: its all-gathers and reduce-scatters are marked through FSDPModule's custom
    collectives, which must leave the training bit for bit as it was (real torchrun, 2 gloo ranks). The
    commit's capture of the sharded model must be state_dict()'s local shards."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).parents[1] / "procs" / "fsdp_marks.py"
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(script), str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    for rank in range(2):
        got = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert got["marked_modules"] == 3  # the root and both blocks
        # per step: 3 all-gathers forward, 2 again backward (the root stays unsharded), 3 reduce-scatters
        assert got["counts"] == [8, 16, 24] and got["inflight"] == 0
        assert got["tensors"] > 100 and got["differ"] == []
        assert got["capture_differs"] == []  # the commit reads state_dict(keep_vars=True): the same tensors

