"""The daemon's contract under bad input, load and attack, spoken with the raw generated stub where
the client would not send such a thing. Every refusal leaves the held replica bit-exact as it was."""

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import grpc
import numpy as np
import pytest

from daemons import TOKEN, held_version, make_tls
from ffstate import codec, layout, wire
from ffstate._proto import replica_pb2 as pb
from ffstate._proto import replica_pb2_grpc as pb_grpc
from ffstate.client import Client
from ffstate.codec import Chunk, Packed
from ffstate.errors import ReplicaError, ReplicaUnavailable
from helpers import Lines, assert_bitwise_equal, train_states

pytestmark = pytest.mark.timeout(180)
ROOT = Path(__file__).resolve().parents[2]
CHUNK = 64 << 10
JOB = "proto"


@pytest.fixture(scope="module")
def states():
    return list(train_states(3))


def _holding(factory, states):
    """A daemon holding version 1 of rank 0 (world 1), and a raw stub to it."""
    d = factory.start("--max-chunk-bytes", "256K")
    with d.client() as c:
        c.push_and_commit(JOB, 0, 1, 1, codec.encode(states[0], chunk_bytes=CHUNK))
    channel = grpc.insecure_channel(d.address)
    yield d, pb_grpc.ReplicaStub(channel)
    channel.close()


@pytest.fixture
def held(daemons, states):
    yield from _holding(daemons, states)


@pytest.fixture(scope="module")
def shared_held(module_daemons, states):
    """``held``, one daemon for every case of a test whose cases each leave it at version 1 (they check it)."""
    yield from _holding(module_daemons, states)


def messages(packed, version, base_version=0, key=None, **override):
    key = key or pb.ShardKey(job_id=JOB, rank=0, world_size=1)
    return [pb.PushChunk(shard=key, version=version, base_version=base_version, chunk_index=c.index,
                         chunk_count=c.count, checksum=c.checksum, payload=bytes(c.payload), **override)
            for c in packed.chunks]


def push_raw(stub, msgs, token=TOKEN, way="stream"):
    """``msgs`` sent as a Push stream, or (way "one call") in one PushVersion message; the error it gets."""
    meta = () if token is None else (("ffstate-token", token),)
    with pytest.raises(grpc.RpcError) as e:
        if way == "stream":
            stub.Push(iter(msgs), metadata=meta, timeout=30)
        else:
            stub.PushVersion(pb.PushChunks(chunks=[m.SerializeToString() for m in msgs]), metadata=meta, timeout=30)
    return e.value


def assert_still_version_1(d, states):
    with d.client() as c:
        assert held_version(c, JOB, 0) == 1
        assert_bitwise_equal(codec.decode(c.fetch(JOB, 0, 1)), states[0])


def test_token_is_checked_on_every_rpc(held, states):
    d, stub = held
    delta = codec.encode(states[1], states[0], chunk_bytes=CHUNK)
    for token in (None, "wrong"):
        assert push_raw(stub, messages(delta, 2, 1), token).code() == grpc.StatusCode.UNAUTHENTICATED
        assert push_raw(stub, messages(delta, 2, 1), token, "one call").code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as e:
            stub.Inventory(pb.InventoryRequest(), metadata=() if token is None else (("ffstate-token", token),))
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Fetch(pb.FetchRequest(shard=pb.ShardKey(job_id=JOB, rank=0, world_size=1)),
                            metadata=(("ffstate-token", token or ""),)))
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with Client(d.address, "wrong") as c, pytest.raises(ReplicaError) as e:
        c.drop(JOB)
    assert e.value.code == "UNAUTHENTICATED"
    assert_still_version_1(d, states)


