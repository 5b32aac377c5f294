"""The daemon's replica store when a commit meets a drop, or fails half-way for a reason that is not the data's: the
budget stays exact and a held replica stays the version its checksum says (docs/design.md I2, I5)."""

import threading

import pytest
import torch

from ffstate import checksum, codec
from ffstate.codec import segment
from ffstate.daemon.held import IncomingChunk
from ffstate.daemon.store import Store
from ffstate.errors import ReplicaError
from ffstate.ids import ShardKey

KEY = ShardKey("races", 0, 1)
CHUNK = 64 << 10


def _state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(300_000, generator=g), "b": torch.randn(1000, generator=g).to(torch.bfloat16)}


def _stage(store: Store, packed, version: int, base: int = 0) -> None:
    store.stage([IncomingChunk(KEY, version, base, c.index, c.count, c.checksum, c.payload) for c in packed.chunks],
                "test")


def _holding() -> tuple[Store, list[dict]]:
    states = [_state(0)]
    store = Store(1 << 30)
    _stage(store, codec.encode(states[0], chunk_bytes=CHUNK), 1)
    store.commit(KEY, 1)
    return store, states


def _held_bytes(store: Store) -> int:
    return sum(row["bytes"] for row in store.inventory())


def _intact(store: Store) -> bool:
    held = store._get(KEY)
    return checksum.checksum(held.snapshot.buffer) == held.snapshot.checksum


def _held_decode(monkeypatch, thread: str = "first") -> tuple[threading.Event, threading.Event]:
    """``codec.decode_snapshot`` on the thread named ``thread`` held until ``go`` is set, once ``decoding`` says it
    began; (decoding, go)."""
    decoding, go = threading.Event(), threading.Event()
    decode = codec.decode_snapshot

    def held(*args, **kwargs):
        if threading.current_thread().name == thread:
            decoding.set()
            assert go.wait(30)
        return decode(*args, **kwargs)

    monkeypatch.setattr(codec, "decode_snapshot", held)
    return decoding, go


def _older_commit_held(store: Store, monkeypatch, older: int) -> tuple[threading.Event, list, threading.Thread]:
    """Full versions ``older`` and ``older + 1`` staged, as pushes leave them; ``older`` committing on a thread, held
    inside its decode (set the event returned to let it go), ``older + 1`` staged for the caller to commit."""
    staged = []
    for v in (older, older + 1):
        _stage(store, codec.encode(_state(v), chunk_bytes=CHUNK), v)
        staged.append(store._staged.pop(KEY))
    decoding, go = _held_decode(monkeypatch)
    errors: list = []
    t = _commit_on_a_thread(store, staged[0], older, errors)
    assert decoding.wait(30)
    store._staged[KEY] = staged[1]
    return go, errors, t


def _commit_on_a_thread(store: Store, staging, version: int, errors: list) -> threading.Thread:
    """``staging`` committed on a thread named "first" (its ReplicaError kept in ``errors``), started."""
    def commit() -> None:
        if staging is not None:
            store._staged[KEY] = staging
        try:
            store.commit(KEY, version)
        except ReplicaError as e:
            errors.append(e)

    t = threading.Thread(target=commit, name="first")
    t.start()
    return t


@pytest.mark.parametrize("kind", ["full", "delta"])
def test_a_drop_while_a_version_is_committed_keeps_nothing_and_counts_every_byte_once(monkeypatch, kind):
    """The job dropped while its next version was decoded: before, a full version came back after the drop, with
    the old replica's bytes given back twice (used 0 with 4 MB held), and a delta's bytes were never given back."""
    store, states = _holding()
    new = _state(1)
    packed = codec.encode(new, chunk_bytes=CHUNK) if kind == "full" else codec.encode(new, states[0], chunk_bytes=CHUNK)
    _stage(store, packed, 2, base=0 if kind == "full" else 1)
    decoding, dropped = _held_decode(monkeypatch)
    errors: list = []
    t = _commit_on_a_thread(store, None, 2, errors)
    assert decoding.wait(30)
    drops: list = []
    dropping = threading.Thread(target=lambda: drops.append(store.drop("races")))
    dropping.start()  # a delta's commit holds the replica's lock: the drop counts its bytes once that is done
    while KEY in store._replicas:
        pass
    dropped.set()
    t.join(30)
    dropping.join(30)
    assert drops == [1]
    assert errors and errors[0].code == "FAILED_PRECONDITION" and "dropped or replaced" in str(errors[0])
    assert store.inventory() == [] and store.used == 0  # nothing came back, nothing counted twice or left counted


