"""Survivors stay in their processes (ffstate.inprocess on NVIDIA's resiliency extension): a 4-rank DDP job as 2
simulated nodes, each with a warm spare, and a spare node of 3 processes; every process launched by hand (no
torchrun: its agent stops every worker when one dies). One job takes, in order: a rank SIGKILLed (a spare of its
node takes it, from the node's slots) and another right after that restore (two in a row); an idle spare of the
spare node killed; then a whole node, its processes with the engine's monitors of them and its daemon, as a
machine's loss takes them (found by the other monitors' heartbeats; it moves to the spare node, restored from the
replicas). It ends bit-identical to the same job without failures, every survivor in the process it started in.
The assignment's logic alone is checked by property tests in tests/unit/test_inprocess_assignment.py."""

import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from ffstate import Config
from ffstate.bench._report import free_ports
from ffstate.inprocess.store import listening
from ffstate.testing.faults import monitor_pid
from helpers import Lines, assert_bitwise_equal

pytest.importorskip("nvidia_resiliency_ext.inprocess", reason="the in-process mode's engine (nvidia-resiliency-ext) "
                    "is not installed")
import torch  # noqa: E402

pytestmark = pytest.mark.timeout(600)
STEPS = 36
# Processes, node by node: machine 0 (node 0: processes 0, 1 train, 2 spare), machine 1 (node 1: 3, 4, spare 5),
# machine 2 (a spare node: 6, 7, 8).
LAYOUT = dict(FFSTATE_SIMULATED_NODES="2", FFSTATE_SPARES="1", FFSTATE_SPARE_NODES="1")
PROCESSES = 9


def launch(out: Path, kills: list[str], after_restore: int = -1, layout: dict = LAYOUT, processes: int = PROCESSES,
           steps: int = STEPS, extra: tuple[str, ...] = ()) -> tuple[list[subprocess.Popen], dict]:
    """Every process of the job, as a launcher such as srun starts them."""
    port = free_ports(6)  # the stores' two (and two spare), then the daemons': one probe, so they cannot overlap
    env = {**os.environ, **layout, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(processes),
           "OMP_NUM_THREADS": "1", "FFSTATE_JOB_ID": f"ip{uuid.uuid4().hex[:8]}", "FFSTATE_TOKEN": uuid.uuid4().hex,
           "FFSTATE_BASE_PORT": str(port + 4), "TMPDIR": str(out), "TORCH_CPP_LOG_LEVEL": "ERROR"}
    args = [sys.executable, "-m", "ffstate.bench._downtime_worker", str(out), str(steps), "--mode", "inprocess",
            *[a for k in kills for a in ("--kill", k)], "--kill-after-restore", str(after_restore), *extra]
    procs = [subprocess.Popen(args, env={**env, "RANK": str(r)}, stdout=open(out / f"p{r}.log", "w"),
                              stderr=subprocess.STDOUT) for r in range(processes)]
    return procs, env


def progress(out: Path) -> list[dict]:
    path = out / "progress.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def wait_for_step(out: Path, step: int, procs: list[subprocess.Popen], timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not any(r.get("step", 0) >= step for r in progress(out)):
        assert time.monotonic() < deadline, f"no step {step} within {timeout}s" + evidence(out, procs, stuck=True)
        assert all(p.poll() in (None, 0, -9) for p in procs), f"{[p.poll() for p in procs]}" + evidence(out, procs)
        time.sleep(0.05)


