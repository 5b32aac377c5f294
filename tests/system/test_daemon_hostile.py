"""A daemon under hostile input (issue: a daemon that holds for a month of failures): malformed headers get
INVALID_ARGUMENT, never UNKNOWN; a Commit that fails gives back the memory its push reserved; ids are matched
whole; TLS flags that cannot work together are refused at start; refusals are counted by status, logged, and
their messages bounded. Against real `ffstate serve` processes on loopback."""

import json
import subprocess
import sys
import urllib.request

import grpc
import numpy as np
import pytest
from daemons import TOKEN, held_version, wait_until
from helpers import train_states

from ffstate import checksum, cli, codec
from ffstate._proto import replica_pb2 as pb
from ffstate._proto import replica_pb2_grpc as pb_grpc
from ffstate.codec import Chunk

JOB, CHUNK = "hostile", 64 << 10
META = (("ffstate-token", TOKEN),)


@pytest.fixture(scope="module")
def states():
    return list(train_states(3))


def _holding(factory, states, metrics=False):
    """A daemon holding version 1 of rank 0 (world 1), a raw stub to it, its memory in use, its metrics port."""
    d = factory.start(metrics=metrics)
    with d.client() as c:
        c.push_and_commit(JOB, 0, 1, 1, codec.encode(states[0], chunk_bytes=CHUNK))
        used = c.inventory().bytes_used
    channel = grpc.insecure_channel(d.address)
    yield d, pb_grpc.ReplicaStub(channel), used, d.metrics_port
    channel.close()


@pytest.fixture
def held(daemons, states):
    yield from _holding(daemons, states, metrics=True)


@pytest.fixture(scope="module")
def shared_held(module_daemons, states):
    """``held``, one daemon for every case of a test whose cases each leave it as they found it (they check it)."""
    yield from _holding(module_daemons, states)


def key(job=JOB):
    return pb.ShardKey(job_id=job, rank=0, world_size=1)


def push(stub, chunks, version=2, base=1, job=JOB):
    msgs = [pb.PushChunk(shard=key(job), version=version, base_version=base, chunk_index=c.index,
                         chunk_count=c.count, checksum=c.checksum, payload=bytes(c.payload)) for c in chunks]
    return stub.Push(iter(msgs), metadata=META, timeout=30)


def with_header(packed, edit):
    """The version's chunks with its header chunk rewritten by ``edit(header) -> bytes`` (checksummed anew)."""
    head = json.loads(bytes(packed.chunks[0].payload))
    return [Chunk.of(0, packed.chunks[0].count, edit(head))] + packed.chunks[1:]


def used(d):
    with d.client() as c:
        return c.inventory().bytes_used


@pytest.mark.parametrize("case, edit", [
    ("delta header without layout_id", lambda h: json.dumps({k: v for k, v in h.items() if k != "layout_id"}).encode()),
    ("base_checksum that is not hex", lambda h: json.dumps({**h, "base_checksum": "not-hex"}).encode()),
    ("Infinity as a size", lambda h: json.dumps({**h, "nbytes": float("inf")}).encode()),
    ("a 100k-deep JSON array", lambda h: b"[" * 100_000 + b"]" * 100_000),
    ("scalars that are not a list", lambda h: json.dumps({**h, "scalars": {"a": 1}}).encode()),
])
def test_a_malformed_header_is_invalid_argument_and_costs_nothing(shared_held, states, case, edit):
    d, stub, before, _ = shared_held
    delta = codec.encode(states[1], states[0], chunk_bytes=CHUNK)
    with pytest.raises(grpc.RpcError) as e:
        push(stub, with_header(delta, edit))
        stub.Commit(pb.CommitRequest(shard=key(), version=2), metadata=META, timeout=30)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (case, e.value.details())
    assert "header" in e.value.details()
    assert used(d) == before
    with d.client() as c:
        assert held_version(c, JOB, 0) == 1


def test_a_commit_that_fails_gives_its_memory_back(held, states):
    """A delta staged on version 2, then the replica stepped back to 1 before its Commit (what recovery does):
    the Commit is refused (the base moved on) and the staged bytes are released, not held until a restart."""
    d, stub, before, _ = held
    with d.client() as c:
        c.push_and_commit(JOB, 0, 1, 2, codec.encode(states[1], states[0], chunk_bytes=CHUNK), base_version=1)
        at_2 = c.inventory().bytes_used
        c.push(JOB, 0, 1, 3, codec.encode(states[2], states[1], chunk_bytes=CHUNK), base_version=2)
        assert c.inventory().bytes_used > at_2
        c.step_back(JOB, 0, 1, 1)
        with pytest.raises(Exception, match="FAILED_PRECONDITION.*moved on"):
            c.commit(JOB, 0, 1, 3)
        assert c.inventory().bytes_used == before  # version 1 held, nothing staged, no delta kept
        assert held_version(c, JOB, 0) == 1


