"""The persistent tier when the filesystem fails, against a real daemon and a real worker process: a full disk, a
read-only one, a directory removed under it. Each failed flush is logged and counted, the daemon keeps serving,
every commit of the worker goes through, and flushing resumes once the directory is usable again; what is
complete reads back bit for bit. The disks are small tmpfs mounts (root only)."""

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from daemons import TOKEN, wait_until
from ffstate import persist
from helpers import assert_bitwise_equal

pytestmark = pytest.mark.timeout(300)
WRITER = Path(__file__).resolve().parents[1] / "procs" / "writer.py"
# The flushing process at the daemon's priority, not idle: the test suite keeps this machine's cores busy, and an
# idle one would flush too little here (its default priority is checked on its own below)
BUSY = ("--persist-nice", "0")


@pytest.fixture
def small_disk(tmp_path):
    """A 256 KiB tmpfs (a disk that fills at once); unmounted afterwards."""
    where = tmp_path / "disk"
    where.mkdir()
    got = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(where)], capture_output=True, text=True)
    if got.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {got.stderr.strip()}")
    yield where
    subprocess.run(["umount", "-l", str(where)], check=False)


def write(daemon, job: str, steps: int, tmp: Path, start: int = 0) -> list:
    dump = tmp / f"states-{job}-{start}.pt"
    proc = subprocess.run([sys.executable, str(WRITER), daemon.address, job, "0", "1", str(steps), "--from", str(start),
                           "--wait-taken", "--dump", str(dump)], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "FFSTATE_TOKEN": TOKEN})
    assert proc.returncode == 0, proc.stderr  # every commit went through, whatever the disk did
    assert f"committed {steps}" in proc.stdout
    return torch.load(dump, weights_only=False)


def flushes(daemon):
    with daemon.client() as c:
        return c.inventory().persist


def test_a_full_disk_then_a_read_only_one_are_counted_and_logged_and_training_goes_on(daemons, small_disk, tmp_path):
    d = daemons.start("--persist-dir", str(small_disk), "--persist-every", "1", *BUSY)
    write(d, "full", 3, tmp_path)  # a TinyGPT training state is ~1.8 MB: no version fits in 256 KiB
    wait_until(lambda: flushes(d).failed >= 1, timeout=120, what="a failed flush")
    got = flushes(d)
    assert got.flushed == 0 and "no space left on device" in got.error.lower(), got
    wait_until(lambda: "no space left on device" in d.log().lower(), 10.0, "the failure logged")  # after its count
    assert "training goes on" in d.log()
    assert not list(small_disk.rglob("*.distcp"))  # what a failed flush wrote is removed: the disk is not left full
    assert not persist.complete_versions(small_disk / "full")
    subprocess.run(["mount", "-o", "remount,ro", str(small_disk)], check=True)
    before = flushes(d).failed
    write(d, "full", 5, tmp_path, start=3)
    wait_until(lambda: flushes(d).failed > before, timeout=120, what="a flush to the read-only disk")
    assert "Read-only file system" in flushes(d).error
    with d.client() as c:  # the daemon serves on: its slots, its health
        assert c.inventory("full").shards[0].version == 5


def test_a_removed_directory_is_made_again_and_flushing_resumes_bit_exact(daemons, tmp_path):
    store = tmp_path / "store"
    d = daemons.start("--persist-dir", str(store), "--persist-every", "1", "--persist-keep", "2", *BUSY)

    def settled(n: int) -> list[int]:  # every version offered was flushed or skipped (a flush still running: skipped)
        got = flushes(d)  # ">=": the writer's restart at version 4 commits 4 again, and it is offered again
        return got.flushed + got.skipped + got.failed >= n and persist.complete_versions(store / "gone")

    write(d, "gone", 4, tmp_path)  # the writer commits faster than a flush: some versions are skipped
    wait_until(lambda: settled(4), timeout=120, what="versions 1-4 flushed or skipped")
    shutil.rmtree(store)
    states = write(d, "gone", 8, tmp_path, start=4)
    # Made again: version 4 again (if it was flushed before, its offer after the restart is flushed again), or a
    # newer one (those committed while it was written are skipped)
    done = wait_until(lambda: settled(8), timeout=120, what="versions 4-8 flushed or skipped")
    assert flushes(d).failed == 0, flushes(d)
    vdir = persist.version_dir(store / "gone", done[-1])
    persist.check(vdir, [0])
    got, _ = persist.read_shard(vdir, 0)
    assert_bitwise_equal(got, states[done[-1] - 1])


def _gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] in "ZX"
    except OSError:
        return True


