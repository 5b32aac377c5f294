"""Loads a persisted version with torch.distributed.checkpoint alone, no ffstate: under torchrun into an FSDP2
model and its optimizer at this world size (DCP reshards), or in one process (``--plain``) into a plain model and
optimizer; writes every parameter and optimizer state as full tensors to ``--out`` (rank 0).

    torchrun --nproc-per-node 2 tests/procs/dcp_load.py CHECKPOINT --out FILE [--plain]
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from ffstate.startup import collector_paused, exit_now  # noqa: E402

with collector_paused():  # imports without Python's collector: a process start's CPU (ffstate/startup.py)
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from ffstate.demo.worker import MODEL
    from ffstate.testing.models import TinyGPT


def full(t):
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("checkpoint", type=Path)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--plain", action="store_true")
    a = p.parse_args()
    torch.manual_seed(1)  # other values than the checkpoint's: every one must come from it
    model = TinyGPT(**MODEL)
    if not a.plain:
        from torch.distributed.fsdp import fully_shard

        dist.init_process_group("gloo")
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1.0)
    msd, osd = get_state_dict(model, opt)
    dcp.load({"model": msd, "optim": osd}, checkpoint_id=a.checkpoint, no_dist=a.plain)
    set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd)
    msd, osd = get_state_dict(model, opt)
    got = {"model": {k: full(v).clone() for k, v in msd.items()},
           "optim": {f"{fqn}.{k}": full(v).clone() for fqn, s in osd["state"].items() for k, v in s.items()},
           "lr": [g["lr"] for g in osd["param_groups"]]}
    if a.plain or dist.get_rank() == 0:
        torch.save(got, a.out)
    if not a.plain:
        dist.destroy_process_group()
    exit_now(0)  # not through the interpreter's finalization, where gloo's threads can abort it (ffstate/startup.py)


if __name__ == "__main__":
    main()
