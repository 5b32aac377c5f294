"""Recovery benchmark: ffstate against torch.save and torch.distributed.checkpoint, at equal protection and equal overhead.

One process per state size (a one-rank gloo group, so DCP's async save runs), a real node daemon,
TinyGPT + AdamW. Measured in one run, interleaved, medians over repeats:

- the training step, and the time each way of protecting it holds the training loop after the
  step: ``ff.commit``, ``torch.save`` of the state to a file, ``dcp.save``, and ``dcp.async_save``
  (the call, plus waiting for the previous async save to finish, as a user's loop must); between
  ways the page cache is written out (``os.sync``, untimed), so that no way pays for the writeback of
  another's files (``dcp.async_save``'s writer thread may still run into the next way: the work it defers);
- each way's restore into the live model and optimizer: ffstate from the node's shared memory,
  ``torch.load`` + ``load_state_dict``, ``dcp.load``.

From those, two comparisons:

(a) **equal protection** (every way saves every step): the per-step overhead of each;
(b) **equal overhead** (each baseline saves every N steps, N the smallest cadence whose amortized
    overhead is at most ffstate's per-step overhead): steps lost on a kill (ffstate 0 for a worker
    killed between steps; a baseline N/2 on average), and the time to regain the progress the
    failure cost: restore + recomputing the lost steps.

With ``--resize`` (``resize.py``), also a job resumed at another world size from the replicas against
``dcp.load`` at the new size; with ``--drain``, a drain's downtime under an elastic torchrun.

Usage: ``ffstate bench recovery [--sizes small,medium] [--repeats 5] [--dir PATH] [--resize] [--drain]``. Prints a table;
writes ``bench/results/recovery.json`` and a PNG plot beside it.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import time
import secrets
import shutil
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

import ffstate
from ffstate import capture, layout, recovery
from ffstate.bench._report import environment, free_ports, median_seconds, publish, pyplot, table
from ffstate.bench.bandwidth import start_daemon
from ffstate.bench.codec import SIZES
from ffstate.client import Client
from ffstate.testing.models import TinyGPT

log = logging.getLogger("ffstate.bench.recovery")
WAYS = ("ffstate", "torch.save", "dcp.save", "dcp.async_save")


def measure(size: str, repeats: int, work: Path, token: str) -> dict:
    import torch.distributed.checkpoint as dcp  # here: 0.7 s to import, which every `ffstate` command would pay

    torch.manual_seed(0)
    model = TinyGPT(**SIZES[size])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    vocab, seq = SIZES[size]["vocab"], SIZES[size]["seq"]

    def step() -> None:
        idx = torch.randint(0, vocab, (8, seq + 1))
        loss = torch.nn.functional.cross_entropy(model(idx[:, :-1]).reshape(-1, vocab), idx[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    for _ in range(2):
        step()
    state = lambda: {"model": model.state_dict(), "optim": opt.state_dict()}  # noqa: E731
    nbytes = layout.describe(state()).nbytes
    daemon, address = start_daemon(token, memory=8 * nbytes + (512 << 20))
    job = f"bench-recovery-{size}"
    cfg = ffstate.Config(job_id=job, token=token, base_port=int(address.rsplit(":", 1)[1]), start_daemon=False)
    ckpt, dcp_dir, async_dir = work / f"{size}.pt", work / f"{size}-dcp", work / f"{size}-dcp-async"
    pending = [None]
    try:
        with ffstate.replicate(model, opt, config=cfg) as ff:
            n = iter(range(1, 1 << 30))

            def async_save() -> None:
                if pending[0] is not None:
                    pending[0].result()
                pending[0] = dcp.async_save(state(), checkpoint_id=async_dir)

            protect = {"ffstate": lambda: ff.commit(next(n)), "torch.save": lambda: torch.save(state(), ckpt),
                       "dcp.save": lambda: dcp.save(state(), checkpoint_id=dcp_dir), "dcp.async_save": async_save}
            # Each way's hold is timed right after a real step (the state just changed), interleaved.
            # Between ways the kernel writes out the files the savers left in the page cache (os.sync, not
            # timed): 1 GB of dirty pages a round at the large size, whose writeback otherwise lands, at the
            # kernel's moment, inside the next way's timing, most visibly in ffstate's 25-ms memory copy.
            held = median_seconds({w: _after(step, fn) for w, fn in protect.items()}, repeats, sync=os.sync,
                                  self_timed=True)
            base = median_seconds({"step": step}, repeats)["step"]
            if pending[0] is not None:
                pending[0].result()
            with Client(address, token, timeout=60) as node:
                local = node.lookup(job, 0, 1)

                def ff_restore() -> None:
                    v = ff._last
                    got = recovery.fetch(job, 0, 1, v, recovery.Available(local=[v]), local, {}, v)
                    capture.restore(model, opt, None, None, got.state)

                def torch_restore() -> None:
                    saved = torch.load(ckpt, weights_only=True)
                    model.load_state_dict(saved["model"])
                    opt.load_state_dict(saved["optim"])

                def dcp_restore() -> None:
                    sd = state()
                    dcp.load(sd, checkpoint_id=dcp_dir)
                    model.load_state_dict(sd["model"])
                    opt.load_state_dict(sd["optim"])

                restores = median_seconds({"ffstate": ff_restore, "torch.save": torch_restore,
                                           "dcp.save": dcp_restore, "dcp.async_save": dcp_restore}, repeats)
    finally:
        daemon.terminate()
        daemon.wait(30)
    ways = {w: {"overhead_seconds": held[w], "restore_seconds": restores[w]} for w in WAYS}
    ff_over = max(ways["ffstate"]["overhead_seconds"], 1e-6)
    for w, row in ways.items():
        cadence = 1 if w == "ffstate" else max(1, math.ceil(row["overhead_seconds"] / ff_over))
        lost = 0.0 if w == "ffstate" else cadence / 2
        row.update(cadence=cadence, expected_steps_lost=lost,
                   regain_seconds=row["restore_seconds"] + lost * base)
    return {"state_bytes": nbytes, "step_seconds": base, "ways": ways}


def measure_disk(size: str, repeats: int, work: Path, token: str) -> dict:
    """The whole job lost: resuming from the persistent tier (a version the daemon flushed: its files checked, read
    back and loaded, as a rank that finds no live copy does) against ``dcp.load`` of the same checkpoint into the
    same model and optimizer (DCP's own ``get_state_dict`` / ``set_state_dict``)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from ffstate import persist

    torch.manual_seed(0)
    model = TinyGPT(**SIZES[size])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    vocab, seq = SIZES[size]["vocab"], SIZES[size]["seq"]
    idx = torch.randint(0, vocab, (8, seq + 1))
    torch.nn.functional.cross_entropy(model(idx[:, :-1]).reshape(-1, vocab), idx[:, 1:].reshape(-1)).backward()
    opt.step()
    nbytes = layout.describe({"model": model.state_dict(), "optim": opt.state_dict()}).nbytes
    store = work / f"{size}-persist"
    daemon, address = start_daemon(token, memory=8 * nbytes + (512 << 20),
                                   extra=["--persist-dir", str(store), "--persist-every", "1"])
    job = f"bench-recovery-disk-{size}"
    cfg = ffstate.Config(job_id=job, token=token, base_port=int(address.rsplit(":", 1)[1]), start_daemon=False)
    try:
        with ffstate.replicate(model, opt, config=cfg) as ff:
            ff.commit(1)
            deadline = time.monotonic() + 120
            while not persist.complete_versions(store / job) and time.monotonic() < deadline:
                time.sleep(0.05)
    finally:
        daemon.terminate()
        daemon.wait(60)
    vdir = persist.version_dir(store / job, 1)
    os.sync()

    def ff_resume() -> None:
        persist.check(vdir, [0])
        state, _ = persist.read_shard(vdir, 0)
        capture.restore(model, opt, None, None, state)

    def dcp_resume() -> None:
        msd, osd = get_state_dict(model, opt)
        dcp.load({"model": msd, "optim": osd}, checkpoint_id=vdir)
        set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd)

    got = median_seconds({"ffstate": ff_resume, "dcp.load": dcp_resume}, repeats)
    return {"state_bytes": nbytes, "disk_bytes": sum(p.stat().st_size for p in vdir.iterdir()),
            "ffstate_seconds": got["ffstate"], "dcp_load_seconds": got["dcp.load"]}


