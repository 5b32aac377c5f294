"""The bulk socket's two sides in one process, over real sockets: the server's bounds (a ticket serves once, offers
expire and give their memory back, too many offers or connections are refused) and the client's checks of what a
daemon sends (a wrong opening, a claimed size past the message limit, a connection that ends early), each with
the error it must give, and its fallback to gRPC where the socket cannot be used."""

import socket
import struct
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

import grpc
import numpy as np
import pytest

from ffstate._proto import replica_pb2 as pb
from ffstate.bulk import client as bulk_client
from ffstate.bulk import server as bulk_server
from ffstate.bulk.frames import FRAME, HELLO, MAGIC, RESULT, TICKET_BYTES
from ffstate.errors import ReplicaError

pytestmark = pytest.mark.timeout(60)


@dataclass
class C:  # a chunk as the codec makes them
    index: int
    count: int
    checksum: int
    payload: memoryview


def chunks(n: int = 3, size: int = 100_000) -> list[C]:
    rng = np.random.default_rng(0)
    return [C(i, n, 1000 + i, memoryview(rng.integers(0, 256, size if i else 50, dtype=np.uint8))) for i in range(n)]


@pytest.fixture
def server():
    released: list[int] = []
    s = bulk_server.BulkServer("127.0.0.1", 0, released.append)
    s.released = released
    yield s
    s.close()


def trickle(sock: socket.socket, times: int, every: float) -> None:
    """A byte every ``every`` seconds, ``times`` times, until the peer is gone."""
    try:
        for _ in range(times):
            sock.sendall(b"x")
            time.sleep(every)
    except OSError:
        pass


def read_all(port: int, data: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=20) as s:
        s.sendall(data)
        s.shutdown(socket.SHUT_WR)
        got = []
        while part := s.recv(1 << 20):
            got.append(part)
    return b"".join(got)


def test_an_offer_is_served_once_then_its_memory_released(server):
    sent = chunks()
    ticket = server.offer(7, sent, reserved=12345)
    assert len(ticket) == TICKET_BYTES and server.released == []
    got = read_all(server.port, ticket)
    assert HELLO.unpack_from(got) == (MAGIC, 7, 3)
    at = HELLO.size
    for c in sent:
        assert FRAME.unpack_from(got, at) == (c.index, c.count, c.checksum, len(c.payload))
        at += FRAME.size
        assert got[at : at + len(c.payload)] == bytes(c.payload)
        at += len(c.payload)
    assert at == len(got)
    deadline = time.monotonic() + 10
    while not server.released and time.monotonic() < deadline:
        time.sleep(0.01)
    assert server.released == [12345]
    assert read_all(server.port, ticket) == b""  # once only
    assert server.released == [12345]


def test_offers_expire_are_bounded_and_close_releases_them(server, monkeypatch):
    monkeypatch.setattr(bulk_server, "TICKET_TTL", 0.05)
    stale = server.offer(1, chunks(), reserved=10)
    time.sleep(0.1)
    assert server.expire() == 1 and server.released == [10]
    assert read_all(server.port, stale) == b""  # expired: nothing
    monkeypatch.setattr(bulk_server, "TICKET_TTL", 60.0)
    monkeypatch.setattr(bulk_server, "MAX_OFFERS", 2)
    server.offer(1, chunks(), reserved=20)
    server.offer(1, chunks(), reserved=30)
    with pytest.raises(ReplicaError) as e:
        server.offer(1, chunks(), reserved=40)
    assert e.value.code == "RESOURCE_EXHAUSTED" and server.released == [10, 40]  # refused: its memory given back
    assert server.expire() == 0
    server.close()
    assert sorted(server.released) == [10, 20, 30, 40]


