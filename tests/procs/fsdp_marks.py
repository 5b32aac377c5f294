"""torchrun, 2 ranks: FSDP2 (fully_shard) trained twice from the same seed, once with its collectives marked for
the scheduler (``marks.mark_fsdp_collectives``) and once without; writes OUT/rank<R>.json with the marks
counted per step and whether every parameter and optimizer tensor came out bit-identical; and whether the
commit's capture (``state_dict(keep_vars=True)``, detached) gives the tensors ``state_dict()`` gives.

    torchrun --nproc-per-node 2 tests/procs/fsdp_marks.py OUT
"""

import json
import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[2]), str(Path(__file__).resolve().parents[1])]

from ffstate.startup import collector_paused, exit_now  # noqa: E402

with collector_paused():  # imports without Python's collector: a process start's CPU (ffstate/startup.py)
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from ffstate import capture, shm
    from ffstate.scheduling.marks import mark_fsdp_collectives
    from ffstate.testing.models import TinyGPT
    from helpers import bits

STEPS = 3


def train(marks: shm.CommMarks | None) -> tuple[dict, list[int], int]:
    torch.manual_seed(0)
    model = TinyGPT()
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    marked = mark_fsdp_collectives(model, marks) if marks is not None else 0
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    counts = []
    for step in range(STEPS):
        g = torch.Generator().manual_seed(step * 7 + dist.get_rank())
        loss = model.loss(torch.randint(0, model.tok.num_embeddings, (4, model.seq + 1), generator=g))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        counts.append(marks.count if marks is not None else 0)
    state = capture.local({"model": model.state_dict(), "optim": opt.state_dict()})
    return state, counts, marked, capture_differs(model, opt)


def capture_differs(model, opt) -> list[str]:
    """Names where capture's model entries are not state_dict()'s local shards (type, grad, storage)."""
    from torch.distributed.tensor import DTensor

    got = capture.capture(model, opt, None, None)["model"]
    with torch.no_grad():
        want = {k: v.to_local() if isinstance(v, DTensor) else v for k, v in model.state_dict().items()}
    describe = lambda t: (type(t), t.requires_grad, t.dtype, t.shape, t.stride(), t.data_ptr())  # noqa: E731
    return [k for k in want if k not in got or describe(got[k]) != describe(want[k])] + sorted(set(got) - set(want))


def flat(tree, prefix=""):
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from flat(v, f"{prefix}/{k}")
    elif isinstance(tree, torch.Tensor):
        yield prefix, tree


def main() -> None:
    out = Path(sys.argv[1])
    dist.init_process_group("gloo")
    plain, _, _, _ = train(None)
    marks = shm.CommMarks()
    marked_state, counts, marked, captured = train(marks)
    a, b = dict(flat(plain)), dict(flat(marked_state))
    differ = [k for k in a if k not in b or not torch.equal(bits(a[k]), bits(b[k]))]
    (out / f"rank{dist.get_rank()}.json").write_text(json.dumps(
        {"marked_modules": marked, "counts": counts, "inflight": marks._inflight, "tensors": len(a),
         "differ": differ, "capture_differs": captured}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    exit_now()  # not through the interpreter's finalization, where gloo's threads can abort it
