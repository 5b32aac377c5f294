"""ffstate/wire.py: the method table's framing and the reports' conversion to and from protobuf."""

import numpy as np
import pytest

from ffstate import wire
from ffstate._proto import replica_pb2 as pb
from ffstate.errors import CodecError


def test_reports_cross_the_wire_field_for_field():
    """The servicer and the client convert the daemon's reports through one function pair: a report survives
    the round trip through its protobuf message, nested records, lists and unset ones included; the daemon's
    own fields stay home."""
    from ffstate import wire
    from ffstate.ids import ShardKey
    from ffstate.reports import LinkReport, NodeReport, RazorReport, RestoreReport, ShardReport

    local = ShardReport(ShardKey("j", 1, 4), True, 7, [7, 6, 5], 1000, 12.5, "/dev/shm", 6,
                        RazorReport([0, 1, 2, 3], 400, 300, 175, "DDP", 2, 0), 4096, 3,
                        RestoreReport(1, 5, 2, 0.25, 1.5), None, queue_versions=1, pushed_raw_bytes=9000)
    replica = ShardReport(ShardKey("j", 3, 4), False, 6, [6], 500, 11.0, "10.0.0.2:7700")
    report = NodeReport("node0", [local, replica], 1500, 1 << 30,
                        [LinkReport("10.0.0.2:7700", 1e7, 0.5, 0.75, 1, 2, "windows", 3, 0.125)], "windows", 10, 3,
                        0.125, link_share=0.5)
    msg = wire.to_proto(report)
    assert msg.shards[0].razor.group == [0, 1, 2, 3] and not msg.shards[1].HasField("razor")
    back = wire.from_proto(msg, NodeReport)
    assert back.shards[0].queue_versions == 0 and back.link_share == 1.0  # the daemon's own: not on the wire
    back.shards[0].queue_versions, back.shards[0].pushed_raw_bytes, back.link_share = 1, 9000, 0.5
    assert back == report


def test_with_payload_frames_a_bytes_field_as_protobuf_does():
    """One copy of a chunk's payload, appended as field 7 (Push) or 5 (Fetch): the message parses as if
    protobuf had serialized it, for payloads whose length takes one, two and three varint bytes."""
    from ffstate import wire
    from ffstate._proto import replica_pb2 as pb

    for n in (0, 5, 200, 70000):
        payload = bytes(range(256)) * (n // 256) + bytes(n % 256)
        head = pb.PushChunk(version=3, chunk_index=1, chunk_count=2, checksum=9).SerializeToString()
        msg = pb.PushChunk.FromString(wire.with_payload(head, 7, payload))
        assert (msg.version, msg.chunk_index, msg.payload) == (3, 1, payload)


def test_a_received_payload_is_split_off_without_a_copy_and_malformed_messages_are_refused():
    """``parse_with_payload`` gives what protobuf's parse gives, the payload as a view of the received bytes (in any
    field order, protobuf's own serialization included), and refuses a truncated or malformed message by name."""
    import pytest

    from ffstate import wire
    from ffstate._proto import replica_pb2 as pb
    from ffstate.errors import CodecError

    for n in (0, 5, 200, 70000):
        payload = bytes(range(256)) * (n // 256) + bytes(n % 256)
        full = pb.FetchChunk(version=3, chunk_index=1, chunk_count=2, checksum=(1 << 64) - 1, payload=payload)
        framed = wire.with_payload(pb.FetchChunk(version=3, chunk_index=1, chunk_count=2,
                                                 checksum=(1 << 64) - 1).SerializeToString(), 5, payload)
        for data in (full.SerializeToString(), framed):
            m, view = wire.parse_with_payload(data, pb.FetchChunk, 5)
            assert isinstance(view, memoryview) and (view.obj is data or not n) and bytes(view) == payload
            assert (m.version, m.chunk_index, m.chunk_count, m.checksum, m.payload) == (3, 1, 2, (1 << 64) - 1, b"")
    data = framed
    for bad, text in ((data[:-1], "runs past"), (data[:1], "truncated"), (b"\x0b\x00", "wire type 3"),
                      (b"\x08" + b"\xff" * 11, "too long"), (b"\x02\x00", "malformed FetchChunk")):
        with pytest.raises(CodecError, match=text):
            wire.parse_with_payload(bad, pb.FetchChunk, 5)


def test_entries_frame_and_split_back_as_views_and_a_field_past_the_end_is_refused():
    payloads = [np.arange(n, dtype=np.uint8) for n in (0, 1, 300, 70000)]
    entries = [[b"\x08\x01", wire.payload_key(7, p.size), memoryview(p)] for p in payloads]
    body = wire.with_entries(entries, 1)
    assert pb.PushChunks.FromString(body).chunks == [b"".join(bytes(x) for x in e) for e in entries]
    got = list(wire.split_entries(body, 1))
    assert all(isinstance(v, memoryview) for v in got)
    for view, p in zip(got, payloads, strict=True):
        m, payload = wire.parse_with_payload(view, pb.PushChunk, 7)
        assert m.shard.job_id == "" and bytes(payload) == p.tobytes()
    with pytest.raises(CodecError, match="runs past its end"):
        list(wire.split_entries(body[:-1], 1))
    assert list(wire.split_entries(b"", 1)) == []
    # what was scanned before the fault came out first: a consumer that refuses it never reads the rest
    it = wire.split_entries(body + b"\x0a\xff\xff\xff\xff\x0f", 1)
    assert [bytes(next(it)) for _ in payloads] == [b"".join(bytes(x) for x in e) for e in entries]
    with pytest.raises(CodecError, match="runs past its end"):
        next(it)
    assert all(v.obj is body for v in wire.split_entries(body, 1))  # views of the message, not copies
    for other in (b"\x12\x00", b"\x08\x01", b"\x0d\0\0\0\0"):  # field 2; field 1 as a varint; as fixed32
        with pytest.raises(CodecError, match="alone"):
            list(wire.split_entries(body + other, 1))
