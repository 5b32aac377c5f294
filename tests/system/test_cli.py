"""The command line as a newcomer meets it: ``ffstate demo`` interrupted by a Ctrl-C (SIGINT to its terminal's
process group: the demo and its torchrun agent; the workers and daemons run in sessions of their own) says so in
one line, ends as a program killed by SIGINT (a shell script running it stops too), and leaves no daemon running."""

import contextlib
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(240)


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[-1].split()[0] not in "ZX"
    except OSError:
        return False


def test_ctrl_c_in_the_demo_stops_its_daemons_and_says_interrupted(tmp_path):
    out = tmp_path / "demo"
    tmp = tmp_path / "tmp"  # the job's run folder (its daemons' pid files) goes here
    tmp.mkdir()
    base = random.SystemRandom().randrange(20000, 30000, 2)  # not the global generator, which tests seed
    # Ctrl-C's disposition as a terminal's foreground command has it, whatever this runner's: a suite started in the
    # background by a script (`make test &`, nohup) ignores SIGINT, and the demo would inherit that.
    proc = subprocess.Popen([sys.executable, "-m", "ffstate.cli", "demo", "--out", str(out), "--base-port", str(base)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            env={**os.environ, "TMPDIR": str(tmp)},
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    pids: list[int] = []
    try:
        deadline = time.monotonic() + 120
        failures = out / "with-failures" / "failures.jsonl"
        while not (failures.exists() and failures.read_text()) and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)  # until the first failure (a rank killed after step 8): both daemons serve by now
        pids = [int(p.read_text()) for p in tmp.glob("ffstate-*/daemon-*.pid")]
        assert proc.poll() is None and len(pids) == 2, (pids, proc.poll())
        os.killpg(proc.pid, signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=90)
        assert proc.returncode == -signal.SIGINT, stderr[-3000:]
        assert stderr.strip().splitlines()[-1] == "ffstate demo: interrupted", stderr[-3000:]
        assert "Traceback" not in stderr, stderr[-3000:]
        deadline = time.monotonic() + 30
        while any(_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not any(_alive(p) for p in pids), pids
        logs = sorted((out / "with-failures").glob("daemon-*.log"))  # kept with the demo's logs, complete
        assert len(logs) == 2 and all("stopped" in p.read_text().splitlines()[-1] for p in logs), \
            [p.read_text()[-500:] for p in logs]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        for pid in pids or [int(p.read_text()) for p in tmp.glob("ffstate-*/daemon-*.pid")]:
            with contextlib.suppress(OSError):  # gone meanwhile
                if _alive(pid) and b"serve" in Path(f"/proc/{pid}/cmdline").read_bytes():
                    os.kill(pid, signal.SIGKILL)


def test_only_a_live_daemon_of_the_job_is_signalled_never_what_a_stale_pid_file_names(daemons, tmp_path, monkeypatch):
    """A SIGKILLed daemon leaves its pid file; by the time the demo or the chaos benchmark cleans up, that pid may be
    another process's. ``daemon_pidfds`` takes only a process whose command line is that node's ``ffstate serve``."""
    import tempfile

    from ffstate.daemon.running import daemon_pidfds, ended

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    run_dir = tmp_path / "ffstate-jobx"
    run_dir.mkdir()
    d = daemons.start()
    other = subprocess.Popen(["sleep", "60"])  # what a stale pid file names
    try:
        for node, pid in ((d.node_id, d.proc.pid), ("node9", other.pid)):
            (run_dir / f"daemon-{node}.pid").write_text(f"{pid}\n")
            (run_dir / f"daemon-{node}.address").write_text(d.address)
        fds = daemon_pidfds("jobx")
        assert list(fds) == [d.proc.pid]
        signal.pidfd_send_signal(fds[d.proc.pid], signal.SIGTERM)
        assert d.proc.wait(30) == 0 and ended(fds[d.proc.pid])
        os.close(fds[d.proc.pid])
        assert other.poll() is None
    finally:
        other.kill()
        other.wait()


def test_status_of_a_daemon_holding_nothing_says_so_and_a_daemon_named_without_a_port_is_refused(daemons, monkeypatch,
                                                                                                 capsys):
    from daemons import TOKEN
    from ffstate import cli

    d = daemons.start()
    monkeypatch.setenv("FFSTATE_TOKEN", TOKEN)
    monkeypatch.setenv("COLUMNS", "250")
    assert cli.main(["status", "--daemon", d.address]) == 0
    out = capsys.readouterr().out
    assert d.address in out and "holds nothing" in out, out
    for bad in ("foo", "foo:", "foo:http", ":7700", "foo:70000"):
        with pytest.raises(SystemExit, match=f"--daemon '{bad}': expected HOST:PORT"):
            cli.main(["status", "--daemon", bad])
