"""The bulk socket (``ffstate/bulk/``) against a real daemon: a fetch's chunks come over it bit for bit as gRPC's
Fetch sends them (whole versions, stepped-back ones, named chunks, stripes); a push over it is staged and applied
as a Push stream is, refused with the status a stream gets, and a stalled one cut off; a ticket serves one
connection, and a connection without a live ticket gets nothing; a daemon without the socket (``--bulk-port -1``,
or TLS) is fetched from and pushed to over gRPC."""

import os
import socket
import time

import grpc
import pytest

from daemons import TOKEN, make_tls, wait_until
from ffstate import codec
from ffstate._proto import replica_pb2 as pb
from ffstate._proto import replica_pb2_grpc as pb_grpc
from ffstate.bulk.frames import FRAME, HELLO, MAGIC, RESULT
from ffstate.bulk.server import HELLO_TIMEOUT, TICKET_TTL
from ffstate.client import Client
from ffstate.errors import ReplicaError
from ffstate.wire import shard
from helpers import assert_bitwise_equal, train_states

pytestmark = pytest.mark.timeout(120)
JOB = "bulk"
CHUNK = 64 << 10
META = (("ffstate-token", TOKEN),)


@pytest.fixture(scope="module")
def states():
    return list(train_states(3))


def held(d, states) -> Client:
    """A client of ``d`` holding versions 1-3 of rank 0 (a full version, then deltas)."""
    c = d.client()
    prev = None
    for v, s in enumerate(states, 1):
        c.push_and_commit(JOB, 0, 1, v, codec.encode(s, prev, chunk_bytes=CHUNK), base_version=v - 1 if prev else 0)
        prev = s
    return c


def no_grpc_fetch(c: Client) -> None:
    def refuse(*args, **kwargs):
        raise AssertionError("the fetch went over gRPC's Fetch, not the bulk socket")
    c._fetch = refuse


def over_grpc(d) -> Client:
    c = d.client()
    c.bulk = False
    return c


def test_fetches_over_the_bulk_socket_match_grpc_bit_for_bit(daemons, states):
    d = daemons.start()
    with held(d, states) as c, over_grpc(d) as g:
        no_grpc_fetch(c)
        for version in (3, 2):  # the held version, and one stepped back
            bulk = c.fetch(JOB, 0, 1, version)
            assert_bitwise_equal(codec.decode(bulk), states[version - 1])
            plain = g.fetch(JOB, 0, 1, version)
            assert [(x.index, x.count, x.checksum, bytes(x.payload)) for x in bulk.chunks] == \
                   [(x.index, x.count, x.checksum, bytes(x.payload)) for x in plain.chunks]
        count = bulk.chunks[0].count
        assert count >= 4
        named = [0, 2, count - 1]
        for first, step in ((0, 1), (1, 2)):  # named chunks, and a stripe of them
            a = c.fetch_chunks(JOB, 0, 1, 3, first=first, step=step, chunks=named)
            b = g.fetch_chunks(JOB, 0, 1, 3, first=first, step=step, chunks=named)
            assert [(v, x.index, bytes(x.payload)) for v, x in a] == [(v, x.index, bytes(x.payload)) for v, x in b]
            assert [x.index for _, x in a] == named[first::step]
        assert c.bulk  # every one of them over the socket
        with pytest.raises(ReplicaError, match="NOT_FOUND"):  # refused as Fetch refuses, before any ticket
            c.fetch(JOB, 0, 1, 9)


def ticket(stub) -> pb.BulkTicket:
    return stub.FetchBulk(pb.FetchRequest(shard=shard(JOB, 0, 1), version=3), metadata=META)


