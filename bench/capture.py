"""Capture and restore benchmark: what ``ff.commit`` holds the training loop for, and how fast a rank comes back.

One process, a real node daemon and a real remote holder (``ffstate serve`` subprocesses on
loopback), a TinyGPT + AdamW state. Measured in one run, interleaved, medians over repeats:

- **commit**: ``ff.commit(step)`` of ``ffstate.replicate`` (capture, one copy into the shared-memory
  slot, publish), next to the two ways a user would copy the same state: into buffers that are
  already allocated and warm (**warm copy**, the floor), and into new tensors (**clone**, what a
  snapshot in memory costs). With ``--device cuda`` the state is on the GPU: the commit is staged and
  returns before its copy into the slot lands, so **commit landed** (``commit`` then ``flush``) is
  measured too, and the floor is one device-to-host copy of the state's bytes into pinned memory;
- **local restore** (the node survived): from the node's slots into the live model and optimizer,
  checksum verified, next to a clone of the state (memory-copy speed);
- **remote restore** (the node is new): fetched from the holder (over its bulk socket, as a restore does: a gRPC
  call for the ticket, the chunks on a plain TCP connection; ``ffstate/bulk/``), decoded and verified, into the live
  model and optimizer, next to the fetch alone (the transport), the same restore and fetch over gRPC alone (a
  client with the bulk socket off), and the state's bytes pulled from the holder's side over a raw TCP socket (what
  the link itself gives). The timed restores fetch a version the holder has served before, its encoding cached;
  **remote restore, cold** fetches one it has just received, encoded for that fetch, as after a failure.

With ``--link RATE`` (e.g. ``1gbit``; needs root) the remote holder is another node: it runs in
a second network namespace behind a ``tc``-shaped veth link, and the transport is that link.

Usage: ``ffstate bench capture [--size medium] [--repeats 9] [--link loopback|RATE] [--device cpu|cuda]``. Prints a
table; writes ``bench/results/capture[-RATE].json`` and a PNG plot beside it.
"""

from __future__ import annotations

import argparse
import logging
import os
import secrets
import subprocess
import sys
import time
from pathlib import Path

import torch

import ffstate
from ffstate import capture, recovery
from ffstate.bench import netns
from ffstate.bench._report import environment, median_seconds, publish, pyplot, table
from ffstate.bench.bandwidth import RawPull, start_daemon
from ffstate.bench.codec import SIZES
from ffstate.client import Client, fetch_striped
from ffstate.testing.models import TinyGPT

log = logging.getLogger("ffstate.bench.capture")
JOB = "bench-capture"


def _job(size: str, steps: int = 2, device: str = "cpu"):
    torch.manual_seed(0)
    model = TinyGPT(**SIZES[size]).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=100)
    vocab = model.tok.num_embeddings
    for _ in range(steps):
        loss = model.loss(torch.randint(0, vocab, (8, model.seq + 1), device=device))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
    return model, opt, sched


def _tensors(state) -> list[torch.Tensor]:
    out = []
    if isinstance(state, torch.Tensor):
        return [state]
    if isinstance(state, dict):
        state = list(state.values())
    if isinstance(state, (list, tuple)):
        for v in state:
            out += _tensors(v)
    return out