def test_a_fetch_of_named_chunks_streams_those_alone_and_a_bad_list_is_refused(shared_held, states):
    """``FetchRequest.chunks``: what a razor restore asks for (a member's part), striped like a whole fetch; a list
    that does not ascend or names a chunk past the version's is INVALID_ARGUMENT, and the replica stays."""
    d, stub = shared_held
    with d.client() as c:
        whole = c.fetch(JOB, 0, 1, 1)
        n = len(whole.chunks)
        assert n >= 4
        named = [0, 2, n - 1]
        got = c.fetch_chunks(JOB, 0, 1, 1, chunks=named)
        assert [ch.index for _, ch in got] == named and {v for v, _ in got} == {1}
        assert [bytes(ch.payload) for _, ch in got] == [bytes(whole.chunks[i].payload) for i in named]
        odd = c.fetch_chunks(JOB, 0, 1, 1, first=1, step=2, chunks=named)  # a stripe of the list
        assert [ch.index for _, ch in odd] == [2]
        head = c.fetch_chunks(JOB, 0, 1, 1, chunks=[0])  # the header alone: made without encoding the segments
        assert [(ch.index, ch.count, bytes(ch.payload)) for _, ch in head] == [(0, n, bytes(whole.chunks[0].payload))]
        for bad, text in (([3, 2], "ascend"), ([0, 0], "ascend"), ([0, n], f"{n} chunks"), ([1 << 31], "below")):
            with pytest.raises(ReplicaError, match=text) as e:
                c.fetch_chunks(JOB, 0, 1, 1, chunks=bad)
            assert e.value.code == "INVALID_ARGUMENT"
        assert len(c.fetch_chunks(JOB, 0, 1, 1, chunks=named, checksum=whole.checksum)) == len(named)
        with pytest.raises(ReplicaError, match="another copy") as e:
            c.fetch_chunks(JOB, 0, 1, 1, chunks=named, checksum=whole.checksum ^ 1)
        assert e.value.code == "FAILED_PRECONDITION"
    assert_still_version_1(d, states)


def test_a_part_fetched_from_holders_whose_copies_of_a_version_differ_comes_from_the_header_s_copy(daemons):
    """Two holders each hold a version 1 of one shard, with other bytes (one missed a step back, say). A razor
    restore's part, its header from the first and its segments striped over both with the header's checksum, comes
    from the first's bytes alone: the second refuses its stripe, which the first serves; never a mix."""
    import torch

    from ffstate.client import stream_striped
    from ffstate.razor import Groups, Plan, in_part, split

    group = (0, 1)
    shards = []
    for fill in (1.0, 2.0):
        state = {"model": {"w": torch.full((2_000_000,), fill)}, "optim": torch.full((500_000,), fill)}
        shards.append(split(state, Plan.of(state, Groups(group, ("model",), "t")), 1))
    a, b = daemons.start(), daemons.start()
    for d, shard in ((a, shards[0]), (b, shards[1])):
        with d.client() as c:
            c.push_and_commit("mix", 1, 2, 1, codec.encode(shard, chunk_bytes=64 << 10))
    with a.client() as ca, b.client() as cb:
        dec = codec.Decoder(want=in_part)
        stream_striped([ca], "mix", 1, 2, 1, dec.add, chunks=[0])
        assert len(dec.needed) > 3
        stream_striped([ca, cb], "mix", 1, 2, 1, dec.add, chunks=dec.needed[1:],
                       checksum=int(dec.header["checksum"], 16))
        got = dec.state()
    assert_bitwise_equal(got["razor"]["part"], shards[0]["razor"]["part"])


def corrupt(msgs, i):
    msgs[i].payload = bytes([msgs[i].payload[0] ^ 1]) + msgs[i].payload[1:]
    return msgs


def swap(msgs, i, j):
    msgs[i], msgs[j] = msgs[j], msgs[i]
    return msgs


