"""What can be known at entry is refused at entry, with the path of the offending entry, before any daemon is
started or training begins (a real process group for the razor's declaration)."""

import contextlib
import os
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pytest
import torch

import ffstate
from ffstate import capture
from ffstate.bench._report import free_ports
from ffstate.daemon.running import alive

pytestmark = pytest.mark.timeout(120)


class Broken:
    def state_dict(self):
        raise RuntimeError("the iterator is gone")

    def load_state_dict(self, state):
        pass


@pytest.mark.parametrize("extra, error, message", [
    ({"hook": lambda: 0}, ffstate.CodecError, r"extra/hook: unsupported type"),
    ({"deep": {"loader": Broken()}}, ffstate.FFStateError, r"extra/deep/loader: Broken.state_dict\(\) failed"),
], ids=["unsupported leaf", "failing state_dict"])
def test_wrong_state_is_refused_at_entry_before_a_daemon_starts(extra, error, message):
    job = f"e{uuid.uuid4().hex[:6]}"
    cfg = ffstate.Config(job_id=job, token="t", base_port=free_ports(1))
    model = torch.nn.Linear(2, 2)
    with pytest.raises(error, match=message):
        with ffstate.replicate(model, torch.optim.SGD(model.parameters(), lr=0.1), extra=extra, config=cfg):
            pytest.fail("entered")
    assert not list((Path(tempfile.gettempdir()) / f"ffstate-{job}").glob("daemon-*"))  # none was started


class Chained:
    """Two optimizers behind one, as torchtitan's container keeps them: a state_dict ffstate could not restore."""

    def __init__(self, *opts):
        self.opts = opts
        self.param_groups = [g for o in opts for g in o.param_groups]

    def state_dict(self):
        return {f"opt{i}": o.state_dict() for i, o in enumerate(self.opts)}


def test_an_optimizer_whose_state_a_restore_could_not_load_is_refused_at_entry():
    cfg = ffstate.Config(job_id=f"e{uuid.uuid4().hex[:6]}", token="t", base_port=free_ports(1))
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    opt = Chained(torch.optim.SGD(model[0].parameters(), lr=0.1), torch.optim.SGD(model[1].parameters(), lr=0.1))
    with pytest.raises(ffstate.FFStateError, match=r"has \['opt0', 'opt1'\], not a torch.optim.Optimizer's"):
        with ffstate.replicate(model, opt, config=cfg):
            pytest.fail("entered")


def test_an_optimizer_over_tensors_that_are_not_the_model_s_is_refused_at_entry():
    """Its values would not come back at a restore (their optimizer state would): refused, not silently half-restored.
    An optimizer over some of the model's parameters is fine."""
    cfg = ffstate.Config(job_id=f"e{uuid.uuid4().hex[:6]}", token="t", base_port=free_ports(1))
    model, other = torch.nn.Linear(2, 2), torch.nn.Linear(3, 3)
    temperature = torch.nn.Parameter(torch.ones(1))
    for params in (other.parameters(), [*model.parameters(), temperature]):
        with pytest.raises(ffstate.FFStateError, match="not parameters of the model given to ffstate"):
            with ffstate.replicate(model, torch.optim.SGD(params, lr=0.1), config=cfg):
                pytest.fail("entered")
    capture.check_restorable(model, torch.optim.SGD([model.weight], lr=0.1))


def test_a_razor_declaration_that_names_nothing_and_a_state_dict_of_copies_are_refused_at_entry(tmp_path):
    env = {**os.environ, "FFSTATE_JOB_ID": f"r{uuid.uuid4().hex[:6]}", "FFSTATE_TOKEN": "t", "OMP_NUM_THREADS": "1",
           "FFSTATE_BASE_PORT": str(free_ports(1)), "TMPDIR": str(tmp_path)}
    script = Path(__file__).resolve().parents[1] / "procs" / "entry.py"
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(script)], capture_output=True, text=True, env=env, timeout=90)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("refused at entry: Config.razor_identical names ['optim/stat']") == 2, proc.stdout
    assert proc.stdout.count("entries that are not the model's parameters or buffers (e.g. ['weight']") == 2, proc.stdout
    assert "entered" not in proc.stdout


