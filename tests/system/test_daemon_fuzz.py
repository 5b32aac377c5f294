"""Every RPC of a real daemon under random, mostly malformed requests (hypothesis, bounded): no request gets
UNKNOWN or INTERNAL (each gets a precise status or succeeds), and once the jobs are dropped the memory the
daemon accounts is back at its baseline."""

import json

import grpc
import pytest
from daemons import TOKEN
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ffstate._proto import replica_pb2 as pb
from ffstate._proto import replica_pb2_grpc as pb_grpc
from ffstate.codec import FORMAT, Chunk

META = (("ffstate-token", TOKEN),)
JOBS = ["fz0", "fz1", "fz\n", "../x", "", "x" * 200]
BAD = {grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL}

keys = st.one_of(
    st.builds(lambda j, r: pb.ShardKey(job_id=j, rank=r, world_size=2), st.sampled_from(JOBS[:2]), st.integers(0, 1)),
    st.builds(lambda j, r, w: pb.ShardKey(job_id=j, rank=r, world_size=w), st.sampled_from(JOBS),
              st.integers(-2, 3), st.integers(-1, 4)))
versions = st.integers(0, 4)
headers = st.fixed_dictionaries({}, optional={
    "format": st.sampled_from([1, 2, "1", None]), "kind": st.sampled_from(["full", "delta", "x", 3]),
    "checksum": st.sampled_from(["0", "ff" * 8, "zz", 7, "f" * 40]),
    "nbytes": st.sampled_from([0, 64, 1 << 40, -1, 1.5, float("inf"), "9"]),
    "chunk_bytes": st.sampled_from([4096, 1, 1 << 31, "x"]), "layout_id": st.sampled_from(["a" * 32, 5, ""]),
    "base_checksum": st.sampled_from(["0", "nothex", None]), "scalars": st.sampled_from([[], [1], {"a": 1}]),
    "manifest": st.sampled_from([{}, {"tree": {"S": 0}, "tensors": [], "scalars": [1]},
                                 {"tree": {"T": 0}, "tensors": [["w", "float32", [4], 0, "tensor", None, "cpu", False]],
                                  "scalars": []}, []]),
})
payloads = st.one_of(st.binary(max_size=64), headers.map(lambda h: json.dumps(h).encode()))
chunks = st.lists(st.tuples(st.integers(-1, 3), st.integers(0, 4), payloads, st.booleans()), min_size=0, max_size=4)


def _real(n: int, seed: int, flip: int) -> list:
    """A real version's chunks (a full encoding, or a delta against the state one step before), maybe one byte off."""
    import torch

    from ffstate import codec

    state = {"w": torch.arange(n, dtype=torch.float32) * seed, "s": seed}
    base = {"w": torch.arange(n, dtype=torch.float32) * (seed - 1), "s": seed - 1}
    packed = codec.encode(state, base if seed % 2 else None, chunk_bytes=4096)
    parts = [(c.index, c.count, bytes(c.payload), True) for c in packed.chunks]
    if flip and parts:
        i, count, payload, _ = parts[flip % len(parts)]
        if payload:
            parts[flip % len(parts)] = (i, count, bytes([payload[0] ^ 1]) + payload[1:], True)
    return parts


real_chunks = st.builds(_real, st.integers(0, 3000), st.integers(1, 4), st.integers(0, 5))
# A delta's header as the held replica (HELD, version 1: its layout and checksum) would accept, and junk that
# replaces or removes one of its fields at a time: what reaches the store's own checks of a delta.
HELD = pb.ShardKey(job_id="fz0", rank=0, world_size=2)
DELTA = {"format": FORMAT, "kind": "delta", "checksum": "0", "nbytes": 4032, "chunk_bytes": 4096,
         "layout_id": "", "base_checksum": "", "scalars": [0]}  # layout and base checksum: set by the test
JUNK = [None, "zz", float("inf"), -1, [], {}, "x" * 300, 1 << 70, 1.5, "f" * 17]


def _mutated(field: str, junk) -> bytes:
    header = dict(DELTA)
    if junk is None:
        header.pop(field)
    else:
        header[field] = junk
    return json.dumps(header).encode()


