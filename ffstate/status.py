"""``ffstate status``: what the daemons hold, and how replication, restores, the watchdog, the links and the
persistent tier are doing. With no flags, on a node, it asks the daemons the jobs' workers started there, each
with its job's token, both found in the jobs' run folders (``$TMPDIR/ffstate-<job>/``); ``--daemon`` asks others.
Outside a terminal nothing is cut, so that its output can go to a pipe or a log."""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path


def targets(given: list[str] | None, job: str, token_file: Path | None, command: str = "status"
            ) -> list[tuple[str, str]]:
    """(address, token) of each daemon to ask: those ``given`` (the token from ``token_file``, ``$FFSTATE_TOKEN``,
    or the run folder of a daemon at that address on this machine), else every daemon of ``job`` (or of every job)
    that the workers started on this machine.

    Raises:
        SystemExit: nothing to ask, or no token for a daemon.
    """
    from ffstate.daemon.running import local_daemons

    found = local_daemons(job)
    explicit = token_file.read_text().strip() if token_file else os.environ.get("FFSTATE_TOKEN", "")
    if not given:
        if not found:
            others = sorted({f.job for f in local_daemons()}) if job else []
            if others:  # daemons run, none of that job
                hint = " (leave out --job to see them all)" if command == "status" else ""
                raise SystemExit(f"ffstate {command}: no daemon of job {job} runs on this machine; daemons of job(s) "
                                 f"{', '.join(others)} do{hint}")
            raise SystemExit(f"ffstate {command}: no daemon started by a job's workers runs on this machine (none in "
                             "the run folders $TMPDIR/ffstate-*/; a job that ended cleanly stopped its daemons: its "
                             "events.jsonl and the daemons' logs stay there); name daemons with --daemon HOST:PORT, "
                             "with --token-file FILE or $FFSTATE_TOKEN")
        return [(f.address, f.token or explicit) for f in found]
    out = []
    for address in given:
        host, _, port = address.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 1 << 16:
            raise SystemExit(f"ffstate {command}: --daemon {address!r}: expected HOST:PORT (a daemon's address, such "
                             "as 10.0.0.2:7700; `ffstate status` on that node lists its daemons)")
        token = explicit or next((f.token for f in found if f.address == address and f.token), "")
        if not token:
            raise SystemExit(f"ffstate {command}: no token for {address}: pass --token-file FILE or set FFSTATE_TOKEN "
                             "(a daemon the workers started keeps its job's token in $TMPDIR/ffstate-<job>/token)")
        out.append((address, token))
    return out


