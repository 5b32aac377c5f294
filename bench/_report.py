"""What every benchmark shares: timing by median of interleaved repeats, and writing results."""

from __future__ import annotations

import contextlib
import json
import logging
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Iterator

import torch


def phase_order(ways: list[str], r: int) -> list[str]:
    """The order in which round ``r`` of an interleaved benchmark runs its ways (modes, functions): the rows
    of a Williams design (a balanced Latin square; for an odd number n of ways, its rows and then their
    mirrors). Over n rounds (2n for odd n) each way runs in each position equally often and right after
    every other way equally often: a way pays for what the one before it left behind (garbage, dirty pages,
    a daemon's teardown), and the machine drifts within a round. A rotation (each round starting one way
    later) keeps every way behind the same one."""
    n = len(ways)
    first = [0] + [(j + 1) // 2 if j % 2 else n - j // 2 for j in range(1, n)]  # 0, 1, n-1, 2, n-2, ...
    row = [ways[(i + r) % n] for i in first]
    return row[::-1] if n % 2 and (r // n) % 2 else row


def median_seconds(fns: dict[str, Callable[[], object]], repeats: int, sync: Callable[[], None] = lambda: None,
                   self_timed: bool = False) -> dict[str, float]:
    """Median wall time of each function over ``repeats`` rounds, run interleaved (noise hits all alike),
    each round in an order of ``phase_order`` (none always runs right after the same one, in what it left).

    With ``self_timed`` each function returns the seconds to count itself (the part of it that matters).
    """
    times: dict[str, list[float]] = {k: [] for k in fns}
    for fn in fns.values():  # warm-up: first-touch allocation, kernel compilation
        fn()
    sync()
    for r in range(repeats):
        for name in phase_order(list(fns), r):
            start = time.perf_counter()
            got = fns[name]()
            sync()
            times[name].append(got if self_timed else time.perf_counter() - start)
    return {k: statistics.median(v) for k, v in times.items()}


def environment(device: str) -> dict:
    env = {"python": platform.python_version(), "torch": torch.__version__, "machine": platform.machine(),
           "cpus": torch.get_num_threads(), "device": device}
    if device.startswith("cuda"):
        env["gpu"] = torch.cuda.get_device_name(device)
    return env


def write_json(out_dir: Path, name: str, payload: dict) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}.json"
    path.write_text(json.dumps(payload, indent=2))
    return path


def publish(out_dir: Path, name: str, result: dict, report: Callable[[dict], str],
            plot: Callable[[dict, Path], Path | None]) -> dict:
    """Writes ``<name>.json``, prints the report's table, draws ``<name>.png``, writes ``<name>.md`` (the table
    with the date, the machine, the versions, the commit and the command: a record to keep, e.g. under
    ``benchmarks/``), and says where they went."""
    path = write_json(out_dir, name, result)
    text = report(result)
    print(text)
    print(f"\nwrote {path}")
    png = plot(result, out_dir / f"{name}.png")
    if png:
        print(f"wrote {png}")
    md = out_dir / f"{name}.md"
    md.write_text(record(name, text))
    print(f"wrote {md}")
    return result


def record(name: str, text: str) -> str:
    """A benchmark's table as a dated, labelled record: what ran, where, on what, at which commit."""
    import datetime
    import os
    import subprocess
    import sys

    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                cwd=Path(__file__).parent, timeout=10).stdout.strip() or "unknown"
    except OSError:
        commit = "unknown"
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor()) if Path("/proc/cpuinfo").exists() else ""
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"
    args = sys.argv[2:] if sys.argv[1:2] == ["bench"] else sys.argv[1:]
    for i, a in enumerate(args):  # where the results went is not what was measured (and names this machine)
        if a == "--out":
            args = args[:i] + args[i + 2:]
            break
        if a.startswith("--out="):
            args = args[:i] + args[i + 1:]
            break
    command = " ".join(["ffstate bench" if sys.argv[1:2] == ["bench"] else Path(sys.argv[0]).name, *args])
    return (f"# {name}, {datetime.date.today().isoformat()}\n\n"
            f"- command: `{command}`\n- machine: {os.cpu_count()} cores ({cpu}), GPU: {gpu}\n"
            f"- Python {platform.python_version()}, torch {torch.__version__}, commit {commit}\n\n"
            f"```\n{text}\n```\n")


def free_ports(n: int, host: str = "127.0.0.1") -> int:
    """The first of ``n`` consecutive ports that are free now (daemons of simulated nodes take one each), below the
    kernel's range for outgoing connections: a port from that range can be taken by any process's connect between
    this probe and the bind it is for."""
    import random
    import socket

    pick = random.SystemRandom()  # not the global generator: tests seed it, and two workers then drew the same ports

    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    top = max(low, 11000) - n - 1
    for _ in range(100):
        base = pick.randint(10000, top)
        try:
            for port in range(base, base + n):
                with socket.socket() as s:
                    s.bind((host, port))
            return base
        except OSError:
            continue
    raise RuntimeError(f"no {n} consecutive free ports")


def pyplot():
    """matplotlib.pyplot on the Agg backend, or None (with a warning) when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        logging.getLogger("ffstate.bench").warning("matplotlib is not installed: no plot (pip install 'ffstate[bench]')")
        return None
    return plt


def table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(str(r[i])) for r in rows + [header]) for i in range(len(header))]
    line = lambda r: "  ".join(str(c).rjust(w) if i else str(c).ljust(w) for i, (c, w) in enumerate(zip(r, widths)))  # noqa: E731
    return "\n".join([line(header), line(["-" * w for w in widths])] + [line(r) for r in rows])


@contextlib.contextmanager
def kept_on_failure(benchmark: str, part: str = "") -> Iterator[Path]:
    """A benchmark's working folder: removed when the benchmark succeeds, kept when it fails, with what tells why
    (torchrun's, the daemons' and the ranks' logs), and the folder named on stderr."""
    work = Path(tempfile.mkdtemp(prefix=f"ffstate-{part or benchmark}-"))
    try:
        yield work
    except BaseException:
        print(f"ffstate bench {benchmark} failed; its logs are kept in {work}", file=sys.stderr)
        raise
    shutil.rmtree(work, ignore_errors=True)
