"""Two real nodes on one machine: network namespaces joined by a veth link shaped to 200 Mbit/s with tc.

Each namespace runs its own torchrun agent (multi-node c10d rendezvous across the link) with 2 ranks, as a
user launches it: one torchrun command per node and nothing ffstate-specific set (no daemon address, no
token). Each node's daemon finds its own address, the ranks agree on a token through the job's store, and
gloo's all-reduces and ffstate's replication cross the same shaped link. A whole node (its ranks and its
daemon) is SIGKILLed; torchrun restarts both nodes' workers and node 1's ranks come back from node 0 over
the link, bit for bit. A node that publishes a loopback address is refused at entry.
"""

import json
import os
import random
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from ffstate import Config
from ffstate.bench import netns
from ffstate.testing.bitwise import compare_runs

REASON = netns.unavailable()
pytestmark = [pytest.mark.timeout(600), pytest.mark.skipif(bool(REASON), reason=f"no shaped links here: {REASON}")]
STEPS = 10


def torchrun_on_link(link: netns.Link, out: Path, tmp: Path, job: str, *extra: str, env: dict | None = None,
                     restarts: int = 3) -> list[subprocess.CompletedProcess]:
    """The demo worker as a 2-node job, one torchrun agent per namespace; returns both agents' results. The job id
    and the port only keep concurrent test runs apart; no other FFSTATE_* variable is set."""
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("FFSTATE_") or k == "FFSTATE_SHM_DIR"},
           "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "FFSTATE_JOB_ID": job,
           "FFSTATE_BASE_PORT": str(random.SystemRandom().randint(20000, 60000)),  # not the global (seeded) generator
           "OMP_NUM_THREADS": "1", "TMPDIR": str(tmp),
           **(env or {})}
    return netns.torchrun_two_nodes(link, ["-m", "ffstate.demo.worker", "--out", str(out), "--steps", str(STEPS),
                                           *extra], env, timeout=500, restarts=restarts)


def test_node_lost_across_a_200mbit_link_resumes_bit_exact(tmp_path):
    ref = tmp_path / "ref"
    env = {**os.environ, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4", "-m",
                           "ffstate.demo.worker", "--out", str(ref), "--steps", str(STEPS), "--parallel", "ddp",
                           "--no-ffstate"], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    job = f"l{uuid.uuid4().hex[:6]}"
    with netns.shaped_link("200mbit") as link:
        results = torchrun_on_link(link, tmp_path / "out", tmp_path, job, "--parallel", "ddp", "--kill-node", "1",
                                   "--kill-node-step", "5")
    for r in results:
        assert r.returncode == 0, r.stdout[-4000:]
    rows = [json.loads(line) for line in (tmp_path / f"ffstate-{job}" / "events.jsonl").read_text().splitlines()]
    restored = [e for e in rows if e["event"] == "restored"]
    assert len(restored) == 4 and len({e["version"] for e in restored}) == 1
    assert all(e["steps_lost"] <= Config().max_lag for e in restored)  # within the replication lag
    lost = [e for e in restored if e["rank"] in (2, 3)]  # node 1's ranks: over the link, from node 0's daemon
    assert len(lost) == 2 and all(link.addresses[0] in e["source"] for e in lost)
    served = "".join(p.read_text(errors="replace") for p in (tmp_path / f"ffstate-{job}").glob("daemon-*.log"))
    assert "over the bulk socket" in served and "over gRPC" not in served  # the chunks crossed on the bulk socket
    print("restores:", [(e["rank"], e["version"], e["steps_lost"], e["source"]) for e in restored])
    token = (tmp_path / f"ffstate-{job}" / "token")
    assert token.stat().st_mode & 0o777 == 0o600 and len(token.read_text()) == 32  # agreed through the store
    assert not any(link.addresses[1] in e["source"] + json.dumps(e["parts_from"]) for e in restored)  # node 1 is new
    assert compare_runs(tmp_path / "out", ref, 4) == []
    finished = [e for e in rows if e["event"] == "finished"]
    assert len(finished) == 4 and all(e["razor_group"] == [0, 1, 2, 3] for e in finished)


def test_a_node_that_publishes_a_loopback_address_is_refused_at_entry(tmp_path):
    """FFSTATE_DAEMON_HOST=127.0.0.1 on a real 2-node job: each node's daemon would be reached at an address that
    only works on that node, and every replica would stay home. Every rank refuses at entry, saying what was
    published and what to set; no training step runs."""
    with netns.shaped_link("1gbit") as link:
        results = torchrun_on_link(link, tmp_path / "out", tmp_path, f"b{uuid.uuid4().hex[:6]}",
                                   env={"FFSTATE_DAEMON_HOST": "127.0.0.1"}, restarts=0)
    out = "".join(r.stdout for r in results)
    assert all(r.returncode != 0 for r in results)
    assert "a loopback address the other 1 node(s) cannot reach (Config.daemon_host (FFSTATE_DAEMON_HOST) says so)" in out
    assert "Set FFSTATE_DAEMON_HOST to this node's address" in out
    assert not list((tmp_path / "out").glob("final-rank*.pt"))