def test_the_flushing_process_killed_mid_flush_is_counted_and_started_again_and_dies_with_its_daemon(daemons, tmp_path):
    """The daemon writes through a child process: SIGKILLed mid-flush (stopped first, so that the flush is surely in
    it), the flush counts as failed with the reason, the next one starts a new child, and what it writes reads back
    bit for bit; SIGKILLing the daemon ends its child too."""
    store = tmp_path / "store"
    d = daemons.start("--persist-dir", str(store), "--persist-every", "1", *BUSY)
    child = wait_until(lambda: flushes(d).flusher_pid, timeout=120, what="the flushing process ready")
    assert int(Path(f"/proc/{child}/stat").read_text().split(")")[-1].split()[1]) == d.proc.pid
    os.kill(child, signal.SIGSTOP)
    write(d, "died", 3, tmp_path)
    wait_until(lambda: flushes(d).pending == 1, what="version 1 handed to the stopped flushing process")
    os.kill(child, signal.SIGKILL)
    wait_until(lambda: flushes(d).failed == 1, what="the flush counted as failed")
    assert f"flushing process (pid {child}) died while writing: killed by signal 9" in flushes(d).error
    assert not persist.complete_versions(store / "died")

    states = write(d, "died", 6, tmp_path, start=3)
    got = wait_until(lambda: (p := flushes(d)).flushed and not p.pending and p.flusher_pid and p, timeout=120,
                     what="a version flushed by a new flushing process")
    assert got.flusher_pid != child and got.flusher_starts == 2 and got.failed == 1, got
    done = persist.complete_versions(store / "died")
    assert done and done[-1] >= 4, done
    persist.check(persist.version_dir(store / "died", done[-1]), [0])
    shard, _ = persist.read_shard(persist.version_dir(store / "died", done[-1]), 0)
    assert_bitwise_equal(shard, states[done[-1] - 1])

    d.kill()
    wait_until(lambda: _gone(got.flusher_pid), what="the flushing process gone with its daemon")
    daemons.restart(d)  # the node's next daemon removes the slots the killed one left


def _flusher_of(pid: int) -> int | None:
    """The daemon's flushing process: among its children, not another (a starting daemon forks and runs short-lived
    ones, ``ldconfig -p`` for one: taken for the flusher, a suite's run found it gone)."""
    for task in Path(f"/proc/{pid}/task").iterdir():
        for c in (task / "children").read_text().split():
            try:
                if b"ffstate.daemon.flusher" in Path(f"/proc/{c}/cmdline").read_bytes():
                    return int(c)
            except OSError:  # gone already
                continue
    return None


def test_the_flushing_process_runs_at_the_idle_priority_by_default_or_at_the_niceness_asked(daemons, tmp_path):
    idle = daemons.start("--persist-dir", str(tmp_path / "a"))
    nice = daemons.start("--persist-dir", str(tmp_path / "b"), "--persist-nice", "7")
    want = [(idle, os.SCHED_IDLE, os.getpriority(os.PRIO_PROCESS, idle.proc.pid)),
            (nice, os.SCHED_OTHER, 7 + os.getpriority(os.PRIO_PROCESS, nice.proc.pid))]
    for d, policy, niceness in want:  # set by the daemon as it starts it, before the child's own imports
        child = wait_until(lambda: _flusher_of(d.proc.pid), what="the flushing process started")
        wait_until(lambda: (os.sched_getscheduler(child), os.getpriority(os.PRIO_PROCESS, child)) == (policy, niceness),
                   timeout=10, what=f"the flushing process of {d.node_id} at policy {policy}, niceness {niceness}")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_to_the_daemon_s_whole_group_still_lets_its_last_flush_finish(daemons, tmp_path, sig):
    """systemd's stop (every process of the unit), a Ctrl-C in a terminal and Slurm signal the daemon's children
    with it: the flushing process goes on with the flush in hand (the daemon waits for it as it stops), and the
    version is complete on disk. The flush is held in the child (stopped) while the signal is sent."""
    store = tmp_path / "store"
    d = daemons.start("--persist-dir", str(store), "--persist-every", "1", *BUSY, session=True)
    child = wait_until(lambda: flushes(d).flusher_pid, timeout=120, what="the flushing process ready")
    os.kill(child, signal.SIGSTOP)
    states = write(d, "grp", 1, tmp_path)
    wait_until(lambda: flushes(d).pending == 1, what="version 1 handed to the stopped flushing process")
    os.killpg(d.proc.pid, sig)
    os.kill(child, signal.SIGCONT)  # the signal is delivered to it now
    assert d.proc.wait(60) == 0, d.log()[-3000:]
    assert "died while writing" not in d.log(), d.log()[-3000:]
    assert persist.complete_versions(store / "grp") == [1], d.log()[-3000:]
    shard, _ = persist.read_shard(persist.version_dir(store / "grp", 1), 0)
    assert_bitwise_equal(shard, states[0])



def test_a_worker_whose_daemon_writes_elsewhere_or_without_it_is_told_at_entry(daemons, tmp_path, caplog):
    """A daemon started by hand with ``--persist-dir``: a worker with another ``persist_dir`` would resume from versions
    never written, and one with none from nothing (and would not drop the versions past one it restores); each is
    told as it enters. One that agrees is not."""
    from types import SimpleNamespace

    from ffstate.daemon import launch

    tier = tmp_path / "tier"
    d = daemons.start("--persist-dir", str(tier))

    def job(persist_dir: str) -> SimpleNamespace:
        return SimpleNamespace(job="j", rank=0, cfg=SimpleNamespace(persist_dir=persist_dir),
                               topology=SimpleNamespace(first_on_node=True, node_id="n0"))

    with d.client() as c, caplog.at_level("INFO", logger=launch.log.name):
        launch.check_persist(job(""), c)
        said = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
        assert said == [f"rank 0: node n0's daemon writes this job's versions to {tier}, but Config.persist_dir is "
                        f"unset: the job will not resume from them when it loses every node (set "
                        f"FFSTATE_PERSIST_DIR={tier})"], said
        caplog.clear()
        launch.check_persist(job(str(tmp_path / "elsewhere")), c)
        assert "will not be in the persistent tier; start it with --persist-dir" in caplog.text, caplog.text
        caplog.clear()
        launch.check_persist(job(str(tier)), c)  # waits for the daemon's flushing process to be ready, if it is not
        assert not [r for r in caplog.records if r.levelname == "WARNING"], caplog.text