def run(size: str, repeats: int, out_dir: Path, link: str = "loopback", holder: str = "", device: str = "cpu") -> dict:
    """``holder`` is ``NAMESPACE@ADDRESS`` for a holder across a shaped link (``main`` sets it up)."""
    token = secrets.token_hex(8)
    cuda = device.startswith("cuda")
    if cuda and not torch.cuda.is_available():
        raise SystemExit(f"--device {device}: this torch sees no CUDA device")
    model, opt, sched = _job(size, device=device)
    extra = {"epoch": 0, "offset": 0}
    state_tensors = _tensors(capture.capture(model, opt, sched, extra))
    nbytes = sum(t.numel() * t.element_size() for t in state_tensors)
    warm = [torch.empty_like(t) for t in state_tensors]
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    if cuda:  # the floor: one device-to-host copy of the state's bytes, into pinned memory
        flat = torch.empty(nbytes, dtype=torch.uint8, device=device)
        pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def warm_copy() -> None:
        if cuda:
            pinned.copy_(flat, non_blocking=True)
        else:
            for dst, src in zip(warm, state_tensors):
                dst.copy_(src)
        sync()

    def clone() -> None:
        [t.clone() for t in state_tensors]
        sync()

    node, node_addr = start_daemon(token, memory=8 * nbytes + (256 << 20))
    holder_ns, _, holder_host = holder.partition("@")
    holder, holder_addr = start_daemon(token, memory=8 * nbytes + (256 << 20), host=holder_host or "127.0.0.1",
                                       prefix=["ip", "netns", "exec", holder_ns] if holder_ns else [])
    port = int(node_addr.rsplit(":", 1)[1])
    cfg = ffstate.Config(job_id=JOB, token=token, base_port=port, start_daemon=False, simulated_nodes=0)
    old_env = {k: os.environ.pop(k, None) for k in ("WORLD_SIZE", "TORCHELASTIC_RUN_ID")}
    raw = None
    try:
        raw = RawPull(nbytes, host=holder_host or "127.0.0.1", prefix=["ip", "netns", "exec", holder_ns] if holder_ns else [])
        with ffstate.replicate(model, opt, sched, extra=extra, config=cfg) as ff, \
                Client(node_addr, token, timeout=60) as node_client, Client(holder_addr, token, timeout=60) as remote, \
                Client(holder_addr, token, timeout=60) as remote_grpc:
            remote_grpc.bulk = False  # the same holder over gRPC alone, for the comparison
            step = iter(range(1, 1 << 30))
            ff.commit(next(step))
            landed = lambda: (ff.commit(next(step)), ff.flush())  # noqa: E731
            commit = median_seconds({"ffstate commit": lambda: ff.commit(next(step)), "commit landed": landed,
                                     "warm copy": warm_copy, "clone": clone}, repeats)
            ff.flush()
            version = ff._last
            local = node_client.lookup(JOB, 0, 1)
            mine = recovery.Available(local=[version], remote={holder_addr: [version]})
            remote.push_and_commit(JOB, 0, 1, version, node_client.fetch(JOB, 0, 1, version))

            def restore(local_msg, holders) -> None:
                got = recovery.fetch(JOB, 0, 1, version, mine if local_msg else
                                     recovery.Available(remote=mine.remote), local_msg, holders, version)
                capture.restore(model, opt, sched, extra, got.state)
                sync()

            def restore_cold() -> float:  # a version the holder has not encoded yet, as after a failure
                ff.commit(next(step))
                ff.flush()
                v = ff._last
                remote.push_and_commit(JOB, 0, 1, v, node_client.fetch(JOB, 0, 1, v))
                start = time.perf_counter()
                got = recovery.fetch(JOB, 0, 1, v, recovery.Available(remote={holder_addr: [v]}), None,
                                     {holder_addr: remote}, v)
                capture.restore(model, opt, sched, extra, got.state)
                sync()
                return time.perf_counter() - start

            restore_t = median_seconds({
                "local restore": lambda: restore(local, {}),
                "remote restore": lambda: restore(None, {holder_addr: remote}),
                "remote restore over gRPC": lambda: restore(None, {holder_addr: remote_grpc}),
                "fetch alone": lambda: fetch_striped([remote], JOB, 0, 1, version),
                "gRPC fetch alone": lambda: fetch_striped([remote_grpc], JOB, 0, 1, version),
                "raw TCP": raw,
                "clone": clone,
            }, repeats)
            cold = median_seconds({"cold": restore_cold}, repeats, self_timed=True)["cold"]  # last: versions move on
            remote.drop(JOB)
    finally:
        for k, v in old_env.items():
            if v is not None:
                os.environ[k] = v
        if raw is not None:
            raw.close()
        for proc in (node, holder):
            proc.terminate()
            proc.wait(30)
    result = {
        "benchmark": "capture",
        "environment": environment(device),
        "config": {"size": size, "state_bytes": nbytes, "tensors": len(state_tensors), "repeats": repeats,
                   "link": link, "device": device},
        "seconds": {"commit": commit["ffstate commit"], "commit_landed": commit["commit landed"],
                    "warm_copy": commit["warm copy"],
                    "clone": (commit["clone"] + restore_t["clone"]) / 2, "local_restore": restore_t["local restore"],
                    "remote_restore": restore_t["remote restore"], "remote_restore_cold": cold,
                    "fetch": restore_t["fetch alone"],
                    "remote_restore_grpc": restore_t["remote restore over gRPC"], "fetch_grpc": restore_t["gRPC fetch alone"],
                    "raw_tcp": restore_t["raw TCP"]},
        "transport": "bulk socket" if remote.bulk else "gRPC (the holder has no bulk socket)",
    }
    s = result["seconds"]
    result["ratios"] = {"commit_over_warm_copy": s["commit"] / s["warm_copy"], "commit_over_clone": s["commit"] / s["clone"],
                        "commit_landed_over_warm_copy": s["commit_landed"] / s["warm_copy"],
                        "local_restore_over_clone": s["local_restore"] / s["clone"],
                        "remote_restore_share_of_transport": s["fetch"] / s["remote_restore"],
                        "remote_restore_share_of_raw_tcp": s["raw_tcp"] / s["remote_restore"],
                        "remote_restore_cold_share_of_raw_tcp": s["raw_tcp"] / s["remote_restore_cold"],
                        "remote_restore_grpc_share_of_raw_tcp": s["raw_tcp"] / s["remote_restore_grpc"]}
    return publish(out_dir, "capture" if link == "loopback" else f"capture-{link}", result, report, plot)


