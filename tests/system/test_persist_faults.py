"""The persistent tier when the filesystem fails, against a real daemon and a real worker process: a full disk, a
read-only one, a directory removed under it. Each failed flush is logged and counted, the daemon keeps serving,
every commit of the worker goes through, and flushing resumes once the directory is usable again; what is
complete reads back bit for bit. The disks are small tmpfs mounts (root only)."""

import os
import shutil
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
    d = daemons.start("--persist-dir", str(small_disk), "--persist-every", "1")
    write(d, "full", 3, tmp_path)  # a TinyGPT training state is ~1.8 MB: no version fits in 256 KiB
    wait_until(lambda: flushes(d).failed >= 1, what="a failed flush")
    got = flushes(d)
    assert got.flushed == 0 and "no space left on device" in got.error.lower(), got
    assert "no space left on device" in d.log().lower() and "training goes on" in d.log()
    assert not list(small_disk.rglob("*.distcp"))  # what a failed flush wrote is removed: the disk is not left full
    assert not persist.complete_versions(small_disk / "full")
    subprocess.run(["mount", "-o", "remount,ro", str(small_disk)], check=True)
    before = flushes(d).failed
    write(d, "full", 5, tmp_path, start=3)
    wait_until(lambda: flushes(d).failed > before, what="a flush to the read-only disk")
    assert "Read-only file system" in flushes(d).error
    with d.client() as c:  # the daemon serves on: its slots, its health
        assert c.inventory("full").shards[0].version == 5


def test_a_removed_directory_is_made_again_and_flushing_resumes_bit_exact(daemons, tmp_path):
    store = tmp_path / "store"
    d = daemons.start("--persist-dir", str(store), "--persist-every", "1", "--persist-keep", "2")

    def settled(n: int) -> list[int]:  # every version offered was flushed or skipped (a flush still running: skipped)
        got = flushes(d)  # ">=": the writer's restart at version 4 commits 4 again, and it is offered again
        return got.flushed + got.skipped + got.failed >= n and persist.complete_versions(store / "gone")

    write(d, "gone", 4, tmp_path)  # the writer commits faster than a flush: some versions are skipped
    wait_until(lambda: settled(4), what="versions 1-4 flushed or skipped")
    shutil.rmtree(store)
    states = write(d, "gone", 8, tmp_path, start=4)
    # Made again: version 4 again (if it was flushed before, its offer after the restart is flushed again), or a
    # newer one (those committed while it was written are skipped)
    done = wait_until(lambda: settled(8), what="versions 4-8 flushed or skipped")
    assert flushes(d).failed == 0, flushes(d)
    vdir = persist.version_dir(store / "gone", done[-1])
    persist.check(vdir, [0])
    got, _ = persist.read_shard(vdir, 0)
    assert_bitwise_equal(got, states[done[-1] - 1])