def test_ids_are_matched_whole(held, states):
    d, stub, before, _ = held
    with pytest.raises(grpc.RpcError) as e:
        push(stub, codec.encode(states[0], chunk_bytes=CHUNK).chunks, version=1, base=0, job="job\n")
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "job id" in e.value.details()
    assert used(d) == before


def test_refusals_are_counted_by_status_logged_and_bounded(held, states):
    d, stub, _, port = held
    long_job = "x" * 5000
    for _ in range(3):
        with pytest.raises(grpc.RpcError) as e:
            stub.StepBack(pb.StepBackRequest(shard=key(long_job), version=1), metadata=META, timeout=30)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and len(e.value.details()) <= 1024
    with pytest.raises(grpc.RpcError) as e:
        stub.Commit(pb.CommitRequest(shard=key(), version=9), metadata=META, timeout=30)
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    counts = {line.split("status=\"")[1].split("\"")[0]: float(line.rsplit(" ", 1)[1])
              for line in text.splitlines() if line.startswith("ffstate_refusals_total{")}
    assert counts.get("INVALID_ARGUMENT") == 3 and counts.get("FAILED_PRECONDITION") == 1, counts
    log = d.log()
    assert "refused StepBack: INVALID_ARGUMENT" in log and "refused Commit: FAILED_PRECONDITION" in log
    assert "x" * 2000 not in log


def test_tls_flags_that_cannot_work_together_are_refused_at_start(tmp_path):
    (tmp_path / "token").write_text(TOKEN)
    (tmp_path / "ca.pem").write_text("")
    proc = subprocess.run([sys.executable, "-m", "ffstate.cli", "serve", "--token-file", str(tmp_path / "token"),
                           "--tls-client-ca", str(tmp_path / "ca.pem")], capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and "--tls-client-ca needs --tls-cert and --tls-key" in proc.stderr


def peak_rss_kib(pid: int) -> int:
    """The process's peak resident memory so far (VmHWM), KiB."""
    return int(next(line for line in open(f"/proc/{pid}/status") if line.startswith("VmHWM")).split()[1])


def test_refusing_costs_what_was_sent_not_what_was_claimed(held):
    """A push of a few hundred bytes whose manifest claims a 4 GiB tensor: its Commit is refused without building
    anything in proportion to the claim (the chunk count is checked by arithmetic), and the memory comes back."""
    d, stub, before, _ = held
    big = {"w": __import__("torch").zeros(1)}
    packed = codec.encode(big, chunk_bytes=4 << 10)
    head = json.loads(bytes(packed.chunks[0].payload))
    head["manifest"]["tensors"][0][2] = [1 << 30]  # float32: 4 GiB, in 4 KiB segments
    head["nbytes"] = 4 << 30
    chunks = [Chunk.of(0, 2, json.dumps(head).encode()), Chunk.of(1, 2, bytes(packed.chunks[1].payload))]
    peak = peak_rss_kib(d.proc.pid)
    push(stub, chunks, version=5, base=0, job="claim")
    with pytest.raises(grpc.RpcError) as e:
        stub.Commit(pb.CommitRequest(shard=key("claim"), version=5), metadata=META, timeout=30)
    assert e.value.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.DATA_LOSS), e.value.details()
    assert "segment chunks" in e.value.details()
    assert peak_rss_kib(d.proc.pid) - peak < 20 << 10  # KiB: no list of a million segments (that cost 105 MB)
    assert used(d) == before


def test_per_chunk_bookkeeping_counts_against_the_budget(daemons, states):
    """Empty chunks cost the daemon about 1 KiB each beside their payload: counted, a push of 200,000 of them
    meets the budget (RESOURCE_EXHAUSTED) instead of growing the daemon past it, and gives everything back."""
    d = daemons.start("--memory-limit", "16M")
    with d.client() as c:
        before = c.inventory().bytes_used
    channel = grpc.insecure_channel(d.address)
    stub = pb_grpc.ReplicaStub(channel)
    head = Chunk.of(0, 200_000, json.dumps({"format": codec.FORMAT, "kind": "full", "checksum": "0", "nbytes": 0,
                                            "chunk_bytes": 4096, "layout_id": "x", "manifest": {}}).encode())
    empty = Chunk.of(1, 200_000, b"")

    def msgs():
        yield pb.PushChunk(shard=key("many"), version=1, chunk_index=0, chunk_count=200_000, checksum=head.checksum,
                           payload=bytes(head.payload))
        for i in range(1, 200_000):
            yield pb.PushChunk(shard=key("many"), version=1, chunk_index=i, chunk_count=200_000,
                               checksum=empty.checksum)

    with pytest.raises(grpc.RpcError) as e:
        stub.Push(msgs(), metadata=META, timeout=120)
    channel.close()
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, e.value.details()
    assert used(d) == before


