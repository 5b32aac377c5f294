"""Finding the node's daemon from a worker, or starting it: the node's first rank starts ``ffstate serve``
when nothing answers at the node's address (docs/design.md section 7), with a command line built from one
``DaemonConfig``; the daemon outlives the worker and torchrun's restarts of it."""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator

from ffstate import placement
from ffstate.client import Client
from ffstate.config import Config, DaemonConfig, parse_bytes, priority
from ffstate.errors import FFStateError, ReplicaError, ReplicaUnavailable
from ffstate.daemon.running import alive, local_daemons, serve_flags
from ffstate.reports import NO_FLUSHER

if TYPE_CHECKING:  # the job needs torch, which `ffstate status` (local_daemons) does not load
    from ffstate.job import Job

log = logging.getLogger("ffstate.launch")
FLUSHER_WAIT = 60.0  # seconds a node's first rank waits, at entry, for its daemon's flushing process to be ready


def node_daemon(job: Job, lost: str | None = None) -> Client:
    """This node's daemon: found, or started by the node's first rank, and its address published. The first rank
    takes the node's daemon port, or the next one when a daemon of another job (another token: one that ended badly
    and has not exited yet) holds it; the node's other ranks take the address it published. ``lost``: the address of
    the node's daemon, gone while training runs: any local rank starts a new one there, publishing nothing.

    Raises:
        ReplicaUnavailable: nothing answers within ``connect_timeout``.
        ReplicaError: a daemon of another job (token) answers where ``start_daemon`` is off.
        FFStateError: the daemon started exited without answering, for another reason than a port held, or
            ``EXITS_TRIED`` times (its log's last line said).
    """
    topo, cfg = job.topology, job.cfg
    address = lost or placement.daemon_address(topo.node, cfg)
    host = address.rsplit(":", 1)[0]
    if topo.num_nodes > 1 and not cfg.simulated_nodes and placement.is_loopback(host):
        how = ("Config.daemon_host (FFSTATE_DAEMON_HOST) says so" if cfg.daemon_host else
               "this host offers nothing else: no GLOO_SOCKET_IFNAME or NCCL_SOCKET_IFNAME interface, no route to "
               "MASTER_ADDR but loopback, a host name that resolves to loopback")
        raise FFStateError(f"rank {job.rank}: node {topo.node}'s daemon would be published at {address}, a loopback "
                           f"address the other {topo.num_nodes - 1} node(s) cannot reach ({how}); its replicas would "
                           "never leave their nodes. Set FFSTATE_DAEMON_HOST to this node's address on the network "
                           "the training uses, or GLOO_SOCKET_IFNAME to that interface")
    if lost is None and not topo.first_on_node and job.store is not None:
        address = job.daemon_addresses([topo.node])[0]  # where the node's first rank found or started it
    elif lost is None and topo.first_on_node:
        address = _claim(job, address)
    client = job.client(address)
    # At entry the node's first rank starts it. A daemon lost while training runs is started again by whichever
    # local rank finds it gone first: waiting for the first rank could wait for ever, since that rank may be
    # inside a collective that waits for this one.
    starts = cfg.start_daemon and (topo.first_on_node or lost)
    deadline = time.monotonic() + cfg.connect_timeout
    pid = _start_once(job, address, client) if starts else 0
    exited, told = 0, False
    while True:
        try:
            client.inventory(job.job)
            break
        except ReplicaUnavailable:
            if pid and not alive(pid) and lost is None:
                # It could not listen there (a port another program took after it was found free): the next one, a few
                # times. A daemon that exited for another reason (its settings) fails the same way anywhere: said now.
                exited += 1
                why = _log_tail(job.run_dir, topo.node_id)
                if exited >= EXITS_TRIED or not any(p in why for p in PORT_TAKEN) or time.monotonic() > deadline:
                    raise FFStateError(f"rank {job.rank}: the daemon started for {topo.node_id} exited without "
                                       f"answering on {exited} port(s), the last {address}: {why} (its log: "
                                       f"{job.run_dir / f'daemon-{topo.node_id}.log'})")
                log.warning("rank %d: the daemon started for %s at %s exited without answering (%s); trying the "
                            "next port", job.rank, topo.node_id, address, why)
                address = _claim(job, address, skip=address)
                client = job.client(address)
                pid = _start_once(job, address, client)
                continue
            if time.monotonic() > deadline:
                raise ReplicaUnavailable(f"rank {job.rank}: no ffstate daemon answers at {address} for node "
                                         f"{topo.node_id}; run `ffstate serve --port {address.rsplit(':', 1)[1]}` "
                                         "on it, or leave Config.start_daemon on") from None
            if not cfg.start_daemon and not told:  # said once: the wait is silent for connect_timeout otherwise
                told = True
                log.warning("rank %d: no ffstate daemon answers at %s for node %s yet (Config.start_daemon is off: "
                            "`ffstate serve` runs it); waiting up to %.0fs (FFSTATE_CONNECT_TIMEOUT)", job.rank,
                            address, topo.node_id, cfg.connect_timeout)
            time.sleep(0.2)
        except ReplicaError as e:
            if e.code == "UNAUTHENTICATED":
                raise ReplicaError(f"the daemon at {address} belongs to another job or token ({e}); set "
                                   "FFSTATE_TOKEN to the job's token (the token `ffstate serve` was given)",
                                   e.code) from None
            raise
    if lost is None and topo.first_on_node:
        job.publish_daemon(topo.node, address)
        if starts:  # one an earlier run of the job started (it waits out its idle time) keeps its own settings
            _compare_settings(job, address)
    return client


