"""ffstate/codec.py: encode/decode round trips bit for bit, in-place restore, and every bad input."""

import copy
import json

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ffstate import checksum, codec, layout
from ffstate.codec import Chunk, Packed
from ffstate.errors import CodecError
from helpers import TinyGPT, assert_bitwise_equal, contiguous_bits, train_states

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32, torch.uint8,
          torch.bool, torch.complex64]


@st.composite
def tensors(draw, dtype=None):
    dtype = dtype or draw(st.sampled_from(DTYPES))
    shape = draw(st.lists(st.integers(0, 7), min_size=0, max_size=3))
    n = int(np.prod(shape)) if shape else 1
    raw = draw(st.binary(min_size=n * dtype.itemsize, max_size=n * dtype.itemsize))
    t = torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype).reshape(shape) if n else torch.empty(shape, dtype=dtype)
    if t.dim() >= 2 and draw(st.booleans()):
        t = t.transpose(0, 1)  # non-contiguous
    return t


scalars = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=True),
                    st.text(max_size=8), st.binary(max_size=8))
keys = st.one_of(st.text(min_size=1, max_size=6), st.integers(0, 50))
states = st.recursive(
    st.one_of(tensors(), scalars),
    lambda children: st.one_of(
        st.dictionaries(keys, children, max_size=4), st.lists(children, max_size=4),
        st.lists(children, max_size=3).map(tuple),
    ),
    max_leaves=12,
)


