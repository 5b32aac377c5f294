"""The exception types ffstate raises. Messages say what was expected, what was found, and what to do."""

from __future__ import annotations


class FFStateError(Exception):
    """Base class of every error ffstate raises on purpose."""


class CodecError(FFStateError):
    """A state, snapshot or encoded version is malformed, corrupted, or does not match its base.

    Raised instead of ever returning a wrong state (docs/design.md I1, I2, I6).
    """


class LayoutChanged(CodecError):
    """A state's layout (its structure, a tensor's dtype or shape) is not the one its buffer was made for."""


class ReplicaError(FFStateError):
    """A replica daemon refused or could not serve a request.

    ``code`` is the gRPC status name the daemon answers with (``INVALID_ARGUMENT``,
    ``FAILED_PRECONDITION``, ``DATA_LOSS``, ``RESOURCE_EXHAUSTED``, ``NOT_FOUND``,
    ``UNAUTHENTICATED``...).
    """

    code = "UNKNOWN"

    def __init__(self, message: str, code: str | None = None):
        super().__init__(message)
        if code is not None:
            self.code = code


class ReplicaUnavailable(ReplicaError):
    """No daemon answered at that address (down, unreachable, or past the deadline) after the retries."""

    code = "UNAVAILABLE"


class SlotError(FFStateError):
    """A shared-memory slot is missing, of another layout, or used wrongly (e.g. a non-increasing version)."""