calls = st.one_of(
    st.tuples(st.just("Push"), keys, versions, versions, chunks),
    st.tuples(st.just("Push"), keys, versions, versions, real_chunks),
    st.tuples(st.just("Push"), st.just(HELD), st.integers(2, 3), st.just(1),
              st.builds(lambda h: [(0, 2, h, True)], st.builds(_mutated, st.sampled_from(sorted(DELTA)),
                                                               st.sampled_from(JUNK)))),
    st.tuples(st.just("Commit"), keys, versions),
    st.tuples(st.just("Commit"), st.just(pb.ShardKey(job_id="fz0", rank=0, world_size=2)), st.integers(2, 3)),
    st.tuples(st.just("StepBack"), keys, versions),
    st.tuples(st.just("Fetch"), keys, versions, st.integers(-1, 3), st.integers(-1, 3)),
    st.tuples(st.just("Attach"), keys, payloads, st.integers(0, 1 << 12)),
    st.tuples(st.just("Lookup"), keys),
    st.tuples(st.just("NotifyCommit"), keys, versions),
    st.tuples(st.just("Inventory"), st.sampled_from(JOBS)),
    st.tuples(st.just("Drop"), keys),
)


def call(stub, c) -> grpc.StatusCode:
    name = c[0]
    try:
        if name == "Push":
            _, key, version, base, parts = c
            msgs = []
            for index, count, payload, right_sum in parts:
                chunk = Chunk.of(max(index, 0), count, payload)
                msgs.append(pb.PushChunk(shard=key, version=version, base_version=base, chunk_index=index,
                                         chunk_count=count, checksum=chunk.checksum if right_sum else 1,
                                         payload=payload))
            stub.Push(iter(msgs), metadata=META, timeout=30)
        elif name == "Commit":
            stub.Commit(pb.CommitRequest(shard=c[1], version=c[2]), metadata=META, timeout=30)
        elif name == "StepBack":
            stub.StepBack(pb.StepBackRequest(shard=c[1], version=c[2]), metadata=META, timeout=30)
        elif name == "Fetch":
            list(stub.Fetch(pb.FetchRequest(shard=c[1], version=c[2], first_chunk=max(c[3], 0),
                                            chunk_step=max(c[4], 0)), metadata=META, timeout=30))
        elif name == "Attach":
            stub.Attach(pb.AttachRequest(shard=c[1], manifest_json=c[2], scalars_capacity=c[3]), metadata=META,
                        timeout=30)
        elif name == "Lookup":
            stub.Lookup(c[1], metadata=META, timeout=30)
        elif name == "NotifyCommit":
            stub.NotifyCommit(pb.CommitNotice(shard=c[1], version=c[2]), metadata=META, timeout=30)
        elif name == "Inventory":
            stub.Inventory(pb.InventoryRequest(job_id=c[1]), metadata=META, timeout=30)
        elif name == "Drop":
            stub.Drop(pb.DropRequest(shard=c[1]), metadata=META, timeout=30)
    except grpc.RpcError as e:
        return e.code()
    except ValueError:  # a negative index the client's own protobuf refuses to serialize
        return grpc.StatusCode.INVALID_ARGUMENT
    return grpc.StatusCode.OK


@pytest.fixture
def target(daemons):
    d = daemons.start("--memory-limit", "64M")
    channel = grpc.insecure_channel(d.address)
    yield d, pb_grpc.ReplicaStub(channel)
    channel.close()


@pytest.mark.timeout(240)
def test_random_requests_get_precise_statuses_and_leave_no_memory_behind(target):
    d, stub = target
    baseline = stub.Inventory(pb.InventoryRequest(), metadata=META, timeout=30).bytes_used
    seen: dict = {}

    import torch

    from ffstate import codec

    seed = codec.encode({"w": torch.arange(1000, dtype=torch.float32) * 0, "s": 0}, chunk_bytes=4096)
    DELTA.update(layout_id=seed.header["layout_id"], base_checksum=seed.header["checksum"])

    @settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
    @given(st.lists(calls, min_size=1, max_size=8))
    def run(sequence):
        with d.client() as c:  # a replica held (fz0, rank 0 of 2, version 1): deltas against it reach deeper
            c.push_and_commit("fz0", 0, 2, 1, seed)
        for c in sequence:
            code = call(stub, c)
            seen[code] = seen.get(code, 0) + 1
            assert code not in BAD, (c, code)
        for job in ("fz0", "fz1"):
            stub.Drop(pb.DropRequest(shard=pb.ShardKey(job_id=job, rank=-1, world_size=1)), metadata=META, timeout=30)
        assert stub.Inventory(pb.InventoryRequest(), metadata=META, timeout=30).bytes_used == baseline, sequence

    run()
    print("statuses:", {k.name: v for k, v in seen.items()})
    assert len(seen) >= 3, seen  # the requests reached past the first checks
