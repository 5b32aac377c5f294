"""How the daemon logs what it refuses: a warning, at most one a second per method and status, saying how many
were not logged; a rank's entry asking for a rank not attached yet (Lookup, NOT_FOUND) is its normal answer, at
INFO."""

import logging
from types import SimpleNamespace

import grpc

from ffstate.daemon.servicer import Servicer


def test_refusals_are_warnings_counted_and_bounded_but_an_entry_s_lookup_is_not_one(caplog):
    counted: list[str] = []
    s = Servicer.__new__(Servicer)  # the refusal log alone: no node, no server
    s.node, s._logged = SimpleNamespace(refused=counted.append), {}
    caplog.set_level(logging.INFO, logger="ffstate.daemon")
    for _ in range(3):
        s._note("Fetch", grpc.StatusCode.NOT_FOUND, "no replica of j/0 is held here")
    s._note("Lookup", grpc.StatusCode.NOT_FOUND, "j/rank 0 of 2 is not attached")
    assert s._note("Push", grpc.StatusCode.INVALID_ARGUMENT, "x" * 100_000).endswith("(truncated)")
    assert counted == ["NOT_FOUND"] * 4 + ["INVALID_ARGUMENT"]
    said = [(r.levelno, r.getMessage()[:30]) for r in caplog.records]
    assert said == [(logging.WARNING, "refused Fetch: NOT_FOUND: no r"), (logging.INFO, "refused Lookup: NOT_FOUND: j/r"),
                    (logging.WARNING, "refused Push: INVALID_ARGUMENT")]
