"""PushVersion: a small version's chunks in one call instead of a Push stream, against a real daemon. The client
picks it by size and falls back to streams at a daemon that does not know the call; the daemon refuses a bad
message with the status a stream would get, and holds nothing of it."""

import logging
import secrets
import time
import uuid
from concurrent import futures

import grpc
import pytest
import torch

from daemons import TOKEN, held_version
from ffstate import codec, wire
from ffstate._proto import replica_pb2 as pb
from ffstate.client import Client
from ffstate.codec import Packed
from ffstate.config import DaemonConfig
from ffstate.daemon.node import Node
from ffstate.daemon.auth import TokenInterceptor
from ffstate.daemon.servicer import Servicer
from helpers import assert_bitwise_equal, train_states

pytestmark = pytest.mark.timeout(120)
JOB = "onecall"
CHUNK = 64 << 10


@pytest.fixture(scope="module")
def states():
    return list(train_states(3))


@pytest.fixture(scope="module")
def little():
    """Three steps of a 256 KiB state: a version of it is one chunk of the default size, its delta too."""
    g = torch.Generator().manual_seed(2)
    w = torch.randn(1 << 16, generator=g)
    out = []
    for step in range(3):
        out.append({"w": w.clone(), "step": step, "rng": torch.arange(8, dtype=torch.int64) + step})
        w = w + 1e-3 * torch.randn(w.numel(), generator=g)
    return out


class Counted:
    """A client's gRPC callable, counted: which way a push went."""

    def __init__(self, fn):
        self.fn, self.calls = fn, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.fn(*args, **kwargs)


def counted(c: Client) -> tuple[Counted, Counted]:
    c._push, c._push_version = Counted(c._push), Counted(c._push_version)
    return c._push, c._push_version


def test_a_version_no_larger_than_one_of_its_chunks_goes_in_one_call_others_stream_all_bit_exact(daemons, little):
    """One call where pacing it is pacing one chunk; a version of several chunks streams, paced chunk by chunk,
    however small; one over wire.SMALL_PUSH_BYTES streams."""
    d = daemons.start()
    big = {"w": torch.randn(1 << 20, generator=torch.Generator().manual_seed(1)), "step": 1}  # 4 MiB of float32
    big2 = {"w": big["w"] + 1e-3, "step": 2}
    with d.client() as c:
        c.bulk = False  # versions that do not go in one call stream over gRPC (over the bulk socket: test_bulk_socket)
        stream, one = counted(c)
        c.push_and_commit(JOB, 0, 2, 1, codec.encode(little[0]))
        small = codec.encode(little[1], little[0])  # one segment a megabyte by default
        assert small.nbytes <= small.header["chunk_bytes"] and c.in_one_call(small)
        paced: list[int] = []  # the scheduler's seam: once, with every byte of a version that goes in one call
        before = (one.calls, stream.calls)
        c.push_and_commit(JOB, 0, 2, 2, small, base_version=1, before_chunk=paced.append)
        assert (one.calls, stream.calls) == (before[0] + 1, before[1])
        assert paced == [sum(len(x.payload) for x in small.chunks)]
        chunked = codec.encode(little[2], little[1], chunk_bytes=CHUNK)  # small, but more than one of its chunks
        assert chunked.nbytes < wire.SMALL_PUSH_BYTES and not c.in_one_call(chunked)
        paced.clear()
        c.push_and_commit(JOB, 0, 2, 3, chunked, base_version=2, before_chunk=paced.append)
        assert (one.calls, stream.calls) == (before[0] + 1, before[1] + 1)
        assert paced == [len(x.payload) for x in chunked.chunks]  # paced chunk by chunk
        full, delta = codec.encode(big), codec.encode(big2, big, chunk_bytes=4 << 20)
        assert delta.nbytes > wire.SMALL_PUSH_BYTES and not c.in_one_call(delta)  # one chunk, but over the limit
        c.push_and_commit(JOB, 1, 2, 1, full)
        c.push_and_commit(JOB, 1, 2, 2, delta, base_version=1)
        assert (one.calls, stream.calls) == (before[0] + 1, before[1] + 3)
        assert held_version(c, JOB, 0) == 3 and held_version(c, JOB, 1) == 2
        assert_bitwise_equal(codec.decode(c.fetch(JOB, 0, 2)), little[2])
        assert_bitwise_equal(codec.decode(c.fetch(JOB, 1, 2)), big2)
    with Client(d.address, TOKEN, small_push_bytes=0) as c:  # every push streams, as a client may ask
        c.bulk = False
        stream, one = counted(c)
        c.push_and_commit(JOB, 0, 2, 4, codec.encode(little[0], little[2]), base_version=3)
        assert (one.calls, stream.calls) == (0, 1)
        assert_bitwise_equal(codec.decode(c.fetch(JOB, 0, 2)), little[0])


