"""The daemon process (``ffstate serve``): the node, its gRPC server and metrics, until SIGTERM/SIGINT, the
idle timeout, or (for daemons the workers start) the job's end. The node's shared-memory slots are
removed on the way out."""

from __future__ import annotations

import logging
import os
import signal
import threading
from typing import Callable

from ffstate.bulk.server import BulkServer
from ffstate.config import DaemonConfig, cpu_list
from ffstate.daemon.node import Node
from ffstate.daemon.replicator import Pacer
from ffstate.daemon.servicer import start_server
from ffstate.daemon.threads import name_new_threads
from ffstate.errors import FFStateError

log = logging.getLogger("ffstate.daemon")


def set_priority(nice: int | str) -> None:
    """The process's CPU priority, before any thread starts (they inherit it; README: scheduling)."""
    if nice == "idle":
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    elif nice:
        os.nice(int(nice))  # the training comes first where it needs every core


def set_cpus(spec: str) -> None:
    """Moves the process, every thread it has (and so every thread it starts), onto the CPUs ``spec`` lists: beyond
    the CPUs it was started on where its cgroup allows (a daemon started by a rank pinned to other cores).

    Raises:
        FFStateError: a CPU listed is offline, or outside the process's cgroup (cpuset).
    """
    if not spec:
        return
    wanted, before = cpu_list(spec, "--cpus"), os.sched_getaffinity(0)
    for tid in os.listdir("/proc/self/task"):  # threads started before now (imports' pools) go along
        try:
            os.sched_setaffinity(int(tid), wanted)
        except ProcessLookupError:  # ended since the listing
            pass
        except OSError as e:  # none of them can be used here
            raise FFStateError(f"--cpus {spec}: none of these CPUs can be used here ({e.strerror}); it was started "
                               f"on CPUs {_ranges(before)}") from None
    got = os.sched_getaffinity(0)
    if got != wanted:  # the kernel keeps those its cpuset allows
        raise FFStateError(f"--cpus {spec}: CPUs {_ranges(wanted - got)} are offline or outside this process's "
                           f"cpuset (it was given {_ranges(got)})")
    log.info("running on CPUs %s", _ranges(wanted))


def _ranges(cpus: set[int] | frozenset[int]) -> str:
    out, run = [], []
    for c in sorted(cpus):
        if run and c != run[-1] + 1:
            out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
            run = []
        run.append(c)
    if run:
        out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ",".join(out)


# glibc's mallopt parameters (malloc.h)
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD, M_ARENA_MAX = -1, -3, -8


