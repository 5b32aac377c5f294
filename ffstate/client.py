"""The gRPC client of a replica daemon: attach, push, commit, fetch, inventory, step-back, drop.

Every call carries the job token, has a deadline, and is retried with backoff while the daemon is
UNAVAILABLE (bounded); anything else becomes a ``ReplicaError`` naming the daemon and the gRPC
status, and exhausted retries a ``ReplicaUnavailable``. Chunks go on the wire with one copy: the
message bytes are the small protobuf fields followed by the payload, joined once.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator, Sequence, TypeVar

import grpc

from ffstate import wire
from ffstate._proto import replica_pb2 as pb
from ffstate.bulk import client as bulk
from ffstate.errors import CodecError, ReplicaError, ReplicaUnavailable
from ffstate.reports import RazorReport
from ffstate.wire import DEFAULT_MAX_MESSAGE, TOKEN_KEY, shard, with_payload

if TYPE_CHECKING:  # the codec and layouts need torch, which `ffstate status` and `ffstate drain` do not load
    from ffstate.codec import Chunk, Packed
    from ffstate.layout import Manifest

log = logging.getLogger("ffstate.client")

T = TypeVar("T")


@dataclass(frozen=True)
class Tls:
    """TLS settings of a client: the CA that signed the daemons' certificates, optionally a client cert."""

    ca: Path
    cert: Path | None = None
    key: Path | None = None
    server_name: str | None = None  # the name in the daemon's certificate, when it is not the address's host


RECONNECT_MIN_MS, RECONNECT_MAX_MS = 100, 250
ONE_CALL_AGAIN = 300.0  # seconds after a daemon refused PushVersion (an older ffstate) before a push asks it again
LOOK_TICK = 0.3  # seconds gRPC's thread watching a channel's state may still run after its last look (its tick: 0.2)


# The retries' jitter has a generator of its own: the global one is the training's (its state is captured and
# restored with every commit; a retry on one rank would make its stream differ from the others').
_JITTER = random.Random()

