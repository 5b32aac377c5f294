"""``ffstate status``'s choice of daemons (``status.targets``): from the run folders of this machine's jobs, and an
error that says what is there when a job asked for has no daemon."""

import os

import pytest

from ffstate import status


@pytest.fixture
def run_folders(tmp_path, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr("tempfile.tempdir", None)  # gettempdir() reads TMPDIR again
    folder = tmp_path / "ffstate-job-a"
    folder.mkdir(mode=0o700)
    (folder / "token").write_text("a" * 32)
    (folder / "daemon-node0.pid").write_text(f"{os.getpid()}\n")  # alive: this process
    (folder / "daemon-node0.address").write_text("127.0.0.1:7700")
    return tmp_path


def test_the_daemons_of_a_job_are_found_with_its_token(run_folders):
    assert status.targets(None, "job-a", None) == [("127.0.0.1:7700", "a" * 32)]
    assert status.targets(None, "", None) == [("127.0.0.1:7700", "a" * 32)]


def test_a_job_with_no_daemon_here_is_said_so_with_the_jobs_that_have_one(run_folders):
    with pytest.raises(SystemExit, match="no daemon of job nope runs on this machine; daemons of job\\(s\\) job-a do"):
        status.targets(None, "nope", None)


def test_no_daemon_at_all_says_where_a_finished_job_left_its_records(run_folders):
    (run_folders / "ffstate-job-a" / "daemon-node0.pid").unlink()
    with pytest.raises(SystemExit, match="a job that ended cleanly stopped its daemons: its events.jsonl"):
        status.targets(None, "", None)
