"""Codec benchmark: throughput next to a plain copy, and compression next to zlib, on a real AdamW state.

Trains TinyGPT with AdamW for a number of steps, then takes the last two states and measures, in
one run and interleaved (medians over repeats):

- pack (state -> flat buffer), encode (XOR delta + byte planes + checksums), decode (verify +
  apply + checksum, into a new buffer), decode in place (onto the held base, as a replica
  holder does) and the checksum alone, each as throughput and as a ratio to a plain tensor copy
  of the same bytes on the same device;
- the lossless delta's compression ratio per kind of tensor (params, exp_avg, exp_avg_sq) and
  overall, next to zlib level 1 on the same XOR bytes.

Usage: ``ffstate bench codec [--size medium] [--steps 50] [--device cpu|cuda]`` (or
``python -m ffstate.bench.codec``). Prints a table; writes ``bench/results/codec-<device>.json``
and a PNG plot beside it.
"""

from __future__ import annotations

import argparse
import copy
import logging
import zlib
from pathlib import Path

import numpy as np
import torch

from ffstate import codec
from ffstate.bench._report import environment, median_seconds, publish, pyplot, table
from ffstate.testing.models import TinyGPT

log = logging.getLogger("ffstate.bench.codec")

SIZES = {  # TinyGPT shapes; fp32 model + AdamW state is about 12 bytes per parameter
    "small": dict(vocab=256, dim=64, heads=4, layers=2, seq=64),
    "medium": dict(vocab=1024, dim=256, heads=8, layers=4, seq=64),
    "large": dict(vocab=4096, dim=512, heads=8, layers=8, seq=128),
    # Many small tensors (about 7,700 with AdamW's), where a commit's per-tensor costs show, not its copy.
    "deep": dict(vocab=256, dim=32, heads=2, layers=160, seq=32),
}


def adamw_states(size: str, steps: int, device: str, lr: float, seed: int = 0) -> tuple[dict, dict, int]:
    """The training states after steps-1 and steps of AdamW; and the parameter count."""
    torch.manual_seed(seed)
    model = TinyGPT(**SIZES[size]).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1)
    vocab = model.tok.num_embeddings
    prev = None
    for step in range(steps):
        loss = model.loss(torch.randint(0, vocab, (8, model.seq + 1), device=device))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if step == steps - 2:
            prev = copy.deepcopy({"model": model.state_dict(), "optim": opt.state_dict()})
    cur = copy.deepcopy({"model": model.state_dict(), "optim": opt.state_dict()})
    return prev, cur, sum(p.numel() for p in model.parameters())


def kind_subsets(state: dict) -> dict[str, dict]:
    """The state's fp32 tensors by kind: parameters, and each AdamW moment."""
    out = {"params": {k: v for k, v in state["model"].items() if v.dtype == torch.float32}}
    for moment in ("exp_avg", "exp_avg_sq"):
        out[moment] = {k: v[moment] for k, v in state["optim"]["state"].items()}
    return out


