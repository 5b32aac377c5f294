"""The DDP shadow step after a restore (``capture.shadow_step``) in one process of a gloo group: it reduces its
gradients, so that DDP records their order and rebuilds its buckets as a run that never stopped has them, even
where the first forward after the restore comes inside ``no_sync`` (gradient accumulation); and the Hugging Face
adapter finds the DDP module under ``torch.compile``'s wrapper."""

import torch
import torch.distributed as dist


def test_the_shadow_step_reduces_its_gradients_inside_no_sync_and_leaves_no_sync_as_it_was(tmp_path):
    from ffstate import capture

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        ddp = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 4))
        reduced = []

        def counting(state, bucket):
            reduced.append(bucket.buffer().numel())
            fut = torch.futures.Future()
            fut.set_result(bucket.buffer())
            return fut

        ddp.register_comm_hook(None, counting)
        x = torch.randn(3, 4)
        with ddp.no_sync():
            ddp(x).sum().backward()
            assert reduced == []  # what no_sync means: nothing reduced, no order recorded
            capture.shadow_step(ddp, lambda: ddp(x))
            assert reduced and ddp.require_backward_grad_sync is False
        assert all(p.grad is None for p in ddp.parameters())  # the shadow's gradients dropped

        from ffstate.integrations.hf import _ddp_of

        assert _ddp_of(ddp) is ddp and _ddp_of(torch.compile(ddp)) is ddp and _ddp_of(ddp.module) is None
    finally:
        dist.destroy_process_group()
