"""``ffstate drop``: frees what daemons hold of a job that is gone.

A job that ends cleanly drops its replicas itself, and a daemon its workers started exits after
``daemon_idle_exit`` seconds without a request. A daemon you run (``ffstate serve`` under systemd, a sidecar) never
exits on its own: the replicas of a job that died and was never relaunched stay in its memory, counted against its
budget, until it is restarted (losing every other job's too). ``ffstate drop --job J`` frees them daemon by daemon,
the job's last versions written to the daemon's persistent tier first where it has one (as at a job's end).

A drop of a job that still trains would remove the slots its ranks commit into and the replicas a failure would be
restored from, so a daemon on which the job was active within ``--idle`` seconds (a commit of one of its ranks, a
push to or from it) is left as it is and named, and the command fails; ``--force`` drops it anyway.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path

IDLE = 600.0  # seconds: a worker-started daemon's daemon_idle_exit, the window a relaunch has to resume from memory


@dataclass
class Activity:
    """What a daemon holds of a job, and when the job was last active there."""

    shards: int
    nbytes: int
    last_active: float | None  # unix time; None: nothing says (no commit seen, nothing pushed)


def activity(shards, now: float) -> Activity:
    """The job's activity on one daemon, from its ``Inventory`` rows (``ShardInfo``) of that job: a local rank's
    last commit as its watchdog saw it (a paused rank counts as active now), the last push from a local rank or
    to a replica."""
    times = []
    for s in shards:
        if s.last_update_unix:
            times.append(s.last_update_unix)
        if s.local and s.HasField("watch"):
            times.append(now if s.watch.paused else now - s.watch.since_seconds)
    return Activity(len(shards), sum(s.bytes for s in shards), max(times) if times else None)


def main(args: argparse.Namespace) -> int:
    """``ffstate drop`` (see the module docstring); 1 if a daemon was left as it was (active, unreachable)."""
    from ffstate.client import Client, Tls
    from ffstate.daemon.persister import FINAL_WAIT
    from ffstate.errors import ReplicaError
    from ffstate.status import targets

    tls = Tls(args.tls_ca) if args.tls_ca else None
    failed = 0
    for address, token in targets(args.daemon, args.job, args.token_file, command="drop"):
        try:
            with Client(address, token, tls=tls, timeout=args.timeout, retries=1) as c:
                inv = c.inventory(args.job)
                now = time.time()
                got = activity([s for s in inv.shards if s.shard.job_id == args.job], now)
                where = f"{address} ({inv.node_id})"
                if not got.shards:
                    print(f"{where}: holds nothing of job {args.job}")
                    continue
                idle = None if got.last_active is None else now - got.last_active
                if not args.force and (idle is None or idle < args.idle):
                    said = "no commit or push of it seen" if idle is None else f"last active {idle:.0f} s ago"
                    print(f"{where}: job {args.job} left as it is ({got.shards} shard(s), {got.nbytes / 1e6:.1f} MB; "
                          f"{said}, under --idle {args.idle:.0f} s): a drop of a job that trains removes its slots "
                          "and the replicas a failure restores from; --force to drop it anyway", file=sys.stderr)
                    failed += 1
                    continue
                dropped = c.drop(args.job, timeout=FINAL_WAIT + 30)  # its persistent tier written first
                print(f"{where}: dropped {dropped} shard(s) of job {args.job}, {got.nbytes / 1e6:.1f} MB"
                      + ("" if idle is None else f" (idle {idle:.0f} s)"))
        except ReplicaError as e:
            print(f"{address}: {e}", file=sys.stderr)
            failed += 1
    return 1 if failed else 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--job", required=True, help="the job whose shards to drop")
    p.add_argument("--daemon", action="append", metavar="HOST:PORT",
                   help="drop at this daemon (repeatable; default: the daemons the job's workers started on this "
                        "node)")
    p.add_argument("--idle", type=float, default=IDLE, metavar="SECONDS",
                   help=f"drop only where the job has been idle this long: no commit, no push (default {IDLE:.0f})")
    p.add_argument("--force", action="store_true", help="drop even where the job looks active")
    p.add_argument("--token-file", type=Path,
                   help="file holding the job's token (default: $FFSTATE_TOKEN, else the token in the job's run "
                        "folder on this node)")
    p.add_argument("--tls-ca", type=Path, help="CA of the daemons' certificates, when they use TLS")
    p.add_argument("--timeout", type=float, default=5.0, help="seconds per daemon for its inventory (default 5)")
