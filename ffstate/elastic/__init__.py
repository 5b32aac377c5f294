"""Jobs that change shape: resume at another world size from the copies made at the old one (a node lost with no
spare, a node added), and drain a node out of a job with no step lost (docs/design.md section 5).

``resize`` loads every old rank's copy of v* into this run's objects, resharded: tensors through DCP's own
planner (``reader``: a ``StorageReader`` over the copies in memory; ``targets``: this run's model and optimizer),
everything else by a rule (``rules``). ``data.ElasticSampler`` keeps one global sample position across a resize.
``drain`` asks a node's daemon to drain it (``ffstate drain``; the daemon's side is ``daemon/drain.py``).
"""

from typing import TYPE_CHECKING, Any

from ffstate.elastic.drain import cancel_drain, drain

if TYPE_CHECKING:
    from ffstate.elastic.data import ElasticSampler

__all__ = ["ElasticSampler", "cancel_drain", "drain"]


def __getattr__(name: str) -> Any:
    if name == "ElasticSampler":  # loaded on first use: the command line reads drain's arguments without torch
        from ffstate.elastic.data import ElasticSampler

        return ElasticSampler
    raise AttributeError(f"module 'ffstate.elastic' has no attribute {name!r}")