def _compare_settings(job: Job, address: str) -> None:
    """Logs where the node's daemon, found running (an earlier run of this job id started it, and it waits out its
    idle time), was started with other settings than this run's: it keeps its own (a watchdog's deadline, say)."""
    topo = job.topology
    found = [d for d in local_daemons(job.job) if d.node_id == topo.node_id and d.address == address]
    if not found:
        return
    try:
        argv = [a.decode(errors="surrogateescape") for a in Path(f"/proc/{found[0].pid}/cmdline").read_bytes().split(b"\0")
                if a]
    except OSError:
        return
    theirs = serve_flags(argv[argv.index("serve") + 1:] if "serve" in argv else [])
    mine = serve_flags(daemon_config(job.cfg, topo.node, topo.node_id, address, job.run_dir).to_args())
    differ = sorted(k for k in {*theirs, *mine} - {"--host", "--port", "--pid-file"} if theirs.get(k) != mine.get(k))
    if differ:
        def shown(flags: dict[str, list[str]], k: str) -> str:
            return " ".join(flags[k]) or "on" if k in flags else "the default"

        said = ", ".join(f"{k} {shown(theirs, k)} (this run: {shown(mine, k)})" for k in differ)
        log.warning("rank %d: node %s's daemon (pid %d), started by an earlier run of job %s, keeps its settings: %s. "
                    "Stop it (kill %d) before relaunching for this run's to apply", job.rank, topo.node_id,
                    found[0].pid, job.job, said, found[0].pid)


def _start_once(job: Job, address: str, client: Client) -> int:
    """Starts the node's daemon at ``address`` unless one of the node's ranks already is starting one or something
    answers there; returns the pid of the daemon starting (0: none)."""
    topo = job.topology
    with _starting(job.run_dir, topo.node_id) as started:
        pid = started()
        if pid or answers(client):
            return pid
        pid = start(daemon_config(job.cfg, topo.node, topo.node_id, address, job.run_dir), job.token, job.run_dir)
        started(pid)
    log.info("rank %d: started the daemon of %s at %s (log %s)", job.rank, topo.node_id, address,
             job.run_dir / f"daemon-{topo.node_id}.log")
    return pid


def _log_tail(run_dir: Path, node_id: str) -> str:
    """The last line of a daemon's log that says why it stopped, for a warning."""
    try:
        lines = (run_dir / f"daemon-{node_id}.log").read_text(errors="replace").strip().splitlines()
    except OSError:
        return "no log"
    return next((ln for ln in reversed(lines) if ln.strip()), "empty log")[-300:]


PORTS_TRIED = 16  # ports a node's first rank tries past the daemon port when other jobs' daemons hold them
EXITS_TRIED = 3  # daemons a node's first rank starts, each on the next port, that exit before they answer
PORT_TAKEN = ("cannot listen", "cannot serve metrics")  # a daemon's last words where one of its ports was held