class Client:
    """One daemon's client. Thread-safe; ``close()`` (or ``with``) releases the channel."""

    def __init__(
        self,
        address: str,
        token: str,
        tls: Tls | None = None,
        timeout: float = 30.0,
        retries: int = 4,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE,
        small_push_bytes: int = wire.SMALL_PUSH_BYTES,
    ):
        self.address = address
        # Versions whose chunks total at most this go in one PushVersion call (``in_one_call``; 0: every push
        # streams); 0 for ``ONE_CALL_AGAIN`` seconds after the daemon did not know the call (an ffstate before it:
        # a rolling upgrade may have brought it since).
        self.small_push_bytes = self._one_call_bytes = min(small_push_bytes, max_message_bytes - (64 << 10))
        self._one_call_again = 0.0  # when a push may try PushVersion again (monotonic; 0: not refused)
        self._told_older = False
        self.token = token
        self.timeout = timeout
        self.retries = retries
        self._metadata = ((TOKEN_KEY, token),)
        self.max_message_bytes = max_message_bytes
        self.bulk = tls is None  # fetch over the daemon's bulk socket (``ffstate/bulk/``) while it has one
        self._ready: grpc.Future | None = None  # reachable()'s look at the connection, while it is not up
        self._ready_lock = threading.Lock()
        self._closed = False
        self._looked = -1.0  # when reachable() last had a look pending (monotonic)
        options = [
            ("grpc.max_send_message_length", max_message_bytes),
            ("grpc.max_receive_message_length", max_message_bytes),
            # A daemon that restarts (its node's workers start a new one within seconds) is reached again within
            # RECONNECT_MAX_MS (and gRPC's jitter, a fifth of it) of coming back, not gRPC's default of up to two
            # minutes of reconnect backoff: until its peers re-seed it, their ranks have no copy off their node (a
            # chaos run lost a second node 1.2 s after the first came back, with 1 s here then, before one rank's
            # re-seed).
            ("grpc.initial_reconnect_backoff_ms", RECONNECT_MIN_MS),
            ("grpc.min_reconnect_backoff_ms", RECONNECT_MIN_MS),
            ("grpc.max_reconnect_backoff_ms", RECONNECT_MAX_MS),
        ]
        if tls is None:
            self._channel = grpc.insecure_channel(address, options=options)
        else:
            creds = grpc.ssl_channel_credentials(
                root_certificates=tls.ca.read_bytes(),
                private_key=tls.key.read_bytes() if tls.key else None,
                certificate_chain=tls.cert.read_bytes() if tls.cert else None,
            )
            if tls.server_name:
                options.append(("grpc.ssl_target_name_override", tls.server_name))
            self._channel = grpc.secure_channel(address, creds, options=options)
        # One callable per method of the wire's table; Push's requests and Fetch's responses are framed by hand.
        self._rpc = {}
        for name, m in wire.METHODS.items():
            make = getattr(self._channel, m.kind)
            self._rpc[name] = make(wire.path(name), (lambda b: b) if m.raw_request else m.request.SerializeToString,
                                   (lambda b: b) if m.raw_response else m.response.FromString)
        self._attach, self._lookup, self._notify = self._rpc["Attach"], self._rpc["Lookup"], self._rpc["NotifyCommit"]
        self._push, self._commit, self._fetch = self._rpc["Push"], self._rpc["Commit"], self._rpc["Fetch"]
        self._push_version = self._rpc["PushVersion"]
        self._inventory, self._step_back, self._drop = self._rpc["Inventory"], self._rpc["StepBack"], self._rpc["Drop"]
        self._drain = self._rpc["Drain"]

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        bulk.cut_off(self)  # a push or fetch on the bulk socket fails now, not at its deadline
        with self._ready_lock:
            self._closed = True
            if self._ready is not None:
                self._ready.cancel()  # its subscription to the channel's state goes with it
                self._ready = None
            looked = time.monotonic() - self._looked < LOOK_TICK
        if not looked:
            self._channel.close()
            return
        # gRPC's thread that watched the channel for a look stops at its next tick; a channel closed under it
        # makes it die with a traceback in the log ("Cannot monitor channel state: Channel closed!")
        later = threading.Timer(LOOK_TICK, self._channel.close)
        later.daemon = True
        later.start()

    def __repr__(self) -> str:
        return f"Client({self.address!r})"

    # ------------------------------------------------------------ plumbing

    def _call(self, what: str, fn: Callable[[], T]) -> T:
        """Runs ``fn`` with bounded retries on UNAVAILABLE; maps gRPC errors to ffstate's."""
        delay = 0.05
        for attempt in range(self.retries + 1):
            try:
                return fn()
            except grpc.RpcError as e:
                code = e.code() if hasattr(e, "code") else grpc.StatusCode.UNKNOWN
                detail = e.details() if hasattr(e, "details") else str(e)
                if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                    if attempt < self.retries:
                        time.sleep(delay * (1 + _JITTER.random()))
                        delay = min(delay * 2, 2.0)
                        continue
                    raise ReplicaUnavailable(f"{what} at {self.address}: {code.name} after {attempt + 1} tries: "
                                             f"{detail}") from None
                raise ReplicaError(f"{what} at {self.address}: {code.name}: {detail}", code.name) from None
        raise AssertionError("unreachable")

    def reachable(self) -> bool:
        """Whether a connection to the daemon has come up, without waiting and without a call (the token is
        checked by the next one): the first look asks the channel to connect, and to keep trying within its
        reconnect backoff; a later look sees whether it has."""
        with self._ready_lock:
            if self._closed:  # a holder replaced while a look at it ran: its channel is gone
                return False
            if self._ready is None:
                self._ready = grpc.channel_ready_future(self._channel)
            self._looked = time.monotonic()
            if not self._ready.done():
                return False
            self._ready = None
            return True

    def _kw(self, timeout: float | None = None) -> dict:
        return {"metadata": self._metadata, "timeout": timeout or self.timeout}

    # ------------------------------------------------------------ local workers

    def attach(self, job_id: str, rank: int, world_size: int, manifest: Manifest, scalars_capacity: int = 0,
               holders: Sequence[str] = (), razor: RazorReport | None = None,
               discard_after: int | None = None, persist_keys: bytes = b"") -> pb.AttachResponse:
        """Creates (or finds) the rank's slots; ``holders`` are where its replicas go (default: the daemon's peers);
        ``razor`` says what the rank replicates of its state, for the daemon's reports; ``discard_after``:
        the version the worker goes on from, past which the daemon un-commits what its slots hold;
        ``persist_keys``: the DCP key map for the persistent tier (``ffstate.persist.keys``)."""
        req = pb.AttachRequest(shard=shard(job_id, rank, world_size), manifest_json=manifest.to_json(),
                               scalars_capacity=scalars_capacity, holders=list(holders),
                               razor=wire.to_proto(razor) if razor is not None else None,
                               discard_after=discard_after, persist_keys=persist_keys)
        return self._call("attach", lambda: self._attach(req, **self._kw()))

    def lookup(self, job_id: str, rank: int, world_size: int) -> pb.AttachResponse | None:
        """What the node keeps of this rank (slots, manifest, committed versions), or None."""
        try:
            return self._call("lookup", lambda: self._lookup(shard(job_id, rank, world_size), **self._kw()))
        except ReplicaError as e:
            if e.code == "NOT_FOUND":
                return None
            raise

    def notify_commit(self, job_id: str, rank: int, world_size: int, version: int) -> None:
        req = pb.CommitNotice(shard=shard(job_id, rank, world_size), version=version)
        self._call("notify_commit", lambda: self._notify(req, **self._kw()))

    # ------------------------------------------------------------ replicas

    def push(self, job_id: str, rank: int, world_size: int, version: int, packed: Packed, base_version: int = 0,
             before_chunk: Callable[[int], None] | None = None, commit: bool = False) -> pb.PushResult:
        """Sends every chunk of ``packed`` (stages it; ``commit`` applies it, or ``commit=True`` here, in the
        same call: the result then says the version held and its checksum): in one PushVersion call where
        ``in_one_call`` says so, else streamed, a chunk a message.

        ``before_chunk(nbytes)`` is called before each chunk goes out, or once with all the bytes of a version sent
        in one call (they go out together): the seam where a scheduler paces the sender.
        """
        key = shard(job_id, rank, world_size)
        last = len(packed.chunks) - 1
        what = f"push of {job_id}/{rank} version {version}"

        def head(i: int, c: Chunk) -> bytes:
            return pb.PushChunk(shard=key, version=version, base_version=base_version, chunk_index=c.index,
                                chunk_count=c.count, checksum=c.checksum, commit=commit and i == last).SerializeToString()

        def messages() -> Iterator[bytes]:
            for i, c in enumerate(packed.chunks):
                if before_chunk is not None:
                    before_chunk(len(c.payload))
                yield with_payload(head(i, c), 7, c.payload)

        def in_one() -> pb.PushResult:
            if before_chunk is not None:
                before_chunk(total)
            entries = [[head(i, c), wire.payload_key(7, len(c.payload)), c.payload] for i, c in enumerate(packed.chunks)]
            return self._push_version(wire.with_entries(entries, 1), **self._kw(self.timeout * 10))

        total = sum(len(c.payload) for c in packed.chunks)
        if self._one_call_again and time.monotonic() >= self._one_call_again:  # upgraded since?
            self._one_call_again, self.small_push_bytes = 0.0, self._one_call_bytes
        if self.in_one_call(packed):
            try:
                return self._call(what, in_one)
            except ReplicaError as e:
                if e.code != "UNIMPLEMENTED":
                    raise
                (log.info if self._told_older else log.warning)(
                    "the daemon at %s does not know PushVersion (an older ffstate): pushes to it stream, and ask again "
                    "in %.0f s; run one version of ffstate on every node", self.address, ONE_CALL_AGAIN)
                self._told_older = True
                self.small_push_bytes, self._one_call_again = 0, time.monotonic() + ONE_CALL_AGAIN
                before_chunk = None  # paced already, as one
        if self.bulk:
            opened = pb.PushOpen(shard=key, version=version, base_version=base_version, chunk_count=len(packed.chunks),
                                 commit=commit)
            got = self._call(what, lambda: bulk.push(self, opened, packed.chunks, before_chunk))
            if got is not None:  # None: no bulk socket there, or no room for the offer: streamed over gRPC
                return got
        return self._call(what, lambda: self._push(messages(), **self._kw(self.timeout * 10)))

    def in_one_call(self, packed: Packed) -> bool:
        """Whether ``push`` sends ``packed`` in one PushVersion call: its chunks total at most ``small_push_bytes``
        and no more than one of them may hold (the segment size it was encoded with, which the daemon's scheduler
        chooses for the link). Pacing one such call is pacing one chunk: a larger version streams, paced chunk by
        chunk."""
        total = sum(len(c.payload) for c in packed.chunks)
        if total > self.small_push_bytes:
            return False
        try:
            return total <= packed.header["chunk_bytes"]
        except CodecError:  # not a version's header: streamed, for the daemon to refuse chunk by chunk
            return False

    def commit(self, job_id: str, rank: int, world_size: int, version: int) -> pb.CommitResult:
        req = pb.CommitRequest(shard=shard(job_id, rank, world_size), version=version)
        return self._call(f"commit of {job_id}/{rank} version {version}", lambda: self._commit(req, **self._kw()))

    def push_and_commit(self, job_id: str, rank: int, world_size: int, version: int, packed: Packed,
                        base_version: int = 0, before_chunk: Callable[[int], None] | None = None) -> pb.CommitResult:
        """``push`` and ``commit`` in one call."""
        got = self.push(job_id, rank, world_size, version, packed, base_version, before_chunk, commit=True)
        return pb.CommitResult(version=got.committed_version, checksum=got.checksum)

    def fetch_chunks(self, job_id: str, rank: int, world_size: int, version: int = 0, first: int = 0, step: int = 1,
                     sink: Callable[[int, Chunk], None] | None = None, chunks: Sequence[int] = (),
                     checksum: int = 0) -> list[tuple[int, Chunk]]:
        """(version, chunk) for chunks first, first+step, ... of a full encoding held by this daemon, or, with
        ``chunks`` (ascending indices), for the entries first, first+step, ... of that list; with ``checksum``, only
        from a copy of the version with that checksum (the daemon refuses another: FAILED_PRECONDITION).

        With ``sink``, each (version, chunk) goes to ``sink`` as it arrives instead (the list is
        empty); a retried stream may pass some chunks twice.
        """
        req = pb.FetchRequest(shard=shard(job_id, rank, world_size), version=version, first_chunk=first,
                              chunk_step=step, chunks=chunks, checksum=checksum)

        from ffstate.codec import Chunk

        def run() -> list[tuple[int, Chunk]]:
            got: list[tuple[int, Chunk]] = []
            deliver = sink or (lambda version, chunk: got.append((version, chunk)))
            if self.bulk:
                try:
                    if bulk.fetch(self, req, deliver):
                        return got
                except ReplicaError as e:
                    if e.code != "UNAVAILABLE":
                        raise
                    log.warning("%s: fetching it over gRPC", e)
                    got.clear()
            for raw in self._fetch(req, **self._kw(self.timeout * 10)):
                m, payload = wire.parse_with_payload(raw, pb.FetchChunk, 5)  # the payload not copied again
                deliver(m.version, Chunk(m.chunk_index, m.chunk_count, m.checksum, payload))
            return got

        return self._call(f"fetch of {job_id}/{rank} version {version or 'newest'}", run)

    def fetch(self, job_id: str, rank: int, world_size: int, version: int = 0) -> Packed:
        """A full encoding of the shard at ``version`` (0: the newest held); decode with ``codec.decode``."""
        got = self.fetch_chunks(job_id, rank, world_size, version)
        if not got:
            raise ReplicaError(f"fetch from {self.address} returned no chunk", "DATA_LOSS")
        from ffstate.codec import Packed

        return Packed([c for _, c in got])

    def inventory(self, job_id: str = "", timeout: float | None = None) -> pb.InventoryResponse:
        return self._call("inventory", lambda: self._inventory(pb.InventoryRequest(job_id=job_id), **self._kw(timeout)))

    def step_back(self, job_id: str, rank: int, world_size: int, version: int) -> pb.StepBackResult:
        req = pb.StepBackRequest(shard=shard(job_id, rank, world_size), version=version)
        return self._call(f"step back of {job_id}/{rank} to {version}", lambda: self._step_back(req, **self._kw()))

    def drop(self, job_id: str, rank: int = -1, world_size: int = 1, only_world: bool = False,
             timeout: float | None = None) -> int:
        """Drops one shard, or with ``rank=-1`` every shard of the job (and its slots: the job's end, when the daemon
        flushes the last versions to its persistent tier first), or with ``only_world`` every shard made at
        ``world_size``."""
        req = pb.DropRequest(shard=pb.ShardKey(job_id=job_id, rank=rank, world_size=world_size), only_world=only_world)
        return self._call(f"drop of {job_id}", lambda: self._drop(req, **self._kw(timeout))).dropped

    def drain(self, job_id: str = "", leave: bool = True, cancel: bool = False, query: bool = False) -> pb.DrainResult:
        """Drains this daemon's node out of a job, cancels a drain, or (``query``) reports one (``daemon/drain.py``)."""
        req = pb.DrainRequest(job_id=job_id, leave=leave, cancel=cancel, query=query)
        return self._call(f"drain of {job_id or 'the job'}", lambda: self._drain(req, **self._kw()))