def _older_daemon(node: Node, token: str, port: int = 0, without: tuple[str, ...] = ("PushVersion",)) \
        -> tuple[grpc.Server, int]:
    """A real node behind the servicer of an ffstate before PushVersion: every method but that one (``without=()``:
    the node upgraded, every method)."""
    servicer = Servicer(node)
    handlers = {}
    for name, m in wire.METHODS.items():
        if name not in without:
            make = getattr(grpc, f"{m.kind}_rpc_method_handler")
            handlers[name] = make(getattr(servicer, name), (lambda b: b) if m.raw_request else m.request.FromString,
                                  (lambda b: b) if m.raw_response else m.response.SerializeToString)
    server = grpc.server(futures.ThreadPoolExecutor(8), interceptors=[TokenInterceptor(token)])
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(wire.SERVICE, handlers)])
    port = server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    return server, port


def test_a_daemon_that_does_not_know_the_call_gets_streams_and_the_client_says_so_once(little, caplog):
    token = secrets.token_hex(8)
    node = Node(DaemonConfig(node_id=f"older-{uuid.uuid4().hex[:8]}", host="127.0.0.1", port=0, token=token,
                             memory_limit=256 << 20))
    server, port = _older_daemon(node, token)
    try:
        with Client(f"127.0.0.1:{port}", token) as c, caplog.at_level(logging.WARNING, logger="ffstate.client"):
            stream, one = counted(c)
            paced: list[int] = []
            first = codec.encode(little[0])
            c.push_and_commit(JOB, 0, 1, 1, first, before_chunk=paced.append)
            assert paced == [sum(len(x.payload) for x in first.chunks)]  # paced once, as one call: not again
            paced.clear()
            delta = codec.encode(little[1], little[0])
            c.push_and_commit(JOB, 0, 1, 2, delta, base_version=1, before_chunk=paced.append)
            assert paced == [len(x.payload) for x in delta.chunks]
            assert (one.calls, stream.calls) == (1, 2)  # one refused call, then streams only
            assert c.small_push_bytes == 0
            assert_bitwise_equal(codec.decode(c.fetch(JOB, 0, 1)), little[1])
        assert sum("does not know PushVersion" in r.getMessage() for r in caplog.records) == 1
    finally:
        server.stop(None)
        node.close()


def test_a_daemon_upgraded_since_it_refused_the_call_gets_it_again(little, monkeypatch):
    # A rolling upgrade: the holder at this address knew no PushVersion, then is restarted with it. The client asks
    # again ONE_CALL_AGAIN seconds after the refusal (it was never asked again: streams for ever).
    from ffstate import client as client_module

    monkeypatch.setattr(client_module, "ONE_CALL_AGAIN", 60.0, raising=False)  # no second ask by chance, loaded
    token = secrets.token_hex(8)
    node = Node(DaemonConfig(node_id=f"upgraded-{uuid.uuid4().hex[:8]}", host="127.0.0.1", port=0, token=token,
                             memory_limit=256 << 20))
    server, port = _older_daemon(node, token)
    try:
        with Client(f"127.0.0.1:{port}", token) as c:
            stream, one = counted(c)
            c.push_and_commit(JOB, 0, 1, 1, codec.encode(little[0]))
            c.push_and_commit(JOB, 0, 1, 2, codec.encode(little[1], little[0]), base_version=1)
            assert (one.calls, stream.calls) == (1, 2)  # refused once, then streams within the second
            server.stop(None).wait()
            server, _ = _older_daemon(node, token, port, without=())  # the same node, now with the call
            assert c.small_push_bytes == 0
            assert c._one_call_again > time.monotonic() + 30  # asked again ONE_CALL_AGAIN after the refusal...
            c._one_call_again = time.monotonic()  # ... which is now, as if that long had passed
            c.push_and_commit(JOB, 0, 1, 3, codec.encode(little[2], little[1]), base_version=2)
            assert (one.calls, stream.calls) == (2, 2) and c.small_push_bytes > 0  # in one call again
            assert_bitwise_equal(codec.decode(c.fetch(JOB, 0, 1)), little[2])
    finally:
        server.stop(None)
        node.close()


def _one_call(address: str, body: bytes) -> grpc.RpcError:
    with grpc.insecure_channel(address) as channel:
        call = channel.unary_unary(wire.path("PushVersion"), request_serializer=lambda b: b,
                                   response_deserializer=pb.PushResult.FromString)
        with pytest.raises(grpc.RpcError) as e:
            call(body, metadata=(("ffstate-token", TOKEN),), timeout=30)
    return e.value


def _entries(packed: Packed, version: int, base: int, key: pb.ShardKey | None = None) -> list[bytes]:
    key = key or pb.ShardKey(job_id=JOB, rank=0, world_size=1)
    return [pb.PushChunk(shard=key, version=version, base_version=base, chunk_index=c.index, chunk_count=c.count,
                         checksum=c.checksum, payload=bytes(c.payload), commit=True).SerializeToString()
            for c in packed.chunks]


