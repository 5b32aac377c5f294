"""A process's start: its imports with Python's cyclic collector paused, the objects they made frozen after.

Importing torch (and ffstate's daemon, or a training script's framework) makes some 200,000 objects that live as
long as the process. CPython's collector walks them again and again while the imports run (a young collection every
700 new objects, a full one each time the objects that survived grew by a quarter), and once more when the
interpreter ends. Measured on this project's 2-core machine (5 runs each), `import` of the demo worker's modules,
then exit: 2.96 s of CPU as it is, 1.89 s with the collector paused for the imports and the result frozen
(``gc.freeze``: never walked again, never freed, as a module's objects are not anyway); the daemon's modules 1.97 s,
1.37. A full collection in a process with torch imported walks them all: 88 ms, against microseconds once they are
frozen. The cyclic garbage the imports leave is frozen with the rest, not freed: 8,679 objects in the demo worker,
where collecting them first would cost 0.24 s.

ffstate does this in the processes it starts (``ffstate serve``, the daemon's flushing process) and in its demo's
worker, never in a training process it is imported into: that process's collector is its owner's
(docs/deployment.md says how a training script does the same).
"""

from __future__ import annotations

import contextlib
import gc
from typing import Iterator


def pause() -> bool:
    """The collector off from here (a process's first line, before its imports); whether it was on."""
    was = gc.isenabled()
    gc.disable()
    return was


def imported(was: bool) -> None:
    """After the imports: everything made so far frozen (``gc.freeze``), the collector on again if ``was`` (what
    ``pause`` returned)."""
    gc.freeze()
    if was:
        gc.enable()


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """Python's cyclic collector off for the block (a process's imports), everything it made frozen after, and the
    collector on again if it was."""
    was = pause()
    try:
        yield
    finally:
        imported(was)