def _after(step, protect):
    """A function that steps, then protects, and returns the seconds the protection took."""
    def fn() -> float:
        step()
        start = time.perf_counter()
        protect()
        return time.perf_counter() - start

    return fn


def run(sizes: list[str], repeats: int, work_dir: Path | None, out_dir: Path, resize: bool = False,
        drain: bool = False) -> dict:
    token = secrets.token_hex(8)
    work = Path(tempfile.mkdtemp(prefix="ffstate-recovery-", dir=work_dir))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_ports(1)}", rank=0, world_size=1)
    old = {k: os.environ.pop(k, None) for k in ("WORLD_SIZE", "TORCHELASTIC_RUN_ID")}
    try:
        sizes_out = {s: measure(s, repeats, work, token) for s in sizes}
        for s in sizes:
            sizes_out[s]["whole_job_lost"] = measure_disk(s, repeats, work, token)
    finally:
        dist.destroy_process_group()
        shutil.rmtree(work, ignore_errors=True)
        for k, v in old.items():
            if v is not None:
                os.environ[k] = v
    result = {"benchmark": "recovery", "environment": environment("cpu"),
              "config": {"sizes": sizes, "repeats": repeats, "checkpoint_dir": str(work.parent)}, "sizes": sizes_out}
    from ffstate.bench import resize as resize_bench

    if resize:
        result["resize"] = resize_bench.measure_resize(sizes[0], repeats)
    if drain:
        result["drain"] = resize_bench.measure_drain(sizes[0])
    return publish(out_dir, "recovery", result, report, plot)


