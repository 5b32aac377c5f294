"""Under torchrun (2 ranks): enter ffstate.replicate with what is refused at entry, and print the error every rank
gets: Config.razor_identical naming nothing in the state; an FSDP2 model whose state_dict() gives a new tensor for
an entry (a hook splitting a fused weight, say), which a restore in place could not put back.

    torchrun --nproc-per-node 2 tests/procs/entry.py
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ffstate.startup import collector_paused, exit_now  # noqa: E402

with collector_paused():  # imports without Python's collector: a process start's CPU (ffstate/startup.py)
    import torch
    import torch.distributed as dist

    import ffstate


def main() -> None:
    dist.init_process_group("gloo")
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.AdamW(model.parameters())
    try:
        with ffstate.replicate(model, opt, config=ffstate.Config.from_env(razor_identical="model,optim/stat")):
            print("entered", flush=True)
    except ffstate.FFStateError as e:
        print(f"refused at entry: {e}", flush=True)
    from torch.distributed.fsdp import fully_shard

    sharded = fully_shard(torch.nn.Linear(4, 4))
    sharded.register_state_dict_post_hook(lambda module, sd, prefix, local: sd.update(weight=sd["weight"] * 1))
    try:
        with ffstate.replicate(sharded, torch.optim.AdamW(sharded.parameters())):
            print("entered", flush=True)
    except ffstate.FFStateError as e:
        print(f"refused at entry: {e}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    exit_now()  # not through the interpreter's finalization, where gloo's threads can abort it
