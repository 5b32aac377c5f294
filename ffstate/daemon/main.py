"""The daemon process (``ffstate serve``): the node, its gRPC server and metrics, until SIGTERM/SIGINT, the
idle timeout, or (for daemons the workers start) the job's end. The node's shared-memory slots are
removed on the way out."""

from __future__ import annotations

import logging
import os
import signal
from typing import Callable

from ffstate.config import DaemonConfig
from ffstate.daemon.node import Node
from ffstate.daemon.replicator import Pacer
from ffstate.daemon.servicer import start_server
from ffstate.errors import FFStateError

log = logging.getLogger("ffstate.daemon")


def set_priority(nice: int | str) -> None:
    """The process's CPU priority, before any thread starts (they inherit it; README: scheduling)."""
    if nice == "idle":
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    elif nice:
        os.nice(int(nice))  # the training comes first where it needs every core


# glibc's mallopt parameters (malloc.h)
M_MMAP_THRESHOLD, M_ARENA_MAX = -3, -8


# Buffers this large and larger are mapped, and unmapped when freed: twice the default segment (Config.chunk_bytes),
# so that a segment's own buffers come from the heap, and are reused.
MMAP_THRESHOLD = 2 << 20


def return_freed_memory() -> bool:
    """Makes the daemon's heap give freed buffers back to the system (glibc only; False elsewhere).

    A daemon lives through hundreds of its job's failures, and each recovery frees megabytes of bases,
    decoded versions and staged pushes and starts new threads. Under glibc's defaults the freed buffers stay
    in the process (the mmap threshold rises after the first large free, and every new thread may get an
    arena of its own): in the chaos run a surviving daemon's RSS grew by ~10 MB per failure, with the bytes
    it accounts flat. A fixed threshold and two arenas cut that to ~1 MB.

    The threshold was 128 KiB: then every segment's buffers (blosc2's output, the payload) were mapped and
    unmapped again, a page fault per 4 KiB each time, and the codec ran a third slower than with glibc's
    defaults (``ffstate bench codec``, which allocates as the daemon does: fp32 LZ4 encode 0.54-0.57 GB/s a
    thread, 0.86-0.88 at 2 MiB, 0.87 with glibc's own; decode 1.25-1.30, 1.49-1.52 and 1.53). At 2 MiB a chaos
    run's daemons ended at 298 and 306 MB (270 at the start; 295 and 298 at 128 KiB), one run each.
    """
    try:
        import ctypes
        libc = ctypes.CDLL("libc.so.6")
        return bool(libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(libc.mallopt(M_ARENA_MAX, 2))
    except (OSError, AttributeError):  # not glibc: its own defaults
        return False


def serve(cfg: DaemonConfig, ready: Callable[[int], None] | None = None, pacer: Pacer | None = None) -> int:
    """Runs a daemon until SIGTERM/SIGINT, the idle timeout or an empty node (``exit_when_empty``); returns the
    exit code. ``ready(port)`` is called once it listens; ``pacer`` replaces the configured scheduler."""
    node = Node(cfg, pacer)
    try:
        server, port = start_server(node, cfg)
    except BaseException:
        node.close()
        raise
    metrics = None
    try:
        if cfg.metrics_port:
            from ffstate.daemon.metrics import serve_metrics

            try:
                metrics = serve_metrics(node.report, cfg.host, cfg.metrics_port)
            except OSError as e:
                raise FFStateError(f"cannot serve metrics on {cfg.host}:{cfg.metrics_port}: {e}") from e
        log.info("scheduler: %s, link share %.2f, link bandwidth %s", node.replicator.pacer.name, cfg.link_share,
                 f"{cfg.link_bandwidth / 1e6:.1f} MB/s" if cfg.link_bandwidth else "measured")
        log.info("ffstate daemon %s serving on %s:%d (%s), budget %d bytes, peers %s", cfg.node_id, cfg.host, port,
                 "TLS" if cfg.tls_cert else "plaintext", node.store.budget, list(cfg.peers) or "none")
        if cfg.pid_file:
            cfg.pid_file.write_text(f"{os.getpid()}\n")
        if ready is not None:
            ready(port)
        done = node.done
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: done.set())
        while not done.wait(0.5):
            node.expire_staged()
            if cfg.idle_exit and node.idle_seconds() > cfg.idle_exit:
                log.info("idle for %.0fs (--idle-exit): exiting", cfg.idle_exit)
                break
    finally:
        server.stop(5.0).wait(6.0)
        if metrics is not None:
            metrics.shutdown()
            metrics.server_close()
        node.close()
        log.info("ffstate daemon %s stopped", cfg.node_id)
        if cfg.pid_file:
            cfg.pid_file.unlink(missing_ok=True)
    return 0