def evidence(out: Path, procs: list[subprocess.Popen], stuck: bool = False) -> str:
    """What a failure's report needs when the run folder is gone (CI): the daemons' errors and warnings, and the end
    of the log of each process that ended other than killed. A job that is ``stuck`` (no progress, nothing failed)
    also reports where each live process and daemon is: their stacks (``kill -USR2``), the last lines of their logs
    and of the engine's, and the last progress rows."""
    lines = []
    for log in sorted(out.glob("ffstate-*/daemon-*.log")):
        lines += [f"{log.name}: {line}" for line in log.read_text(errors="replace").splitlines()
                  if " ERROR " in line or " WARNING " in line][-15:]
    for i, p in enumerate(procs):
        if p.poll() not in (None, 0, -9):
            lines += [f"p{i}.log: {line}" for line in (out / f"p{i}.log").read_text(errors="replace").splitlines()[-15:]]
    if stuck:
        lines += [f"progress: {r}" for r in progress(out)[-8:]] or ["progress: none"]
        daemons = [int(f.read_text()) for f in out.glob("ffstate-*/daemon-*.pid") if f.read_text().strip().isdigit()]
        for pid in [p.pid for p in procs if p.poll() is None] + daemons:
            try:
                os.kill(pid, signal.SIGUSR2)  # faulthandler: every thread's stack to the log
            except OSError:
                pass
        time.sleep(3)
        logs = [(f"p{i}.log", out / f"p{i}.log") for i, p in enumerate(procs) if p.poll() is None]
        logs += [(f.name, f) for kind in ("daemon", "engine") for f in sorted(out.glob(f"ffstate-*/{kind}-*.log"))]
        for name, path in logs:
            lines += [f"{name}: {line}" for line in _stacks_and_tail(path.read_text(errors="replace"))]
    return "\n" + "\n".join(lines)


def _stacks_and_tail(text: str, tail: int = 6) -> list[str]:
    """A log's last lines before faulthandler's dump, and each thread of the dump with its innermost frames (12 of
    the thread the signal interrupted, the main one as a rule; 3 of the others)."""
    rows = text.splitlines()
    start = next((i for i, r in enumerate(rows) if r.startswith(("Thread 0x", "Current thread 0x"))), len(rows))
    kept, left = rows[max(0, start - tail):start], 0
    for r in rows[start:]:
        if r.startswith(("Thread 0x", "Current thread 0x")):
            kept.append(r)
            left = 12 if r.startswith("Current") else 3
        elif r.startswith("  File ") and left:
            kept.append(r)
            left -= 1
    return kept


def finish(procs: list[subprocess.Popen], out: Path, env: dict, timeout: float = 400,
           host_goes: str = "") -> list[int]:
    """The processes' exit codes; then nothing of the job is left: its daemons and its stores' host are stopped.
    ``host_goes``: the stores' host's log line expected once every process has ended, the host then gone by itself
    (a launch right after may take its ports)."""
    deadline = time.monotonic() + timeout
    try:
        codes = [p.wait(max(1.0, deadline - time.monotonic())) for p in procs]
        if host_goes:
            stores_log, start = out / f"ffstate-{env['FFSTATE_JOB_ID']}" / "stores.log", time.monotonic()
            while host_goes not in stores_log.read_text() or listening("127.0.0.1", int(env["MASTER_PORT"])):
                assert time.monotonic() - start < 10, f"the stores' host did not go by itself: {stores_log.read_text()}"
                time.sleep(0.05)
        return codes
    except subprocess.TimeoutExpired:  # where each live process is, before they are killed
        raise AssertionError(f"the job did not end within {timeout:.0f} s" + evidence(out, procs, stuck=True)) from None
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        for pid_file in out.glob("ffstate-*/daemon-*.pid"):
            try:
                os.kill(int(pid_file.read_text()), signal.SIGKILL)
            except (OSError, ValueError):
                pass
        # this job's host alone (its ready file is in the job's run folder): another test's may have the same port
        run_dir = out / f"ffstate-{env['FFSTATE_JOB_ID']}"
        subprocess.run(["pkill", "-f", f"ffstate.inprocess.store --ready {run_dir}/stores-{env['MASTER_PORT']}.ready "],
                       check=False)


def finals(out: Path, world: int = 4) -> list[dict]:
    return [torch.load(out / f"final-rank{r}.pt", weights_only=False) for r in range(world)]


def _reference(out: Path) -> None:
    # The same job, no failure and no spare (spares change nothing of the training, and each costs a start)
    procs, env = launch(out, [], layout={**LAYOUT, "FFSTATE_SPARES": "0", "FFSTATE_SPARE_NODES": "0"}, processes=4)
    # every process left the engine: the stores' host goes at once (a relaunch right after finds the ports free)
    codes = finish(procs, out, env, host_goes="every process of the job left (4): the stores go")
    assert codes == [0] * 4, (out / "p0.log").read_text()[-3000:]