def test_a_connection_has_its_ticket_time_in_all_and_one_waiting_gets_the_place(monkeypatch):
    """One place, taken by a stranger who sends a byte every 0.2 s: it is cut off when its ticket time is up (not
    a read's timeout at a time), and the caller queued behind it is served then."""
    monkeypatch.setattr(bulk_server, "HELLO_TIMEOUT", 1.0)
    refused: list[str] = []
    s = bulk_server.BulkServer("127.0.0.1", 0, lambda n: None, refused=refused.append, max_connections=1)
    try:
        ticket = s.offer(3, chunks(1), reserved=1)
        start = time.monotonic()
        with socket.create_connection(("127.0.0.1", s.port), timeout=20) as stranger:
            threading.Thread(target=trickle, args=(stranger, 40, 0.2), daemon=True).start()
            time.sleep(0.1)
            got = read_all(s.port, ticket)  # queued behind the stranger
            served = time.monotonic() - start
            assert HELLO.unpack_from(got) == (MAGIC, 3, 1)
            assert 0.9 < served < 3.0, served  # once the stranger's second is up
            try:  # and the stranger was cut off: an orderly close, or a reset when a byte of its trickle was
                ended = stranger.recv(1) == b""  # still unread in the server's socket as it closed it
            except ConnectionResetError:
                ended = True
            assert ended
        assert refused == ["UNAUTHENTICATED"]
    finally:
        s.close()


def test_a_transfer_counts_against_the_offers_until_its_connection_ends_and_always_finds_a_place(monkeypatch):
    """Two transfers at most, one stranger's place: while a push is being served it holds its offer's count, and the
    stranger sitting on its place keeps neither push out (before, the places were fewer than the offers, and a
    push's connection past them was closed without an answer: its holder was then taken for down)."""
    monkeypatch.setattr(bulk_server, "MAX_OFFERS", 2)
    monkeypatch.setattr(bulk_server, "STRANGERS", 1)
    refused: list[str] = []
    s = bulk_server.BulkServer("127.0.0.1", 0, lambda n: None, refused=refused.append)  # HELLO_TIMEOUT: 5 s
    go, served = threading.Event(), []

    def handler(conn, peer) -> None:
        served.append(peer)
        go.wait(20)
        conn.sendall(b"done")

    try:
        first, second = s.offer_push(handler), s.offer_push(handler)
        with pytest.raises(ReplicaError) as e:
            s.offer_push(handler)
        assert e.value.code == "RESOURCE_EXHAUSTED"
        with socket.create_connection(("127.0.0.1", s.port), timeout=20) as stranger, \
                socket.create_connection(("127.0.0.1", s.port), timeout=20) as a, \
                socket.create_connection(("127.0.0.1", s.port), timeout=20) as b:
            a.sendall(first)
            b.sendall(second)
            deadline = time.monotonic() + 10
            while len(served) < 2 and time.monotonic() < deadline:
                time.sleep(0.01)
            # both served beside the stranger, before its 5 s were up (with places for the transfers alone, the
            # second would have waited for the stranger to be cut off)
            assert len(served) == 2 and refused == []
            with pytest.raises(ReplicaError):  # served, not yet ended: still counted
                s.offer_push(handler)
            go.set()
            assert a.recv(4) == b"done" and b.recv(4) == b"done"
            assert stranger.recv(1) == b"" and refused == ["UNAUTHENTICATED"]  # cut off when its 5 s were up
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:  # the connections' ends give the counts back
            try:
                s.offer_push(handler)
                break
            except ReplicaError:
                time.sleep(0.01)
        else:
            pytest.fail("the transfers' counts never came back")
    finally:
        go.set()
        s.close()


def test_strangers_are_counted_logged_at_most_once_a_second_and_close_cuts_off_a_stalled_receiver(caplog):
    refused: list[str] = []
    released: list[int] = []
    s = bulk_server.BulkServer("127.0.0.1", 0, released.append, refused=refused.append)
    try:
        began = time.monotonic()
        for _ in range(5):  # reset before any ticket
            c = socket.create_connection(("127.0.0.1", s.port), timeout=20)
            c.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            c.close()
        deadline = time.monotonic() + 10
        while len(refused) < 5 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert refused == ["UNAUTHENTICATED"] * 5
        took = time.monotonic() - began  # a loaded machine spreads the five over more than one LOG_EVERY
        logged = [r for r in caplog.records if "refused a bulk connection" in r.getMessage()]
        assert 1 <= len(logged) <= 2 + int(took / bulk_server.LOG_EVERY), (len(logged), took)
        big = [C(i, 64, i, memoryview(np.zeros(1 << 20, dtype=np.uint8))) for i in range(64)]  # 64 MiB
        ticket = s.offer(1, big, reserved=77)
        with socket.create_connection(("127.0.0.1", s.port), timeout=20) as slow:
            slow.sendall(ticket)
            assert len(slow.recv(HELLO.size)) > 0  # then reads no more: the sender fills the socket and waits
            time.sleep(0.5)
            assert released == []
            s.close()  # shuts the connection down under it
            deadline = time.monotonic() + 10
            while not released and time.monotonic() < deadline:
                time.sleep(0.02)
            assert released == [77]
    finally:
        s.close()


