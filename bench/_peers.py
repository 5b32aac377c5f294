"""The far ends of the bandwidth benchmark's baselines, run as separate processes.

    python -m ffstate.bench._peers tcp-server PORT NBYTES REPEATS
    python -m ffstate.bench._peers tcp-source HOST PORT NBYTES
    python -m ffstate.bench._peers gloo RANK PORT NBYTES REPEATS

``tcp-server`` receives NBYTES REPEATS times into one buffer and acknowledges each with a byte.
``tcp-source`` listens on HOST and answers each byte its one client sends with NBYTES (the direction of a
restore: from the holder), until the client closes. ``gloo`` is one of two ranks: rank 0 sends a uint8 tensor
of NBYTES to rank 1 REPEATS times (after a warm-up), each followed by a 1-byte reply, and prints the seconds of
each transfer as JSON.
"""

from __future__ import annotations

import json
import socket
import sys
import time


def tcp_server(port: int, nbytes: int, repeats: int) -> None:
    buf = bytearray(nbytes)
    view = memoryview(buf)
    with socket.create_server(("127.0.0.1", port)) as srv:
        print("ready", flush=True)
        conn, _ = srv.accept()
        with conn:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            for _ in range(repeats):
                got = 0
                while got < nbytes:
                    n = conn.recv_into(view[got:], nbytes - got)
                    if not n:
                        return
                    got += n
                conn.sendall(b"k")


def tcp_source(host: str, port: int, nbytes: int) -> None:
    data = memoryview(bytes(nbytes))
    with socket.create_server((host, port)) as srv:
        print("ready", flush=True)
        conn, _ = srv.accept()
        with conn:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            while conn.recv(1):
                conn.sendall(data)


def gloo(rank: int, port: int, nbytes: int, repeats: int) -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    data = torch.empty(nbytes, dtype=torch.uint8)
    ack = torch.zeros(1, dtype=torch.uint8)
    times = []
    for i in range(repeats + 1):  # the first is a warm-up (connection setup)
        dist.barrier()
        start = time.perf_counter()
        if rank == 0:
            dist.send(data, 1)
            dist.recv(ack, 1)
        else:
            dist.recv(data, 0)
            dist.send(ack, 0)
        if i:
            times.append(time.perf_counter() - start)
    if rank == 0:
        print(json.dumps(times), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    what, *args = sys.argv[1:]
    if what == "tcp-server":
        tcp_server(*map(int, args))
    elif what == "tcp-source":
        tcp_source(args[0], int(args[1]), int(args[2]))
    elif what == "gloo":
        gloo(*map(int, args))
    else:
        raise SystemExit(f"unknown peer {what!r}")
