"""ffstate/wire.py: the method table's framing and the reports' conversion to and from protobuf."""

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