def test_a_daemon_left_by_a_job_that_ended_badly_blocks_no_one_and_status_finds_it(tmp_path):
    """Job A is SIGKILLed and leaves its daemon up (it waits out its idle time); job B, another token on the same
    machine and ports (the bulk socket's and the metrics' pinned), starts its daemon on the next port, its other
    ports moved as far, and trains. `ffstate status`, no flags and no token given, finds A's daemon from A's run
    folder, and piped, cuts no column."""
    port = free_ports(7)  # the daemon's 3, then the bulk socket's 2 and the metrics' 2, none overlapping
    bulk, metrics = port + 3, port + 5
    single = Path(__file__).resolve().parents[1] / "procs" / "single.py"
    base = {**os.environ, "OMP_NUM_THREADS": "1", "FFSTATE_BASE_PORT": str(port), "TMPDIR": str(tmp_path),
            "FFSTATE_BULK_PORT": str(bulk), "FFSTATE_METRICS_PORT": str(metrics)}
    base.pop("FFSTATE_TOKEN", None)
    a_job, b_job = f"stale-a-{uuid.uuid4().hex}", f"next-b-{uuid.uuid4().hex}"
    a_env = {**base, "FFSTATE_JOB_ID": a_job, "FFSTATE_TOKEN": "token-a"}
    b_env = {**base, "FFSTATE_JOB_ID": b_job, "FFSTATE_TOKEN": "token-b"}
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    a_pid = None
    try:
        a = subprocess.run([sys.executable, str(single), str(tmp_path / "a"), "5", "--kill-after", "2"],
                           capture_output=True, text=True, env=a_env, timeout=90)
        assert a.returncode == -9, a.stderr[-2000:]
        a_pid = int((tmp_path / f"ffstate-{a_job}" / "daemon-node0.pid").read_text())
        assert (tmp_path / f"ffstate-{a_job}" / "daemon-node0.address").read_text().endswith(f":{port}")
        b = subprocess.run([sys.executable, str(single), str(tmp_path / "b"), "3"], capture_output=True, text=True,
                           env=b_env, timeout=90)
        assert b.returncode == 0, b.stderr[-3000:]
        assert "held by a daemon of another job" in b.stderr, b.stderr[-3000:]
        assert (tmp_path / "b" / "final.pt").exists()
        logs = {j: (tmp_path / f"ffstate-{j}" / "daemon-node0.log").read_text() for j in (a_job, b_job)}
        assert f"bulk socket {bulk})" in logs[a_job] and f"bulk socket {bulk + 1})" in logs[b_job], logs[b_job][-3000:]
        b_daemon = int((tmp_path / f"ffstate-{b_job}" / "daemon-node0.starting").read_text())
        deadline = time.monotonic() + 30  # B's daemon exits with its job: gone, it is not listed as unreachable
        while alive(b_daemon) and time.monotonic() < deadline:
            time.sleep(0.1)

        status = subprocess.run([sys.executable, "-m", "ffstate.cli", "status"], capture_output=True, text=True,
                                env={**base, "COLUMNS": "80"}, timeout=60)
        assert status.returncode == 0, status.stdout + status.stderr
        assert a_job in status.stdout, status.stdout  # the whole id, not cut to the terminal's width
        assert f":{port}" in status.stdout and "local" in status.stdout
    finally:
        if a_pid:
            os.kill(a_pid, 9)


