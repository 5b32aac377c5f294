"""Elastic torchrun across two real nodes: network namespaces joined by a veth link, one `torchrun --nnodes 1:2`
agent per node (c10d rendezvous, each node its own temporary folder as on its own machine; nothing ffstate-specific
set), DDP with a ZeRO-sharded AdamW under ffstate.replicate (tests/procs/elastic.py).

1. Node 1 is lost for good after a few steps (its agent, workers and daemon SIGKILLed): torchrun re-forms the job
   on node 0 at 2 ranks, which resume from node 0's slots and the replicas it held of node 1's ranks.
2. Node 1 comes back (a new agent): torchrun grows the job to 4 ranks, resuming from node 0's copies.
3. `ffstate drain` on node 1: its ranks stop at a step, the daemon has it on every holder and sends node 1's agent
   SIGTERM; the job re-forms on node 0 without losing a step. `ffstate status` there shows the resize.

Every resize is checked, every tensor's bits, against DCP's own load of the job's consolidated copy of v* at the
new world size.
"""

import json
import os
import random
import re
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from ffstate.bench import netns

REASON = netns.unavailable()
pytestmark = [pytest.mark.timeout(600), pytest.mark.skipif(bool(REASON), reason=f"no network namespaces here: {REASON}")]
ROOT = Path(__file__).resolve().parents[2]
# The job ends when the test says (a stop file) or at STEPS: the test's checks, each waiting on agents that import
# torch, must all come before the end, and a loaded machine slows those far more than the job's sleeping steps.
STEPS = 400


class ElasticJob:
    """Two nodes' torchrun agents for one elastic job; each node has its own temporary folder (its run folder)."""

    def __init__(self, link: netns.Link, tmp: Path):
        self.link, self.tmp, self.out = link, tmp, tmp / "out"
        self.job, self.port = f"e{uuid.uuid4().hex[:6]}", random.SystemRandom().randint(20000, 60000)
        self.env = {**{k: v for k, v in os.environ.items() if not k.startswith("FFSTATE_") or k == "FFSTATE_SHM_DIR"},
                    "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "OMP_NUM_THREADS": "1", "FFSTATE_JOB_ID": self.job,
                    "FFSTATE_BASE_PORT": str(random.SystemRandom().randint(20000, 60000))}
        self.agents: list[subprocess.Popen] = []

    def node_tmp(self, node: int) -> Path:
        path = self.tmp / f"node{node}"
        path.mkdir(exist_ok=True)
        return path

    def run_dir(self, node: int) -> Path:
        return self.node_tmp(node) / f"ffstate-{self.job}"

    def agent(self, node: int) -> subprocess.Popen:
        """One node's `torchrun --nnodes 1:2` (the rendezvous hosted by node 0's agent). The rendezvous settings a
        user of elastic jobs sets for fast re-forms: a last call of 2 s (default 30: the wait for more nodes once
        the minimum is there) and a node found gone after 3 missed heartbeats a second apart (default 5 s apart)."""
        args = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1:2", "--nproc-per-node", "2",
                "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{self.link.addresses[0]}:{self.port}",
                "--rdzv-id", self.job, "--rdzv-conf",
                f"is_host={int(node == 0)},last_call_timeout=2,keep_alive_interval=1,keep_alive_max_attempt=3",
                "--local-addr", self.link.addresses[node], "--max-restarts", "5", str(ROOT / "tests/procs/elastic.py"),
                "--out", str(self.out), "--parallel", "ddp-zero", "--steps", str(STEPS), "--check", "--step-sleep", "0.15",
                "--stop-file", str(self.tmp / "stop")]
        env = {**self.env, "GLOO_SOCKET_IFNAME": self.link.devices[node], "TMPDIR": str(self.node_tmp(node))}
        log = open(self.tmp / f"agent{node}-{len(self.agents)}.log", "w")
        proc = subprocess.Popen(self.link.cmd(node, args), env=env, stdout=log, stderr=subprocess.STDOUT)
        self.agents.append(proc)
        return proc

    def progress(self) -> dict:
        try:
            lines = (self.out / "progress.jsonl").read_text().splitlines()
        except OSError:
            return {}
        return json.loads(lines[-1]) if lines else {}

    def wait_for(self, what: str, cond, timeout: float = 180) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            got = self.progress()
            if got and cond(got):
                return got
            for a in self.agents[:1]:
                assert a.poll() is None, f"node 0's agent ended while waiting for {what}: {self.logs()}"
            time.sleep(0.1)
        raise AssertionError(f"no {what} within {timeout:.0f}s (progress {self.progress()}): {self.logs()}")

    def logs(self) -> str:
        return "".join(p.read_text()[-2500:] for p in sorted(self.tmp.glob("agent*.log")))

    def cli(self, node: int, *args: str) -> subprocess.CompletedProcess:
        token = (self.run_dir(node) / "token").read_text().strip()
        return subprocess.run(self.link.cmd(node, [sys.executable, "-m", "ffstate.cli", *args]), capture_output=True,
                              text=True, timeout=120, env={**self.env, "FFSTATE_TOKEN": token,
                                                            "TMPDIR": str(self.node_tmp(node))})

    def checks(self, v: int, world: int) -> list[dict]:
        got = [json.loads(p.read_text()) for p in sorted(self.out.glob(f"check-v{v}-w{world}-rank*.json"))]
        assert len(got) == world, (v, world, got)
        return got

    def events(self, kind: str) -> list[dict]:
        rows = []
        for node in (0, 1):
            path = self.run_dir(node) / "events.jsonl"
            if path.exists():
                rows += [e for e in map(json.loads, path.read_text().splitlines()) if e["event"] == kind]
        return rows


