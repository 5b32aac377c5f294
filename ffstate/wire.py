"""The wire constants the client and the daemon's servicer share: the service's method table, the token's
metadata key, the message bound, and the one-copy framing of chunk payloads (docs/design.md I6; the
messages themselves are ``proto/ffstate/v1/replica.proto``)."""

from __future__ import annotations

import dataclasses
import typing
from typing import Any, Iterator, NamedTuple

from google.protobuf.message import DecodeError, Message

from ffstate._proto import replica_pb2 as pb
from ffstate.errors import CodecError

SERVICE = "ffstate.v1.Replica"
TOKEN_KEY = "ffstate-token"  # metadata of every call
# gRPC messages carry one chunk plus a few fields; 64 MiB bounds a chunk (docs/design.md I6).
DEFAULT_MAX_MESSAGE = 64 << 20
# A version whose chunks total at most this, and no more than one of its chunks may hold, goes in one PushVersion
# call, not a Push stream: a stream costs a thread on the sender and a wake-up a message on the holder, about half a
# millisecond of CPU a push on the two sides together (`ffstate bench push`). A larger version streams, and the scheduler paces
# it chunk by chunk, at the chunk size it chose for the link.
SMALL_PUSH_BYTES = 2 << 20
# Bytes a chunk's message may carry beside its payload: its shard key (a job id of at most 128 characters), its
# numbers and their framing take under 200. A message padded past it is refused: the payload stays a view of the
# received bytes, so padding would be held with it, uncounted.
MAX_CHUNK_FIELDS = 512


class Method(NamedTuple):
    kind: str  # unary_unary, stream_unary (client streams), unary_stream (server streams)
    request: type
    response: type
    # Push's requests and Fetch's responses are framed by hand (``with_payload``, ``parse_with_payload``): bytes on
    # the wire's side, the payload a view of them on the receiving one.
    raw_request: bool = False
    raw_response: bool = False


METHODS: dict[str, Method] = {
    "Attach": Method("unary_unary", pb.AttachRequest, pb.AttachResponse),
    "Lookup": Method("unary_unary", pb.ShardKey, pb.AttachResponse),
    "NotifyCommit": Method("unary_unary", pb.CommitNotice, pb.CommitNoticeAck),
    "Push": Method("stream_unary", pb.PushChunk, pb.PushResult, raw_request=True),
    "PushVersion": Method("unary_unary", pb.PushChunks, pb.PushResult, raw_request=True),
    "Commit": Method("unary_unary", pb.CommitRequest, pb.CommitResult),
    "Fetch": Method("unary_stream", pb.FetchRequest, pb.FetchChunk, raw_response=True),
    "FetchBulk": Method("unary_unary", pb.FetchRequest, pb.BulkTicket),
    "PushBulk": Method("unary_unary", pb.PushOpen, pb.BulkTicket),
    "Inventory": Method("unary_unary", pb.InventoryRequest, pb.InventoryResponse),
    "StepBack": Method("unary_unary", pb.StepBackRequest, pb.StepBackResult),
    "Drop": Method("unary_unary", pb.DropRequest, pb.DropResult),
    "Drain": Method("unary_unary", pb.DrainRequest, pb.DrainResult),
}


def path(method: str) -> str:
    """The method's gRPC path, e.g. ``/ffstate.v1.Replica/Push``."""
    return f"/{SERVICE}/{method}"


def with_payload(prefix: bytes, field: int, payload: memoryview | bytes) -> bytes:
    """Appends a bytes field to a serialized message: one copy of the payload, no protobuf round trip."""
    return b"".join((prefix, _key_and_length(field, len(payload)), payload))


def with_entries(entries: list[list[bytes | memoryview]], field: int) -> bytes:
    """A message of one repeated bytes ``field`` whose entries are each the concatenation of its pieces (a
    ``PushChunks``: each entry a serialized ``PushChunk``, its other fields, then its payload's key and length and
    the payload): one copy of every piece, no protobuf round trip."""
    parts: list[bytes | memoryview] = []
    for pieces in entries:
        parts.append(_key_and_length(field, sum(len(p) for p in pieces)))
        parts.extend(pieces)
    return b"".join(parts)


def payload_key(field: int, nbytes: int) -> bytes:
    """The key and length that precede a bytes ``field`` of ``nbytes`` (what ``with_payload`` inserts)."""
    return _key_and_length(field, nbytes)


def _key_and_length(field: int, n: int) -> bytes:
    head = bytearray([(field << 3) | 2])
    while True:
        byte, n = n & 0x7F, n >> 7
        head.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(head)


