"""A holder serves the newest version of a replica while its encoding is being made (``daemon/making.py``): the
fetch answers once the header is made, each chunk is read as soon as it is made, the chunks are the whole
encoding's bit for bit, the replica does not change under them (a push waits for the last one), and a chunk that
cannot be made fails its readers, is not served again, and leaves nothing counted."""

import threading
import time

import numpy as np
import pytest
import torch

from ffstate import codec
from ffstate.codec import Packed, delta
from ffstate.daemon.held import IncomingChunk
from ffstate.daemon.store import Store
from ffstate.errors import ReplicaError
from ffstate.ids import ShardKey

pytestmark = pytest.mark.timeout(60)
A = ShardKey("j", 0, 1)


def state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(6 << 18, generator=g), "m": torch.zeros(1 << 18), "step": 3}  # 7 MiB: 7 segments


def put(store: Store, version: int, snap, base=None) -> None:
    packed = codec.encode_snapshot(snap, base)
    store.stage((IncomingChunk(A, version, version - 1 if base is not None else 0, c.index, c.count, c.checksum,
                               c.payload) for c in packed.chunks), "test")
    store.commit(A, version)


def gated(monkeypatch, manifest, fail: bool = False) -> threading.Event:
    """The last segment's encoding waits for the event returned (``fail``: then raises)."""
    last = codec.segments(manifest, codec.DEFAULT_CHUNK_BYTES)[-1][0]
    gate, real = threading.Event(), delta.encode_segment

    def encode_segment(data, base, itemsize, offset, *args):
        if offset == last:
            assert gate.wait(20)
            if fail:
                raise RuntimeError("a bug")
        return real(data, base, itemsize, offset, *args)

    monkeypatch.setattr(delta, "encode_segment", encode_segment)
    return gate


def test_a_fetch_answers_before_its_encoding_is_made_and_a_push_waits_for_the_last_chunk(monkeypatch):
    store = Store(1 << 30)
    one, two = codec.pack(state(0)), codec.pack(state(1))
    put(store, 1, one)
    replica = store.used
    gate = gated(monkeypatch, one.manifest)
    version, enc, lease = store.fetch(A)  # answers with the last segment not made
    making = enc.chunks
    assert version == 1 and len(making) == 8 and not making.settled.is_set()
    assert making[0].index == 0 and making[1].index == 1  # read before the last is made
    pushed = threading.Thread(target=put, args=(store, 2, two, one))
    pushed.start()
    time.sleep(0.3)
    assert store.inventory()[0]["version"] == 1  # the push waits: the replica does not change under the chunks
    gate.set()
    assert making.settled.wait(10)
    pushed.join(10)
    assert store.inventory()[0]["version"] == 2
    whole = codec.encode_snapshot(one)
    assert [(c.index, c.count, c.checksum, bytes(c.payload)) for c in making] == \
           [(c.index, c.count, c.checksum, bytes(c.payload)) for c in whole.chunks]
    got = codec.decode_snapshot(Packed(list(making)), device=None)
    assert np.array_equal(got.buffer, one.buffer.numpy()) and got.checksum == one.checksum
    assert enc.nbytes == whole.nbytes and store.used == store.inventory()[0]["bytes"] + enc.nbytes  # settled
    lease.release()
    store.drop("j")
    assert store.used == 0 and replica > 0


def test_a_chunk_that_cannot_be_made_fails_its_readers_is_not_served_again_and_leaves_nothing_counted(monkeypatch):
    store = Store(1 << 30)
    one = codec.pack(state(0))
    put(store, 1, one)
    replica = store.used
    gate = gated(monkeypatch, one.manifest, fail=True)
    _, enc, lease = store.fetch(A)
    gate.set()
    with pytest.raises(ReplicaError, match="could not be made") as e:
        list(enc.chunks)
    assert e.value.code == "INTERNAL"
    assert enc.chunks.settled.wait(10) and enc.chunks.failed
    monkeypatch.undo()
    _, again, lease2 = store.fetch(A)  # not the failed one: made again (the replica's lock was given back)
    assert again is not enc and again.chunks.settled.wait(10) and not again.chunks.failed
    lease.release(), lease2.release()
    assert store.used == replica + again.nbytes  # the new one cached; the failed one counts nothing
    store.drop("j")
    assert store.used == 0


def test_dropping_an_encoding_still_being_made_never_waits_for_it(monkeypatch):
    """An encoding whose reader went (a refused offer, a cancelled call) is the cache while its last chunk is still
    being made: forgetting it, as a reservation under memory pressure does while it holds the budget's lock, gives
    its count back at once instead of waiting for the codec's threads (which, settling the encodings they finish,
    need that lock: a daemon-wide hang). Its count comes back once, whatever comes first."""
    store = Store(1 << 30)
    one = codec.pack(state(0))
    put(store, 1, one)
    replica = store.used
    gate = gated(monkeypatch, one.manifest)
    _, enc, lease = store.fetch(A)
    lease.release()  # no reader left: the cache alone holds it
    forgot: list[int] = []
    t = threading.Thread(target=lambda: forgot.append(store.served.forget()))
    t.start()
    t.join(10)
    assert forgot and not enc.chunks.settled.is_set(), "forgetting waited for the encoding to be made"
    store.release(forgot[0])
    assert store.used == replica
    gate.set()
    assert enc.chunks.settled.wait(10)
    assert store.used == replica  # the settlement gave back nothing more: the whole count went with the forget
    store.drop("j")
    assert store.used == 0


def test_a_grpc_fetch_of_a_chunk_that_cannot_be_made_is_internal_and_the_next_fetch_is_whole(monkeypatch):
    """The same failure through a daemon's gRPC ``Fetch`` (no bulk socket): the reader gets INTERNAL with the reason,
    not an UNKNOWN status; the daemon counts nothing for it and serves the version whole to the next fetch."""
    from ffstate.client import Client
    from ffstate.config import DaemonConfig
    from ffstate.daemon.node import Node
    from ffstate.daemon.servicer import start_server

    token = "t" * 32
    cfg = DaemonConfig(node_id="making-grpc", host="127.0.0.1", port=0, token=token, memory_limit=256 << 20)
    node = Node(cfg)
    server, port = start_server(node, cfg, None)
    one = codec.pack(state(0))
    try:
        with Client(f"127.0.0.1:{port}", token) as c:
            c.push_and_commit("j", 0, 1, 1, codec.encode_snapshot(one))
            replica = node.store.used
            gate = gated(monkeypatch, one.manifest, fail=True)
            gate.set()
            with pytest.raises(ReplicaError, match="could not be made") as e:
                c.fetch("j", 0, 1)
            assert e.value.code == "INTERNAL"
            monkeypatch.undo()
            deadline = time.monotonic() + 10  # the failed encoding's count goes back once its readers are gone
            while node.store.used != replica and time.monotonic() < deadline:
                time.sleep(0.02)
            assert node.store.used == replica
            got = codec.decode_snapshot(c.fetch("j", 0, 1), device=None)
            assert np.array_equal(got.buffer, one.buffer.numpy()) and got.checksum == one.checksum
    finally:
        server.stop(None).wait()
        node.close()