@pytest.fixture(scope="module")
def reference(once):
    return finals(once("inprocess-reference", _reference))


def test_a_rank_two_in_a_row_a_spare_and_a_node_lost_survivors_stay_and_end_bit_identical(tmp_path, reference):
    out = tmp_path
    # Process 1 (rank 1) dies after step 8; process 4 (rank 3) right after the group's restore.
    procs, env = launch(out, ["1:8"], after_restore=4)
    try:
        wait_for_step(out, 16, procs)
        procs[8].kill()  # an idle spare of the spare node
        wait_for_step(out, 26, procs)
        run_dir = out / f"ffstate-{env['FFSTATE_JOB_ID']}"
        daemon = int((run_dir / "daemon-node1.pid").read_text())
        held = {r["rank"]: r["process"] for r in progress(out) if "step" in r}  # the newest holder of each rank
        monitors = [monitor_pid(run_dir, p) for p in (held[2], held[3])]
        for p in (held[2], held[3]):
            procs[p].kill()  # node 1's ranks (a spare of it holds rank 3 by now), their engine monitors and its
        for pid in [*monitors, daemon]:  # daemon, as a machine's loss takes them: found by the heartbeats alone
            os.kill(pid, signal.SIGKILL)
    finally:
        codes = finish(procs, out, env)
    killed = {1, 4, 8, held[2], held[3]}
    assert [c for i, c in enumerate(codes) if i not in killed] == [0] * (PROCESSES - len(killed)), codes
    assert all(codes[i] == -9 for i in killed), codes
    for got, want in zip(finals(out), reference):
        assert_bitwise_equal(got, want)

    rows = progress(out)
    commits = [r for r in rows if "step" in r]
    events = [json.loads(line) for line in (out / f"ffstate-{env['FFSTATE_JOB_ID']}" / "events.jsonl").read_text()
              .splitlines()]
    restored = [e for e in events if e["event"] == "restored"]
    # Survivors stayed: process 0 (rank 0), started once, committed every step of the job through the four restarts
    # (a rank, another right after, a spare, a node). The worker notes a step after its commit; the engine's
    # interruption may land between the two (seen once: step 18 committed, not noted), and the job then resumes at
    # that very step: every step is a noted commit of process 0 or a restore's v*.
    mine = [r for r in commits if r["process"] == 0]
    assert [r["event"] for r in rows if r.get("process") == 0 and r.get("event") == "started"] == ["started"]
    # Every process that lived returned from the engine with its environment put back (FFSTATE_ATTEMPT stayed, and a
    # later error leaving replicate in that process counted as an engine rank's: watched, killed at the deadline).
    left = [r for r in rows if r.get("event") == "left"]
    assert sorted(r["process"] for r in left) == sorted(set(range(PROCESSES)) - killed), left
    assert all(r["attempt"] is None for r in left), left
    assert {r["step"] for r in mine} | {e["version"] for e in restored} >= set(range(1, STEPS + 1)), mine
    assert max(r["iteration"] for r in mine) >= 4, mine[-3:]
    # Who held what: a spare of each node took its rank; node 1 moved whole to the spare node.
    last = {r["rank"]: r["process"] for r in commits if r["step"] == STEPS}
    assert last[0] == 0 and last[1] == 2 and {last[2], last[3]} == {6, 7}, last
    assert sorted({e["attempt"] for e in restored}) == [1, 2, 3, 4], restored
    for attempt in (1, 2, 3, 4):
        these = [e for e in restored if e["attempt"] == attempt]
        assert len({e["version"] for e in these}) == 1, these  # one v* (I3)
        # 1, 2: a rank died after its commit; its node's slots hold it, and the others cannot pass the next step's
        # all-reduce without it: nothing lost. 3: an idle spare died; the engine stops every rank wherever it is, one
        # maybe between its optimizer's step and its commit: that step is redone. 4: a node lost, from its replicas,
        # killed from outside at any point of a step: its ranks' replicas are within the lag of their last commit,
        # and the survivors may have committed one step more (the node died between that step's all-reduce and its
        # commits), as after attempt 3.
        lost = {1: 0, 2: 0, 3: 1, 4: Config().max_lag + 1}[attempt]
        assert max(e["steps_lost"] for e in these) <= lost, these
    assert sorted(e["rank"] for e in restored if e["attempt"] == 4) == [0, 1, 2, 3]
    assert [k["kill"] for k in rows if "kill" in k] == [1, 4]  # the others were killed from outside


