"""Where the codec's work runs: on a thread pool (NumPy and blosc2 release the interpreter lock, so it scales
with cores), or, for packing CUDA buffers and the razor's fingerprints of CUDA tensors, in the Triton kernels
(``ffstate.kernels``), which produce the same bytes; ``FFSTATE_KERNELS`` forces either. And the buffer checksum
every level verifies against."""

from __future__ import annotations

import functools
import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

from ffstate import checksum
from ffstate.codec.host import Buffer, array, is_cuda
from ffstate.config import Config

if TYPE_CHECKING:
    import torch

log = logging.getLogger("ffstate.codec")
_fingerprint_said = False  # the kernel's failure logged once a process

_POOL: ThreadPoolExecutor | None = None
_POOL_LOCK = threading.Lock()


def _pool() -> ThreadPoolExecutor:
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            workers = Config.from_env().codec_threads or min(8, len(os.sched_getaffinity(0)))  # the CPUs it may use
            _POOL = ThreadPoolExecutor(workers, thread_name_prefix="ffstate-codec")
        return _POOL


LEAK_WAIT = 0.2  # seconds a lock of the pool must stay held, with no use of the pool under way, to count as leaked


def release_leaked_pool_locks() -> list[str]:
    """Releases the codec pool's locks that an asynchronous exception left held (the in-process engine's restart,
    landing inside ``submit``: measured, 50 landings of 360 there left its semaphore's lock held), which the next
    commit or restore, and every worker that finishes a task, would wait on forever (the process could not even
    exit). Call on the thread that uses the pool, between uses: a worker holds these locks for microseconds, so one
    held for ``LEAK_WAIT`` is leaked. They are plain locks: any thread may release them. Returns which."""
    pool = _POOL
    if pool is None:
        return []
    semaphore = getattr(getattr(pool, "_idle_semaphore", None), "_cond", None)
    released = []
    for name, lock in (("shutdown lock", getattr(pool, "_shutdown_lock", None)),
                       ("idle semaphore's lock", getattr(semaphore, "_lock", None))):
        if lock is not None and _held_for(lock, LEAK_WAIT):
            lock.release()
            released.append(name)
    return released


def _held_for(lock, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while lock.locked():
        if time.monotonic() > deadline:
            return True
        time.sleep(0.005)
    return False


def use_threads(n: int) -> None:
    """The codec's pool from now on: ``n`` threads (0: ``Config.codec_threads``, else the cores). For the
    benchmarks, which compare thread counts in one process."""
    global _POOL
    with _POOL_LOCK:
        if _POOL is not None:
            _POOL.shutdown(wait=True)
        _POOL = ThreadPoolExecutor(n, thread_name_prefix="ffstate-codec") if n else None


# Work on fewer bytes than this runs on the calling thread: a task handed to the pool and waited for costs tens of
# microseconds of interpreter time (a daemon's profile: 20 tasks a version of 0.7 MB, more than the work saved).
POOL_MIN_BYTES = 4 << 20


def _map(fn, items, inline: bool = False):
    """``map`` over a thread pool: NumPy, blosc2 and the checksum release the GIL or run in C, so the CPU path
    scales with cores; on this thread when there is one item or ``inline`` (little work)."""
    items = list(items)
    if len(items) < 2 or inline:
        return [fn(x) for x in items]
    return list(_pool().map(fn, items))


def _use_kernels(t: Buffer) -> bool:
    """Triton for CUDA tensors; FFSTATE_KERNELS=triton forces it (CPU tensors need TRITON_INTERPRET=1)."""
    choice = _kernels_choice(os.environ.get("FFSTATE_KERNELS", "auto"))
    return choice == "triton" or (choice == "auto" and is_cuda(t))


@functools.lru_cache(maxsize=4)
def _kernels_choice(raw: str) -> str:
    """``FFSTATE_KERNELS`` checked as ``Config`` checks it, once per value: every commit and checksum asks
    (``Config.from_env()`` reads every variable: 60 us, 4% of a commit)."""
    return Config(kernels=raw).kernels


def buffer_checksum(buf: Buffer) -> int:
    """The checksum of a uint8 buffer (``ffstate.checksum``), on the codec's threads; a buffer on a GPU is
    copied to the host first (the daemon, which checksums every version, holds host buffers only)."""
    return checksum.checksum(array(buf), _map)


def fingerprint(buf: torch.Tensor) -> int:
    """The razor's fingerprint of a uint8 buffer (``ffstate.checksum.fingerprint``), on the buffer's device: the
    Triton kernel for a GPU tensor, no copy to the host."""
    global _fingerprint_said
    if _use_kernels(buf):
        from ffstate import kernels

        try:
            return kernels.fingerprint(buf)
        except Exception as e:  # noqa: BLE001 (Triton missing, or unable to compile: no C compiler, a ptxas too old)
            if _kernels_choice(os.environ.get("FFSTATE_KERNELS", "auto")) == "triton" or not buf.is_cuda:
                raise
            if not _fingerprint_said:
                _fingerprint_said = True
                log.warning("the fingerprint kernel failed on %s (%s: %s): the razor's fingerprints are taken on the "
                            "host instead", buf.device, type(e).__name__, (str(e).splitlines() or [""])[0][:200])
    return checksum.fingerprint(array(buf), _map)
