"""The mode in which the surviving ranks stay in their processes when one fails (docs/inprocess.md): the training
function runs under NVIDIA's resiliency extension (``nvidia-resiliency-ext``), which finds a dead rank, stops the
collectives the others wait in and enters the function again in the same processes; a warm spare takes the dead
rank's place, and ffstate restores every rank at v*.

    from ffstate.inprocess import restartable

    @restartable()
    def train(attempt):            # entered again after a failure, in the same process
        ddp = DDP(model)           # over this entry's process group; the model was built once, outside
        with ffstate.replicate(ddp, optimizer, ...) as ff:
            ...

``assignment`` (which process holds which rank: pure code), ``abort`` (stopping a gloo group), ``store`` (the
job's stores, outside every rank), ``group`` (each entry's process group, once every rank has arrived), ``locks``
(logging locks a restart's asynchronous exception left held), ``unwind`` (the deadline after an abort), ``raised``
(a function that raises at every entry stops the job), ``engine`` (the extension's wrapper, configured).
"""

try:
    import nvidia_resiliency_ext.inprocess  # noqa: F401
except ImportError as e:  # an optional dependency: only this mode needs it
    raise ImportError("ffstate.inprocess needs NVIDIA's resiliency extension: pip install 'ffstate[inprocess]' "
                      "(or nvidia-resiliency-ext)") from e

from typing import TYPE_CHECKING

from ffstate import lazy

if TYPE_CHECKING:
    from ffstate.inprocess.assignment import Layout, NoSpareLeft
    from ffstate.inprocess.engine import Attempt, restartable
    from ffstate.inprocess.raised import TrainingRaised

# Loaded when first named: the stores' host (``python -m ffstate.inprocess.store``) loads this package first, and
# would otherwise load the engine and, through it, its own module a second time (runpy's warning in its log).
__all__ = ["Attempt", "Layout", "NoSpareLeft", "TrainingRaised", "restartable"]
__getattr__, __dir__ = lazy.attach(globals(), {
    "Attempt": "ffstate.inprocess.engine", "restartable": "ffstate.inprocess.engine",
    "Layout": "ffstate.inprocess.assignment", "NoSpareLeft": "ffstate.inprocess.assignment",
    "TrainingRaised": "ffstate.inprocess.raised"})
