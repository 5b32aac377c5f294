"""Codec benchmark: the daemon's encode and decode next to a plain copy, and the compression they get, on real
AdamW states in fp32 and in bf16.

Trains TinyGPT with AdamW (in fp32, and a bf16 copy of the model trained the same way), takes the last two
states and measures, in one run and interleaved (medians over repeats), for each entropy stage (python-blosc2
with LZ4 and with ZSTD, level 1, a byte shuffle by element size) and each number of codec threads:

- encode: the delta (zigzag differences) against the previous state, from packed buffers (what the daemon does
  with a slot), compressed, each chunk checksummed;
- decode in place: every chunk verified, decompressed and added onto the held base, the result checksummed
  (what a holder does);
- both together, as throughput and as a ratio to one plain copy of the same bytes on one thread (NumPy's: torch's
  ``copy_`` splits a large copy across its threads, and made the baseline twice as fast before 2026-11-27), timed
  among the codec's own phases so that it meets the cache in the state they leave it in;
- the compression ratio of the delta (raw bytes / bytes on the wire);
- the entropy stage alone, one thread: blosc2's compression and decompression of the same deltas, computed
  beforehand, segment by segment at the codec's settings, as a ratio to the copy (timed among them): what the codec's
  speed is bounded by on these deltas (no checksums, no delta, no placement).

Plus, once: pack (state -> flat buffer), the checksum alone and the copy after them (its source still partly in the
cache from the two).

The process allocates as a daemon does (``daemon.main.return_freed_memory``: glibc's mmap and trim thresholds and
arenas as ``ffstate serve`` sets them), since each segment's buffers are allocated and freed where the daemon's are;
``--malloc default`` keeps glibc's own settings, for a comparison.

Usage: ``ffstate bench codec [--size medium] [--steps 30] [--threads 1,2]``. Prints a table; writes
``bench/results/codec-cpu.json`` and a PNG plot beside it.
"""

from __future__ import annotations

import argparse
import copy
import logging
from pathlib import Path

import blosc2
import numpy as np
import torch

from ffstate import codec
from ffstate.bench._report import environment, median_seconds, publish, pyplot, table
from ffstate.codec import backend, segment
from ffstate.codec.chunks import segments
from ffstate.codec.segment import CODECS
from ffstate.testing.models import TinyGPT

log = logging.getLogger("ffstate.bench.codec")

SIZES = {  # TinyGPT shapes; fp32 model + AdamW state is about 12 bytes per parameter
    "small": dict(vocab=256, dim=64, heads=4, layers=2, seq=64),
    "medium": dict(vocab=1024, dim=256, heads=8, layers=4, seq=64),
    "large": dict(vocab=4096, dim=512, heads=8, layers=8, seq=128),
    # Many small tensors (about 7,700 with AdamW's), where a commit's per-tensor costs show, not its copy.
    "deep": dict(vocab=256, dim=32, heads=2, layers=160, seq=32),
}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def adamw_states(size: str, steps: int, lr: float, dtype: torch.dtype = torch.float32, seed: int = 0
                 ) -> tuple[dict, dict, int]:
    """The training states after steps-1 and steps of AdamW (the model and its state in ``dtype``); and the
    parameter count."""
    torch.manual_seed(seed)
    model = TinyGPT(**SIZES[size]).to(dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1)
    vocab = model.tok.num_embeddings
    prev = None
    for step in range(steps):
        loss = model.loss(torch.randint(0, vocab, (8, model.seq + 1)))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if step == steps - 2:
            prev = copy.deepcopy({"model": model.state_dict(), "optim": opt.state_dict()})
    cur = copy.deepcopy({"model": model.state_dict(), "optim": opt.state_dict()})
    return prev, cur, sum(p.numel() for p in model.parameters())