def _scan(data: bytes | memoryview) -> Iterator[tuple[int, int, int, int, int]]:
    """(field, wire type, start, lo, hi) of every top-level field of a message, in order: ``start`` is where its key
    is, ``data[lo:hi]`` its bytes (a length-delimited field's contents; the value of another). Each field is
    skipped over by its length, so the scan costs in proportion to the fields sent.

    Raises:
        CodecError: the message is not well-formed protobuf at its top level.
    """
    n, i = len(data), 0
    while i < n:
        start = i
        key, i = _varint(data, i)
        kind, lo = key & 7, i
        if kind == 0:
            _, i = _varint(data, i)
        elif kind == 1:
            i += 8
        elif kind == 2:
            size, lo = _varint(data, i)
            i = lo + size
        elif kind == 5:
            i += 4
        else:
            raise CodecError(f"malformed message: wire type {kind} at byte {start}")
        if i > n:
            raise CodecError(f"malformed message: a field at byte {start} runs past its end ({n} bytes)")
        yield key >> 3, kind, start, lo, i


def split_payload(data: bytes | memoryview, field: int) -> tuple[bytes, memoryview]:
    """``with_payload`` undone on a received message: (the message without its ``field``, for protobuf to parse; a
    view of that field's bytes, not copied). A parse that copied the payload cost 9 ms of a restore's CPU per 40 MB.

    Raises:
        CodecError: the message is not well-formed protobuf at its top level.
    """
    found = None
    for f, kind, start, lo, hi in _scan(data):
        if f == field and kind == 2:
            found = (start, lo, hi)
    if found is None:
        return bytes(data), memoryview(b"")
    start, lo, hi = found
    return bytes(data[:start]) + bytes(data[hi:]), memoryview(data)[lo:hi]


def split_entries(data: bytes, field: int) -> Iterator[memoryview]:
    """``with_entries`` undone, lazily: a view of each entry of the repeated bytes ``field``, in order, none copied.
    A consumer that refuses an entry stops the scan there: a malformed message costs what was read of it.

    Raises:
        CodecError: the message is malformed, or holds another field (it would be held with the views, uncounted),
            when the scan reaches the fault.
    """
    view = memoryview(data)
    for f, kind, start, lo, hi in _scan(view):
        if f != field or kind != 2:
            raise CodecError(f"malformed message: field {f} (wire type {kind}) at byte {start}; it holds the bytes "
                             f"of field {field} alone")
        yield view[lo:hi]


def parse_with_payload(data: bytes | memoryview, message: type, field: int) -> tuple[Any, memoryview]:
    """A received message framed by ``with_payload``: (its other fields parsed by protobuf, its payload's view).

    Raises:
        CodecError: the message is malformed.
    """
    head, payload = split_payload(data, field)
    try:
        return message.FromString(head), payload
    except DecodeError as e:
        raise CodecError(f"malformed {message.__name__}: {e}") from None


def _varint(data: bytes, i: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if i >= len(data) or shift > 63:
            raise CodecError(f"malformed message: a varint at byte {i} is truncated or too long")
        byte = data[i]
        value |= (byte & 0x7F) << shift
        i += 1
        if not byte & 0x80:
            return value, i
        shift += 7


def shard(job_id: str, rank: int, world_size: int) -> pb.ShardKey:
    return pb.ShardKey(job_id=job_id, rank=rank, world_size=world_size)


def to_proto(record: Any, message: type | None = None) -> Any:
    """A ``reports`` record (or ``ShardKey``) as its protobuf message: fields by name, nested records
    as sub-messages, None left unset."""
    message = message or _MESSAGES[type(record).__name__]
    values = {}
    for f in dataclasses.fields(record):
        v = getattr(record, f.name)
        if v is None or not f.metadata.get("wire", True):
            continue
        sub = message.DESCRIPTOR.fields_by_name[f.name].message_type
        if sub is not None:
            kind = getattr(pb, sub.name)
            v = [to_proto(x, kind) for x in v] if isinstance(v, list) else to_proto(v, kind)
        values[f.name] = v
    return message(**values)


def from_proto(msg: Any, record: type) -> Any:
    """The ``reports`` record of a protobuf message (unset sub-messages: None)."""
    hints = typing.get_type_hints(record)
    values = {}
    for f in dataclasses.fields(record):
        if not f.metadata.get("wire", True):
            continue
        v = getattr(msg, f.name)
        kind = _record_type(hints[f.name])
        if kind is not None:
            if isinstance(v, Message):
                v = from_proto(v, kind) if msg.HasField(f.name) else None
            else:
                v = [from_proto(x, kind) for x in v]
        elif not isinstance(v, (str, bytes, int, float, bool)):
            v = list(v)
        values[f.name] = v
    return record(**values)


def _record_type(hint: Any) -> type | None:
    """The dataclass a field's type names (through ``X | None`` and ``list[X]``), if any."""
    if dataclasses.is_dataclass(hint):
        return hint
    for arg in typing.get_args(hint):
        if (kind := _record_type(arg)) is not None:
            return kind
    return None


_MESSAGES = {"ShardKey": pb.ShardKey, "RazorReport": pb.RazorInfo, "RestoreReport": pb.RestoreInfo,
             "ProfiledReport": pb.ProfiledInfo, "ShardReport": pb.ShardInfo, "LinkReport": pb.LinkInfo,
             "NodeReport": pb.InventoryResponse, "DrainReport": pb.DrainResult, "DrainRankReport": pb.DrainRank}