@pytest.mark.parametrize("fmt", [1, 2])
def test_a_version_in_an_older_wire_format_is_refused_saying_why(held, fmt):
    """A node still running an ffstate of an older wire format pushes to this one (its header chunk's checksum of the
    older kind): refused at its header, with what to do; nothing is staged."""
    d, stub, before, _ = held
    head = json.dumps({"format": fmt, "kind": "full", "checksum": "0", "nbytes": 4, "chunk_bytes": 4096,
                       "layout_id": "x", "manifest": {}}).encode()
    msgs = [pb.PushChunk(shard=key("old"), version=1, chunk_index=0, chunk_count=2,
                         checksum=checksum.fingerprint(np.frombuffer(head, dtype=np.uint8)), payload=head)]
    with pytest.raises(grpc.RpcError) as e:
        stub.Push(iter(msgs), metadata=META, timeout=60)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"wire format {fmt}" in e.value.details() and "run one version on every node" in e.value.details()
    assert used(d) == before


def test_a_manifest_over_the_limit_gets_the_daemons_message(held):
    d, stub, before, _ = held
    with pytest.raises(grpc.RpcError) as e:
        stub.Attach(pb.AttachRequest(shard=key("m"), manifest_json=b" " * (17 << 20)), metadata=META, timeout=60)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "exceeds 16777216" in e.value.details()


def test_stalled_push_streams_cannot_take_the_daemon_from_other_clients(daemons, states):
    """Streams that send their first chunk and then nothing: past --max-pushes they are refused at once, the
    daemon keeps answering health checks, Inventory and Commit meanwhile, and each stalled stream is cut off
    (CANCELLED) after --push-idle-timeout with its memory given back."""
    import threading
    import time

    from grpc_health.v1 import health_pb2, health_pb2_grpc

    idle = 8  # the RPCs and the Inventory below must come before the stalls are cut: 2 s of margin was seen loaded
    d = daemons.start("--max-pushes", "4", "--push-idle-timeout", str(idle))
    with d.client() as c:
        c.push_and_commit(JOB, 0, 1, 1, codec.encode(states[0], chunk_bytes=CHUNK))
    packed = codec.encode(states[1], chunk_bytes=CHUNK)
    full = packed.chunks
    release = threading.Event()
    codes: list = []

    def stalled(i: int) -> None:
        def msgs():
            c = full[0]
            yield pb.PushChunk(shard=key(f"stall{i}"), version=1, chunk_index=0, chunk_count=c.count,
                               checksum=c.checksum, payload=bytes(c.payload))
            release.wait(60)

        channel = grpc.insecure_channel(d.address)
        try:
            pb_grpc.ReplicaStub(channel).Push(msgs(), metadata=META, timeout=60)
            codes.append(grpc.StatusCode.OK)
        except grpc.RpcError as e:
            codes.append(e.code())
        finally:
            channel.close()

    channel = grpc.insecure_channel(d.address)
    stub = pb_grpc.ReplicaStub(channel)
    push(stub, codec.encode(states[1], states[0], chunk_bytes=CHUNK).chunks)  # staged; committed mid-stall
    threads = [threading.Thread(target=stalled, args=(i,)) for i in range(40)]
    try:
        for t in threads:
            t.start()
        deadline = time.monotonic() + 30  # every stream open: 4 stalled in the daemon, the rest refused
        while codes.count(grpc.StatusCode.RESOURCE_EXHAUSTED) < 36 and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.3)
        start = time.monotonic()
        assert health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=2).status == 1
        assert stub.Inventory(pb.InventoryRequest(), metadata=META, timeout=2).node_id
        assert stub.Commit(pb.CommitRequest(shard=key(), version=2), metadata=META, timeout=2).version == 2
        answered = time.monotonic() - start
        mid_stall = stub.Inventory(pb.InventoryRequest(), metadata=META, timeout=2).bytes_used
        channel.close()
        for t in threads:
            t.join(30)
    finally:
        release.set()
    assert answered < idle  # answered while the stalls held their places
    assert codes.count(grpc.StatusCode.CANCELLED) == 4 and codes.count(grpc.StatusCode.RESOURCE_EXHAUSTED) == 36
    from ffstate.daemon.store import CHUNK_BOOKKEEPING

    with d.client() as c:
        assert held_version(c, JOB, 0) == 2
        # What the 4 stalled streams reserved (their header chunk, and the full version's buffer it announced)
        # is given back, to the byte.
        stalled = len(full[0].payload) + CHUNK_BOOKKEEPING + packed.raw_nbytes
        # (the callers see CANCELLED at once; each handler gives its memory back as its stream unwinds)
        wait_until(lambda: c.inventory().bytes_used == mid_stall - 4 * stalled, 10.0, "the stalled pushes' memory back")
    assert d.log().count(f"push stalled: no chunk for {idle}s") == 4