def stage_alone(sa: codec.Snapshot, sb: codec.Snapshot, name: str, repeats: int, copy_fn) -> dict:
    """blosc2's compression and decompression alone (one thread) of ``sb``'s delta from ``sa``, the delta computed
    beforehand, in the codec's segments (each dtype group's, at its element width) and at its settings; timed
    interleaved with ``copy_fn``, a plain copy of ``sb``'s buffer, its baseline."""
    a, b = sa.buffer.numpy(), sb.buffer.numpy()
    segs = segments(sb.manifest, codec.DEFAULT_CHUNK_BYTES)
    deltas = [(segment.delta(b[off : off + n * size], a[off : off + n * size], size).copy(), size)
              for off, n, size in segs]
    bodies = [segment.compress(d, size, name) for d, size in deltas]
    z = np.empty(max(d.size for d, _ in deltas), dtype=np.uint8)
    secs = median_seconds({"compress": lambda: [segment.compress(d, size, name) for d, size in deltas],
                           "decompress": lambda: [blosc2.decompress2(x, dst=z[: d.size], nthreads=1)
                                                  for x, (d, _) in zip(bodies, deltas)],
                           "copy": copy_fn}, repeats)
    n = sum(d.size for d, _ in deltas)
    return {"bytes": n, "compress_seconds": secs["compress"], "decompress_seconds": secs["decompress"],
            "ratio": n / sum(len(x) for x in bodies), "copy_seconds": secs["copy"],
            "vs_copy": secs["copy"] * n / sb.manifest.nbytes / (secs["compress"] + secs["decompress"])}


def measure(prev: dict, cur: dict, repeats: int, threads: list[int]) -> dict:
    """Encode, decode in place and the ratio of the delta, per entropy stage and thread count; and the entropy
    stage alone (``stage_alone``)."""
    sa, sb = codec.pack(prev), codec.pack(cur)
    dst = torch.empty_like(sb.buffer)
    out: dict = {"bytes": sb.manifest.nbytes, "ways": {}}
    backend.use_threads(1)
    src_np, dst_np = sb.buffer.numpy(), dst.numpy()
    copy_fn = lambda: np.copyto(dst_np, src_np)  # noqa: E731  # one thread (torch's copy_ splits across its threads)
    once = median_seconds({"copy": copy_fn,
                           "pack": lambda: codec.pack_into(cur, dst, sb.manifest),
                           "checksum": lambda: codec.buffer_checksum(sb.buffer)}, repeats)
    out["copy_seconds"], out["pack_seconds"], out["checksum_seconds"] = once["copy"], once["pack"], once["checksum"]
    for name in CODECS:
        alone = stage_alone(sa, sb, name, repeats, copy_fn)
        out["ways"].setdefault(name, {})["stage_alone"] = alone
    for n in threads:
        backend.use_threads(n)
        fns = {"copy": copy_fn}  # the baseline, among the codec's phases: in the same state of the cache
        for name in CODECS:
            forth = codec.encode_snapshot(sb, sa, codec=name)
            back = codec.encode_snapshot(sa, sb, codec=name)
            held = codec.Snapshot(sa.manifest, sa.buffer.clone(), sa.checksum)

            def apply(forth=forth, back=back, held=held) -> None:  # onto the held base, and back again
                codec.decode_snapshot(back, codec.decode_snapshot(forth, held, inplace=True), inplace=True)

            fns[f"{name} encode"] = lambda name=name: codec.encode_snapshot(sb, sa, codec=name)
            fns[f"{name} decode"] = apply
            out["ways"].setdefault(name, {})["ratio"] = forth.raw_nbytes / forth.nbytes
        secs = median_seconds(fns, repeats)
        for name in CODECS:
            enc, dec = secs[f"{name} encode"], secs[f"{name} decode"] / 2  # two applies a call
            out["ways"][name][n] = {"encode_seconds": enc, "decode_seconds": dec,
                                    "vs_copy": secs["copy"] / (enc + dec), "copy_seconds": secs["copy"],
                                    "encode_GBps": out["bytes"] / enc / 1e9, "decode_GBps": out["bytes"] / dec / 1e9}
    backend.use_threads(0)
    return out


def run(size: str, steps: int, repeats: int, lr: float, threads: list[int], out_dir: Path,
        malloc: str = "daemon") -> dict:
    if malloc == "daemon":
        from ffstate.daemon.main import return_freed_memory

        if not return_freed_memory():
            malloc = "default (not glibc)"
    result = {"benchmark": "codec", "environment": environment("cpu"),
              "config": {"size": size, "steps": steps, "lr": lr, "repeats": repeats, "threads": threads,
                         "chunk_bytes": codec.DEFAULT_CHUNK_BYTES, "malloc": malloc}, "states": {}}
    for name, dtype in DTYPES.items():
        log.info("training TinyGPT-%s in %s for %d AdamW steps", size, name, steps)
        prev, cur, n_params = adamw_states(size, steps, lr, dtype)
        result["config"]["params"] = n_params
        result["states"][name] = measure(prev, cur, repeats, threads)
    return publish(out_dir, "codec-cpu", result, report, plot)


