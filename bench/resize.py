"""The resize and drain parts of the recovery benchmark (``ffstate bench recovery --resize --drain``).

- **Resize from the replicas against ``dcp.load`` at the new size.** A 4-rank DDP job (2 simulated nodes, TinyGPT
  + AdamW) trains a few steps, saving each with ``dcp.save`` too; node 1 is lost (its ranks and its daemon
  SIGKILLed). Relaunched at 2 ranks, each rank times, interleaved over repeats: ffstate resuming from the old
  world's copies (node 0's slots and the replicas it held of node 1's ranks), resharded (the whole entry into
  ``ffstate.replicate``, and of it the fetch and load), against ``dcp.load`` of the same version from disk into
  the same model and optimizer, resharded by DCP (page cache warm: DCP's best case). Medians per rank, the
  slowest rank's reported (a step waits for it). Also: the steps lost and the kill to the first step at the new
  size (a new torchrun launch: process start, imports, rendezvous, restore, one step).
- **A drain's downtime** (needs root: two network namespaces). A 2-node ``torchrun --nnodes 1:2`` job (2 ranks a
  node); ``ffstate drain`` on node 1: from the request to node 1's ranks stopped at a step with every holder
  current (ffstate's part), to the agent signalled, to the first step of the job re-formed on node 0 (torchrun's
  re-rendezvous, the workers' start, the resize, a step); and the steps lost.
"""

from __future__ import annotations

import json
import os
import random
import secrets
import subprocess
import sys
import time
import uuid
from pathlib import Path

from ffstate.bench._report import free_ports, kept_on_failure

WORKER = ["-m", "ffstate.bench._resize_worker"]


def _torchrun(world: int, args: list[str], env: dict, log: Path, timeout: float = 600) -> subprocess.CompletedProcess:
    """A torchrun launch of the worker, its output written whole to ``log`` too."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world),
           "--max-restarts", "0", *WORKER, *args]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    log.write_text(done.stdout + done.stderr)
    return done


def _kill_daemons(run_dir: Path) -> None:
    for pid_file in run_dir.glob("daemon-*.pid"):
        try:
            os.kill(int(pid_file.read_text()), 9)
        except (ProcessLookupError, ValueError, OSError):
            pass


def measure_resize(size: str, repeats: int, world: int = 4, new_world: int = 2, steps: int = 5) -> dict:
    job = f"bench-resize-{uuid.uuid4().hex[:6]}"
    with kept_on_failure("recovery", "resize") as work:
        env = {**os.environ, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "FFSTATE_JOB_ID": job,
               "FFSTATE_TOKEN": secrets.token_hex(8), "FFSTATE_BASE_PORT": str(free_ports(2)), "OMP_NUM_THREADS": "1",
               "TMPDIR": str(work)}
        try:
            common = ["--out", str(work), "--size", size]
            trained = _torchrun(world, [*common, "--phase", "train", "--steps", str(steps)],
                                {**env, "FFSTATE_SIMULATED_NODES": "2"}, work / "train.log")
            killed = json.loads((work / "killed.json").read_text()) if (work / "killed.json").exists() else None
            if killed is None:
                raise RuntimeError(f"the {world}-rank job did not get to the node's loss (its log: {work}/train.log): "
                                   f"{trained.stderr[-3000:]}")
            resized = _torchrun(new_world, [*common, "--phase", "resize", "--repeats", str(repeats)],
                                {**env, "FFSTATE_SIMULATED_NODES": "1"}, work / "resize.log")
            if resized.returncode != 0:
                raise RuntimeError(f"the {new_world}-rank job failed (its log: {work}/resize.log; resize.json "
                                   f"{'written' if (work / 'resize.json').exists() else 'not written'}): "
                                   f"{resized.stderr[-3000:]}")
            got = json.loads((work / "resize.json").read_text())
        finally:
            _kill_daemons(work / f"ffstate-{job}")
    ranks = got["ranks"]
    slowest = {k: max(r[k] for r in ranks) for k in ("ffstate", "ffstate restore", "dcp.load")}
    return {"size": size, "world": world, "new_world": new_world, "state_bytes_per_old_rank": ranks[0]["nbytes"],
            "version": ranks[0]["version"], "killed_after": killed["step"], "steps_lost": ranks[0]["steps_lost"],
            "ffstate_entry_seconds": slowest["ffstate"], "ffstate_restore_seconds": slowest["ffstate restore"],
            "dcp_load_seconds": slowest["dcp.load"], "kill_to_first_step_seconds": got["first_step"] - killed["time"]}


def measure_drain(size: str, steps: int = 400) -> dict:
    """A drain under a 2-node elastic torchrun (network namespaces); see the module docstring."""
    from ffstate.bench import netns

    why = netns.unavailable()
    if why:
        return {"skipped": why}
    with kept_on_failure("recovery", "drain") as work:
        job, port = f"bench-drain-{uuid.uuid4().hex[:6]}", random.randint(20000, 60000)
        env = {**{k: v for k, v in os.environ.items() if not k.startswith("FFSTATE_")},
               "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "FFSTATE_JOB_ID": job, "OMP_NUM_THREADS": "1",
               "FFSTATE_BASE_PORT": str(random.randint(20000, 60000))}
        agents = []
        try:
            with netns.shaped_link("1gbit") as link:
                for node in (0, 1):
                    (work / f"node{node}").mkdir()
                    args = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1:2", "--nproc-per-node", "2",
                            "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{link.addresses[0]}:{port}", "--rdzv-id", job,
                            "--rdzv-conf", f"is_host={int(node == 0)},last_call_timeout=2,keep_alive_interval=1,"
                            "keep_alive_max_attempt=3", "--local-addr", link.addresses[node], "--max-restarts", "3",
                            *WORKER, "--out", str(work), "--size", size, "--phase", "elastic", "--steps", str(steps),
                            "--step-seconds", "0.1"]
                    log = open(work / f"agent{node}.log", "w")
                    agents.append(subprocess.Popen(link.cmd(node, args), stdout=log, stderr=subprocess.STDOUT, env={
                                                       **env, "GLOO_SOCKET_IFNAME": link.devices[node],
                                                       "TMPDIR": str(work / f"node{node}")}))
                progress = work / "progress.jsonl"

                def rows() -> list[dict]:
                    return [json.loads(x) for x in progress.read_text().splitlines()] if progress.exists() else []

                deadline = time.monotonic() + 300
                while not any(r["world"] == 4 and r["step"] >= 10 for r in rows()) and time.monotonic() < deadline:
                    time.sleep(0.1)
                run_dir = work / "node1" / f"ffstate-{job}"
                address = (run_dir / "daemon-node1.address").read_text()
                token = (run_dir / "token").read_text().strip()
                try:
                    report = _drain_in_namespace(link, 1, address, token, job)
                except RuntimeError as e:
                    raise RuntimeError(f"{e}\nprogress: {rows()[-3:]}\n" + "".join(
                        (work / f"agent{n}.log").read_text()[-3000:] for n in (0, 1))) from None
                requested = report.requested_unix  # the daemon's clock: the request itself, not this tool's start
                while not any(r["world"] == 2 and r["time"] > requested for r in rows()) and time.monotonic() < deadline:
                    time.sleep(0.05)
                first = next(r for r in rows() if r["world"] == 2 and r["time"] > requested)
                last_at_4 = max(r["step"] for r in rows() if r["world"] == 4)
        finally:
            for a in agents:
                if a.poll() is None:
                    a.kill()
    return {"size": size, "stopped_at": report.version, "last_step_at_4": last_at_4,
            "first_step_after": first["step"], "steps_lost": last_at_4 - (first["step"] - 1),
            "drained_seconds": report.drained_unix - report.requested_unix,
            "signalled_seconds": report.left_unix - report.requested_unix,
            "downtime_seconds": first["time"] - requested}


def _drain_in_namespace(link, node: int, *args: str):
    """``ffstate.elastic.drain(address, token, job)`` in a child process inside node ``node``'s network namespace (its
    daemon's address is only reachable there); its report."""
    code = ("import json, sys; from ffstate.elastic.drain import drain; import dataclasses; "
            "r = drain(*sys.argv[1:4]); print(json.dumps(dataclasses.asdict(r), default=str))")
    out = subprocess.run(link.cmd(node, [sys.executable, "-c", code, *args]), capture_output=True, text=True,
                         timeout=300, env=os.environ)
    if out.returncode != 0:
        raise RuntimeError(f"ffstate drain failed: {out.stderr[-2000:]}")
    from types import SimpleNamespace

    return SimpleNamespace(**json.loads(out.stdout.strip().splitlines()[-1]))


