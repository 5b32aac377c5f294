"""The exception types ffstate raises. Messages say what was expected, what was found, and what to do."""

from __future__ import annotations


class FFStateError(Exception):
    """Base class of every error ffstate raises on purpose."""


class CodecError(FFStateError):
    """A state, snapshot or encoded version is malformed, corrupted, or does not match its base.

    Raised instead of ever returning a wrong state (DESIGN.md I1, I2, I6).
    """