def report(result: dict) -> str:
    cfg = result["config"]
    lines = [f"TinyGPT-{cfg['size']} ({cfg['params'] / 1e6:.2f}M params) + AdamW: the delta between steps "
             f"{cfg['steps'] - 1} and {cfg['steps']} (lr {cfg['lr']}); median of {cfg['repeats']}; x copy: one "
             f"plain copy of the same bytes (one thread, timed among the phases) over encode + decode; "
             f"malloc: {cfg.get('malloc', 'default')}",
             ""]
    rows = []
    for dtype, s in result["states"].items():
        for name, w in s["ways"].items():
            for n in cfg["threads"]:
                t = w[n]
                alone = w.get("stage_alone")
                rows.append([dtype, f"{s['bytes'] / 1e6:.1f}", f"blosc2 {name}", str(n), f"{w['ratio']:.3f}x",
                             f"{t['encode_GBps']:.2f}", f"{t['decode_GBps']:.2f}", f"{t['vs_copy']:.3f}",
                             f"{alone['vs_copy']:.3f}" if alone else "-"])
    lines.append(table(rows, ["state", "MB", "entropy stage", "threads", "ratio", "encode GB/s", "decode GB/s",
                              "x copy", "stage alone x copy (1 thread)"]))
    s = result["states"]["fp32"]
    lines += ["", f"fp32, once (after pack and checksum): copy {s['bytes'] / s['copy_seconds'] / 1e9:.2f} GB/s, pack "
              f"{s['bytes'] / s['pack_seconds'] / 1e9:.2f} GB/s, checksum {s['bytes'] / s['checksum_seconds'] / 1e9:.2f} GB/s"]
    return "\n".join(lines)


def plot(result: dict, path: Path) -> Path | None:
    plt = pyplot()
    if plt is None:
        return None
    threads = result["config"]["threads"]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    labels, ratios, speeds, bounds = [], [], [], []
    for dtype, s in result["states"].items():
        for name, w in s["ways"].items():
            labels.append(f"{dtype} {name}")
            ratios.append(w["ratio"])
            speeds.append([w[n]["vs_copy"] for n in threads])
            bounds.append(w.get("stage_alone", {}).get("vs_copy"))
    a.barh(labels, ratios)
    a.axvline(1.0, color="grey", lw=0.5)
    a.set_xlabel("compression ratio of the delta (raw / on the wire)")
    for i, n in enumerate(threads):
        b.barh([j + i * 0.4 for j in range(len(labels))], [s[i] for s in speeds], 0.4, label=f"{n} thread(s)")
    marked = [(j + 0.2, x) for j, x in enumerate(bounds) if x is not None]
    if marked:
        b.scatter([x for _, x in marked], [y for y, _ in marked], marker="|", s=300, color="black",
                  label="the entropy stage alone, 1 thread")
    b.set_yticks([j + 0.2 for j in range(len(labels))], labels)
    b.axvline(0.15, color="red", lw=0.5, ls="--", label="the goal, 0.15x")
    b.set_xlabel("encode + decode throughput / one plain copy")
    b.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--size", choices=sorted(SIZES), default="medium", help="TinyGPT size (default: medium)")
    p.add_argument("--steps", type=int, default=30, help="AdamW steps before the measured delta (default: 30)")
    p.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate (default: 1e-3)")
    p.add_argument("--repeats", type=int, default=7, help="timed repeats; medians are reported (default: 7)")
    p.add_argument("--threads", default="1,2", help="codec thread counts to measure (default: 1,2)")
    p.add_argument("--malloc", choices=("daemon", "default"), default="daemon",
                   help="allocate as a daemon does (glibc's settings as ffstate serve makes them; default), or with "
                        "glibc's own")
    p.add_argument("--out", type=Path, default=Path("bench/results"), help="results folder (default: bench/results)")


def main(args: argparse.Namespace) -> int:
    if args.steps < 2:
        raise SystemExit("--steps must be at least 2: the benchmark measures the delta between the last two steps")
    run(args.size, args.steps, args.repeats, args.lr, [int(t) for t in args.threads.split(",") if t], args.out,
        args.malloc)
    return 0


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    raise SystemExit(main(parser.parse_args()))