def bit_exact(job: ElasticJob, old: int, world: int, lost_at_most: int) -> int:
    """The newest resize from ``old`` to ``world`` ranks: every rank got DCP's load of v*, bit for bit."""
    rows = [e for e in job.events("restored") if e.get("from_world") == old and e.get("world") == world]
    v = rows[-1]["version"]
    for g in job.checks(v, world):
        assert g["mismatches"] == [] and g["tensors"] > 0 and g["lost"] <= lost_at_most, g
        assert g["position"] == g["samples"] and g["epoch"] == g["epochs"], g  # past an epoch's end too
    return v


def test_a_node_lost_rejoined_and_drained_under_torchrun_nnodes_1_2(tmp_path):
    with netns.shaped_link("1gbit") as link:
        job = ElasticJob(link, tmp_path)
        try:
            job.agent(0), job.agent(1)
            job.wait_for("4 ranks at step 5", lambda p: p["world"] == 4 and p["step"] >= 5)
            for pid in subprocess.run(["ip", "netns", "pids", link.namespaces[1]], capture_output=True,
                                      text=True).stdout.split():  # node 1 lost for good
                os.kill(int(pid), 9)
            job.wait_for("the job re-formed at 2 ranks", lambda p: p["world"] == 2)
            from ffstate import Config

            lost_node = bit_exact(job, 4, 2, Config().max_lag)
            at = job.wait_for("2 ranks training on", lambda p: p["world"] == 2 and p["step"] >= lost_node + 5)
            job.agent(1)  # node 1 is back
            job.wait_for("the job grown back to 4 ranks", lambda p: p["world"] == 4 and p["step"] > at["step"])
            grown = bit_exact(job, 2, 4, 1)
            job.wait_for("4 ranks training on", lambda p: p["world"] == 4 and p["step"] >= grown + 5)
            drained = job.cli(1, "drain", "--daemon", (job.run_dir(1) / "daemon-node1.address").read_text())
            assert drained.returncode == 0, drained.stdout + drained.stderr
            assert "left at step" in drained.stdout and "sent SIGTERM" in drained.stdout, drained.stdout
            step = int(re.search(r"left at step (\d+)", drained.stdout).group(1))
            job.wait_for("the job re-formed at 2 ranks after the drain", lambda p: p["world"] == 2 and p["step"] > step)
            status = job.cli(0, "status", "--daemon", (job.run_dir(0) / "daemon-node0.address").read_text())
            (tmp_path / "stop").touch()  # every check is done: the job may end
            assert job.agents[0].wait(timeout=300) == 0, job.logs()
        finally:
            for a in job.agents:
                if a.poll() is None:
                    a.kill()
    after_drain = bit_exact(job, 4, 2, 0)
    assert after_drain == step  # 0 steps lost: every rank resumed at the step node 1's ranks stopped at
    stopped = job.events("drain-stopped")
    assert {e["rank"] for e in stopped} <= {2, 3} and {e["step"] for e in stopped} == {step}, stopped
    assert "4 -> 2 ranks" in status.stdout, status.stdout
    downtime = [e for e in job.events("restored") if e.get("from_world") == 4][-1]
    print(f"node lost -> v* {lost_node}; grown at v* {grown}; drained at step {step}: resumed at v* {after_drain}, "
          f"restore {downtime['restore_seconds']:.3f}s")
