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


class Recording:
    """A holder's client that takes every push, recording (version, kind, base version)."""

    def __init__(self):
        self.pushes = []

    def reachable(self) -> bool:
        return True

    def push_and_commit(self, job, rank, world, version, packed, base_version, before_chunk=None):
        self.pushes.append((version, packed.kind, base_version))

    def close(self) -> None:
        pass


def test_a_holder_re_seeded_with_a_full_version_does_not_stop_the_versions_being_taken(tmp_path, monkeypatch):
    """A holder that lacks a base gets a full version, whose encoding takes seconds for a large state. It was made in
    the replicator's loop, under the shard's lock: no version was taken meanwhile, so a block-policy commit waited
    SLOT_WAIT and overwrote a version the daemon had not read (never replicated), and the commits stalled. The full
    version is encoded from a copy on the holder's own push thread; the loop goes on taking versions, and keeps
    the deltas taken meanwhile (more than keep_deltas) for the holder, which would otherwise get another full
    version, and another."""
    import threading

    import torch
    from helpers import worker_and_daemon_slots

    from ffstate import codec
    from ffstate.commit import SlotWriter
    from ffstate.daemon.shard import LocalShard
    from ffstate.daemon.store import Store

    gate, encoding, real = threading.Event(), threading.Event(), codec.encode_snapshot

    def slow_full(snapshot, base=None, **kw):  # as a large state's full encoding: until the test lets it end
        if base is None:
            encoding.set()
            assert gate.wait(30)
        return real(snapshot, base, **kw)

    monkeypatch.setattr(codec, "encode_snapshot", slow_full)
    state = {"w": torch.zeros(4096)}
    with worker_and_daemon_slots(tmp_path, monkeypatch, state) as (state, worker, daemon_slots):
        client = Recording()
        shard = LocalShard(ShardKey("j", 0, 1), daemon_slots.manifest, daemon_slots, [Holder("b:1", client)], 0)
        store = Store(1 << 30, 8, 1 << 20)  # the daemon's budget counts the copy and its encoding
        # keep 2, the daemon's default: the deltas taken while the full version is made are kept for the holder
        rep = Replicator(lambda a: client, [], poll_interval=0.01, budget=store, keep=2)
        writer = SlotWriter(worker)
        writer.commit(state, 1, wait=2.0)
        rep.start(shard)
        try:
            assert encoding.wait(10)  # version 1's full version is being encoded for the holder
            for version in range(2, 6):
                state["w"][version] = version
                writer.commit(state, version, wait=2.0)
                assert not worker.wait_timed_out, f"version {version - 2} was overwritten before the daemon read it"
            deadline = time.monotonic() + 5
            while shard.base_version < 5 and time.monotonic() < deadline:
                time.sleep(0.01)
            assert shard.base_version == 5 and not client.pushes  # every version taken, the full one still encoding
            # counted: the copy and its encoding, and the deltas kept past keep for the holder (2 -> 3, 3 -> 4)
            expected = lambda: 2 * shard.manifest.nbytes + sum(c[2].nbytes for c in shard.chain[:-2])  # noqa: E731
            deadline = time.monotonic() + 5
            while (len(shard.chain), store.used) != (4, expected()) and time.monotonic() < deadline:
                time.sleep(0.01)
            assert (len(shard.chain), store.used) == (4, expected())
            gate.set()
            deadline = time.monotonic() + 10
            while shard.holders[0].acked < 5 and time.monotonic() < deadline:
                time.sleep(0.01)
            assert client.pushes == [(1, "full", 0), (2, "delta", 1), (3, "delta", 2), (4, "delta", 3),
                                     (5, "delta", 4)]
            deadline = time.monotonic() + 5  # the chain back to keep at the round after, all given back
            while (len(shard.chain), store.used) != (2, 0) and time.monotonic() < deadline:
                time.sleep(0.01)
            assert (len(shard.chain), store.used) == (2, 0)
        finally:
            gate.set()
            rep.stop(shard)
            rep.shutdown()
            writer.close()


def test_with_no_room_for_its_copy_a_full_version_is_encoded_in_the_loop_as_before(tmp_path, monkeypatch, caplog):
    import logging

    import torch
    from helpers import worker_and_daemon_slots

    from ffstate.commit import SlotWriter
    from ffstate.daemon.shard import LocalShard
    from ffstate.daemon.store import Store

    with worker_and_daemon_slots(tmp_path, monkeypatch, {"w": torch.arange(4096.0)}) as (state, worker, daemon_slots):
        client, store = Recording(), Store(1000, 8, 1 << 20)  # less than the state's copy
        shard = LocalShard(ShardKey("j", 0, 1), daemon_slots.manifest, daemon_slots, [Holder("b:1", client)], 0)
        rep = Replicator(lambda a: client, [], poll_interval=0.01, budget=store)
        writer = SlotWriter(worker)
        rep.start(shard)
        try:
            with caplog.at_level(logging.INFO, logger="ffstate.daemon.replicator"):
                for version in (1, 2):
                    writer.commit(state, version, wait=2.0)
                deadline = time.monotonic() + 10
                while shard.holders[0].acked < 2 and time.monotonic() < deadline:
                    time.sleep(0.01)
            assert client.pushes[0][1] == "full" and client.pushes[-1][0] == 2  # the full one at version 1 or 2
            assert "encoding it in the replication loop instead" in caplog.text and store.used == 0
        finally:
            rep.stop(shard)
            rep.shutdown()
            writer.close()


