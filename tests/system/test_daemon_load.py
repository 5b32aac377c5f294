"""A daemon under sustained load: several clients, each its own shard, pushing full versions and deltas and
fetching them back for about 10 s against one real daemon. Every fetch is byte-identical to what was pushed,
the daemon's resident memory stays bounded, and its accounted memory ends at what it holds."""

import threading
import time

import pytest
import torch

from ffstate import codec
from ffstate.testing.bitwise import assert_bitwise_equal

CLIENTS, SECONDS = 6, 10.0


def rss_kib(pid: int) -> int:
    return int(next(line for line in open(f"/proc/{pid}/status") if line.startswith("VmRSS")).split()[1])


@pytest.mark.timeout(180)
def test_several_clients_under_sustained_load_fetch_what_they_pushed_in_bounded_memory(daemons):
    d = daemons.start("--memory-limit", "256M", "--keep-deltas", "3")
    start_rss = rss_kib(d.proc.pid)
    errors: list[BaseException] = []
    counts = [0] * CLIENTS
    peak = [start_rss]
    stop = threading.Event()

    def client(i: int) -> None:
        gen = torch.Generator().manual_seed(i)
        state = {"w": torch.randn(1 << 18, generator=gen), "step": 0}  # 1 MiB of float32
        with d.client() as c:
            try:
                version, prev = 0, None
                while not stop.is_set():
                    version += 1
                    state = {"w": state["w"] + 1e-3 * torch.randn(1 << 18, generator=gen), "step": version}
                    full = prev is None or version % 7 == 0
                    packed = codec.encode(state, None if full else prev, chunk_bytes=256 << 10)
                    c.push_and_commit(f"load{i}", 0, 1, version, packed, base_version=0 if full else version - 1)
                    if version % 3 == 0:
                        assert_bitwise_equal(codec.decode(c.fetch(f"load{i}", 0, 1)), state)
                    prev = state
                    counts[i] = version
            except BaseException as e:  # noqa: BLE001 (reported by the test)
                errors.append(e)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(CLIENTS)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + SECONDS
    while time.monotonic() < deadline and not errors:
        peak[0] = max(peak[0], rss_kib(d.proc.pid))
        time.sleep(0.5)
    stop.set()
    for t in threads:
        t.join(60)
    assert not errors, errors[0]
    assert min(counts) >= 10, counts  # every client kept going
    with d.client() as c:
        inv = c.inventory()
        held = sum(s.bytes for s in inv.shards)
        # Accounted: what the replicas take (snapshots and kept deltas) and the one encoding kept for the next
        # reader of the version last fetched (a full 1 MiB state, its header and chunk framing); nothing else.
        assert 0 <= inv.bytes_used - held <= (1 << 20) + (64 << 10), (inv.bytes_used, held)
        assert all(s.version == counts[int(s.shard.job_id[4:])] for s in inv.shards)
    # 6 replicas of 1 MiB with 3 kept deltas each hold under 30 MB; allow for the encodings and gRPC buffers.
    assert peak[0] - start_rss < 300 << 10, (start_rss, peak[0])  # KiB
    print(f"versions per client {counts}; RSS {start_rss >> 10} -> peak {peak[0] >> 10} MiB; accounted {held} bytes")