def _claim(job: Job, address: str, skip: str = "") -> str:
    """The node's daemon address for this job: where this job's daemon already answers (the address its run folder
    records: a restart of the job), else the daemon port unless a daemon of another job answers there (then the
    next port, a node's share of them apart for simulated nodes), where nothing answers. ``skip``: an address found
    unusable (a daemon started there could not listen): the search goes on past it. With ``start_daemon`` off, the
    daemon port as it is (the daemon there is the user's)."""
    cfg = job.cfg
    if not cfg.start_daemon:
        return address
    try:
        recorded = (job.run_dir / f"daemon-{job.topology.node_id}.address").read_text().strip()
    except OSError:
        recorded = ""
    if recorded and recorded != skip and _ours(job, recorded):
        return recorded
    host, port = address.rsplit(":", 1)
    stride = cfg.simulated_nodes or 1
    first = int(port) + (stride if skip == address else 0)
    for i in range(PORTS_TRIED):
        candidate = f"{host}:{first + i * stride}"
        try:
            with Client(candidate, job.token, timeout=2.0, retries=0) as probe:
                probe.inventory(job.job)
            return candidate  # this job's daemon (a restart of the job)
        except ReplicaUnavailable:
            return candidate  # nothing there: it starts here
        except ReplicaError as e:
            if e.code != "UNAUTHENTICATED":
                return candidate
            log.warning("rank %d: %s is held by a daemon of another job (another token): node %s's daemon goes to "
                        "the next port", job.rank, candidate, job.topology.node_id)
    raise FFStateError(f"rank {job.rank}: {PORTS_TRIED} ports from {address} are held by daemons of other jobs; "
                       "stop them (`ffstate status` on this node lists them) or set FFSTATE_BASE_PORT")


def _ours(job: Job, address: str) -> bool:
    """Whether a daemon answers at ``address`` with this job's token."""
    try:
        with Client(address, job.token, timeout=2.0, retries=0) as probe:
            probe.inventory(job.job)
        return True
    except ReplicaError:
        return False


def check_persist(job: Job, daemon: Client) -> None:
    """Says so when this worker reads the persistent tier from one place and its node's daemon, started by hand
    (``ffstate serve``), flushes to another or nowhere: the versions it would resume from never get written.
    Otherwise waits (at most ``FLUSHER_WAIT`` seconds, once) for the daemon's flushing process to be ready, so
    that the persistent tier holds versions from the job's first steps on: a daemon started with the job starts
    it then, and it imports torch and DCP (seconds of CPU). And says so when the daemon flushes and this worker has
    no ``persist_dir``: the versions are written, and never read nor dropped past a restore."""
    if not job.topology.first_on_node:
        return
    got = daemon.inventory(job.job)
    flushed = got.persist.dir if got.HasField("persist") else ""
    if not job.cfg.persist_dir:
        if flushed:
            log.warning("rank %d: node %s's daemon writes this job's versions to %s, but Config.persist_dir is unset: "
                        "the job will not resume from them when it loses every node (set FFSTATE_PERSIST_DIR=%s)",
                        job.rank, job.topology.node_id, flushed, flushed)
        return
    if os.path.realpath(flushed or "/nonexistent") != os.path.realpath(job.cfg.persist_dir):
        log.warning("rank %d: Config.persist_dir is %s but node %s's daemon flushes %s: versions of this node's "
                    "ranks will not be in the persistent tier; start it with --persist-dir %s (or let the workers "
                    "start it)", job.rank, job.cfg.persist_dir, job.topology.node_id,
                    f"to {flushed}" if flushed else "nowhere (no --persist-dir)", job.cfg.persist_dir)
        return
    start = time.monotonic()
    while not got.persist.flusher_pid and NO_FLUSHER not in got.persist.error \
            and time.monotonic() - start < FLUSHER_WAIT:
        time.sleep(0.1)
        got = daemon.inventory(job.job)
    waited = time.monotonic() - start
    if not got.persist.flusher_pid:
        log.warning("rank %d: node %s's daemon cannot flush to the persistent tier yet (%s): this node's versions "
                    "are not persisted until it can", job.rank, job.topology.node_id,
                    got.persist.error if NO_FLUSHER in got.persist.error
                    else f"its flushing process is not ready after {waited:.0f}s")
    elif waited > 1:
        log.info("rank %d: waited %.1fs for node %s's daemon's flushing process", job.rank, waited,
                 job.topology.node_id)


def check_holders(job: Job, nodes: list[int], addresses: list[str]) -> None:
    """Refuses holders whose published address reaches this node's own daemon (an address that works only
    locally, two nodes publishing one address): replicas sent there would never leave this node.

    Raises:
        FFStateError: saying what was published for which node, and what to set.
    """
    for node, address in zip(nodes, addresses):
        try:
            answer = job.client(address).inventory(job.job).node_id
        except ReplicaError:  # down or starting: the replicator retries it, as after any failure
            continue
        if answer == job.topology.node_id:
            raise FFStateError(
                f"rank {job.rank}: node {node}'s daemon was published at {address}, but the daemon answering there is "
                f"this node's own ({answer}): replicas sent there would never leave this node. Set "
                "FFSTATE_DAEMON_HOST on each node to an address of it that the other nodes reach (or "
                "GLOO_SOCKET_IFNAME to that interface)")