def test_a_port_another_program_holds_moves_the_daemon_on_and_a_restart_finds_it_there(tmp_path):
    """A program that is not a daemon holds the daemon port (a port found free, then taken): the daemon started there
    cannot listen and exits; the rank says so and starts it on the next port. Killed and started again once the port
    is free, the job goes back to its own daemon (the address its run folder records), not a second one."""
    port = free_ports(2)
    single = Path(__file__).resolve().parents[1] / "procs" / "single.py"
    job = f"moved-{uuid.uuid4().hex}"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "FFSTATE_BASE_PORT": str(port), "TMPDIR": str(tmp_path),
           "FFSTATE_JOB_ID": job, "FFSTATE_TOKEN": "token-moved"}
    run_dir = tmp_path / f"ffstate-{job}"
    daemon_pid = None
    try:
        with socket.socket() as squatter:
            squatter.bind(("0.0.0.0", port))
            squatter.listen()
            first = subprocess.run([sys.executable, str(single), str(tmp_path), "5", "--kill-after", "2"],
                                   capture_output=True, text=True, env=env, timeout=90)
        assert first.returncode == -9, first.stderr[-3000:]
        assert "exited without answering" in first.stderr and "trying the next port" in first.stderr, first.stderr[-3000:]
        moved = int((run_dir / "daemon-node0.address").read_text().rsplit(":", 1)[1])
        assert port < moved <= port + 2, moved  # the next port, or the one after where a test beside took that
        daemon_pid = int((run_dir / "daemon-node0.pid").read_text())
        again = subprocess.run([sys.executable, str(single), str(tmp_path), "5"], capture_output=True, text=True,
                               env=env, timeout=90)
        assert again.returncode == 0, again.stderr[-3000:]
        assert "start 2" in again.stdout, again.stdout  # restored from its daemon's slots
        assert "started the daemon" not in again.stderr, again.stderr[-3000:]
        assert int((run_dir / "daemon-node0.starting").read_text()) == daemon_pid  # the last daemon started
    finally:
        if daemon_pid:
            with contextlib.suppress(ProcessLookupError):
                os.kill(daemon_pid, 9)


def test_a_daemon_that_cannot_start_fails_the_rank_at_once_with_its_reason(tmp_path):
    """A daemon that exits at its start for a reason no other port would change (here: told to run on CPUs this
    machine does not have) fails the rank at once, saying why from the daemon's log (the rank climbed the ports
    without end before). A held port is tried past: test_a_port_another_program_holds_moves_the_daemon_on_..."""
    single = Path(__file__).resolve().parents[1] / "procs" / "single.py"
    cpu = 4000  # no machine here has it
    env = {**os.environ, "OMP_NUM_THREADS": "1", "FFSTATE_BASE_PORT": str(free_ports(4)), "TMPDIR": str(tmp_path),
           "FFSTATE_JOB_ID": f"nocpu-{uuid.uuid4().hex}", "FFSTATE_TOKEN": "token-nocpu", "FFSTATE_DAEMON_CPUS": str(cpu)}
    out = subprocess.run([sys.executable, str(single), str(tmp_path), "3"], capture_output=True, text=True, env=env,
                         timeout=90)
    assert out.returncode != 0, out.stderr[-3000:]
    assert out.stderr.count("exited without answering") == 1, out.stderr[-3000:]  # the error, no port tried past it
    assert "exited without answering on 1 port(s)" in out.stderr, out.stderr[-3000:]
    assert f"--cpus {cpu}: none of these CPUs can be used here" in out.stderr, out.stderr[-3000:]


def test_status_with_no_daemon_on_the_node_says_how_to_name_one(tmp_path):
    out = subprocess.run([sys.executable, "-m", "ffstate.cli", "status"], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "TMPDIR": str(tmp_path)})
    assert out.returncode != 0
    assert "--daemon HOST:PORT" in out.stderr