# Buffers this large and larger are mapped, and unmapped when freed: twice the default segment (DEFAULT_CHUNK_BYTES),
# so that a segment's own buffers come from the heap, and are reused.
MMAP_THRESHOLD = 2 << 20
# Free bytes at the top of a heap kept, not given back, up to this: glibc's own ceiling for it (twice its largest
# dynamic mmap threshold), so that a version's encoded chunks, where they are freed together, are the next version's
# memory instead of fresh pages (a fixed mmap threshold otherwise leaves it at 128 KiB).
TRIM_THRESHOLD = 64 << 20


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

    Fixing the mmap threshold also fixes glibc's trim threshold, at 128 KiB: where a version's chunks were freed
    together, they went back to the system and the next version's were fresh pages, a fault per 4 KiB of blosc2's
    output and of each payload. On the fp32 AdamW state of ``bench codec``, which frees them so, the entropy stage
    compressed at 1.21 GB/s and the encode ran at 0.88; with free memory kept up to ``TRIM_THRESHOLD`` (64 MiB,
    glibc's own ceiling for it) at 2.20 and 1.77. In a job, where a daemon frees its chunks one by one as it sends
    them, its faults fell by a sixth to a third and its CPU per step did not move beyond noise
    (benchmarks/2026-11-27-trim-and-copy.md). The heap keeps at most that much free at its top, per arena (two): a
    bound, not a growth.
    """
    try:
        import ctypes
        libc = ctypes.CDLL("libc.so.6")
        return (bool(libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
                and bool(libc.mallopt(M_ARENA_MAX, 2)))
    except (OSError, AttributeError):  # not glibc: its own defaults
        return False


class StopSignals:
    """SIGTERM and SIGINT set ``done``, from a thread of their own; from ``close()`` on they are ignored.

    A Python signal handler runs in the main thread between two of its bytecodes, possibly while that thread
    holds the very lock ``done.set()`` takes: inside ``done.wait``, or inside the handler of the signal before
    (a second SIGTERM close behind the first, as a supervisor, a user's second Ctrl-C or a clean-up sends it).
    A handler that set the event itself deadlocked the daemon there, its slots never removed: 7 of 10 daemons
    flooded with SIGTERMs for 0.5 s, and once in a CI run whose clean-up sent two. The handler here only
    writes the signal's number to a pipe (no lock) after ignoring both signals from then on (a flood of them
    nested handlers until a RecursionError); the thread reading it sets the event, then logs. Once the daemon is
    stopping, more signals change nothing: its clean-up runs to the end (SIGKILL still stops it)."""

    def __init__(self, done: threading.Event):
        self.done = done
        self._read, self._write = os.pipe()
        os.set_blocking(self._write, False)
        self._thread = threading.Thread(target=self._run, name="ffstate-signals", daemon=True)
        self._thread.start()
        try:
            for sig in (signal.SIGTERM, signal.SIGINT):
                signal.signal(sig, self._handle)  # ValueError outside the main thread
        except BaseException:
            os.close(self._write)  # the thread ends, closing its end
            raise

    def _handle(self, signum: int, _frame) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):  # first: a flood of signals nests no deeper than these lines
            signal.signal(sig, signal.SIG_IGN)
        try:
            os.write(self._write, bytes([signum]))
        except BlockingIOError:  # the pipe is full of signals not yet read: one more changes nothing
            pass

    def _run(self) -> None:
        try:
            while data := os.read(self._read, 64):
                first = not self.done.is_set()
                self.done.set()  # before the log line: a blocked stderr must not hold the stop
                if first:
                    log.info("%s: stopping", signal.Signals(data[0]).name)
        finally:
            os.close(self._read)  # here, not in close(): never a descriptor this thread may still read

    def close(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, signal.SIG_IGN)  # before the pipe closes: no handler writes to a closed descriptor
        os.close(self._write)  # the thread reads the end of its pipe, closes it and exits
        self._thread.join(5.0)


def serve(cfg: DaemonConfig, ready: Callable[[int], None] | None = None, pacer: Pacer | None = None) -> int:
    """Runs a daemon until SIGTERM/SIGINT, the idle timeout or an empty node (``exit_when_empty``); returns the
    exit code. ``ready(port)`` is called once it listens; ``pacer`` replaces the configured scheduler. Call it
    from the main thread (the signals' handlers); from its return on, SIGTERM and SIGINT are ignored."""
    name_new_threads()  # top -H and perf show the codec, the replicators, the RPCs by name
    done = threading.Event()
    stop = StopSignals(done)  # first: a SIGTERM while the node starts is a clean stop too
    try:
        return _serve(cfg, ready, Node(cfg, pacer, done))
    finally:
        stop.close()


def _serve(cfg: DaemonConfig, ready: Callable[[int], None] | None, node: Node) -> int:
    bulk = metrics = server = None
    try:  # every other port bound before the gRPC one answers: a daemon that answers keeps running
        if cfg.bulk_port >= 0 and not cfg.tls_cert:  # under TLS every byte stays on the encrypted channel
            try:
                bulk = BulkServer(cfg.host, cfg.bulk_port, node.release, node.touch, node.refused)
            except OSError as e:
                raise FFStateError(f"cannot listen for bulk fetches on {cfg.host}:{cfg.bulk_port} (--bulk-port): {e}"
                                   ) from e
        if cfg.metrics_port:
            from ffstate.daemon.metrics import serve_metrics

            try:
                metrics = serve_metrics(node.report, cfg.host, cfg.metrics_port)
            except (OSError, OverflowError) as e:  # OverflowError: a port past 65535
                raise FFStateError(f"cannot serve metrics on {cfg.host}:{cfg.metrics_port} (--metrics-port): {e}"
                                   ) from e
        server, port = start_server(node, cfg, bulk)
        log.info("scheduler: %s, link share %.2f, link bandwidth %s", node.replicator.pacer.name, cfg.link_share,
                 f"{cfg.link_bandwidth / 1e6:.1f} MB/s" if cfg.link_bandwidth else "measured")
        log.info("ffstate daemon %s serving on %s:%d (%s; bulk socket %s), budget %d bytes, peers %s", cfg.node_id,
                 cfg.host, port, "TLS" if cfg.tls_cert else "plaintext", bulk.port if bulk else "off", node.store.budget,
                 list(cfg.peers) or "none")
        if cfg.pid_file:
            cfg.pid_file.write_text(f"{os.getpid()}\n")
        node.touch()  # the idle clock runs from here: a slow start (a persistent tier to read) is not idle time
        if ready is not None:
            ready(port)
        while not node.done.wait(0.5):
            node.expire_staged()
            if bulk is not None:
                bulk.expire()
            if cfg.idle_exit and node.idle_seconds() > cfg.idle_exit:
                log.info("idle for %.0fs (--idle-exit): exiting", cfg.idle_exit)
                break
    finally:  # a start that failed closes what it had bound too
        if server is not None:
            server.stop(5.0).wait(6.0)
        if bulk is not None:
            bulk.close()
        if metrics is not None:
            metrics.shutdown()
            metrics.server_close()
        node.close()
        if server is not None:
            # What is still counted once every server and offer is closed (offers in flight at the job's drop are
            # given back by now): the replicas kept; after the job's end, normally nothing (docs/deployment.md).
            log.info("ffstate daemon %s stopped, %d bytes accounted", cfg.node_id, node.store.used)
            if cfg.pid_file:
                cfg.pid_file.unlink(missing_ok=True)
    return 0
