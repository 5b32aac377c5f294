"""The ``ffstate`` command line: ``serve`` (the replica daemon), ``status`` (what daemons hold), ``bench``
(benchmarks) and ``demo`` (the main job, with failures)."""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import signal
import sys
from pathlib import Path
from typing import Sequence

from ffstate.config import DaemonConfig, parse_bytes

log = logging.getLogger("ffstate.cli")

def read_token(path: Path | None) -> str:
    """The job token: from --token-file, else $FFSTATE_TOKEN; never empty."""
    token = path.read_text().strip() if path else os.environ.get("FFSTATE_TOKEN", "")
    if not token:
        raise SystemExit("ffstate: no token: pass --token-file FILE or set FFSTATE_TOKEN (every RPC carries the job's "
                         "token; generate one with e.g. `python -c 'import secrets; print(secrets.token_hex(16))'`)")
    return token


def _tls_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tls-cert", type=Path, help="this daemon's certificate (PEM); enables TLS")
    p.add_argument("--tls-key", type=Path, help="its private key (PEM)")
    p.add_argument("--tls-ca", type=Path, help="CA that signed the other daemons' certificates (to push to them)")


def nice_level(text: str) -> int | str:
    """``--nice``, ``--persist-nice``: a niceness 0-19, or ``idle`` (the SCHED_IDLE policy)."""
    from ffstate.config import priority

    try:
        return priority(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is neither a niceness 0-19 nor 'idle'") from None


def cmd_serve(args: argparse.Namespace) -> int:
    from ffstate.startup import collector_paused

    with collector_paused():  # the daemon's imports (grpc, NumPy, blosc2) without the collector: ffstate/startup.py
        from ffstate.config import DaemonConfig
        from ffstate.daemon.main import return_freed_memory, serve, set_cpus, set_priority
        from ffstate.errors import FFStateError

        from ffstate import placement
        from ffstate.config import Config

    try:  # by default where the workers look for it: the node's address on the training's network, port 7700
        cfg = DaemonConfig.from_args(args, node_id=args.node_id or DaemonConfig().node_id,
                                     host=args.host or placement.local_address(Config.from_env()),
                                     token=read_token(args.token_file))
    except ValueError as e:
        raise SystemExit(f"ffstate serve: {e}") from None
    try:
        set_cpus(cfg.cpus)
    except FFStateError as e:
        raise SystemExit(f"ffstate serve: {e}") from None
    set_priority(cfg.nice)
    return_freed_memory()
    import faulthandler

    # `kill -USR2 <daemon>` writes every thread's stack to its log (stderr): what a stuck daemon is doing, read at
    # the C level, whatever its main thread is blocked in.
    faulthandler.register(signal.SIGUSR2, all_threads=True)

    def ready(port: int) -> None:
        print(f"ffstate daemon {cfg.node_id} listening on {cfg.host}:{port}", flush=True)

    code = serve(cfg, ready)
    # Everything the daemon owns is released by now (slots removed, flushes done, the server stopped): skip the
    # interpreter's teardown of torch and gRPC, which took another 0.3-0.7 s before a restarted node could bind.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


BENCHMARKS = {  # ffstate bench NAME: the module of ffstate.bench that runs it, and its help line
    "codec": "encode and decode vs a plain copy, and the compression, on fp32 and bf16 AdamW state",
    "bandwidth": "gRPC push/fetch over a chunk-size sweep vs raw TCP and gloo",
    "push": "a version's push: the holder's and the sender's CPU, streamed vs in one call",
    "capture": "commit hold time vs a copy; local and remote restore vs copy and transport",
    "overhead": "step time and bytes replicated per step: ffstate off, on, razor off/on",
    "recovery": "ffstate vs torch.save and DCP: equal protection, equal overhead",
    "simulate": "scale by simulation: replication in the idle link time of 7B and 70B jobs",
    "chaos": "one job under a seeded schedule of many failures: steps lost, downtime, memory",
    "downtime": "a rank's loss under torchrun and with survivors kept in their processes: seconds to the next step, "
                "and where they go",
}


def build_parser(argv: Sequence[str] | None = None) -> argparse.ArgumentParser:
    """The command line's parser. Given ``argv``, only the command it names gets its arguments: the demo's and the
    benchmarks' modules import torch, a second and a half that ``ffstate --help`` or ``status`` need not wait."""
    words = None if argv is None else [a for a in argv if not a.startswith("-")]

    def wanted(*names: str) -> bool:
        return words is None or words[:len(names)] == list(names)

    parser = argparse.ArgumentParser(prog="ffstate", description="Bit-exact in-memory replication of training state.")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("serve", help="run this node's replica daemon")
    p.add_argument("--host", default="", help="address to listen on (default: this node's address on the training's "
                   "network, found as the workers find it: GLOO_SOCKET_IFNAME or NCCL_SOCKET_IFNAME, else the host "
                   "name's)")
    p.add_argument("--port", type=int, default=DaemonConfig.port, help=f"port (default {DaemonConfig.port}, where the "
                   "workers look for their node's daemon; 0: a free one, printed on stdout)")
    p.add_argument("--node-id", default="", help="this node's name (default: the host name)")
    p.add_argument("--peer", dest="peers", action="append", default=[], metavar="HOST:PORT",
                   help="a daemon on another node that holds this node's replicas (repeatable)")
    p.add_argument("--memory-limit", type=parse_bytes, default=0,
                   help="memory budget for slots, replicas and staging, e.g. 8G (default: a quarter of the host's "
                        "RAM, or of its container's memory limit where lower)")
    p.add_argument("--token-file", type=Path, help="file holding the job token (default: $FFSTATE_TOKEN)")
    _tls_args(p)
    p.add_argument("--tls-client-ca", type=Path, help="require client certificates signed by this CA (mutual TLS)")
    p.add_argument("--idle-exit", type=float, default=0.0, metavar="SECONDS",
                   help="exit after this long without a request or commit (default: never)")
    p.add_argument("--exit-when-empty", action="store_true",
                   help="exit once a Drop leaves nothing attached or held (how workers start a node's daemon)")
    p.add_argument("--pid-file", type=Path, help="write the daemon's pid here (removed on exit)")
    p.add_argument("--keep-deltas", type=int, default=DaemonConfig.keep_deltas, metavar="N",
                   help=f"deltas kept per replica, i.e. how far it can step back (default {DaemonConfig.keep_deltas}: "
                        "the workers' max_lag plus one)")
    p.add_argument("--max-chunk-bytes", type=parse_bytes, default=32 << 20,
                   help="largest chunk accepted in a push (default 32M)")
    p.add_argument("--scheduler", choices=("windows", "naive"), default="windows",
                   help="windows: send into the training's idle network windows (default); naive: at once")
    p.add_argument("--link-share", type=float, default=0.5, help="share of each link replication may use (0.5)")
    p.add_argument("--link-bandwidth", type=parse_bytes, default=0, metavar="BYTES_PER_S",
                   help="the links' bandwidth, e.g. 25M (default: measured from the pushes)")
    p.add_argument("--metrics-port", type=int, default=0, help="serve Prometheus metrics on this port (default: off)")
    p.add_argument("--bulk-port", type=int, default=0, help="port of the bulk socket that carries pushes' and "
                   "restores' chunks beside gRPC (default 0: one the kernel picks; -1: none, all over gRPC; none "
                   "under TLS)")
    p.add_argument("--slot-poll", type=float, default=0.05, metavar="SECONDS",
                   help="how often the daemon looks at its workers' slots between their rings of its doorbell "
                        "(a worker rings after each commit; default 0.05)")
    p.add_argument("--max-pushes", type=int, default=48, metavar="N",
                   help="pushes (streamed or in one call) served at once; more are refused with RESOURCE_EXHAUSTED, so "
                        "that stalled or slow pushers cannot take every thread from health checks, Inventory and Commit "
                        "(default 48)")
    p.add_argument("--push-idle-timeout", type=float, default=60.0, metavar="SECONDS",
                   help="cut off a push stream that sends no chunk for this long (default 60)")
    p.add_argument("--staged-timeout", type=float, default=300.0, metavar="SECONDS",
                   help="discard a pushed version not committed within this long, and free its memory (default 300)")
    p.add_argument("--nice", type=nice_level, default=0, metavar="N|idle",
                   help="lower the daemon's CPU priority where the training uses every core: by N (0-19), or idle "
                        "(SCHED_IDLE: the CPU only where a core is idle, yielded at once when the training wakes; "
                        "default 0)")
    p.add_argument("--cpus", default="", metavar="LIST",
                   help="the CPUs the daemon runs on, in taskset's list syntax (60-63, 0,2,4-7): cores of its own "
                        "where the training takes the others (default: where it was started)")
    p.add_argument("--hang-action", choices=("kill", "log", "off"), default="kill",
                   help="when a local rank has not committed within its deadline: write its stacks, then kill the "
                        "job's local ranks so that torchrun restarts them (kill, default), or only log (log), or "
                        "watch nothing (off)")
    p.add_argument("--hang-multiple", type=float, default=10.0, metavar="X",
                   help="a rank's deadline: this many of its median steps (default 10) ...")
    p.add_argument("--hang-floor", type=float, default=60.0, metavar="SECONDS", help="... at least this (default 60)")
    p.add_argument("--hang-ceiling", type=float, default=600.0, metavar="SECONDS",
                   help="... at most this (default 600)")
    p.add_argument("--hang-startup", type=float, default=600.0, metavar="SECONDS",
                   help="the deadline until a rank's third commit after it attached (default 600)")
    p.add_argument("--straggler-ratio", type=float, default=1.5, metavar="X",
                   help="warn about a rank whose compute a step stays above X times its node's median (default 1.5)")
    p.add_argument("--persist-dir", type=Path, default=None, metavar="DIR",
                   help="flush the local ranks' committed versions here, in the torch.distributed.checkpoint format "
                        "(a directory every node reaches; default: off)")
    p.add_argument("--persist-every", type=int, default=DaemonConfig.persist_every, metavar="N",
                   help=f"flush versions whose step is a multiple of N (default {DaemonConfig.persist_every}); one "
                        "due while a flush still runs is skipped")
    p.add_argument("--persist-keep", type=int, default=DaemonConfig.persist_keep, metavar="N",
                   help=f"complete versions kept per job (default {DaemonConfig.persist_keep})")
    p.add_argument("--persist-nice", type=nice_level, default=DaemonConfig.persist_nice, metavar="N|idle",
                   help="the CPU priority of the daemon's flushing process: idle (SCHED_IDLE, default: it takes only "
                        "the CPU nobody else wants, so a node whose cores are all busy skips more versions), or N "
                        "(0-19) below the daemon's own")
    p.set_defaults(run=cmd_serve)

    from ffstate import status

    p = sub.add_parser("status", help="what the daemons on this node (or those named) hold, and how replication, "
                       "restores and the watchdog are doing")
    p.add_argument("--daemon", action="append", metavar="HOST:PORT",
                   help="ask this daemon (repeatable; default: the daemons the jobs' workers started on this node)")
    p.add_argument("--job", help="only this job")
    p.add_argument("--token-file", type=Path, help="file holding the job's token (default: $FFSTATE_TOKEN, else the "
                   "token in the job's run folder on this node)")
    p.add_argument("--tls-ca", type=Path, help="CA of the daemons' certificates, when they use TLS")
    p.add_argument("--timeout", type=float, default=5.0, help="seconds per daemon (default 5)")
    p.set_defaults(run=status.main)

    from ffstate.elastic.drain import add_arguments as drain_arguments
    from ffstate.elastic.drain import main as drain_main

    p = sub.add_parser("drain", help="take this node out of its job with no step lost (planned maintenance)")
    drain_arguments(p)
    p.set_defaults(run=drain_main)

    from ffstate import drop

    p = sub.add_parser("drop", help="free what the daemons hold of a job that is gone (a daemon you run keeps a dead "
                       "job's replicas until told)")
    drop.add_arguments(p)
    p.set_defaults(run=drop.main)

    p = sub.add_parser("demo", help="the main job: torchrun, a killed rank and node, recovery, bit-exact check")
    if wanted("demo"):
        from ffstate.demo import main as demo

        demo.add_arguments(p)
        p.set_defaults(run=demo.main)

    bench = sub.add_parser("bench", help="benchmarks; each writes JSON and a PNG under bench/results/")
    which = bench.add_subparsers(dest="benchmark", required=True)
    for name, text in BENCHMARKS.items():
        p = which.add_parser(name, help=text)
        if wanted("bench", name):
            module = importlib.import_module(f"ffstate.bench.{name}")
            module.add_arguments(p)
            p.set_defaults(run=module.main)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(argv).parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("numexpr").setLevel(logging.WARNING)  # "NumExpr defaulting to N threads", at each command
    try:
        return args.run(args)
    except KeyboardInterrupt:  # Ctrl-C: the command's own clean-up (its finally blocks) has run; no traceback
        print(f"ffstate {args.command}: interrupted", file=sys.stderr, flush=True)
        # Ended by SIGINT, as the shell expects of a program it sent one (a script running `ffstate` stops too;
        # an exit code of 130 would make bash carry on with the script).
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
        raise  # not reached


if __name__ == "__main__":
    sys.exit(main())