@pytest.mark.parametrize(
    "case, code, text",
    [
        ("bad job id", grpc.StatusCode.INVALID_ARGUMENT, "job id"),
        ("rank out of range", grpc.StatusCode.INVALID_ARGUMENT, "not a shard"),
        ("out of order", grpc.StatusCode.INVALID_ARGUMENT, "out of order"),
        ("duplicate", grpc.StatusCode.INVALID_ARGUMENT, "duplicate"),
        ("mixed versions", grpc.StatusCode.INVALID_ARGUMENT, "belongs to"),
        ("truncated stream", grpc.StatusCode.INVALID_ARGUMENT, "ended after"),
        ("version gap", grpc.StatusCode.FAILED_PRECONDITION, "version gap"),
        ("wrong base", grpc.StatusCode.FAILED_PRECONDITION, "wrong base"),
        ("checksum", grpc.StatusCode.DATA_LOSS, "corrupted"),
        ("malformed header", grpc.StatusCode.INVALID_ARGUMENT, "malformed header"),
        ("chunk over the limit", grpc.StatusCode.RESOURCE_EXHAUSTED, "more than the limit"),
        ("message over the limit", grpc.StatusCode.RESOURCE_EXHAUSTED, ""),
    ],
)
@pytest.mark.parametrize("way", ["stream", "one call"])
def test_bad_push_gets_a_precise_status_and_changes_nothing(shared_held, states, case, code, text, way):
    d, stub = shared_held
    delta = codec.encode(states[1], states[0], chunk_bytes=CHUNK)
    assert len(delta.chunks) >= 4
    good = lambda: messages(delta, 2, 1)  # noqa: E731
    if case == "bad job id":
        msgs = messages(delta, 2, 1, key=pb.ShardKey(job_id="../etc", rank=0, world_size=1))
    elif case == "rank out of range":
        msgs = messages(delta, 2, 1, key=pb.ShardKey(job_id=JOB, rank=3, world_size=2))
    elif case == "out of order":
        msgs = swap(good(), 1, 2)
    elif case == "duplicate":
        msgs = good()
        msgs.insert(2, msgs[1])
    elif case == "mixed versions":
        msgs = good()
        msgs[2].version = 3
    elif case == "truncated stream":
        msgs = good()[:3]
    elif case == "version gap":
        msgs = messages(codec.encode(states[2], states[1], chunk_bytes=CHUNK), 3, 2)
    elif case == "wrong base":  # a delta against another state, claiming to apply to version 1
        msgs = messages(codec.encode(states[2], states[1], chunk_bytes=CHUNK), 2, 1)
    elif case == "checksum":
        msgs = corrupt(good(), 2)
    elif case == "malformed header":
        head = Chunk.of(0, len(delta.chunks), np.frombuffer(b"{not json", dtype=np.uint8).copy())
        msgs = messages(Packed([head] + delta.chunks[1:]), 2, 1)
    elif case == "chunk over the limit":  # the daemon runs with --max-chunk-bytes 256K
        big = np.zeros(300 << 10, dtype=np.uint8)
        msgs = messages(Packed([Chunk.of(0, 1, big)]), 2, 0)
    else:  # beyond the gRPC message limit itself
        big = np.zeros(3 << 20, dtype=np.uint8)
        msgs = messages(Packed([Chunk.of(0, 1, big)]), 2, 0)
    err = push_raw(stub, msgs, way=way)
    assert err.code() == code, err.details()
    assert text in (err.details() or "")
    assert_still_version_1(d, states)