def report(result: dict) -> str:
    s, r, cfg = result["seconds"], result["ratios"], result["config"]
    gbps = lambda sec: f"{cfg['state_bytes'] / sec / 1e9:.2f}"  # noqa: E731
    rows = [
        ["ffstate commit", f"{s['commit'] * 1e3:.1f}", gbps(s["commit"]),
         f"{r['commit_over_warm_copy']:.2f}x warm copy, {r['commit_over_clone']:.2f}x clone"],
        ["commit landed", f"{s['commit_landed'] * 1e3:.1f}", gbps(s["commit_landed"]),
         f"{r['commit_landed_over_warm_copy']:.2f}x warm copy (commit, then flush)"],
        ["warm copy", f"{s['warm_copy'] * 1e3:.1f}", gbps(s["warm_copy"]),
         "floor: one device-to-host copy" if cfg.get("device", "cpu").startswith("cuda") else "floor"],
        ["clone", f"{s['clone'] * 1e3:.1f}", gbps(s["clone"]), "memory-copy speed"],
        ["local restore", f"{s['local_restore'] * 1e3:.1f}", gbps(s["local_restore"]),
         f"{r['local_restore_over_clone']:.2f}x clone"],
        ["remote restore", f"{s['remote_restore'] * 1e3:.1f}", gbps(s["remote_restore"]),
         f"{100 * r['remote_restore_share_of_transport']:.0f}% of the transport's speed, "
         f"{r['remote_restore_share_of_raw_tcp']:.2f}x raw TCP's"],
        *([["remote restore, cold", f"{s['remote_restore_cold'] * 1e3:.1f}", gbps(s["remote_restore_cold"]),
            f"a version the holder encodes for it: {r['remote_restore_cold_share_of_raw_tcp']:.2f}x raw TCP's"]]
          if "remote_restore_cold" in s else []),
        ["fetch alone", f"{s['fetch'] * 1e3:.1f}", gbps(s["fetch"]), f"the transport: {result['transport']}"],
        ["remote restore over gRPC", f"{s['remote_restore_grpc'] * 1e3:.1f}", gbps(s["remote_restore_grpc"]),
         f"{r['remote_restore_grpc_share_of_raw_tcp']:.2f}x raw TCP's (the bulk socket off)"],
        ["gRPC fetch alone", f"{s['fetch_grpc'] * 1e3:.1f}", gbps(s["fetch_grpc"]), "gRPC's Fetch"],
        ["raw TCP", f"{s['raw_tcp'] * 1e3:.1f}", gbps(s["raw_tcp"]), "the link's ceiling"],
    ]
    where = "on loopback" if cfg.get("link", "loopback") == "loopback" else f"across a {cfg['link']} link"
    head = (f"TinyGPT-{cfg['size']} + AdamW on {cfg.get('device', 'cpu')}: {cfg['state_bytes'] / 1e6:.1f} MB in "
            f"{cfg['tensors']} tensors, "
            f"remote holder {where}, median of {cfg['repeats']}")
    return "\n".join([head, "", table(rows, ["", "ms", "GB/s", "vs"])])


def plot(result: dict, path: Path) -> Path | None:
    plt = pyplot()
    if plt is None:
        return None
    s = result["seconds"]
    names = ["commit", "commit_landed", "warm_copy", "clone", "local_restore", "remote_restore", "remote_restore_cold",
             "fetch", "remote_restore_grpc", "fetch_grpc", "raw_tcp"]
    colors = ["tab:blue", "tab:blue", "grey", "grey", "tab:green", "tab:orange", "tab:orange", "grey", "tab:red",
              "grey", "grey"]
    fig, ax = plt.subplots(figsize=(7, 3.6))
    ax.barh([n.replace("_", " ") for n in names][::-1], [s[n] * 1e3 for n in names][::-1], color=colors[::-1])
    ax.set_xlabel("milliseconds (median)")
    ax.set_title(f"capture and restore, {result['config']['state_bytes'] / 1e6:.0f} MB state")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--size", choices=sorted(SIZES), default="medium", help="TinyGPT size (default: medium)")
    p.add_argument("--repeats", type=int, default=9, help="timed repeats; medians are reported (default: 9)")
    p.add_argument("--out", type=Path, default=Path("bench/results"), help="results folder (default: bench/results)")
    p.add_argument("--link", default="loopback",
                   help="loopback, or a tc rate (e.g. 1gbit) between this node and the holder's namespace (needs root)")
    p.add_argument("--device", default="cpu", help="where the training's state lives: cpu, or cuda (a GPU: the "
                   "commit is staged) (default: cpu)")
    p.add_argument("--holder", default="", help=argparse.SUPPRESS)  # NAMESPACE@ADDRESS, set by the outer run


def main(args: argparse.Namespace) -> int:
    if args.link == "loopback" or args.holder:
        run(args.size, args.repeats, args.out, args.link, args.holder, args.device)
        return 0
    why = netns.unavailable()
    if why:
        raise SystemExit(f"--link {args.link}: {why}")
    with netns.shaped_link(args.link) as link:  # this benchmark again, in node 0's namespace
        inner = [sys.executable, "-m", "ffstate.bench.capture", "--size", args.size, "--repeats", str(args.repeats),
                 "--out", str(args.out.resolve()), "--link", args.link, "--device", args.device,
                 "--holder", f"{link.namespaces[1]}@{link.addresses[1]}"]
        return subprocess.run(link.cmd(0, inner), timeout=1800).returncode


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    raise SystemExit(main(parser.parse_args()))