def test_a_newcomer_s_mistakes_in_the_loop_get_clear_errors_and_pauses_nest():
    """World 1 with its node's daemon: steps given as a numpy integer or a 0-d tensor are steps (the job's end once
    failed on them, and the daemon never heard of it); a float step, a first commit not past ``start_step``, and an
    endless pause are refused by name; an inner pause's end gives the outer one back."""
    import math
    import time

    import numpy as np

    job = f"n{uuid.uuid4().hex[:6]}"
    cfg = ffstate.Config(job_id=job, token="t", base_port=free_ports(1), replicas=0)
    model = torch.nn.Linear(2, 2)
    with ffstate.replicate(model, torch.optim.SGD(model.parameters(), lr=0.1), config=cfg) as ff:
        with pytest.raises(ffstate.FFStateError, match=r"ff.start_step is 0 \(nothing restored\).*range\(ff.start_step"):
            ff.commit(0)
        with pytest.raises(ffstate.FFStateError, match="the step must be an integer, got float 1.0"):
            ff.commit(1.0)
        ff.commit(np.int64(1))
        ff.commit(torch.tensor(2))
        for bad in (math.inf, math.nan, 0):
            with pytest.raises(ffstate.FFStateError, match="seconds must be a finite number > 0"):
                with ff.pause(bad):
                    pass
        with ff.pause(60):
            with ff.pause(1):
                pass
            assert ff._slots.worker().paused_until > time.time() + 50  # the outer pause holds
        assert ff._slots.worker().paused_until == 0
        first, second = ff.pause(60), ff.pause(120)  # ended out of order (a pause of another thread's, say)
        first.__enter__()
        second.__enter__()
        first.__exit__(None, None, None)
        assert ff._slots.worker().paused_until > time.time() + 110
        second.__exit__(None, None, None)
        assert ff._slots.worker().paused_until == 0
    assert ff._last == 2


def test_a_relaunch_that_finds_an_earlier_run_s_daemon_with_other_settings_says_which(caplog):
    """A run that ended by an exception leaves its node's daemon waiting for a restart; a relaunch under the same job
    id uses it, with the settings it was started with: the relaunch names each one that differs from its own."""
    import logging

    job, port = f"s{uuid.uuid4().hex[:6]}", free_ports(1)
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    first = ffstate.Config(job_id=job, token="t", base_port=port, replicas=0, hang_floor=5.0, hang_ceiling=10.0)
    with contextlib.suppress(RuntimeError):
        with ffstate.replicate(model, opt, config=first) as ff:
            ff.commit(1)
            raise RuntimeError("the loop failed")
    again = first.replace(hang_floor=60.0, hang_ceiling=600.0, hang_action="off")
    with caplog.at_level(logging.WARNING, logger="ffstate.launch"):
        with ffstate.replicate(model, opt, config=again) as ff:
            ff.commit(ff.start_step + 1)
    said = caplog.text
    assert "started by an earlier run of job" in said, said
    for flag in ("--hang-floor 5.0 (this run: the default)", "--hang-ceiling 10.0 (this run: the default)",
                 "--hang-action the default (this run: off)"):
        assert flag in said, said


def test_without_a_daemon_to_start_the_wait_for_one_is_said_at_once_and_ends_at_its_timeout(caplog):
    """``start_daemon`` off and nothing on the port: a warning at the first try says what the rank waits for and for
    how long (it waited ``connect_timeout``, a minute by default, in silence), then the error names the command."""
    port = free_ports(1)
    cfg = ffstate.Config(job_id=f"e{uuid.uuid4().hex[:6]}", token="t", base_port=port, start_daemon=False,
                         connect_timeout=8.0)
    model = torch.nn.Linear(2, 2)
    with caplog.at_level("WARNING", logger="ffstate"), pytest.raises(ffstate.ReplicaUnavailable,
                                                                      match=f"ffstate serve --port {port}"):
        with ffstate.replicate(model, torch.optim.SGD(model.parameters(), lr=0.1), config=cfg):
            pytest.fail("entered")
    end = time.time()
    said = [r for r in caplog.records if "no ffstate daemon answers" in r.getMessage()]
    assert len(said) == 1 and "waiting up to 8s (FFSTATE_CONNECT_TIMEOUT)" in said[0].getMessage(), caplog.text
    assert said[0].created < end - 4  # at the first try (the client's own retries: ~2 s), not at the timeout
