"""``ffstate drain``'s API: ask a node's daemon to drain the node out of a job, and follow the drain to its end
(what the daemon does is ``ffstate/daemon/drain.py``)."""

from __future__ import annotations

import logging
import time
from typing import Callable

from ffstate import wire
from ffstate.client import Client, Tls
from ffstate.errors import FFStateError
from ffstate.reports import DrainReport

log = logging.getLogger("ffstate.elastic")

FINAL = ("left", "cancelled", "failed", "none")


def drain(address: str, token: str, job: str = "", leave: bool = True, timeout: float = 600.0,
          on_progress: Callable[[DrainReport], None] | None = None, tls: Tls | None = None) -> DrainReport:
    """Drains the node whose daemon is at ``address`` out of ``job`` ("" when it has local ranks of one job only):
    its ranks stop at their next commit; once every holder has that step, with ``leave`` the ranks leave the job
    (their torchrun agent gets SIGTERM) and the job goes on without the node, losing no step. Waits for the end
    (``left``, or ``drained`` without ``leave``), at most ``timeout`` seconds; ``on_progress`` sees each report.

    Returns:
        The drain's last report (``state`` says how it ended).

    Raises:
        FFStateError: the daemon refused (no such job here, a rank without a replica elsewhere), or the drain did
            not end within ``timeout`` (it goes on in the daemon; ``cancel_drain`` gives it up).
    """
    with Client(address, token, tls=tls, timeout=30.0) as c:
        got = wire.from_proto(c.drain(job, leave), DrainReport)
        deadline = time.monotonic() + timeout
        while True:
            if on_progress is not None:
                on_progress(got)
            if got.state in FINAL or (got.state == "drained" and not leave):
                return got
            if time.monotonic() > deadline:
                raise FFStateError(f"the drain of {address} is still {got.state} after {timeout:.0f}s (ranks: "
                                   f"{[(r.shard.rank, r.committed, r.replicated, r.stopped_at) for r in got.ranks]})")
            time.sleep(0.05)
            got = wire.from_proto(c.drain(job, query=True), DrainReport)


def cancel_drain(address: str, token: str, job: str = "", tls: Tls | None = None) -> DrainReport:
    """Gives a drain up: the node's ranks go on training."""
    with Client(address, token, tls=tls, timeout=30.0) as c:
        return wire.from_proto(c.drain(job, cancel=True), DrainReport)


def target(daemon: str | None, job: str, token: str) -> tuple[str, str, str]:
    """(address, token, job) of the daemon to drain: the one given, else the one daemon workers started on this
    machine (its run folder holds its address and the job's token).

    Raises:
        FFStateError: none, or several, found; or no token.
    """
    from ffstate.daemon.running import local_daemons

    found = local_daemons(job)
    if daemon is None:
        if not found:
            others = sorted({f.job for f in local_daemons()}) if job else []
            raise FFStateError("no daemon started by a job's workers runs on this machine"
                               + (f" for job {job} (daemons of job(s) {', '.join(others)} do)" if others else "")
                               + ": name one with --daemon HOST:PORT")
        if len(found) > 1:
            several = ", ".join(f"{f.address} (job {f.job}, node {f.node_id})" for f in found)
            jobs = len({f.job for f in found})  # --job narrows the daemons to one job's, and does no more
            raise FFStateError(f"several daemons run on this machine: {several}; name one with --daemon HOST:PORT"
                               + (" (or --job, where it is the only one of its job)" if jobs > 1 else
                                  " (they serve one job: --job does not choose)"))
        daemon, job = found[0].address, job or found[0].job
    token = token or next((f.token for f in found if f.address == daemon and f.token), "")
    if not token:
        raise FFStateError("no token: pass --token-file FILE or set FFSTATE_TOKEN (the job's run folder "
                           "$TMPDIR/ffstate-<job>/token holds it for daemons the workers started)")
    return daemon, token, job


def main(args) -> int:
    """``ffstate drain``: see ``drain``; prints each change of the drain and how it ended."""
    import os

    token = args.token_file.read_text().strip() if args.token_file else os.environ.get("FFSTATE_TOKEN", "")
    try:
        address, token, job = target(args.daemon, args.job or "", token)
        if args.cancel:
            got = cancel_drain(address, token, job)
            print(f"{address}: {got.message}" if got.message.startswith(got.state) else
                  f"{address}: drain {got.state}: {got.message}")
            return 0
        seen = []

        def show(r: DrainReport) -> None:
            line = f"{address}: {r.state}" + (f" at step {r.version}" if r.version else "")
            if r.ranks:  # a report after the drain ended may name none: the ranks have detached
                line += "; ranks (committed/replicated/stopped): " + ", ".join(
                    f"{x.shard.rank}:{x.committed}/{x.replicated}/{x.stopped_at}" for x in r.ranks)
            if not seen or seen[-1] != line:
                seen.append(line)
                print(line, flush=True)

        got = drain(address, token, job, leave=not args.stay, timeout=args.timeout, on_progress=show)
    except FFStateError as e:
        raise SystemExit(f"ffstate drain: {e}") from None
    if got.message:
        print(f"{address}: {got.message}")
    if got.drained_unix:
        print(f"{address}: drained {got.drained_unix - got.requested_unix:.2f}s after the request")
    return 0 if got.state in ("left", "drained") else 1


def add_arguments(p) -> None:
    from pathlib import Path

    p.add_argument("--daemon", metavar="HOST:PORT", help="the node's daemon (default: the one the job's workers "
                   "started on this machine)")
    p.add_argument("--job", help="the job (default: the only one with ranks on that node)")
    p.add_argument("--token-file", type=Path, help="file holding the job token (default: $FFSTATE_TOKEN, else the "
                   "job's run folder)")
    p.add_argument("--stay", action="store_true", help="stop the ranks at a step with every replica current, but "
                   "leave them running (default: they leave the job, torchrun re-forms it without this node)")
    p.add_argument("--cancel", action="store_true", help="give a drain in progress up: the ranks train on")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for the drain (default 600)")