class Refusing(Recording):
    """A holder whose daemon answers and refuses every push (its memory budget full)."""

    def push_and_commit(self, *args, **kwargs):
        from ffstate.errors import ReplicaError

        self.pushes.append(args[3])
        raise ReplicaError("no room: this daemon's memory budget is full", "RESOURCE_EXHAUSTED")


def test_with_two_holders_one_that_refuses_shows_as_being_seeded_and_holds_back_no_push_to_the_other(tmp_path,
                                                                                                      monkeypatch):
    """With ``replicas`` 2, a holder that refuses every push (its budget full; each refusal makes its next push a full
    version) holds back none of the other holder's pushes, and ``ffstate status`` and the metrics say why the lag
    grows: it is being seeded. It is still counted in the version the worker's lag check reads, so ``block`` holds
    the training for it, as with one holder."""
    import torch
    from helpers import worker_and_daemon_slots

    from ffstate.commit import SlotWriter
    from ffstate.daemon.shard import LocalShard

    with worker_and_daemon_slots(tmp_path, monkeypatch, {"w": torch.zeros(4096)}) as (state, worker, daemon_slots):
        refusing, taking = Refusing(), Recording()
        holders = [Holder("b:1", refusing), Holder("c:1", taking)]
        shard = LocalShard(ShardKey("j", 0, 1), daemon_slots.manifest, daemon_slots, holders, 0)
        rep = Replicator(lambda a: None, [], poll_interval=0.01)
        writer = SlotWriter(worker)
        rep.start(shard)
        try:
            for version in range(1, 5):
                state["w"][version] = version
                writer.commit(state, version, wait=2.0)
                deadline = time.monotonic() + 10
                while holders[1].acked < version and time.monotonic() < deadline:
                    time.sleep(0.01)
                assert holders[1].acked == version, (version, taking.pushes)
            assert refusing.pushes and holders[0].acked == 0
            assert (shard.holders_seeding, shard.holders_down, worker.replicated()) == (1, 0, 0)
        finally:
            rep.stop(shard)
            rep.shutdown()
            writer.close()


def test_the_replicated_version_and_the_holders_left_behind():
    from ffstate.daemon.shard import LocalShard

    def shard(*acked, down=(), chain=()):
        holders = [Holder(f"h{i}:1", None, acked=a, down=i in down) for i, a in enumerate(acked)]
        s = LocalShard(ShardKey("j", 0, 1), None, None, holders, 0, base_version=9)
        s.chain = [(v, v - 1, None, None) for v in chain]
        return s

    def seen(s):
        return s.replicated_version, s.holders_down, s.holders_seeding

    assert seen(shard(9, 0)) == (0, 0, 1)  # one waiting for its full version: counted, and said
    assert seen(shard(9, 3, chain=(8, 9))) == (3, 0, 1)  # out of the deltas kept: a full version next
    assert seen(shard(9, 7, chain=(8, 9))) == (7, 0, 0)  # 2 behind: deltas catch it up
    assert seen(shard(3, chain=(8, 9))) == (3, 0, 1)  # one holder
    assert seen(shard(9, 5, down={1})) == (9, 1, 0)  # down: not counted
    assert seen(shard(4, 2, down={0, 1})) == (2, 2, 0)  # all down: every holder's


def test_a_full_version_that_fails_to_encode_is_tried_again_after_a_backoff_and_frees_its_memory(tmp_path,
                                                                                                   monkeypatch, caplog):
    """Encoded on a push thread, a failure (short of memory) ended the batch with the holder due at once: the next
    round copied and encoded again, thousands of times a second, a traceback each."""
    import torch
    from helpers import worker_and_daemon_slots

    from ffstate import codec
    from ffstate.commit import SlotWriter
    from ffstate.daemon.shard import LocalShard
    from ffstate.daemon.store import Store

    tries, real = [], codec.encode_snapshot

    def failing(snapshot, base=None, **kw):
        if base is None:
            tries.append(time.monotonic())
            raise MemoryError("no memory for the encoding")
        return real(snapshot, base, **kw)

    monkeypatch.setattr(codec, "encode_snapshot", failing)
    with worker_and_daemon_slots(tmp_path, monkeypatch, {"w": torch.zeros(4096)}) as (state, worker, daemon_slots):
        client, store = Recording(), Store(1 << 30, 8, 1 << 20)
        shard = LocalShard(ShardKey("j", 0, 1), daemon_slots.manifest, daemon_slots, [Holder("b:1", client)], 0)
        rep = Replicator(lambda a: client, [], poll_interval=0.01, budget=store)
        writer = SlotWriter(worker)
        writer.commit(state, 1, wait=2.0)
        rep.start(shard)
        try:
            time.sleep(1.0)
            assert 1 <= len(tries) <= 6, len(tries)  # 0.1, 0.2, 0.4 s apart...
            assert "encoding version 1 in full for b:1 failed" in caplog.text and not client.pushes
            deadline = time.monotonic() + 2  # between two tries, every try's copy given back
            while store.used and time.monotonic() < deadline:
                time.sleep(0.005)
            assert store.used == 0
        finally:
            rep.stop(shard)
            rep.shutdown()
            writer.close()