def claim(port: int, data: bytes) -> bytes:
    """What the daemon sends a connection that opens with ``data``, until it closes it."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(data)
        s.shutdown(socket.SHUT_WR)  # and nothing more
        got = []
        while part := s.recv(1 << 20):
            got.append(part)
    return b"".join(got)


def test_a_ticket_serves_one_connection_and_nothing_else_is_served(daemons, states):
    d = daemons.start()
    with held(d, states), grpc.insecure_channel(d.address) as ch:
        stub = pb_grpc.ReplicaStub(ch)
        offer = ticket(stub)
        got = claim(offer.port, offer.ticket)
        magic, version, n = HELLO.unpack_from(got)
        assert (magic, version, n) == (MAGIC, 3, offer.chunks)
        first = FRAME.unpack_from(got, HELLO.size)
        assert first[0] == 0 and first[1] == n  # the header chunk first
        assert claim(offer.port, offer.ticket) == b""  # used: nothing the second time
        assert claim(offer.port, os.urandom(32)) == b""  # a guess: nothing
        assert claim(offer.port, ticket(stub).ticket[:31]) == b""  # a ticket's prefix, then the end: nothing
        start = time.monotonic()
        with socket.create_connection(("127.0.0.1", offer.port), timeout=30) as s:  # silent: cut off
            s.sendall(b"x")
            assert s.recv(1) == b""
        assert time.monotonic() - start < HELLO_TIMEOUT + 10
        with pytest.raises(grpc.RpcError) as e:  # the ticket's call is token-checked like every call
            stub.FetchBulk(pb.FetchRequest(shard=shard(JOB, 0, 1)), metadata=(("ffstate-token", "wrong"),))
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert "refused a bulk connection" in d.log()
    with held(d, states) as c:  # and the daemon serves on
        no_grpc_fetch(c)
        assert_bitwise_equal(codec.decode(c.fetch(JOB, 0, 1, 3)), states[2])


def test_a_daemon_without_the_socket_is_fetched_from_and_pushed_to_over_grpc(daemons, states, tmp_path):
    d = daemons.start("--bulk-port", "-1")
    with held(d, states) as c:
        assert not c.bulk  # its pushes (streamed, over gRPC) learned that the daemon has none
    with d.client() as c:
        assert c.bulk
        assert_bitwise_equal(codec.decode(c.fetch(JOB, 0, 1, 3)), states[2])
        assert not c.bulk  # the daemon said it has none: later fetches go straight to gRPC
    assert "bulk socket off" in d.log()
    tls, cert, key, ca = make_tls(tmp_path)
    t = daemons.start("--tls-cert", str(cert), "--tls-key", str(key))
    with Client(t.address, TOKEN, tls=tls) as c:
        assert not c.bulk  # a TLS client never leaves the encrypted channel
        c.push_and_commit(JOB, 0, 1, 1, codec.encode(states[0], chunk_bytes=CHUNK))
        assert_bitwise_equal(codec.decode(c.fetch(JOB, 0, 1, 1)), states[0])
        with pytest.raises(ReplicaError) as e:
            c._call("ticket", lambda: c._rpc["FetchBulk"](pb.FetchRequest(shard=shard(JOB, 0, 1)), **c._kw()))
        assert e.value.code == "UNIMPLEMENTED"  # and a TLS daemon offers no plaintext socket


def test_pushes_over_the_bulk_socket_are_staged_applied_and_refused_as_streams_are(daemons, states):
    d = daemons.start()
    with d.client() as c:
        def refuse(*args, **kwargs):
            raise AssertionError("the push went over gRPC's Push, not the bulk socket")
        c._push = refuse
        paced: list[int] = []
        prev = None
        for v, st in enumerate(states, 1):  # a full version, then deltas, each of several chunks
            packed = codec.encode(st, prev, chunk_bytes=CHUNK)
            assert len(packed.chunks) > 2 and not c.in_one_call(packed)
            paced.clear()
            got = c.push_and_commit(JOB, 0, 1, v, packed, base_version=v - 1 if prev else 0, before_chunk=paced.append)
            assert got.version == v and paced == [len(x.payload) for x in packed.chunks]  # paced chunk by chunk
            prev = st
        assert c.bulk
        assert_bitwise_equal(codec.decode(c.fetch(JOB, 0, 1, 3)), states[2])
        staged = c.push(JOB, 0, 1, 4, codec.encode(states[0], states[2], chunk_bytes=CHUNK), base_version=3)
        assert staged.staged_version == 4 and staged.bytes_received > 0  # staged, not applied, until Commit
        assert c.commit(JOB, 0, 1, 4).version == 4
        assert_bitwise_equal(codec.decode(c.fetch(JOB, 0, 1, 4)), states[0])
        wrong = codec.encode(states[1], states[0], chunk_bytes=CHUNK)  # a delta against a base it does not hold
        with pytest.raises(ReplicaError) as e:
            c.push_and_commit(JOB, 0, 1, 5, wrong, base_version=2)
        assert e.value.code == "FAILED_PRECONDITION" and "bulk push" in str(e.value)
        assert_bitwise_equal(codec.decode(c.fetch(JOB, 0, 1, 4)), states[0])  # as it was
    assert "refused PushBulk: FAILED_PRECONDITION" in d.log()


def test_a_stalled_bulk_push_is_cut_off_and_a_chunk_past_the_limit_refused_unread(daemons, states):
    d = daemons.start("--push-idle-timeout", "2", "--max-chunk-bytes", "1M")
    with grpc.insecure_channel(d.address) as ch, d.client() as c:
        stub = pb_grpc.ReplicaStub(ch)
        opening = pb.PushOpen(shard=shard(JOB, 0, 1), version=1, chunk_count=3, commit=True)
        offer = stub.PushBulk(opening, metadata=META)
        start = time.monotonic()
        with socket.create_connection(("127.0.0.1", offer.port), timeout=30) as s:
            s.sendall(offer.ticket + FRAME.pack(0, 3, 0, 100) + b"x" * 10)  # then nothing
            assert s.recv(1 << 16) == b""  # cut off, no answer
        assert 1.5 < time.monotonic() - start < 12
        offer = stub.PushBulk(opening, metadata=META)
        with socket.create_connection(("127.0.0.1", offer.port), timeout=30) as s:
            s.sendall(offer.ticket + FRAME.pack(0, 3, 0, 1 << 30))  # claims 1 GiB: refused before a byte of it
            answer = s.recv(1 << 16)
        status, *_ , length = RESULT.unpack_from(answer)
        assert status.rstrip(b"\0") == b"RESOURCE_EXHAUSTED" and b"more than the limit" in answer[RESULT.size:]
        assert not [x for x in c.inventory(JOB).shards if not x.local]  # nothing held, nothing left staged
    assert "refused PushBulk: CANCELLED" in d.log()


def test_a_fetch_whose_caller_left_while_it_was_encoded_offers_nothing_and_holds_no_memory(daemons):
    """A rank killed (or timed out) while the daemon encodes its fetch from the slots: the daemon gives the two copies'
    memory back at once instead of offering a ticket nobody claims, which would hold it for ``TICKET_TTL``."""
    import torch

    from ffstate import layout, shm
    from ffstate.commit import SlotWriter

    d = daemons.start()
    state = {"w": torch.randn(16 << 20, generator=torch.Generator().manual_seed(0))}  # 64 MB: encoded in tens of ms
    manifest = layout.describe(state)
    with d.client() as c, grpc.insecure_channel(d.address) as ch:
        slots = shm.Slots(list(c.attach("left", 0, 1, manifest).slot_paths), manifest)
        try:
            SlotWriter(slots).commit(state, 1)
            baseline = c.inventory().bytes_used  # the slots' reservation
            stub = pb_grpc.ReplicaStub(ch)
            for deadline in (0.01, 0.02, 0.05, 0.1, 0.2):  # one short enough to leave while the encoding runs
                try:  # (one that ran out before the handler started, or after it offered, proves nothing: the next)
                    got = stub.FetchBulk(pb.FetchRequest(shard=shard("left", 0, 1), version=1), metadata=META,
                                         timeout=deadline)
                    claim(got.port, got.ticket)  # encoded within the deadline: served, and so given back
                except grpc.RpcError as e:
                    assert e.code() == grpc.StatusCode.DEADLINE_EXCEEDED, e
                start = time.monotonic()
                wait_until(lambda: c.inventory().bytes_used == baseline, TICKET_TTL + 5, "the fetch's memory back")
                back = time.monotonic() - start
                time.sleep(0.2)  # the refusal is logged just after its memory goes back
                if "refused FetchBulk: CANCELLED" in d.log():  # the handler ran, and found its caller gone:
                    assert back < 3.0, back  # the two copies given back once the encoding ended, not 10 s later
                    break
            assert "refused FetchBulk: CANCELLED" in d.log(), d.log()[-2000:]
        finally:
            slots.close()