def test_commit_without_staging_and_of_a_bad_version_change_nothing(held, states):
    d, stub = held
    meta = (("ffstate-token", TOKEN),)
    key = pb.ShardKey(job_id=JOB, rank=0, world_size=1)
    with pytest.raises(grpc.RpcError) as e:
        stub.Commit(pb.CommitRequest(shard=key, version=2), metadata=meta)
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    # Well-formed chunks, each with a valid checksum, that do not make up version 2: refused at commit.
    delta = codec.encode(states[1], states[0], chunk_bytes=CHUNK)
    other = codec.encode(states[2], states[0], chunk_bytes=CHUNK)
    stub.Push(iter(messages(Packed([delta.chunks[0]] + other.chunks[1:]), 2, 1)), metadata=meta)
    with pytest.raises(grpc.RpcError) as e:
        stub.Commit(pb.CommitRequest(shard=key, version=2), metadata=meta)
    assert e.value.code() == grpc.StatusCode.DATA_LOSS
    assert_still_version_1(d, states)
    # And the real version 2 goes through afterwards.
    stub.Push(iter(messages(delta, 2, 1)), metadata=meta)
    assert stub.Commit(pb.CommitRequest(shard=key, version=2), metadata=meta).version == 2


def test_pusher_killed_mid_stream_leaves_the_replica_and_the_next_push_works(daemons, states):
    d = daemons.start()
    proc = subprocess.Popen([sys.executable, str(ROOT / "tests" / "procs" / "pusher.py"), d.address, "killed"],
                            stdout=subprocess.PIPE, text=True, env={**os.environ, "FFSTATE_TOKEN": TOKEN})
    try:
        lines = Lines(proc)
        assert lines.next() == "committed 1"
        assert lines.next() == "streaming"
        proc.kill()
        proc.wait(10)
    finally:
        proc.kill()
    with d.client() as c:
        s1, s2 = list(train_states(2))
        assert held_version(c, "killed", 0) == 1
        assert_bitwise_equal(codec.decode(c.fetch("killed", 0, 1)), s1)
        c.push_and_commit("killed", 0, 1, 2, codec.encode(s2, s1), base_version=1)
        assert_bitwise_equal(codec.decode(c.fetch("killed", 0, 1)), s2)


def test_four_concurrent_pushers(daemons):
    d = daemons.start()
    runs = {rank: list(train_states(3, seed=rank)) for rank in range(4)}
    errors = []

    def pusher(rank):
        try:
            with d.client() as c:
                prev = None
                for v, s in enumerate(runs[rank], 1):
                    packed = codec.encode(s, prev, chunk_bytes=CHUNK)
                    c.push_and_commit("many", rank, 4, v, packed, base_version=0 if prev is None else v - 1)
                    prev = s
        except Exception as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=pusher, args=(r,)) for r in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    with d.client() as c:
        for rank in range(4):
            assert_bitwise_equal(codec.decode(c.fetch("many", rank, 4)), runs[rank][-1])


def test_memory_budget_is_never_exceeded(daemons, states):
    d = daemons.start("--memory-limit", "3M")
    with d.client() as c:
        c.push_and_commit("budget", 0, 1, 1, codec.encode(states[0]))
        big = {"w": np.random.default_rng(0).integers(0, 255, 4 << 20, dtype=np.uint8)}
        with pytest.raises(ReplicaError) as e:
            c.push_and_commit("budget", 1, 2, 1, codec.encode(big))
        assert e.value.code == "RESOURCE_EXHAUSTED"
        assert "memory budget" in str(e.value) and "needs" in str(e.value)
        inv = c.inventory()
        assert inv.bytes_used <= inv.bytes_budget == 3 << 20
        assert_bitwise_equal(codec.decode(c.fetch("budget", 0, 1)), states[0])


def test_attach_with_another_layout_is_refused(daemons, states):
    d = daemons.start()
    with d.client() as c:
        c.attach("layout", 0, 1, layout.describe(states[0]))
        with pytest.raises(ReplicaError) as e:
            c.attach("layout", 0, 1, layout.describe({"w": np.zeros(3)}))
        assert e.value.code == "FAILED_PRECONDITION" and "layout" in str(e.value)
    with grpc.insecure_channel(d.address) as ch:
        req = pb.AttachRequest(shard=pb.ShardKey(job_id="layout2", rank=0, world_size=1), manifest_json=b"{nope")
        with pytest.raises(grpc.RpcError) as e:
            pb_grpc.ReplicaStub(ch).Attach(req, metadata=(("ffstate-token", TOKEN),))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "manifest" in e.value.details()