def test_a_survivor_stuck_in_c_after_the_abort_ends_itself_and_the_job_goes_on_bit_identical(tmp_path, reference):
    """Rank 1 dies after step 5; rank 2's training thread is then inside C (an hour's sleep), where the engine's
    restart is not delivered, as a survivor waiting on a send gloo had queued is. Without a bound every rank would
    wait in the engine's barrier until it returned (an hour here; gloo's timeout, 30 minutes, for the real thing).
    The unwind deadline (3 s here) ends that process with a report of where it was; the job restarts without it,
    node 1's spare taking its rank, and ends bit-identical to the same job without failures."""
    out = tmp_path
    layout = {**LAYOUT, "FFSTATE_SPARE_NODES": "0"}  # node 0: processes 0, 1, spare 2; node 1: 3, 4, spare 5
    procs, env = launch(out, ["1:5"], layout=layout, processes=6, extra=("--stuck", "3:5", "--unwind-grace", "3"))
    codes = finish(procs, out, env, timeout=300)
    assert codes == [0, -9, 0, -9, 0, 0], (codes, evidence(out, procs))
    for got, want in zip(finals(out), reference):
        assert_bitwise_equal(got, want)
    report = (out / "p3.log").read_text()
    assert "ffstate.inprocess: rank 2 (process 3, iteration 0): the training thread is still in its step" in report
    assert "in main" in report.split("the training thread is still in its step")[1]  # its stacks follow
    rows = progress(out)
    assert [r["stuck"] for r in rows if "stuck" in r] == [3]
    last = {r["rank"]: r["process"] for r in rows if r.get("step") == STEPS}
    assert last == {0: 0, 1: 2, 2: 5, 3: 4}, last  # each node's spare took the rank of its lost process
    events = [json.loads(line) for line in (out / f"ffstate-{env['FFSTATE_JOB_ID']}" / "events.jsonl").read_text()
              .splitlines()]
    restored = [e for e in events if e["event"] == "restored" and e["attempt"] == 1]
    assert sorted(e["rank"] for e in restored) == [0, 1, 2, 3] and {e["version"] for e in restored} == {5}, restored


def test_a_hung_rank_is_killed_alone_and_its_spare_takes_over_while_the_others_stay(tmp_path, reference):
    """Rank 2 (process 3) hangs in its own code after step 5 (an hour's sleep); the others wait for it in the loop's
    own all-reduce of its loss, a collective ffstate does not mark (DDP's are marked: the torchrun hang test waits
    there). The watchdog (a 3-s deadline floor here) reads the stuck ranks' stacks and kills the hung one alone: the
    others are inside torch.distributed, and node 0's, all waiting, are left to node 1's daemon. Before, every daemon
    killed every local rank of the job, and later every stuck rank with no collective marked: with one spare a node
    the job could not go on. Node 1's spare takes rank 2, the others stay in their processes,
    and the job ends bit-identical to the same job without failures."""
    out = tmp_path
    layout = {**LAYOUT, "FFSTATE_SPARE_NODES": "0", "FFSTATE_HANG_FLOOR": "3"}  # node 0: 0, 1, spare 2; node 1: 3, 4, 5
    procs, env = launch(out, [], layout=layout, processes=6, extra=("--stuck", "3:5", "--loss-all-reduce"))
    codes = finish(procs, out, env, timeout=300)
    assert codes == [0, 0, 0, -9, 0, 0], (codes, evidence(out, procs))
    for got, want in zip(finals(out), reference):
        assert_bitwise_equal(got, want)
    rows = progress(out)
    last = {r["rank"]: r["process"] for r in rows if r.get("step") == STEPS}
    assert last == {0: 0, 1: 1, 2: 5, 3: 4}, last
    logs = "".join(p.read_text() for p in out.glob("ffstate-*/daemon-*.log"))
    assert re.search(r"killed ranks of job \S+ \(2\)", logs) and "killed the local ranks" not in logs, logs[-3000:]
    waits = r"rank 3 of 4 \(pid \d+\) waits: File \S+torch/distributed/distributed_c10d.py"  # read from its stacks
    assert re.search(waits, logs), logs[-3000:]