def daemon_config(cfg: Config, node: int, node_id: str, address: str, run_dir: Path) -> DaemonConfig:
    """The configuration of the daemon a worker starts for node ``node`` (``node_id``) at ``address``. Its metrics
    port and bulk socket are moved as far as its own port is from ``base_port``: none on a real node; + n for
    simulated node n; and as much again where ``_claim`` moved it past a daemon of another job (two jobs' daemons on
    one host never want the same port)."""
    host, port = address.rsplit(":", 1)
    shift = int(port) - cfg.base_port if 0 < cfg.base_port <= int(port) else (node if cfg.simulated_nodes else 0)
    return DaemonConfig(
        host=host, port=int(port), node_id=node_id, exit_when_empty=True, idle_exit=cfg.daemon_idle_exit,
        pid_file=run_dir / f"daemon-{node_id}.pid", keep_deltas=cfg.max_lag + 1,
        memory_limit=parse_bytes(cfg.daemon_memory_limit) if cfg.daemon_memory_limit else 0,
        scheduler=cfg.scheduler, link_share=cfg.link_share,
        link_bandwidth=parse_bytes(cfg.link_bandwidth) if cfg.link_bandwidth else 0,
        metrics_port=cfg.metrics_port + shift if cfg.metrics_port else 0, hang_action=cfg.hang_action,
        bulk_port=cfg.bulk_port + shift if cfg.bulk_port > 0 else cfg.bulk_port,
        hang_multiple=cfg.hang_multiple, hang_floor=cfg.hang_floor, hang_ceiling=cfg.hang_ceiling,
        hang_startup=cfg.hang_startup, straggler_ratio=cfg.straggler_ratio,
        persist_dir=Path(cfg.persist_dir) if cfg.persist_dir else None, persist_every=cfg.persist_every,
        persist_keep=cfg.persist_keep, persist_nice=priority(cfg.persist_nice), nice=priority(cfg.daemon_nice),
        cpus=cfg.daemon_cpus)


def start(dcfg: DaemonConfig, token: str, run_dir: Path) -> int:
    """Starts ``ffstate serve`` with ``dcfg``'s flags, in a session of its own (it outlives this worker and
    torchrun's restarts of it), logging to the run folder, where its address goes too (``local_daemons`` finds it
    there); the token goes in its environment, and in a file only the user reads (``ffstate status`` asks the
    daemon with it). Returns its pid."""
    args = [sys.executable, "-m", "ffstate.cli", "serve", *dcfg.to_args()]
    (run_dir / f"daemon-{dcfg.node_id}.address").write_text(f"{dcfg.host}:{dcfg.port}")
    token_file = run_dir / f"daemon-{dcfg.node_id}.token"
    tmp = token_file.with_name(f"{token_file.name}.{os.getpid()}.tmp")
    with os.fdopen(os.open(tmp, os.O_CREAT | os.O_TRUNC | os.O_WRONLY, 0o600), "w") as f:
        f.write(token)
    os.replace(tmp, token_file)
    with open(run_dir / f"daemon-{dcfg.node_id}.log", "a") as out:
        return subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=out, stderr=out, start_new_session=True,
                                env={**os.environ, "FFSTATE_TOKEN": token}, close_fds=True).pid


@contextlib.contextmanager
def _starting(run_dir: Path, node_id: str) -> Iterator[Callable[..., int]]:
    """The node's ranks start its daemon one at a time (a lock file in the run folder). Inside, ``started()`` says
    whether a daemon started by one of them is still starting (its process alive: it listens within seconds), and
    ``started(pid)`` records one: two ranks that find the daemon gone together start one, not two. ``started()``
    gives the pid of that daemon while it runs, else 0."""
    path = run_dir / f"daemon-{node_id}.starting"
    with open(path, "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            def started(pid: int | None = None) -> int:
                if pid is not None:
                    f.seek(0)
                    f.truncate()
                    f.write(str(pid))
                    f.flush()
                    return pid
                f.seek(0)
                try:
                    recorded = int(f.read().strip() or 0)
                except ValueError:
                    return 0
                return recorded if alive(recorded) else 0

            yield started
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def answers(client: Client) -> bool:
    """Whether anything answers at the client's address (one try, no retries)."""
    try:
        with Client(client.address, client.token, timeout=2.0, retries=0) as once:
            once.inventory()
        return True
    except ReplicaUnavailable:
        return False
    except ReplicaError:
        return True  # someone answers (maybe with another token): reported by the caller