# A daemon that runs out of file descriptors for a moment: its bulk socket cannot take a connection (accept fails
# with EMFILE) until some are given back. Run apart: the limit is the whole process's.
OUT_OF_DESCRIPTORS = """
import logging, os, resource, sys, time
logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
from ffstate.bulk.server import BulkServer
s = BulkServer("127.0.0.1", 0, lambda n: None)
ticket = s.offer(3, [], reserved=0)
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + 8, hard))
held = []
try:
    while True:
        held.append(os.open(os.devnull, os.O_RDONLY))
except OSError:  # from here no descriptor is to be had
    pass
print(s.port, ticket.hex(), flush=True)
sys.stdin.readline()  # the test has connected: its connection waits in the listen queue, accept fails meanwhile
time.sleep(1.0)
for fd in held:
    os.close(fd)
resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
time.sleep(20)
"""


def test_a_bulk_socket_out_of_descriptors_for_a_while_serves_again_once_it_has_them():
    proc = subprocess.Popen([sys.executable, "-c", OUT_OF_DESCRIPTORS], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        port, ticket = proc.stdout.readline().split()
        # A thread waiting in accept has its descriptor already (the kernel takes it first): the first connection
        # may be taken with it, the second cannot.
        with socket.create_connection(("127.0.0.1", int(port)), timeout=20), \
                socket.create_connection(("127.0.0.1", int(port)), timeout=20) as c:
            proc.stdin.write("connected\n")
            proc.stdin.flush()
            c.sendall(bytes.fromhex(ticket))
            assert HELLO.unpack_from(c.recv(HELLO.size)) == (MAGIC, 3, 0)  # served once there were descriptors
    finally:
        proc.kill()
        _, err = proc.communicate(timeout=20)
    assert "could not take a connection" in err and "Too many open files" in err, err[-2000:]


def test_a_pinned_port_is_bound_again_at_once_after_it_served():
    first = bulk_server.BulkServer("127.0.0.1", 0, lambda n: None)
    port = first.port
    assert len(read_all(port, first.offer(1, chunks(), reserved=1))) > 0  # the daemon closes first: TIME_WAIT here
    first.close()
    again = bulk_server.BulkServer("127.0.0.1", port, lambda n: None)  # a daemon restarted on --bulk-port
    again.close()


# ---------------------------------------------------------------- the client's side


class Rejected(grpc.RpcError):
    def __init__(self, code):
        self._code = code

    def code(self):
        return self._code


class Caller:
    """What ``bulk.client.fetch`` uses of an ``ffstate.client.Client``, its FetchBulk answered by ``answer``."""

    def __init__(self, answer, max_message_bytes: int = 1 << 20):
        self.address, self.timeout, self.max_message_bytes, self.bulk = "127.0.0.1:1", 10.0, max_message_bytes, True
        self._rpc = {"FetchBulk": lambda req, **kw: answer(), "PushBulk": lambda req, **kw: answer()}

    def _kw(self, timeout=None):
        return {}


def daemon_sending(data: bytes) -> tuple[int, threading.Thread]:
    """A listening socket that answers one connection's ticket with ``data``, then closes: a peer misbehaving."""
    lsock = socket.create_server(("127.0.0.1", 0))

    def serve():
        conn, _ = lsock.accept()
        with conn:
            conn.recv(TICKET_BYTES)
            conn.sendall(data)
        lsock.close()

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    return lsock.getsockname()[1], t


def fetch_from(data: bytes, version: int = 5, count: int = 1, limit: int = 1 << 20) -> list:
    port, t = daemon_sending(data)
    got = []
    caller = Caller(lambda: pb.BulkTicket(ticket=b"t" * 32, port=port, version=version, chunks=count), limit)
    try:
        assert bulk_client.fetch(caller, pb.FetchRequest(), lambda v, c: got.append((v, c)))
    finally:
        t.join(10)
    return got


def test_the_client_reads_frames_and_refuses_what_is_not_them():
    payload = bytes(range(256)) * 10
    good = HELLO.pack(MAGIC, 5, 1) + FRAME.pack(0, 1, 99, len(payload)) + payload
    [(version, chunk)] = fetch_from(good)
    assert (version, chunk.index, chunk.count, chunk.checksum, bytes(chunk.payload)) == (5, 0, 1, 99, payload)
    cases = [
        (HELLO.pack(b"HTTP", 5, 1), "DATA_LOSS", {}),  # not the framing
        (HELLO.pack(MAGIC, 4, 1), "DATA_LOSS", {}),  # another version than the ticket's
        (HELLO.pack(MAGIC, 5, 1) + FRAME.pack(0, 1, 99, 1 << 40), "DATA_LOSS", {}),  # past the limit: nothing allocated
        (b"", "UNAVAILABLE", {}),  # closed: a refused or expired ticket
        (HELLO.pack(MAGIC, 5, 2) + FRAME.pack(0, 2, 99, 10) + b"x" * 10, "UNAVAILABLE", {"count": 2}),  # ends early
        (HELLO.pack(MAGIC, 5, 1) + FRAME.pack(0, 1, 99, 1000) + b"x" * 10, "UNAVAILABLE", {}),  # inside a payload
    ]
    for data, code, kw in cases:
        with pytest.raises(ReplicaError) as e:
            fetch_from(data, **kw)
        assert e.value.code == code, (data[:20], e.value)


def test_the_client_falls_back_where_there_is_no_socket():
    def unimplemented():
        raise Rejected(grpc.StatusCode.UNIMPLEMENTED)

    caller = Caller(unimplemented)
    assert not bulk_client.fetch(caller, pb.FetchRequest(), lambda v, c: None) and not caller.bulk
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    caller = Caller(lambda: pb.BulkTicket(ticket=b"t" * 32, port=port, version=1, chunks=1))
    assert not bulk_client.fetch(caller, pb.FetchRequest(), lambda v, c: None) and not caller.bulk

    def full():
        raise Rejected(grpc.StatusCode.RESOURCE_EXHAUSTED)

    caller = Caller(full)  # its offers all taken: this fetch over gRPC, the socket kept for the next
    assert not bulk_client.fetch(caller, pb.FetchRequest(), lambda v, c: None) and caller.bulk

    def refused():
        raise Rejected(grpc.StatusCode.NOT_FOUND)

    with pytest.raises(grpc.RpcError):  # the daemon's refusal of the request itself is the caller's to see
        bulk_client.fetch(Caller(refused), pb.FetchRequest(), lambda v, c: None)


def test_host_of_addresses():
    assert bulk_client.host_of("10.0.0.2:7700") == "10.0.0.2"
    assert bulk_client.host_of("[::1]:7700") == "::1"
    assert bulk_client.host_of("node-3.cluster:7701") == "node-3.cluster"


def test_a_daemon_that_trickles_meets_the_whole_fetch_s_deadline():
    """A byte every 0.1 s never trips a read's timeout (0.2 s here); the fetch's deadline (ten times it) ends it."""
    lsock = socket.create_server(("127.0.0.1", 0))

    def serve():
        conn, _ = lsock.accept()
        with conn:
            conn.recv(TICKET_BYTES)
            conn.sendall(HELLO.pack(MAGIC, 5, 1) + FRAME.pack(0, 1, 99, 1000))
            trickle(conn, 100, 0.1)
        lsock.close()

    threading.Thread(target=serve, daemon=True).start()
    caller = Caller(lambda: pb.BulkTicket(ticket=b"t" * 32, port=lsock.getsockname()[1], version=5, chunks=1))
    caller.timeout = 0.2
    start = time.monotonic()
    with pytest.raises(ReplicaError) as e:
        bulk_client.fetch(caller, pb.FetchRequest(), lambda v, c: None)
    assert e.value.code == "UNAVAILABLE" and time.monotonic() - start < 5


def daemon_answering(answer: bytes, after: int) -> tuple[int, list[int], threading.Thread]:
    """A listening socket that reads a push's ticket and ``after`` bytes of it, answers ``answer`` and drains (as the
    daemon does on a refusal): what it read comes back in the list."""
    from ffstate.bulk.frames import drain, recv_exactly

    lsock = socket.create_server(("127.0.0.1", 0))
    got: list[int] = []

    def serve():
        conn, _ = lsock.accept()
        with conn:
            got.append(len(recv_exactly(conn, TICKET_BYTES + after)))
            conn.sendall(answer)
            drain(conn, 3.0)
        lsock.close()

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    return lsock.getsockname()[1], got, t


def test_a_push_refused_midway_stops_sending_and_says_why():
    from ffstate.bulk.frames import result
    from ffstate.errors import ReplicaUnavailable

    many = [C(i, 200, i, memoryview(np.zeros(1 << 20, dtype=np.uint8))) for i in range(200)]  # 200 MiB to send
    port, got, t = daemon_answering(result("FAILED_PRECONDITION", "base 2 is not held here"), FRAME.size + 1000)
    caller = Caller(lambda: pb.BulkTicket(ticket=b"t" * 32, port=port))
    paced: list[int] = []
    with pytest.raises(ReplicaError) as e:
        bulk_client.push(caller, pb.PushOpen(), many, paced.append)
    assert e.value.code == "FAILED_PRECONDITION" and "base 2 is not held here" in str(e.value)
    assert len(paced) < 50  # it stopped soon after the answer came, not after 200 MiB
    t.join(10)
    for answer, kind in ((b"", ReplicaUnavailable), (RESULT.pack(b"OK", 0, 0, 0, 0, 5000), ReplicaError)):
        port, got, t = daemon_answering(answer, 0)
        with pytest.raises(kind) as e:  # closed without an answer; an answer's message past its bound
            bulk_client.push(Caller(lambda: pb.BulkTicket(ticket=b"t" * 32, port=port)), pb.PushOpen(), [], None)
        assert kind is ReplicaUnavailable or e.value.code == "DATA_LOSS"
        t.join(10)
    ok = RESULT.pack(b"OK", 0, 7, 99, 1234, 0)
    port, got, t = daemon_answering(ok, FRAME.size + 10)
    answer = bulk_client.push(Caller(lambda: pb.BulkTicket(ticket=b"t" * 32, port=port)), pb.PushOpen(),
                              [C(0, 1, 5, memoryview(b"0123456789"))], None)
    assert (answer.committed_version, answer.checksum, answer.bytes_received) == (7, 99, 1234)
    t.join(10)


def test_closing_the_client_cuts_off_its_push_in_flight_at_once():
    """A replication stopped (its shard dropped, the daemon stopping) closes its clients: a bulk push to a holder
    that stopped reading fails then, where it waited for its deadline (ten times the client's timeout)."""
    from ffstate.errors import ReplicaUnavailable

    lsock = socket.create_server(("127.0.0.1", 0))
    taken = threading.Event()

    def serve():  # takes the ticket, then reads nothing: the sender fills the socket and waits
        conn, _ = lsock.accept()
        with conn:
            conn.recv(TICKET_BYTES)
            taken.set()
            time.sleep(15)
        lsock.close()

    threading.Thread(target=serve, daemon=True).start()
    caller = Caller(lambda: pb.BulkTicket(ticket=b"t" * 32, port=lsock.getsockname()[1]))
    caller.timeout = 30.0  # its deadline: 300 s
    many = [C(i, 200, i, memoryview(np.zeros(1 << 20, dtype=np.uint8))) for i in range(200)]
    failed: list[BaseException] = []

    def pushing():
        try:
            bulk_client.push(caller, pb.PushOpen(), many, None)
        except BaseException as e:  # noqa: BLE001
            failed.append(e)

    t = threading.Thread(target=pushing)
    t.start()
    assert taken.wait(10)
    time.sleep(0.3)  # blocked in a send
    start = time.monotonic()
    bulk_client.cut_off(caller)
    t.join(10)
    assert not t.is_alive() and time.monotonic() - start < 5
    assert len(failed) == 1 and isinstance(failed[0], ReplicaUnavailable)
    assert not bulk_client._OPEN.get(caller)  # nothing left tracked
    from ffstate.client import Client

    client = Client("127.0.0.1:1", "token")
    mine, peer = socket.socketpair()
    bulk_client._OPEN[client] = {mine}  # as a push in flight registers its connection
    client.close()
    peer.settimeout(5)
    assert peer.recv(1) == b""  # shut down by the close
    mine.close(), peer.close()
