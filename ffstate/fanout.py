"""Work fanned out over a few threads and waited for in slices, so that the waiting thread can be interrupted.

A restore fetches its ranks' copies and its stripes on threads of its own while the training's thread waits. A wait
on a future without a timeout (``result()``, a ``ThreadPoolExecutor`` leaving its ``with``) holds that thread inside
a lock until every item is done: an exception raised into it from another thread, as the in-process engine raises
its restart after a failure elsewhere in the job, does not land until then (a fetch from a slow holder runs to its
deadline). ``run_all`` waits a second at a time, and when something is raised into it leaves at once: the items not
begun never begin, those under way end on their own threads, unwaited.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor, wait
from typing import Callable, Sequence, TypeVar

T = TypeVar("T")
R = TypeVar("R")

SLICE = 1.0  # seconds the caller's thread waits at a time: what an exception raised into it may wait to land


def run_all(fn: Callable[[T], R], items: Sequence[T], workers: int, name: str) -> list[R]:
    """``[fn(x) for x in items]`` on up to ``workers`` threads (named ``name``), once every one is done.

    Raises:
        The exception of the first item (in order) that raised, once every item is done; or whatever was raised into
            the calling thread meanwhile, at once.
    """
    pool = ThreadPoolExecutor(max(1, min(workers, len(items))), thread_name_prefix=name)
    try:
        futures = [pool.submit(fn, x) for x in items]
        while wait(futures, timeout=SLICE).not_done:
            pass
    except BaseException:
        pool.shutdown(wait=False, cancel_futures=True)
        raise
    pool.shutdown()
    return [f.result() for f in futures]