@pytest.fixture(scope="module")
def holding(module_daemons, states):
    """A daemon holding version 1 of rank 0 (world 1), and the bytes it accounts; each case leaves it so."""
    d = module_daemons.start()
    with d.client() as c:
        c.push_and_commit(JOB, 0, 1, 1, codec.encode(states[0], chunk_bytes=CHUNK))
        c.fetch(JOB, 0, 1)  # a fetch keeps the full encoding it made, counted: each case fetches
        return d, c.inventory().bytes_used


@pytest.mark.parametrize("case, code, text", [
    ("no chunk", grpc.StatusCode.INVALID_ARGUMENT, "empty push"),
    ("not protobuf", grpc.StatusCode.INVALID_ARGUMENT, "runs past its end"),
    ("an entry not protobuf", grpc.StatusCode.INVALID_ARGUMENT, "runs past its end"),
    ("a chunk more than its count", grpc.StatusCode.INVALID_ARGUMENT, "past the version's"),
    ("another shard's chunk", grpc.StatusCode.INVALID_ARGUMENT, "belongs to"),
    ("a chunk corrupted", grpc.StatusCode.DATA_LOSS, "corrupted"),
    ("a chunk padded", grpc.StatusCode.INVALID_ARGUMENT, "other fields take at most"),
    ("another field", grpc.StatusCode.INVALID_ARGUMENT, "alone"),
    ("a token missing", grpc.StatusCode.UNAUTHENTICATED, ""),
])
def test_a_bad_one_call_push_gets_a_precise_status_holds_nothing_and_accounts_nothing(holding, states, case, code,
                                                                                        text):
    d, used = holding
    delta = codec.encode(states[1], states[0], chunk_bytes=CHUNK)
    good = _entries(delta, 2, 1)
    entries = {"no chunk": [],
               "an entry not protobuf": good[:1] + [b"\x0a\xff\xff\xff\xff\x0f"] + good[2:],  # a field 4 GiB long
               "a chunk more than its count": good + [pb.PushChunk(**{**_fields(good[-1]), "chunk_index": len(good)})
                                                      .SerializeToString()],
               "another shard's chunk": good[:2] + _entries(delta, 2, 1, pb.ShardKey(job_id=JOB, rank=0,
                                                                                      world_size=2))[2:],
               "a chunk corrupted": good[:2] + [pb.PushChunk(**{**_fields(good[2]), "payload": b"\0" * 8})
                                                .SerializeToString()] + good[3:]}.get(case, good)
    if case == "a chunk padded":  # an unknown field of 4 KiB in one chunk: held with its payload's view
        entries = good[:1] + [good[1] + b"\x7a\x80\x20" + b"\0" * 4096] + good[2:]
    body = b"\x0a\xff\xff\xff\xff\x0f" if case == "not protobuf" else pb.PushChunks(chunks=entries).SerializeToString()
    if case == "another field":  # a varint field 2 after the chunks: the message is held with the chunks' views
        body += b"\x10\x01"
    if case == "a token missing":
        with grpc.insecure_channel(d.address) as channel, pytest.raises(grpc.RpcError) as e:
            channel.unary_unary(wire.path("PushVersion"), request_serializer=lambda b: b,
                                response_deserializer=pb.PushResult.FromString)(body, timeout=30)
        err = e.value
    else:
        err = _one_call(d.address, body)
    assert err.code() == code, err.details()
    assert text in (err.details() or "")
    with d.client() as c:
        assert held_version(c, JOB, 0) == 1
        assert_bitwise_equal(codec.decode(c.fetch(JOB, 0, 1)), states[0])
        assert c.inventory().bytes_used == used  # the staging's reservations given back


def _fields(raw: bytes) -> dict:
    m = pb.PushChunk.FromString(raw)
    return {f.name: v for f, v in m.ListFields()}


def test_a_streamed_chunk_padded_past_its_fields_bound_is_refused_and_holds_nothing(holding, states):
    """The stream's side of the padding bound: each message's payload stays a view of it, so a message is at most
    its payload and wire.MAX_CHUNK_FIELDS bytes."""
    d, used = holding
    good = _entries(codec.encode(states[1], states[0], chunk_bytes=CHUNK), 2, 1)
    padded = good[:1] + [good[1] + b"\x7a\x80\x20" + b"\0" * 4096] + good[2:]
    with grpc.insecure_channel(d.address) as channel, pytest.raises(grpc.RpcError) as e:
        channel.stream_unary(wire.path("Push"), request_serializer=lambda b: b,
                             response_deserializer=pb.PushResult.FromString)(iter(padded),
                                                                             metadata=(("ffstate-token", TOKEN),),
                                                                             timeout=30)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "other fields take at most" in e.value.details()
    with d.client() as c:
        assert held_version(c, JOB, 0) == 1 and c.inventory().bytes_used == used