def test_a_second_daemon_on_a_port_in_use_fails_clearly(daemons):
    """gRPC servers share a port by default (SO_REUSEPORT): a second daemon there would take half the RPCs."""
    d = daemons.start()
    port = d.address.rsplit(":", 1)[1]
    out = subprocess.run([sys.executable, "-m", "ffstate.cli", "serve", "--node-id", "second", "--host", "127.0.0.1",
                          "--port", port,
                          "--token-file", str(daemons.token_file)], capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and f"cannot listen on 127.0.0.1:{port}: the address is in use" in out.stderr, out
    with d.client() as c:
        assert c.inventory().node_id == d.node_id  # the first one still serves, alone


@pytest.mark.parametrize("flag, says", [("--metrics-port", "cannot serve metrics on"),
                                        ("--bulk-port", "cannot listen for bulk fetches on")])
def test_a_held_metrics_or_bulk_port_stops_the_daemon_before_it_answers_saying_which(daemons, flag, says):
    """A held metrics or bulk port: the daemon exits at its start, naming the flag and the port, never announced."""
    import socket

    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        held = squatter.getsockname()[1]
        out = subprocess.run([sys.executable, "-m", "ffstate.cli", "serve", "--node-id", "held", "--host", "127.0.0.1",
                              "--port", "0", flag, str(held), "--token-file", str(daemons.token_file)],
                             capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and f"{says} 127.0.0.1:{held} ({flag})" in out.stderr, out
    assert "listening on" not in out.stdout and "serving on" not in out.stderr, out


def test_tls_with_token(daemons, tmp_path, states):
    tls, cert, key, _ = make_tls(tmp_path)
    d = daemons.start("--tls-cert", str(cert), "--tls-key", str(key))
    with Client(d.address, TOKEN, tls=tls) as c:
        c.push_and_commit("tls", 0, 1, 1, codec.encode(states[0]))
        assert_bitwise_equal(codec.decode(c.fetch("tls", 0, 1)), states[0])
    with Client(d.address, "wrong", tls=tls) as c, pytest.raises(ReplicaError) as e:
        c.inventory()
    assert e.value.code == "UNAUTHENTICATED"
    with Client(d.address, TOKEN, timeout=2, retries=1) as c, pytest.raises(ReplicaUnavailable):
        c.inventory()  # plaintext against a TLS daemon


def test_generated_stubs_are_current():
    out = subprocess.run([sys.executable, str(ROOT / "proto" / "generate.py"), "--check"], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr


def test_manifest_json_in_header_is_plain_data(states):
    head = json.loads(bytes(codec.encode(states[0]).chunks[0].payload))
    assert head["kind"] == "full" and isinstance(head["manifest"], dict)


def test_a_push_message_that_is_not_protobuf_is_invalid_argument_and_changes_nothing(shared_held, states):
    """The daemon parses a push's messages itself (the payload stays a view of the received bytes): a message whose
    field runs past its end is refused with INVALID_ARGUMENT, before anything of the version is held."""
    d, _ = shared_held
    good = [m.SerializeToString() for m in messages(codec.encode(states[1], states[0], chunk_bytes=CHUNK), 2, 1)]
    bad = good[:1] + [b"\x0a\xff\xff\xff\xff\x0f"] + good[2:]  # field 1, 4 GiB long, in 6 bytes
    with grpc.insecure_channel(d.address) as channel:
        push = channel.stream_unary(wire.path("Push"), request_serializer=lambda b: b,
                                    response_deserializer=pb.PushResult.FromString)
        with pytest.raises(grpc.RpcError) as e:
            push(iter(bad), metadata=(("ffstate-token", TOKEN),), timeout=30)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value.details()
    assert "runs past its end" in e.value.details()
    assert_still_version_1(d, states)
