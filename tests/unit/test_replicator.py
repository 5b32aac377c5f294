"""The replicator's policy towards a holder that does not answer (``daemon.replicator``): looks at its connection
while it is unreachable, nothing encoded for it; a push at once when it answers; the ordinary backoff when it answers
and the push still fails. The end-to-end case, with real daemons, is in tests/system/test_daemon.py."""

import time
from types import SimpleNamespace

import pytest

from ffstate.daemon.replicator import PROBE_EVERY, Replicator
from ffstate.daemon.shard import Holder
from ffstate.errors import ReplicaUnavailable
from ffstate.ids import ShardKey


class Unreachable:
    """A holder's client whose daemon is not there (pushes fail as a refused connection does), until ``up``."""

    def __init__(self):
        self.up, self.pushes = False, 0

    def reachable(self) -> bool:
        return self.up

    def push_and_commit(self, *args, **kwargs):
        self.pushes += 1
        raise ReplicaUnavailable("push at holder: UNAVAILABLE after 1 tries: failed to connect to all addresses")


def _shard():
    return SimpleNamespace(key=ShardKey("j", 0, 2), chain=[], base_version=3, report=lambda: None)


def test_an_unreachable_holder_is_looked_at_then_pushed_to_then_backed_off_if_it_answers_and_fails():
    client = Unreachable()
    holder, shard, rep = Holder("b:1", client), _shard(), Replicator(lambda a: client, [])
    assert not rep._push(shard, 3, holder, SimpleNamespace(kind="full", nbytes=10))
    assert holder.down and holder.probe and client.pushes == 1
    assert holder.next_try - time.monotonic() <= PROBE_EVERY
    for _ in range(5):  # while it is down: looks, no push (nothing encoded for it)
        rep._probe(shard, holder)
    assert holder.probe and client.pushes == 1 and holder.next_try - time.monotonic() <= PROBE_EVERY
    client.up = True
    rep._probe(shard, holder)  # it answers: pushed to at the next round
    assert not holder.probe and holder.next_try == 0.0 and holder.down
    before = time.monotonic()
    assert not rep._push(shard, 3, holder, SimpleNamespace(kind="full", nbytes=10))  # answers, but the push fails
    assert not holder.probe  # not its connection: no look, the backoff of any failed push (up to a second)
    assert holder.next_try - before > PROBE_EVERY  # from before the push: a stalled thread cannot eat the margin
    assert not rep._push(shard, 3, holder, SimpleNamespace(kind="full", nbytes=10))
    assert holder.probe  # failing again after that: looks again first


def test_a_holder_down_for_long_is_still_looked_at_a_tenth_of_a_second_apart():
    # Looks count as failures, ten a second: after 1,024 of them (102 s) the backoff's 2 ** n overflowed a float,
    # the batch died silently and the replicator span without any backoff.
    client = Unreachable()
    holder, shard, rep = Holder("b:1", client), _shard(), Replicator(lambda a: client, [])
    rep._push(shard, 3, holder, SimpleNamespace(kind="full", nbytes=10))
    holder.failures = 5000
    rep._probe(shard, holder)
    assert holder.probe and 0 < holder.next_try - time.monotonic() <= PROBE_EVERY


@pytest.mark.filterwarnings("error::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_closed_client_is_never_reachable_and_its_look_ends_quietly():
    # A holder replaced (its client closed) while a look at it ran must not be seen answering (a cancelled look
    # counts as done), and gRPC's thread watching the channel must not die on the closed channel with a traceback.
    from ffstate.client import Client

    for wait in (0.0, 0.05, 0.1, 0.15):
        c = Client("127.0.0.1:9", "token")  # nothing listens there
        assert not c.reachable()
        time.sleep(wait)
        c.close()
        assert not c.reachable()
    time.sleep(0.6)  # past the watching thread's next tick (0.2 s)