def test_a_rank_lost_while_the_next_group_is_made_is_replaced_and_the_job_ends_bit_identical(tmp_path, reference):
    """Rank 1 dies after step 5; in the restart, rank 3 (process 4) dies with its engine's monitor process (as a
    machine's loss takes both) as it comes to make the new process group, before it has arrived. Only its siblings'
    heartbeats find it, after the engine's heartbeat timeout. Meanwhile the other ranks wait for it in Python
    (``ffstate/inprocess/group.py``), where the engine's next restart lands: without that they were inside gloo's
    setup, which waits in C++ for the group's timeout (30 minutes) and which no abort ends. And every process leaves
    the engine at the end (its heartbeat check wrote the lost rank into the termination barrier as bytes, which every
    exit failed to parse: ``engine.EngineStore``). Node 1's spare takes rank 3, and the job ends bit-identical."""
    out = tmp_path
    layout = {**LAYOUT, "FFSTATE_SPARE_NODES": "0"}  # node 0: processes 0, 1, spare 2; node 1: 3, 4, spare 5
    procs, env = launch(out, ["1:5"], layout=layout, processes=6, extra=("--kill-at-group", "4:1"))
    codes = finish(procs, out, env, timeout=300)
    assert codes == [0, -9, 0, 0, -9, 0], (codes, evidence(out, procs))
    for got, want in zip(finals(out), reference):
        assert_bitwise_equal(got, want)
    rows = progress(out)
    assert [r["kill"] for r in rows if "kill" in r] == [1, 4]
    assert not any(r.get("process") == 4 and r.get("iteration") == 1 for r in rows)  # it never made the group
    last = {r["rank"]: r["process"] for r in rows if r.get("step") == STEPS}
    assert last == {0: 0, 1: 2, 2: 3, 3: 5}, last
    events = [json.loads(line) for line in (out / f"ffstate-{env['FFSTATE_JOB_ID']}" / "events.jsonl").read_text()
              .splitlines()]
    restored = [e for e in events if e["event"] == "restored"]
    assert {e["attempt"] for e in restored} == {2}, restored  # iteration 1 never got its group
    assert sorted(e["rank"] for e in restored) == [0, 1, 2, 3] and {e["version"] for e in restored} == {5}, restored


def test_no_spare_left_the_node_leaves_and_the_others_go_on_at_the_smaller_world_size(tmp_path):
    """2 nodes of 2 ranks, no spare, Config.min_nodes 1: rank 1 dies; node 0 has no spare and there is no spare node,
    so node 0 leaves. Node 1's processes go on as ranks 0 and 1 of a 2-rank job, in their processes, restored by the
    resize from the copies (node 0's slots, the replicas) to exactly the state of v*; node 0's survivor waits, idle,
    to the end. (Simulated nodes take their daemons by node number: the new node 0 uses the daemon of the node 0
    that left, alive here; on real nodes each uses its machine's own.)"""
    out, steps = tmp_path, 14
    layout = {**LAYOUT, "FFSTATE_SPARES": "0", "FFSTATE_SPARE_NODES": "0", "FFSTATE_MIN_NODES": "1"}
    procs, env = launch(out, ["1:6"], layout=layout, processes=4, steps=steps, extra=("--dump-steps", "5,6"))
    codes = finish(procs, out, env)
    assert codes == [0, -9, 0, 0], (codes, (out / "p2.log").read_text()[-3000:])
    events = [json.loads(line) for line in (out / f"ffstate-{env['FFSTATE_JOB_ID']}" / "events.jsonl").read_text()
              .splitlines()]
    shrunk = [e for e in events if e["event"] == "restored" and e["attempt"] == 1]
    assert sorted(e["rank"] for e in shrunk) == [0, 1] and {e.get("from_world") for e in shrunk} == {4}, shrunk
    v = {e["version"] for e in shrunk}
    assert len(v) == 1 and 6 - Config().max_lag <= min(v), shrunk  # one v*, within the lag (replicas of ranks 2, 3)
    at_v = torch.load(out / f"step{v.pop()}-rank0.pt", weights_only=False)  # DDP + AdamW: every old rank alike
    for r in (0, 1):
        assert_bitwise_equal(torch.load(out / f"restored-it1-rank{r}.pt", weights_only=False), at_v)
    rows = progress(out)
    last = {r["rank"]: r["process"] for r in rows if r.get("step") == steps}
    assert last == {0: 2, 1: 3}, last  # node 1's processes, renumbered, finished the job in the processes they began in
    assert not any(r.get("process") == 0 and r.get("iteration", 0) >= 1 and "step" in r for r in rows)
    assert len(finals(out, 2)) == 2 and not (out / "final-rank2.pt").exists()