def fetch_striped(clients: Sequence[Client], job_id: str, rank: int, world_size: int, version: int) -> Packed:
    """Fetches one version from several holders in parallel (``stream_striped``), as one Packed."""
    got: dict[int, Chunk] = {}
    stream_striped(clients, job_id, rank, world_size, version, lambda c: got.setdefault(c.index, c))
    from ffstate.codec import Packed

    return Packed([got[i] for i in sorted(got)])


def stream_striped(clients: Sequence[Client], job_id: str, rank: int, world_size: int, version: int,
                   sink: Callable[[Chunk], None], chunks: Sequence[int] = (), checksum: int = 0) -> None:
    """Streams one version from several holders in parallel, chunk i from holder i mod k, into ``sink``; with
    ``chunks`` (ascending indices), only those, the i-th of the list from holder i mod k (no more stripes than
    chunks); with ``checksum``, only from copies of the version with that checksum.

    ``sink`` gets each chunk as it arrives, from one thread per holder (``codec.Decoder.add``
    decodes while the rest is on the wire). Full encodings of one version are deterministic, so the
    stripes fit together; the checksums (per chunk and of the whole version) catch anything that
    does not. A holder that fails has its stripe fetched again from the next one, so ``sink`` may
    see a chunk twice. ``version`` must be given (not 0): holders may hold different newest versions.
    """
    if version <= 0:
        raise ValueError("fetching from several holders needs an explicit version: their newest may differ")
    k = min(len(clients), len(chunks)) if chunks else len(clients)

    def stripe(i: int) -> None:
        last: Exception | None = None
        for j in range(len(clients)):
            try:
                clients[(i + j) % len(clients)].fetch_chunks(job_id, rank, world_size, version, first=i, step=k,
                                                             sink=lambda _, c: sink(c), chunks=chunks, checksum=checksum)
                return
            except ReplicaError as e:
                last = e
                log.warning("stripe %d of %s/%d version %d: %s; trying the next holder", i, job_id, rank, version, e)
        raise ReplicaUnavailable(f"no holder could serve stripe {i} of {job_id}/{rank} version {version}: {last}")

    if k == 1:
        stripe(0)
        return
    with ThreadPoolExecutor(k) as pool:
        list(pool.map(stripe, range(k)))