def report(result: dict) -> str:
    rows = []
    for size, r in result["sizes"].items():
        ff = r["ways"]["ffstate"]
        for w, row in r["ways"].items():
            rows.append([f"{size} ({r['state_bytes'] / 1e6:.0f} MB)", w, f"{r['step_seconds'] * 1e3:.0f}",
                         f"{row['overhead_seconds'] * 1e3:.1f}",
                         f"{row['overhead_seconds'] / max(ff['overhead_seconds'], 1e-9):.1f}",
                         f"{row['restore_seconds'] * 1e3:.0f}", str(row["cadence"]), f"{row['expected_steps_lost']:.1f}",
                         f"{row['regain_seconds'] * 1e3:.0f}",
                         f"{row['regain_seconds'] / max(ff['regain_seconds'], 1e-9):.1f}"])
    head = (f"median of {result['config']['repeats']}; (a) equal protection: overhead per step when saving every "
            "step; (b) equal overhead: the baseline saves every N steps")
    disk = [[f"{size} ({r['state_bytes'] / 1e6:.0f} MB)", f"{d['disk_bytes'] / 1e6:.1f}",
             f"{d['ffstate_seconds'] * 1e3:.0f}", f"{d['dcp_load_seconds'] * 1e3:.0f}",
             f"{d['ffstate_seconds'] / max(d['dcp_load_seconds'], 1e-9):.2f}"]
            for size, r in result["sizes"].items() if (d := r.get("whole_job_lost"))]
    out = [head, "", table(rows, ["state", "way", "step ms", "(a) overhead ms", "x ffstate", "restore ms",
                                  "(b) every N", "steps lost", "regain ms", "x ffstate"])]
    if disk:
        out += ["", "the whole job lost: resuming from the persistent tier (files checked, read, loaded) against "
                "dcp.load of the same checkpoint",
                table(disk, ["state", "on disk MB", "ffstate ms", "dcp.load ms", "ffstate / dcp.load"])]
    if "resize" in result or "drain" in result:
        from ffstate.bench.resize import report_rows

        out += report_rows(result.get("resize"), result.get("drain"))
    return "\n".join(out)


def plot(result: dict, path: Path) -> Path | None:
    plt = pyplot()
    if plt is None:
        return None
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8))
    sizes = list(result["sizes"])
    width = 0.8 / len(WAYS)
    for i, w in enumerate(WAYS):
        xs = [j + i * width for j in range(len(sizes))]
        left.bar(xs, [result["sizes"][s]["ways"][w]["overhead_seconds"] * 1e3 for s in sizes], width, label=w)
        right.bar(xs, [result["sizes"][s]["ways"][w]["regain_seconds"] * 1e3 for s in sizes], width, label=w)
    for ax, title in ((left, "(a) overhead per step, saving every step"),
                      (right, "(b) time to regain the lost progress, equal overhead")):
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(sizes))], sizes)
        ax.set_ylabel("ms")
        ax.set_title(title, fontsize=9)
    left.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sizes", default="small,medium", help="TinyGPT sizes (default small,medium; large is ~0.4 GB)")
    p.add_argument("--repeats", type=int, default=5, help="timed repeats; medians are reported (default 5)")
    p.add_argument("--dir", type=Path, help="where the baselines write their checkpoints (default: the temp dir)")
    p.add_argument("--out", type=Path, default=Path("bench/results"), help="results folder (default: bench/results)")
    p.add_argument("--resize", action="store_true", help="also a job resumed at another world size from the replicas "
                   "against dcp.load at the new size (torchrun jobs)")
    p.add_argument("--drain", action="store_true", help="also a drain's downtime under torchrun --nnodes 1:2 (two "
                   "network namespaces: needs root)")


def main(args: argparse.Namespace) -> int:
    sizes = [s for s in args.sizes.split(",") if s]
    if not set(sizes) <= set(SIZES):
        raise SystemExit(f"--sizes takes {sorted(SIZES)}")
    run(sizes, args.repeats, args.dir, args.out, resize=args.resize, drain=args.drain)
    return 0


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    raise SystemExit(main(parser.parse_args()))