def test_a_second_full_commit_of_a_shard_meeting_the_first_is_refused_not_counted_twice(monkeypatch):
    store, _ = _holding()
    go, errors, t = _older_commit_held(store, monkeypatch, 2)
    assert store.commit(KEY, 3)[0] == 3
    go.set()
    t.join(30)
    assert errors and errors[0].code == "FAILED_PRECONDITION"
    assert store._get(KEY).version == 3 and _intact(store)
    assert store.used == _held_bytes(store)  # the version held, counted once


def test_a_delta_that_fails_half_way_for_want_of_memory_leaves_the_replica_as_its_checksum_says(monkeypatch):
    """A segment's scratch buffer that cannot be had (a MemoryError under a memory limit) after two segments were
    applied in place: those are undone, the replica stays version 1, whole, and the staged bytes are given back.
    Before, only a CodecError was undone, and the replica was left neither version."""
    store, states = _holding()
    delta = codec.encode(_state(1), states[0], chunk_bytes=CHUNK)
    assert len(delta.chunks) > 4
    _stage(store, delta, 2, base=1)
    before = store.used
    scratch, calls = segment._scratch, [0]

    def failing_scratch(nbytes, which=0):
        if which == 0:
            calls[0] += 1
            if calls[0] == 3:
                raise MemoryError("scratch")
        return scratch(nbytes, which)

    monkeypatch.setattr(segment, "_scratch", failing_scratch)
    monkeypatch.setattr("ffstate.codec.delta.POOL_MIN_BYTES", 1 << 40)  # in order, on this thread: the third fails
    with pytest.raises(MemoryError):
        store.commit(KEY, 2)
    assert calls[0] >= 3
    assert store._get(KEY).version == 1 and _intact(store)
    assert store.used == _held_bytes(store) < before  # the staged delta's bytes given back


def test_a_version_whose_segments_are_larger_than_the_chunk_limit_is_refused_before_any_is_decoded():
    """Decoding a segment allocates its size as the header gives it: a delta of a few hundred bytes claiming 1 GiB
    segments took that much memory, uncounted, and kept it. The header's segment size is bounded by
    --max-chunk-bytes (the encoders' own: 1 MiB at most)."""
    store = Store(1 << 30, max_chunk_bytes=1 << 20)
    state = _state(0)
    _stage(store, codec.encode(state, chunk_bytes=CHUNK), 1)
    store.commit(KEY, 1)
    before = store.used
    with pytest.raises(ReplicaError, match="segments of 4194304 bytes") as e:
        _stage(store, codec.encode(_state(1), state, chunk_bytes=4 << 20), 2, base=1)
    assert e.value.code == "RESOURCE_EXHAUSTED" and store.used == before
    assert segment._scratch(16 << 20).size == 16 << 20 and segment._scratch(1).base.size < 16 << 20  # not kept


def test_a_step_back_or_a_fetch_meeting_a_drop_stops_and_counts_nothing_twice(monkeypatch):
    """A step-back that got the replica before a drop took it: the drop gave its bytes (its deltas among them) back,
    and the step-back gave the deltas back again (the budget went to -2.4 MB in the review's run). A replica dropped
    or replaced is marked under the store's lock; whoever holds it already stops (NOT_FOUND)."""
    store, states = _holding()
    _stage(store, codec.encode(_state(1), states[0], chunk_bytes=CHUNK), 2, base=1)
    store.commit(KEY, 2)
    got = store._get
    dropped = []

    def get_then_drop(key):
        held = got(key)
        if not dropped:
            dropped.append(store.drop("races"))  # between the lookup and the replica's lock
        return held

    monkeypatch.setattr(store, "_get", get_then_drop)
    with pytest.raises(ReplicaError, match="any more") as e:
        store.step_back(KEY, 1)
    assert e.value.code == "NOT_FOUND" and dropped == [1] and store.used == 0
    store2, _ = _holding()
    held = store2._get(KEY)
    store2.drop("races")
    monkeypatch.setattr(store2, "_get", lambda key: held)  # a fetch that got it before the drop
    with pytest.raises(ReplicaError, match="no longer held") as e:
        store2.fetch(KEY, 1)
    assert e.value.code == "NOT_FOUND" and store2.used == 0


def test_two_first_commits_of_a_shard_and_a_drop_between_them_keep_nothing(monkeypatch):
    """Two full versions of a shard not held yet, committed at once; the second lands, the job is dropped, then the
    first would land: both commits are marked by the drop, so nothing comes back after it."""
    store = Store(1 << 30)
    go, errors, t = _older_commit_held(store, monkeypatch, 1)
    store.commit(KEY, 2)
    assert store.drop("races") == 1
    go.set()
    t.join(30)
    assert errors and errors[0].code == "FAILED_PRECONDITION"
    assert store.inventory() == [] and store.used == 0