def test_a_version_pushed_and_never_committed_is_shown_and_expires(daemons, states, tmp_path, monkeypatch, capsys):
    """A pusher that dies between Push and Commit: the staged version is visible (Inventory, ffstate status,
    metrics) and, after --staged-timeout, discarded with its memory given back and a log line."""
    import time

    d = daemons.start("--staged-timeout", "15", metrics=True)  # past the checks below, however loaded the machine
    port = d.metrics_port
    with d.client() as c:
        before = c.inventory().bytes_used
        packed = codec.encode(states[0], chunk_bytes=CHUNK)
        c.push(JOB, 0, 1, 1, packed)
        inv = c.inventory(JOB)
        (s,) = inv.shards
        assert (s.staged_version, s.version, s.versions) == (1, 0, []) and s.staged_bytes > packed.raw_nbytes
        assert inv.bytes_used == before + s.staged_bytes
        monkeypatch.setenv("FFSTATE_TOKEN", TOKEN)  # `ffstate status`, in this process (its start would take
        monkeypatch.setenv("COLUMNS", "250")  # seconds of the timeout: torch's import)
        assert cli.main(["status", "--daemon", d.address]) == 0
        status = capsys.readouterr().out
        assert "v1, " in status, status
        metrics = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        line = next(x for x in metrics.splitlines() if x.startswith("ffstate_staged_bytes{"))
        assert f'job="{JOB}"' in line and float(line.rsplit(" ", 1)[1]) == s.staged_bytes
        deadline = time.monotonic() + 30
        while c.inventory(JOB).shards and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not c.inventory(JOB).shards and c.inventory().bytes_used == before
    assert f"discarded {JOB}/rank 0 of 1 version 1: pushed and not committed within 15s" in d.log()


def test_calls_without_the_token_that_never_send_a_request_cannot_take_the_daemons_threads(daemons):
    """gRPC's server gives each call a thread and, for a method taking one request, waits there for it: a refusal
    or a health check that waited let a stranger hold every thread (25 calls here, 64 with the defaults) and every
    RPC of the job queued behind them (DEADLINE_EXCEEDED after 5 s, before). Both now answer without reading; the
    refusals are logged a line a second, not one each."""
    import threading
    import time

    from grpc_health.v1 import health_pb2, health_pb2_grpc

    d = daemons.start("--max-pushes", "4")  # a pool of 20 threads
    release = threading.Event()

    def never():
        release.wait(60)
        return
        yield  # a request stream that sends nothing

    attacker = grpc.insecure_channel(d.address)
    channel = grpc.insecure_channel(d.address)
    try:
        calls = [attacker.stream_unary(f"/ffstate.v1.Replica/{m}").future(never(), timeout=60)
                 for m in ("Inventory", "Commit", "StepBack") for _ in range(10)]
        checks = [attacker.stream_unary("/grpc.health.v1.Health/Check",
                                        response_deserializer=health_pb2.HealthCheckResponse.FromString
                                        ).future(never(), timeout=60) for _ in range(10)]
        fetches = [attacker.stream_stream(f"/{m}")(never(), timeout=60) for m in ("ffstate.v1.Replica/Fetch",
                                                                                   "grpc.health.v1.Health/Watch")
                   for _ in range(5)]
        time.sleep(1.0)  # every call at the daemon
        assert pb_grpc.ReplicaStub(channel).Inventory(pb.InventoryRequest(), metadata=META, timeout=5).node_id
        assert health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5).status == 1
        assert {c.exception(10).code() for c in calls} == {grpc.StatusCode.UNAUTHENTICATED}
        assert {c.result(10).status for c in checks} == {health_pb2.HealthCheckResponse.SERVING}
        for f in fetches:
            with pytest.raises(grpc.RpcError) as e:
                next(f)
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    finally:
        release.set()
        attacker.close()
        channel.close()
    assert d.log().count("missing or wrong token") < 10  # 45 refused within a second or two


def test_a_fetch_naming_more_chunks_than_a_version_can_have_is_refused_before_they_are_listed(held):
    from ffstate.daemon.checks import MAX_CHUNKS

    d, stub, before, _ = held
    # 1M + 1 indices (a 3 MB request: 15x that as a list of ints, before) and one far past the version's end
    for chunks, says in ((range(1, MAX_CHUNKS + 2), "a version has at most"), ([1, (1 << 32) - 1], "the version has")):
        with pytest.raises(grpc.RpcError) as e:
            next(stub.Fetch(pb.FetchRequest(shard=key(), version=1, chunks=chunks), metadata=META, timeout=30))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and says in e.value.details(), e.value.details()
    assert used(d) == before