def contiguous(state):
    """The state as decode returns it: tensors contiguous, everything else unchanged."""
    if isinstance(state, torch.Tensor):
        return contiguous_bits(state)
    if isinstance(state, dict):
        return {k: contiguous(v) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(contiguous(v) for v in state)
    return state


def perturb(state, draw):
    """Same structure, some tensor bytes and scalars changed."""
    if isinstance(state, torch.Tensor):
        t = contiguous(state)
        if t.numel() and draw(st.booleans()):
            b = t.view(-1).view(torch.uint8) if t.dim() else t.reshape(1).view(torch.uint8)
            i = draw(st.integers(0, b.numel() - 1))
            b[i] ^= draw(st.integers(1, 255))
        return t
    if isinstance(state, dict):
        return {k: perturb(v, draw) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(perturb(v, draw) for v in state)
    if isinstance(state, float) and draw(st.booleans()):
        return draw(st.floats(allow_nan=True))
    return state


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(state=states, data=st.data(), chunk=st.sampled_from([4096, 1 << 20]))
def test_random_states_roundtrip_full_and_delta_bitwise(state, data, chunk):
    full = codec.encode(state, chunk_bytes=chunk)
    assert_bitwise_equal(codec.decode(full), contiguous(state))
    nxt = perturb(state, data.draw)
    delta = codec.encode(nxt, state, chunk_bytes=chunk)
    assert delta.kind == ("full" if state is None else "delta")  # base=None means "no base"
    assert_bitwise_equal(codec.decode(delta, state), contiguous(nxt))


def test_adamw_training_run_roundtrips_through_a_chain_of_deltas():
    """30 consecutive AdamW states of a small transformer; each restored from the previous restored one."""
    prev_restored = None
    for i, state in enumerate(train_states(30)):
        if prev_restored is None:
            packed = codec.encode(state)
            restored = codec.decode(packed)
        else:
            packed = codec.encode(state, prev_restored)
            assert packed.kind == "delta"
            restored = codec.decode(packed, prev_restored)
            assert packed.nbytes < packed.raw_nbytes, f"step {i}: the delta did not compress"
        assert_bitwise_equal(restored, state)
        prev_restored = restored


def test_unchanged_state_costs_almost_nothing():
    state = next(train_states(1))
    delta = codec.encode(state, state)
    assert delta.nbytes < 0.01 * delta.raw_nbytes + 64 * 1024


def test_pack_into_a_caller_buffer_and_restore_in_place_keeps_tensor_identity():
    torch.manual_seed(0)
    model = TinyGPT()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    def step():
        model(torch.randint(0, 96, (2, 32))).sum().backward()
        opt.step()
        opt.zero_grad()
    step()
    live = {"model": model.state_dict(), "optim": opt.state_dict()}
    manifest = layout.describe(live)
    slot = layout.alloc_buffer(manifest)  # stands for a shared-memory slot owned by someone else
    snap = codec.pack_into(live, slot, manifest)
    assert snap.buffer.data_ptr() == slot.data_ptr()
    want = copy.deepcopy(live)
    for _ in range(3):
        step()
    params = [p for p in model.parameters()]
    exp_avg = [opt.state[p]["exp_avg"] for p in params]
    restored = codec.restore_into(snap, {"model": model.state_dict(), "optim": opt.state_dict()})
    assert [p for p in model.parameters()] == params and all(a is b for a, b in zip(params, model.parameters()))
    assert all(opt.state[p]["exp_avg"] is e for p, e in zip(params, exp_avg))
    assert_bitwise_equal({"model": model.state_dict(), "optim": opt.state_dict()}, want)
    assert_bitwise_equal(restored, want)


def test_pack_into_refuses_a_changed_layout_and_a_small_buffer():
    a = {"w": torch.zeros(8)}
    m = layout.describe(a)
    with pytest.raises(CodecError, match="layout changed"):
        codec.pack_into({"w": torch.zeros(9)}, layout.alloc_buffer(m), m)
    with pytest.raises(CodecError, match="too small"):
        codec.pack_into(a, torch.zeros(8, dtype=torch.uint8))


def test_restore_into_refuses_another_layout():
    snap = codec.pack({"w": torch.zeros(8)})
    with pytest.raises(CodecError, match="another layout"):
        codec.restore_into(snap, {"w": torch.zeros(8, dtype=torch.float64)})


# ---------------------------------------------------------------- bad input


@pytest.fixture(scope="module")
def pair():
    s0, s1, s2 = list(train_states(3))
    return s0, s1, codec.encode(s1, s0, chunk_bytes=64 << 10), s2


def with_chunks(packed, chunks):
    return Packed(list(chunks))


def test_structure_mismatch_between_state_and_base():
    with pytest.raises(CodecError, match="another layout"):
        codec.encode({"w": torch.zeros(3)}, {"w": torch.zeros(4)})
    with pytest.raises(CodecError, match="another layout"):
        codec.encode({"w": torch.zeros(3)}, {"v": torch.zeros(3)})


def test_corrupted_chunk_is_detected(pair):
    s0, _, d, _ = pair
    chunks = list(d.chunks)
    bad = bytearray(chunks[2].payload)
    bad[len(bad) // 2] ^= 0x10
    chunks[2] = Chunk(2, chunks[2].count, chunks[2].checksum, memoryview(bytes(bad)))
    with pytest.raises(CodecError, match="chunk 2 .* corrupted"):
        codec.decode(with_chunks(d, chunks), s0)


def test_truncated_chunk_list_is_detected(pair):
    s0, _, d, _ = pair
    with pytest.raises(CodecError, match="truncated"):
        codec.decode(with_chunks(d, d.chunks[:-1]), s0)
    with pytest.raises(CodecError, match="empty"):
        codec.decode(with_chunks(d, []), s0)


def test_reordered_chunks_are_detected(pair):
    s0, _, d, _ = pair
    chunks = list(d.chunks)
    chunks[1], chunks[2] = chunks[2], chunks[1]
    with pytest.raises(CodecError, match="reordered"):
        codec.decode(with_chunks(d, chunks), s0)


def test_relabelled_chunk_with_valid_checksum_is_detected(pair):
    """A chunk renumbered by a buggy sender (its checksum still valid) lands out of place."""
    s0, _, d, _ = pair
    chunks = list(d.chunks)
    a, b = chunks[1], chunks[2]
    chunks[1] = Chunk(1, a.count, b.checksum, b.payload)
    chunks[2] = Chunk(2, a.count, a.checksum, a.payload)
    with pytest.raises(CodecError, match="out of place"):
        codec.decode(with_chunks(d, chunks), s0)


def test_chunk_from_another_version_is_detected(pair):
    s0, s1, d, s2 = pair
    other = codec.encode(s2, s0, chunk_bytes=64 << 10)  # same layout and base, another version
    chunks = list(d.chunks)
    chunks[3] = other.chunks[3]
    with pytest.raises(CodecError, match="checksum"):
        codec.decode(with_chunks(d, chunks), s0)


def test_wrong_base_is_detected(pair):
    s0, s1, d, _ = pair
    with pytest.raises(CodecError, match="wrong base"):
        codec.decode(d, s1)
    with pytest.raises(CodecError, match="wrong base"):
        codec.decode(d, {"w": torch.zeros(2)})
    with pytest.raises(CodecError, match="needs the base"):
        codec.decode(d)


def rewrite_segment(packed, index, payload):
    chunks = list(packed.chunks)
    arr = np.frombuffer(bytes(payload), dtype=np.uint8)
    chunks[index] = Chunk.of(index, chunks[index].count, arr.copy())
    return Packed(chunks)


@pytest.mark.parametrize(
    "what, mutate",
    [
        ("magic", lambda b: b"XXXX" + b[4:]),
        ("out of place", lambda b: b[:8] + (1 << 40).to_bytes(8, "little") + b[16:]),
        ("the chunk carries", lambda b: b + b"\x00\x00"),
        ("truncated", lambda b: b[:10]),
    ],
)
def test_malformed_segment_with_valid_checksum_is_refused(pair, what, mutate):
    """A sender bug (not line noise: the chunk checksum is recomputed) still cannot yield a wrong state."""
    s0, _, d, _ = pair
    with pytest.raises(CodecError, match=what):
        codec.decode(rewrite_segment(d, 1, mutate(bytes(d.chunks[1].payload))), s0)


@pytest.mark.parametrize("fmt", [1, 2, 3, 4])
def test_a_version_of_an_older_wire_format_is_refused_saying_why(pair, fmt):
    s0, _, d, _ = pair
    head = json.loads(bytes(d.chunks[0].payload))
    head["format"] = fmt
    with pytest.raises(CodecError, match=f"wire format {fmt} .* an ffstate of another version sent it: run one version "
                                         "on every node"):
        codec.decode(rewrite_segment(d, 0, json.dumps(head).encode()), s0)
    # With a header chunk checksum that does not match ours (formats 1 and 2 summed their chunks another way).
    payload = np.frombuffer(json.dumps(head).encode(), dtype=np.uint8)
    chunks = list(d.chunks)
    chunks[0] = Chunk(0, chunks[0].count, checksum.fingerprint(payload), memoryview(payload))
    with pytest.raises(CodecError, match=f"wire format {fmt} .* run one version on every node"):
        codec.decode(Packed(chunks), s0)


def test_malformed_header_is_refused(pair):
    s0, _, d, _ = pair
    head = json.loads(bytes(d.chunks[0].payload))
    for mutate, what in [
        (lambda h: h.__setitem__("format", 99), "format"),
        (lambda h: h.__setitem__("kind", "weird"), "kind"),
        (lambda h: h.pop("base_checksum"), "base checksum"),
        (lambda h: h.__setitem__("chunk_bytes", 1), "chunk_bytes"),
        (lambda h: h.__setitem__("scalars", [1]), "scalars"),
    ]:
        h = copy.deepcopy(head)
        mutate(h)
        with pytest.raises(CodecError, match=what):
            codec.decode(rewrite_segment(d, 0, json.dumps(h).encode()), s0)
    with pytest.raises(CodecError, match="malformed header"):
        codec.decode(rewrite_segment(d, 0, b"\xff not json"), s0)


def test_full_version_larger_than_allowed_is_refused_before_allocating():
    packed = codec.encode({"w": torch.zeros(1 << 16)})
    with pytest.raises(CodecError, match="more than"):
        codec.decode_snapshot(packed, max_nbytes=1 << 10)


def test_chunk_bytes_out_of_range_is_refused():
    with pytest.raises(CodecError, match="chunk_bytes"):
        codec.encode({"w": torch.zeros(4)}, chunk_bytes=10)


def test_inplace_decode_applies_onto_the_base_and_leaves_it_intact_on_failure(pair):
    s0, s1, d, s2 = pair
    base = codec.pack(s0)
    before = base.buffer.clone()
    # A malformed segment in the middle: the segments before it were applied, and must be undone.
    chunks = list(d.chunks)
    bad = bytearray(chunks[-2].payload)
    bad[:4] = b"XXXX"
    chunks[-2] = Chunk.of(len(chunks) - 2, len(chunks), np.frombuffer(bytes(bad), dtype=np.uint8).copy())
    with pytest.raises(CodecError, match="magic"):
        codec.decode_snapshot(Packed(chunks), base, inplace=True)
    assert torch.equal(base.buffer, before)
    # Chunks of another version with the same base: well-formed, wrong content; caught by the version checksum.
    other = codec.encode(s2, s0, chunk_bytes=64 << 10)
    mixed = [d.chunks[0]] + list(other.chunks[1:])
    with pytest.raises(CodecError, match="checksum"):
        codec.decode_snapshot(Packed(mixed), base, inplace=True)
    assert torch.equal(base.buffer, before)
    got = codec.decode_snapshot(d, base, inplace=True)
    assert got.buffer.data_ptr() == base.buffer.data_ptr()
    assert_bitwise_equal(codec.unpack(got), s1)
    with pytest.raises(CodecError, match="full version has no base"):
        codec.decode_snapshot(codec.encode(s0), base, inplace=True)


def test_revert_steps_a_snapshot_back_through_its_deltas_bitwise():
    states = list(train_states(4))
    snaps = [codec.pack(s) for s in states]
    deltas = [codec.encode_snapshot(b, a) for a, b in zip(snaps, snaps[1:])]
    held = codec.Snapshot(snaps[-1].manifest, snaps[-1].buffer.clone(), snaps[-1].checksum)
    for i in range(len(deltas) - 1, -1, -1):
        held = codec.revert_snapshot(deltas[i], held, snaps[i].manifest.scalars)
        assert_bitwise_equal(codec.unpack(held), states[i])
    with pytest.raises(CodecError, match="not the given one"):
        codec.revert_snapshot(deltas[1], held, snaps[0].manifest.scalars)


@pytest.mark.parametrize("fault", ["a malformed segment", "another base"])
def test_a_revert_that_fails_leaves_the_snapshot_as_it_was(fault):
    """Large enough for the codec's thread pool (8 MB in 32 segments): one segment refused after the others were
    taken off, or a result that is not the delta's base, and every byte is put back."""
    g = torch.Generator().manual_seed(3)
    a = {"w": torch.randn(2 << 20, generator=g), "h": torch.randn(1 << 19, generator=g).to(torch.bfloat16)}
    b = {k: v + (torch.randn(v.shape, generator=g) * 1e-3).to(v.dtype) for k, v in a.items()}
    sa, sb = codec.pack(a), codec.pack(b)
    packed = codec.encode_snapshot(sb, sa, chunk_bytes=256 << 10)
    assert len(packed.chunks) > 30
    if fault == "a malformed segment":
        bad = bytearray(bytes(packed.chunks[17].payload))
        bad[:4] = b"FFS9"
        packed, match = rewrite_segment(packed, 17, bad), "magic"
    else:
        head = json.loads(bytes(packed.chunks[0].payload))
        head["base_checksum"] = f"{(sa.checksum + 1) % 2**64:016x}"
        packed, match = rewrite_segment(packed, 0, json.dumps(head).encode()), "reverting gave checksum"
    held = codec.Snapshot(sb.manifest, sb.buffer.clone(), sb.checksum)
    with pytest.raises(CodecError, match=match):
        codec.revert_snapshot(packed, held, sa.manifest.scalars)
    assert torch.equal(contiguous_bits(held.buffer), contiguous_bits(sb.buffer))


# ---------------------------------------------------------------- streaming decode (remote restore)


def _stream(chunks, threads=3, max_nbytes=None):
    """Feeds ``chunks`` to a Decoder from ``threads`` threads at once, as stripes do."""
    from concurrent.futures import ThreadPoolExecutor

    dec = codec.Decoder(max_nbytes)
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(lambda i: [dec.add(c) for c in chunks[i::threads]], range(threads)))
    return dec.finish()


def test_streamed_full_version_decodes_bit_exact_in_any_order_with_repeats(pair):
    _, s1, _, _ = pair
    full = codec.encode(s1, chunk_bytes=64 << 10)
    assert len(full.chunks) > 8
    chunks = list(full.chunks)
    rng = np.random.default_rng(0)
    rng.shuffle(chunks)  # the header is not first
    chunks += chunks[: len(chunks) // 2]  # a retried stripe resends some
    snapshot = _stream(chunks)
    assert snapshot.checksum == full.checksum
    assert_bitwise_equal(codec.unpack(snapshot), s1)
    dec = codec.Decoder()
    for c in chunks:
        dec.add(c)
    assert_bitwise_equal(dec.state(), s1)  # copied out and summed in one pass


def test_a_version_of_stored_and_compressed_segments_decodes_bit_exact_whole_streamed_and_as_deltas():
    """Weights of noise do not compress (their segments are stored as they are), zeros and small integers do: one
    version holds both kinds, and decodes bit for bit in one piece, streamed in any order, and as a delta."""
    from ffstate.codec import segment

    g = torch.Generator().manual_seed(5)
    state = {"w": torch.randn(600_000, generator=g), "m": torch.zeros(300_000), "h": torch.randn(200_001, generator=g)
             .bfloat16(), "step": torch.arange(100_000), "lr": 0.5}
    full = codec.encode(state, chunk_bytes=256 << 10)
    kinds = {bytes(c.payload[:4]) for c in full.chunks[1:]}
    assert kinds == {segment.MAGIC, segment.STORED}
    assert_bitwise_equal(codec.decode(full), state)
    chunks = list(full.chunks)
    np.random.default_rng(1).shuffle(chunks)
    dec = codec.Decoder()
    for c in chunks:
        dec.add(c)
    assert_bitwise_equal(dec.state(), state)
    moved = {**state, "w": state["w"] + torch.randn(600_000, generator=g), "m": state["m"] + 1e-3}
    delta = codec.encode(moved, state, chunk_bytes=256 << 10)
    assert {bytes(c.payload[:4]) for c in delta.chunks[1:]} == {segment.MAGIC, segment.STORED}
    assert_bitwise_equal(codec.decode(delta, state), moved)


def test_a_streamed_version_is_copied_out_as_its_segments_land_and_ends_bit_exact():
    """The copy-out into new tensors and the version's sum run task by task (4 MiB of the buffer each) as soon as
    the segments under a task's bytes are in: before the last segment lands, the tasks away from it are done; the
    state at the end is bit-exact, from any order of arrival over several threads, with repeats."""
    g = torch.Generator().manual_seed(3)
    state = {"big": torch.randn(2_500_001, generator=g), "h": torch.randn(1_000_003, generator=g).bfloat16(),
             "i": torch.randint(0, 1 << 40, (700_001,), generator=g), "small": [torch.randn(17) for _ in range(50)],
             "b": torch.rand(33, generator=g) > 0.5, "lr": 0.25}
    full = codec.encode(state, chunk_bytes=256 << 10)
    chunks = list(full.chunks)
    last = max(chunks[1:], key=lambda c: c.index)  # the end of the buffer: under the last task only
    dec = codec.Decoder()
    for c in [chunks[0], *chunks[1:-1]]:
        dec.add(c)
    import time
    deadline = time.monotonic() + 30
    while not (len(dec._tasks) >= dec._unpacking.count - 1 and all(t.done() for t in dec._tasks)):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert dec._unpacking.count >= 5 and len(dec._tasks) < dec._unpacking.count  # the last waits for its segment
    dec.add(last)
    assert_bitwise_equal(dec.state(), state)
    rng = np.random.default_rng(1)
    shuffled = chunks + chunks[::3]
    rng.shuffle(shuffled)
    from concurrent.futures import ThreadPoolExecutor

    dec = codec.Decoder()
    with ThreadPoolExecutor(3) as pool:
        list(pool.map(lambda i: [dec.add(c) for c in shuffled[i::3]], range(3)))
    assert_bitwise_equal(dec.state(), state)


def test_chunks_encoded_by_name_are_the_whole_encoding_s_and_bad_names_are_refused(pair):
    """``encode_chunks``: what a fetch of some chunks encodes (a razor part's segments, or the header alone), the same
    bytes as the whole encoding's at those indices; indices that do not ascend or pass the end are refused."""
    _, s1, _, _ = pair
    snapshot = codec.pack(s1)
    whole = codec.encode_snapshot(snapshot, chunk_bytes=16 << 10)
    n = len(whole.chunks)
    assert n > 6
    for names in ([0], [0, 2, n - 1], [1, 3], list(range(n))):
        got = codec.encode_chunks(snapshot, names, chunk_bytes=16 << 10)
        assert [(c.index, c.count, c.checksum, bytes(c.payload)) for c in got.chunks] == \
            [(c.index, c.count, c.checksum, bytes(c.payload)) for c in (whole.chunks[i] for i in names)]
        assert got.checksum == whole.checksum
    for bad in ([2, 1], [0, 0], [0, n], [-1]):
        with pytest.raises(CodecError, match="must ascend and stay below"):
            codec.encode_chunks(snapshot, bad, chunk_bytes=16 << 10)


def test_unpack_verified_sums_what_it_copies_bit_exact():
    """One pass: the copies are the state, their sum is the buffer's checksum (padding and tails included)."""
    state = {"a": torch.arange(13, dtype=torch.uint8), "b": torch.randn(3, 5, dtype=torch.float64),
             "big": torch.randn(700_001), "h": torch.randn(7).half(), "n": np.arange(5, dtype=np.int16), "s": 3}
    snapshot = codec.pack(state)
    got, checksum = codec.unpack_verified(snapshot.manifest, snapshot.buffer)
    assert checksum == snapshot.checksum
    assert_bitwise_equal(got, state)
    spec = {t.name: t for t in snapshot.manifest.tensors}
    assert spec["big"].nbytes > 2 << 20 and spec["big"].nbytes % 8  # several pieces, a partial last word
    got["big"][0] = 1.0  # new storage, not a view of the buffer
    assert not torch.equal(got["big"], layout.tensor_view(snapshot.buffer, spec["big"]))
    snapshot.buffer[spec["a"].offset + 13] ^= 1  # a padding byte: not in the state, but in the sum
    assert codec.unpack_verified(snapshot.manifest, snapshot.buffer)[1] != snapshot.checksum


def test_unpack_verified_of_many_small_tensors_is_bit_exact_and_sums_the_whole_buffer():
    # Many small tensors (copied together, summed by span) across several 4 MiB tasks, odd-sized bools and
    # halves between them, medium ones (each summed from its copy) and an empty one.
    state = {f"t{i}": (torch.randn(4001) if i % 3 else torch.rand(37) > 0.5) for i in range(1200)}
    state |= {"mid": [torch.randn(30_000) for _ in range(5)], "h": torch.randn(9).half(), "e": torch.zeros(0)}
    snapshot = codec.pack(state)
    got, checksum = codec.unpack_verified(snapshot.manifest, snapshot.buffer)
    assert checksum == snapshot.checksum
    assert_bitwise_equal(got, state)
    last = max((t for t in snapshot.manifest.tensors if t.nbytes), key=lambda t: t.offset)
    assert last.nbytes % 8 and last.offset + last.nbytes < snapshot.manifest.nbytes
    snapshot.buffer[last.offset + last.nbytes] ^= 1  # the padding after the last tensor: in the sum
    assert codec.unpack_verified(snapshot.manifest, snapshot.buffer)[1] != snapshot.checksum


def test_unpack_verified_of_a_state_without_tensor_bytes_sums_the_padding_alone():
    snapshot = codec.pack({"lr": 0.5, "e": torch.zeros(0)})
    got, checksum = codec.unpack_verified(snapshot.manifest, snapshot.buffer)
    assert checksum == snapshot.checksum == codec.buffer_checksum(snapshot.buffer)
    assert got["lr"] == 0.5 and got["e"].shape == (0,)


def test_streamed_version_with_a_bad_chunk_is_refused(pair):
    s0, s1, d, _ = pair
    full = codec.encode(s1, chunk_bytes=64 << 10)
    chunks = list(full.chunks)
    bad = bytearray(chunks[3].payload)
    bad[len(bad) // 2] ^= 0x01
    corrupted = chunks[:3] + [Chunk(3, chunks[3].count, chunks[3].checksum, memoryview(bytes(bad)))] + chunks[4:]
    with pytest.raises(CodecError, match="chunk 3 .* corrupted"):
        _stream(corrupted)
    with pytest.raises(CodecError, match="truncated.*missing"):
        _stream(chunks[:5] + chunks[6:])
    with pytest.raises(CodecError, match="header .* never came"):
        _stream(chunks[1:])
    foreign = codec.encode(s0, chunk_bytes=32 << 10).chunks  # another count
    with pytest.raises(CodecError, match="foreign"):
        _stream(chunks + [foreign[len(chunks) + 1]], threads=1)
    with pytest.raises(CodecError, match="more than"):
        _stream(chunks, max_nbytes=1000)
    with pytest.raises(CodecError, match="delta"):
        _stream(list(d.chunks))
    relabelled = list(chunks)  # valid chunks, swapped places
    a, b = chunks[1], chunks[2]
    relabelled[1], relabelled[2] = Chunk(1, a.count, b.checksum, b.payload), Chunk(2, a.count, a.checksum, a.payload)
    with pytest.raises(CodecError, match="out of place"):
        _stream(relabelled)


@pytest.mark.parametrize("chunk_bytes", [4 << 10, 5000, 1 << 20])
def test_segment_count_is_the_segments_length_by_arithmetic(chunk_bytes):
    from ffstate.codec.chunks import segment_count, segments

    state = {"a": torch.zeros(12345), "b": torch.zeros(7, dtype=torch.float16), "c": torch.zeros(3, 3, dtype=torch.int64),
             "d": torch.zeros(0), "e": np.zeros(1001, dtype=np.uint8)}
    manifest = layout.describe(state)
    assert segment_count(manifest, chunk_bytes) == len(segments(manifest, chunk_bytes))


def test_a_full_version_decodes_into_an_uninitialised_buffer_every_byte_of_which_is_a_segment_s(monkeypatch):
    """The decoders do not zero a full version's buffer first (8 ms of a 40 MB restore's start): the dtype groups
    tile the buffer, padding included, and the segments cover the groups. Garbage in the buffer beforehand must
    not show in the state or the sum."""
    from ffstate.codec import delta as delta_mod
    from ffstate.layout import buffers as buffers_mod
    from ffstate.layout.host import empty_array

    def garbage(nbytes):  # the decoders' uninitialised buffers, full of 0xAB
        out = empty_array(nbytes)
        out.fill(0xAB)
        return out

    state = {"a": torch.randn(1001), "b": torch.arange(7, dtype=torch.int16), "c": torch.rand(33) > 0.5,
             "d": torch.randn(5, 3).bfloat16(), "n": np.arange(3, dtype=np.uint8)}
    full = codec.encode(state, chunk_bytes=4096)
    monkeypatch.setattr(buffers_mod, "empty_array", garbage)  # the streaming decoder's (layout.empty_buffer)
    dec = codec.Decoder()
    for c in full.chunks:
        dec.add(c)
    monkeypatch.undo()
    assert_bitwise_equal(dec.state(), state)
    monkeypatch.setattr(delta_mod, "empty_array", garbage)
    snapshot = codec.decode_snapshot(full)
    monkeypatch.undo()
    assert snapshot.checksum == full.checksum and torch.equal(snapshot.buffer, codec.pack(state).buffer)


def test_the_codec_pool_is_sized_to_the_cpus_the_process_may_use_not_the_machine_s(monkeypatch):
    # a daemon on cores of its own (--cpus, taskset, a cgroup's set) runs no more codec threads than it has CPUs
    from ffstate.codec import backend

    monkeypatch.delenv("FFSTATE_CODEC_THREADS", raising=False)
    monkeypatch.setattr(backend.os, "sched_getaffinity", lambda pid: {3})
    monkeypatch.setattr(backend.os, "cpu_count", lambda: 64)
    backend.use_threads(0)
    try:
        assert backend._pool()._max_workers == 1
    finally:
        backend.use_threads(0)