def report_rows(resize: dict | None, drain: dict | None) -> list[str]:
    """The lines the recovery report prints for these parts."""
    from ffstate.bench._report import table

    out = []
    if resize:
        r = resize
        out += ["", f"a node lost, the job resumed at {r['new_world']} ranks from copies made at {r['world']}: ffstate "
                "(from node 0's slots and its replicas of node 1's ranks, resharded) against dcp.load of the same "
                "version from disk at the new size (page cache warm); the slowest rank's median",
                table([[r["size"], f"{r['state_bytes_per_old_rank'] / 1e6:.1f}", str(r["version"]),
                        str(r["steps_lost"]), f"{r['ffstate_restore_seconds'] * 1e3:.0f}",
                        f"{r['ffstate_entry_seconds'] * 1e3:.0f}", f"{r['dcp_load_seconds'] * 1e3:.0f}",
                        f"{r['ffstate_restore_seconds'] / max(r['dcp_load_seconds'], 1e-9):.2f}",
                        f"{r['kill_to_first_step_seconds']:.1f}"]],
                      ["state", "MB read a rank", "v*", "steps lost", "ffstate restore ms", "ffstate entry ms",
                       "dcp.load ms", "restore / dcp.load", "kill -> first step s"])]
    if drain and "skipped" not in drain:
        d = drain
        out += ["", "a drain (ffstate drain) under torchrun --nnodes 1:2, two network namespaces",
                table([[d["size"], str(d["stopped_at"]), str(d["steps_lost"]), f"{d['drained_seconds']:.2f}",
                        f"{d['signalled_seconds']:.2f}", f"{d['downtime_seconds']:.1f}"]],
                      ["state", "stopped at", "steps lost", "request -> drained s", "-> agent signalled s",
                       "-> first step at 2 ranks s"])]
    elif drain:
        out += ["", f"the drain was not measured: {drain['skipped']}"]
    return out