def main(args: argparse.Namespace) -> int:
    """``ffstate status`` (see the module docstring); 1 if a daemon did not answer."""
    from rich.console import Console
    from rich.table import Table

    from ffstate.client import Client, Tls
    from ffstate.errors import ReplicaError

    tls = Tls(args.tls_ca) if args.tls_ca else None
    daemons = targets(args.daemon, args.job or "", args.token_file)
    table = Table(title="ffstate replicas")
    for col in ("daemon", "node", "job", "rank", "kind", "version", "versions", "MB", "last update", "lag", "staged",
                "source"):
        table.add_column(col, justify="right" if col in ("rank", "version", "MB", "lag") else "left")
    rows, owners, failed = [], {}, 0
    for address, token in daemons:
        try:
            with Client(address, token, tls=tls, timeout=args.timeout, retries=1) as c:
                inv = c.inventory(args.job or "")
        except ReplicaError as e:
            why = ("wrong or missing token: pass --token-file or set $FFSTATE_TOKEN; " if e.code == "UNAUTHENTICATED"
                   else "") + str(e)
            table.add_row(address, "-", "-", "-", "[red]unreachable[/red]", "-", "-", "-", "-", "-", "-", why)
            failed += 1
            continue
        if not inv.shards:  # an empty table said nothing of it
            table.add_row(address, inv.node_id, args.job or "-", "-", "holds nothing", "-", "-", "-", "-", "-", "-", "")
        for s in inv.shards:
            key = (s.shard.job_id, s.shard.rank, s.shard.world_size)
            if s.local:
                owners[key] = s.version
            rows.append((address, inv, s, key))
    now = time.time()
    for address, inv, s, key in rows:
        if s.local:  # "-": nothing to lag behind (no version yet, or no holder: a one-node job)
            lag = str(s.version - s.replicated_version) if s.version and (s.replicated_version or s.pushed_versions) \
                else "-"
            # holders with no copy within the lag bound: down (with replicas 2 not in the lag), or being seeded
            for n, what in ((s.holders_down, "down"), (s.holders_seeding, "being seeded")):
                if n:
                    lag += f" ([red]{n} holder{'s' if n > 1 else ''} {what}[/red])"
        else:
            # The owner's daemon was asked first: a replica that moved on since reads as ahead of it (-1), never is.
            lag = str(max(0, owners[key] - s.version)) if key in owners else "?"
        age = f"{now - s.last_update_unix:.1f}s ago" if s.last_update_unix else "-"
        staged = f"v{s.staged_version}, {s.staged_bytes / 1e6:.1f} MB" if s.staged_version else "-"
        table.add_row(address, inv.node_id, key[0], f"{key[1]}/{key[2]}", "local" if s.local else "replica",
                      str(s.version), ",".join(map(str, s.versions)), f"{s.bytes / 1e6:.1f}", age, lag, staged,
                      s.source)
    # Outside a terminal (a pipe, a log) rich would cut every column to 80 characters: room for the longest rows.
    console = Console() if sys.stdout.isatty() else Console(width=400)
    console.print(table)
    razor = Table(title="what each rank replicates (razor: each byte once per data-parallel group)")
    for col in ("job", "rank", "group", "state MB", "replicated MB", "share", "wire MB/version", "verified",
                "mismatches"):
        razor.add_column(col, justify="left" if col in ("job", "group") else "right")
    for address, inv, s, key in rows:
        if not s.local:
            continue
        wire = f"{s.pushed_bytes / s.pushed_versions / 1e6:.2f}" if s.pushed_versions else "-"
        if s.HasField("razor"):
            r = s.razor
            razor.add_row(key[0], f"{key[1]}/{key[2]}", ",".join(map(str, r.group)) or "none",
                          f"{r.state_bytes / 1e6:.2f}", f"{r.shard_bytes / 1e6:.2f}",
                          f"{r.shard_bytes / r.state_bytes:.2f}", wire, str(r.verifications),
                          f"[red]{r.mismatches}[/red]" if r.mismatches else "0")
        else:
            razor.add_row(key[0], f"{key[1]}/{key[2]}", "?", "-", "-", "-", wire, "-", "-")
    if razor.row_count:
        console.print(razor)
    _local_table(console, rows, "restore", "restores (what each rank's workers recorded in its slots: the newest)",
                 ("restores", "to step (v*)", "steps lost", "restore s", "from entry s", "resized from"),
                 lambda r, key: (str(r.restores), str(r.version), str(r.steps_lost), f"{r.seconds:.3f}",
                                 f"{r.entry_seconds:.2f}",
                                 f"{r.from_world_size} -> {key[2]} ranks" if r.from_world_size else "-"))
    computes = {key: s.watch.compute_seconds for _, _, s, key in rows
                if s.local and s.HasField("watch") and s.watch.compute_seconds}
    job_median = {job: statistics.median(v for k, v in computes.items() if k[0] == job) for job, *_ in computes}
    _local_table(console, rows, "watch",
                 "watchdog (hang deadline from each rank's commits; stragglers by compute a step, waits excluded)",
                 ("pid", "step s", "compute s", "x node", "x job", "since s", "deadline s", "hangs"),
                 lambda w, key: (str(w.pid), f"{w.step_seconds:.3f}", f"{w.compute_seconds:.3f}",
                                 f"{w.straggler_ratio:.2f}" if w.straggler_ratio else "-",
                                 f"{w.compute_seconds / job_median[key[0]]:.2f}"
                                 if w.compute_seconds and job_median.get(key[0]) else "-",
                                 "paused" if w.paused else f"{w.since_seconds:.1f}", f"{w.deadline_seconds:.0f}",
                                 f"[red]{w.hangs}[/red]" if w.hangs else "0"))
    _local_table(console, rows, "profiled",
                 "profiled timelines (ranks whose collectives nothing marks: the scheduler predicts from these)",
                 ("steps profiled", "collectives a step", "step s", "on the wire s", "share"),
                 lambda t, _: (str(t.steps), str(t.collectives), f"{t.period_seconds:.3f}", f"{t.busy_seconds:.3f}",
                            f"{t.busy_seconds / t.period_seconds:.2f}"))
    links = Table(title="replication links (scheduler)")
    for col in ("daemon", "scheduler", "holder", "estimate MB/s", "share", "held s", "catch-ups", "rushes", "deadline overrides",
                "collisions", "overlap s"):
        links.add_column(col, justify="left" if col in ("daemon", "scheduler", "holder") else "right")
    for address, inv, *_ in {r[0]: r for r in rows}.values():
        for link in inv.links:
            links.add_row(address, link.scheduler, link.holder, f"{link.estimate_bytes_per_second / 1e6:.1f}",
                          f"{link.share:.2f}", f"{link.waited_seconds:.2f}", str(link.catch_ups),
                          str(link.rushes), str(link.deadline_overrides),
                          str(link.collisions), f"{link.overlap_seconds:.2f}")
    if links.row_count:
        console.print(links)
    for address, inv, *_ in {r[0]: r for r in rows}.values():
        if inv.collectives:
            print(f"{address} ({inv.scheduler}): {inv.collisions} of {inv.collectives} collectives started with a "
                  f"replication chunk on the wire; replication shared the link with them {inv.overlap_seconds:.2f} s")
    for address, inv, *_ in {r[0]: r for r in rows}.values():
        print(f"{address} ({inv.node_id}): {inv.bytes_used / 1e6:.1f} MB of {inv.bytes_budget / 1e6:.0f} MB budget")
        if inv.HasField("persist"):
            p = inv.persist
            print(f"{address} ({inv.node_id}): persistent tier {p.dir} every {p.every} steps: {p.flushed} ranks' "
                  f"versions flushed ({p.bytes / 1e6:.1f} MB, the newest in {p.seconds:.2f} s), {p.skipped} skipped, "
                  f"{p.failed} failed, {p.pending} being written; newest complete version {p.newest_complete or '-'}; "
                  f"flushing process {p.flusher_pid or 'starting'}"
                  + (f" (started {p.flusher_starts} times: it died)" if p.flusher_starts > 1 else "")
                  + (f"; last error: {p.error}" if p.error else ""))
    return 1 if failed else 0



def _local_table(console, rows: list, field: str, title: str, columns: tuple[str, ...], cells) -> None:
    """Prints a table of the local ranks whose ShardInfo has ``field`` set: job, rank, then ``cells(it, key)``."""
    from rich.table import Table

    table = Table(title=title)
    for col in ("job", "rank", *columns):
        table.add_column(col, justify="left" if col == "job" else "right")
    for _, _, s, key in rows:
        if s.local and s.HasField(field):
            table.add_row(key[0], f"{key[1]}/{key[2]}", *cells(getattr(s, field), key))
    if table.row_count:
        console.print(table)


