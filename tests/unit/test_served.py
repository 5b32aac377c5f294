"""A daemon's store counts the whole encodings it serves for as long as they live (``daemon/served.py``): one
being read is counted until its last reader is done, even after another replaced it as the cache (a node's ranks
restoring at once from one holder each hold one); a fetch waits for room while others are being sent, and is
refused, counting nothing, where none comes; nothing stays counted once every lease is given back."""

import threading
import time

import pytest
import torch

from ffstate import codec
from ffstate.daemon import store as store_module
from ffstate.daemon.held import IncomingChunk
from ffstate.daemon.store import Store
from ffstate.errors import ReplicaError
from ffstate.ids import ShardKey

pytestmark = pytest.mark.timeout(60)
A, B = ShardKey("j", 0, 2), ShardKey("j", 1, 2)


def hold(store: Store, key: ShardKey, seed: int) -> int:
    """A replica of ``key`` (1 MB of random floats: an encoding about as large) committed; its bytes."""
    snap = codec.pack({"w": torch.randn(1 << 18, generator=torch.Generator().manual_seed(seed))})
    packed = codec.encode_snapshot(snap)
    store.stage((IncomingChunk(key, 1, 0, c.index, c.count, c.checksum, c.payload) for c in packed.chunks), "test")
    store.commit(key, 1)
    return store.used


def fetch(store: Store, key: ShardKey, version: int, **kw):
    """``store.fetch``, once the encoding is made and its count settled (``daemon/making.py``: until then what it
    may take is counted)."""
    got = store.fetch(key, version, **kw)
    settled = getattr(got[1].chunks, "settled", None)
    assert settled is None or settled.wait(10)
    return got


def test_an_encoding_being_read_stays_counted_after_another_replaces_it_as_the_cache():
    store = Store(1 << 30)
    hold(store, A, 0)
    replicas = hold(store, B, 1)
    _, enc_a, lease_a = fetch(store, A, 1)
    assert store.used == replicas + enc_a.nbytes
    _, enc_b, lease_b = fetch(store, B, 1)  # the cache now; A's still being sent
    assert store.used == replicas + enc_a.nbytes + enc_b.nbytes
    _, again, lease_b2 = fetch(store, B, 1)  # B's cached encoding, read twice: counted once
    assert again is enc_b and store.used == replicas + enc_a.nbytes + enc_b.nbytes
    lease_a.release()
    lease_a.release()  # once only
    assert store.used == replicas + enc_b.nbytes
    lease_b.release(), lease_b2.release()
    assert store.used == replicas + enc_b.nbytes  # kept as the cache
    _, part, lease_part = fetch(store, A, 1, only=[0, 1])  # some chunks, not cached: counted while read
    assert len(part.chunks) == 2 and store.used == replicas + enc_b.nbytes + part.nbytes
    lease_part.release()
    assert store.used == replicas + enc_b.nbytes
    store.drop("j")
    assert store.used == 0


def test_a_fetch_waits_for_room_while_another_encoding_is_sent_and_is_refused_where_none_comes(monkeypatch):
    probe = Store(1 << 30)
    hold(probe, A, 0)
    replicas = hold(probe, B, 1)
    one = fetch(probe, A, 1)[1].nbytes
    store = Store(replicas + one + (64 << 10))  # the replicas and one encoding
    hold(store, A, 0), hold(store, B, 1)
    _, _, lease_a = fetch(store, A, 1)
    monkeypatch.setattr(store_module, "SERVE_WAIT", 0.3)
    with pytest.raises(ReplicaError, match="memory budget") as e:
        store.fetch(B, 1)
    assert e.value.code == "RESOURCE_EXHAUSTED" and store.used == replicas + one  # nothing counted for it
    monkeypatch.setattr(store_module, "SERVE_WAIT", 20.0)
    got: list = []
    waiter = threading.Thread(target=lambda: got.append(fetch(store, B, 1)))
    waiter.start()
    time.sleep(0.5)
    assert not got  # waiting for A's encoding to be sent
    lease_a.release()
    waiter.join(10)
    assert got and store.used <= store.budget
    got[0][2].release()
    store.drop("j")
    assert store.used == 0


@pytest.mark.parametrize("dense", [True, False], ids=["random (stored segments)", "zeros (compressed)"])
def test_a_rank_s_shard_served_from_its_slots_counts_its_encoding_exactly(tmp_path, dense):
    """A daemon serving its own node's rank from the slots counted twice the state (a copy and its encoding) until
    sent: short of an encoding of incompressible state (its headers), far past one that compresses. Once encoded,
    the copy goes and the encoding's own bytes are counted, given back when it is sent."""
    import uuid

    from ffstate import layout, shm
    from ffstate.commit import SlotWriter
    from ffstate.config import DaemonConfig
    from ffstate.daemon.node import Node

    g = torch.Generator().manual_seed(1)
    state = {"w": torch.randn(3 << 18, generator=g) if dense else torch.zeros(3 << 18), "step": 5}
    manifest = layout.describe(state)
    key = ShardKey("j", 0, 1)
    node = Node(DaemonConfig(node_id=f"slots-{uuid.uuid4().hex[:8]}", host="127.0.0.1", port=0, token="t" * 32,
                             memory_limit=256 << 20))
    try:
        info = node.attach(key, manifest.to_json(), shm.DEFAULT_SCALARS_CAPACITY, [], None, None)
        slots = shm.Slots(list(info.slot_paths), manifest)
        try:
            SlotWriter(slots).commit(state, 1)
            before = node.store.used
            version, packed, held = node.fetch(key, 0)
            assert version == 1 and node.store.used - before == packed.nbytes
            assert (packed.nbytes > manifest.nbytes) if dense else (packed.nbytes < manifest.nbytes // 10)
            got = codec.decode_snapshot(packed, device=None)
            assert bytes(got.buffer) == bytes(codec.pack(state).buffer.numpy())
            node.release(held)
            assert node.store.used == before
        finally:
            slots.close()
    finally:
        node.close()