def test_a_function_that_raises_at_every_entry_stops_the_job_saying_what_it_raised(tmp_path):
    """Rank 0 raises a ValueError at step 5 at every entry, with no process lost: the extension restarted such a job
    forever (a few entries a second). Now the third restart in a row for an exception alone stops every process,
    each with TrainingRaised naming the exception, and no spare is used."""
    out = tmp_path
    layout = {**LAYOUT, "FFSTATE_SPARES": "1", "FFSTATE_SPARE_NODES": "0"}  # 2 nodes of a rank and a spare
    procs, env = launch(out, [], layout=layout, processes=4, steps=12, extra=("--raise-at", "5"))
    codes = finish(procs, out, env, timeout=300, host_goes="every process of the job left (4): the stores go")
    assert all(c not in (0, -9) for c in codes), codes
    for r in range(4):
        log = (out / f"p{r}.log").read_text(errors="replace")
        said = [line for line in log.splitlines() if "TrainingRaised: the training function raised at 3" in line]
        assert said and "(the last: rank 0: ValueError: injected at step " in said[-1], log[-3000:]  # the cause
    entries = sorted({(r["process"], r["iteration"]) for r in progress(out) if r.get("event") == "group"})
    assert entries == [(p, i) for p in (0, 2) for i in range(3)], entries  # the ranks' processes, 3 entries each


def test_the_stores_host_stays_while_any_process_of_the_job_beats_wherever_it_runs():
    """The stores' host counts the job's processes by their heartbeats through the store, not by pid files on its
    own node: a process elsewhere (here one with no file in any run folder) keeps it past its idle exit, and once
    the last heartbeat stops the host exits on its own."""
    port, idle_exit = free_ports(2), 3  # the host's two stores: port and port + 1
    # The process that beats is started first and finds nothing listening for a while, as a process on another node
    # may: `heartbeat` looks for the host every 50 ms, so its first beat comes within the host's idle exit however
    # long it waited (torch's own connect retries back off to seconds: 7.6 s after 10 s of refusals, measured, and a
    # beater connected after the host had gone, once in a suite).
    # It ends without the interpreter's finalization, as the jobs do (ffstate/startup.py): there the heartbeat's
    # thread, inside the store's C++, aborted the process once (SIGABRT, in a fresh clone's suite).
    beater = subprocess.Popen([sys.executable, "-c", "import sys, time\nimport torch.distributed\n"
                               "from ffstate.inprocess.store import heartbeat\nfrom ffstate.startup import exit_now\n"
                               "print('ready', flush=True)\n"
                               f"heartbeat('127.0.0.1', {port}, every=0.5)\ntime.sleep(10)\nexit_now()"],
                              stdout=subprocess.PIPE, text=True)
    host = None
    try:
        assert Lines(beater).next() == "ready"
        time.sleep(3)  # refused all that while
        host = subprocess.Popen([sys.executable, "-m", "ffstate.inprocess.store", "127.0.0.1", str(port),
                                 str(idle_exit)])
        time.sleep(3 * idle_exit)  # from the host's start (it listens within ~2 s of it)
        assert host.poll() is None, "the host left while a process of the job was beating"
        assert beater.wait(60) == 0
        assert host.wait(60) == 0  # no heartbeat for its idle exit: it exits, cleanly
    finally:
        for p in (host, beater):
            if p is not None and p.poll() is None:
                p.kill()
