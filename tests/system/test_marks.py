"""ffstate/scheduling/marks.py under real torchrun: FSDP2's collectives marked for the scheduler, without changing a bit."""


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



def test_a_hook_registered_through_ffstate_marks_its_buckets_and_ddp_s_buffer_broadcasts(tmp_path):
    """``ffstate.register_comm_hook`` marks the user's hook's work on each gradient bucket and, as ffstate's own hook
    does, DDP's broadcast of the module's buffers before each forward (one process, gloo): the scheduler sees every
    collective the step waits in. The hook's result is DDP's gradient as without ffstate."""
    import torch
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    import ffstate

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        counts, grads = {}, {}
        for broadcast in (True, False):
            torch.manual_seed(0)
            model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))  # BatchNorm: buffers
            ddp = torch.nn.parallel.DistributedDataParallel(model, broadcast_buffers=broadcast)
            ffstate.register_comm_hook(ddp, None, default_hooks.allreduce_hook)
            seen = []
            for _ in range(3):
                ddp(torch.randn(8, 4)).sum().backward()
                seen.append(ddp._ffstate_marks.count)
            counts[broadcast], grads[broadcast] = seen, [p.grad.clone() for p in model.parameters()]
        assert counts[False] == [1, 2, 3]  # one bucket a step
        assert counts[True] == [2, 4, 6]  # and the buffers' broadcast
        assert all(torch.equal(a, b) for a, b in zip(grads[True], grads[False]))
    finally:
        dist.destroy_process_group()
