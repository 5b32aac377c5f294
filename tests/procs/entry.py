"""Under torchrun (2 ranks): enter ffstate.replicate with Config.razor_identical naming nothing in the state;
prints the error every rank gets at entry.

    torchrun --nproc-per-node 2 tests/procs/entry.py
"""

import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import ffstate  # noqa: E402


def main() -> None:
    dist.init_process_group("gloo")
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.AdamW(model.parameters())
    try:
        with ffstate.replicate(model, opt, config=ffstate.Config.from_env(razor_identical="model,optim/stat")):
            print("entered", flush=True)
    except ffstate.FFStateError as e:
        print(f"refused at entry: {e}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