def compression(prev: dict, cur: dict) -> dict[str, dict]:
    """Per kind and overall: raw bytes, ffstate delta bytes, zlib-1 bytes of the same XOR."""
    subsets = {**{k: (a, b) for (k, a), b in zip(kind_subsets(prev).items(), kind_subsets(cur).values())},
               "overall": (prev, cur)}
    out = {}
    for kind, (a, b) in subsets.items():
        sa, sb = codec.pack(a), codec.pack(b)
        packed = codec.encode_snapshot(sb, sa)
        xor = np.bitwise_xor(sa.buffer.cpu().numpy(), sb.buffer.cpu().numpy())
        zl = len(zlib.compress(xor.tobytes(), 1))
        out[kind] = {"raw_bytes": packed.raw_nbytes, "ffstate_bytes": packed.nbytes, "zlib1_bytes": zl,
                     "ffstate_ratio": packed.raw_nbytes / packed.nbytes, "zlib1_ratio": packed.raw_nbytes / zl}
        if kind != "overall":  # all fp32: what fraction of each byte plane of the XOR is zero
            planes = xor[: xor.size // 4 * 4].reshape(-1, 4)
            out[kind]["zero_fraction_per_plane"] = [float((planes[:, p] == 0).mean()) for p in range(4)]
    return out


def throughput(prev: dict, cur: dict, repeats: int, device: str) -> dict[str, dict]:
    sa, sb = codec.pack(prev), codec.pack(cur)
    slot = torch.empty_like(sb.buffer)
    dst = torch.empty_like(sb.buffer)
    packed = codec.encode_snapshot(sb, sa)
    # In place, as a replica holder applies it: forward onto a copy of the base, then back again.
    back = codec.encode_snapshot(sa, sb)
    held = codec.Snapshot(sa.manifest, sa.buffer.clone(), sa.checksum)

    def apply_forth_and_back() -> None:
        s1 = codec.decode_snapshot(packed, held, inplace=True)
        codec.decode_snapshot(back, s1, inplace=True)

    xor = np.bitwise_xor(sa.buffer.cpu().numpy(), sb.buffer.cpu().numpy()).tobytes()
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    fns = {
        "copy": lambda: dst.copy_(sb.buffer),
        "pack": lambda: codec.pack_into(cur, slot, sb.manifest),
        "checksum": lambda: codec.buffer_checksum(sb.buffer),
        "encode": lambda: codec.encode_snapshot(sb, sa),
        "decode": lambda: codec.decode_snapshot(packed, sa),
        "decode in place": apply_forth_and_back,
    }
    secs = median_seconds(fns, repeats, sync)
    secs["decode in place"] /= 2  # two applies per call
    secs["encode+decode in place"] = secs["encode"] + secs["decode in place"]
    secs["zlib1 (encode only)"] = median_seconds({"z": lambda: zlib.compress(xor, 1)}, max(1, repeats // 3))["z"]
    n = sb.manifest.nbytes
    return {k: {"seconds": s, "GBps": n / s / 1e9, "vs_copy": secs["copy"] / s} for k, s in secs.items()}


def run(size: str, steps: int, repeats: int, device: str, lr: float, out_dir: Path) -> dict:
    log.info("training TinyGPT-%s for %d AdamW steps on %s", size, steps, device)
    prev, cur, n_params = adamw_states(size, steps, device, lr)
    result = {
        "benchmark": "codec",
        "environment": environment(device),
        "config": {"size": size, "params": n_params, "steps": steps, "lr": lr, "repeats": repeats,
                   "chunk_bytes": codec.DEFAULT_CHUNK_BYTES},
        "compression": compression(prev, cur),
        "throughput": throughput(prev, cur, repeats, device),
    }
    tag = "cuda" if device.startswith("cuda") else "cpu"
    return publish(out_dir, f"codec-{tag}", result, report, plot)


def report(result: dict) -> str:
    cfg = result["config"]
    mb = result["compression"]["overall"]["raw_bytes"] / 1e6
    lines = [f"TinyGPT-{cfg['size']}: {cfg['params'] / 1e6:.2f}M params, {mb:.1f} MB of state, delta between "
             f"AdamW steps {cfg['steps'] - 1} and {cfg['steps']} (lr {cfg['lr']}), on {result['environment']['device']}",
             ""]
    rows = [[k, f"{v['raw_bytes'] / 1e6:.2f}", f"{v['ffstate_ratio']:.3f}x", f"{v['zlib1_ratio']:.3f}x",
             " ".join(f"{z:.2f}" for z in v.get("zero_fraction_per_plane", []))]
            for k, v in result["compression"].items()]
    lines.append(table(rows, ["lossless delta", "raw MB", "ffstate", "zlib-1 on XOR", "zero bytes, planes 0-3"]))
    lines.append("")
    rows = [[k, f"{v['GBps']:.3f}", f"{v['vs_copy']:.3f}", f"{v['seconds'] * 1e3:.1f}"]
            for k, v in result["throughput"].items()]
    lines.append(table(rows, [f"throughput (median of {cfg['repeats']})", "GB/s", "x copy", "ms"]))
    return "\n".join(lines)


def plot(result: dict, path: Path) -> Path | None:
    plt = pyplot()
    if plt is None:
        return None
    comp, thr = result["compression"], result["throughput"]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    kinds = list(comp)
    x = np.arange(len(kinds))
    a.bar(x - 0.2, [comp[k]["ffstate_ratio"] for k in kinds], 0.4, label="ffstate")
    a.bar(x + 0.2, [comp[k]["zlib1_ratio"] for k in kinds], 0.4, label="zlib-1 on XOR")
    a.set_xticks(x, kinds)
    a.set_ylabel("compression ratio (raw / encoded)")
    a.axhline(1.0, color="grey", lw=0.5)
    a.legend(loc="lower right")
    a.set_title("lossless delta, consecutive AdamW steps")
    ops = [k for k in thr if k != "copy"]
    b.barh(ops, [thr[k]["vs_copy"] for k in ops])
    b.axvline(1.0, color="grey", lw=0.5)
    b.set_xlabel("throughput / plain copy of the same bytes")
    b.set_title(f"on {result['environment']['device']} (copy {thr['copy']['GBps']:.1f} GB/s)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--size", choices=sorted(SIZES), default="medium", help="TinyGPT size (default: medium)")
    p.add_argument("--steps", type=int, default=30, help="AdamW steps before the measured delta (default: 30)")
    p.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate (default: 1e-3)")
    p.add_argument("--repeats", type=int, default=7, help="timed repeats; medians are reported (default: 7)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   help="cpu (reference path) or cuda (Triton kernels); default: cuda when present")
    p.add_argument("--out", type=Path, default=Path("bench/results"), help="results folder (default: bench/results)")


def main(args: argparse.Namespace) -> int:
    if args.steps < 2:
        raise SystemExit("--steps must be at least 2: the benchmark measures the delta between the last two steps")
    run(args.size, args.steps, args.repeats, args.device, args.lr, args.out)
    return 0


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    raise SystemExit(main(parser.parse_args()))
