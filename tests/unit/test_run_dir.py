"""A job's run folder on a node (``$TMPDIR/ffstate-<job>/``): private to its user, and refused, saying why, where
another user's job of the same name made it first."""

import os
import stat

import pytest

from ffstate.daemon.running import run_dir
from ffstate.errors import FFStateError


def test_the_run_folder_is_made_private_and_one_left_open_by_an_earlier_run_is_closed(tmp_path, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr("tempfile.tempdir", None)  # read TMPDIR again
    made = run_dir("j1")
    assert made == tmp_path / "ffstate-j1" and stat.S_IMODE(made.stat().st_mode) == 0o700
    (made / "daemon-node0.address").write_text("x")  # kept: it is found again, not made anew
    old = tmp_path / "ffstate-j2"
    old.mkdir(mode=0o755)
    os.chmod(old, 0o755)
    assert run_dir("j1") == made and (made / "daemon-node0.address").read_text() == "x"
    assert stat.S_IMODE(run_dir("j2").stat().st_mode) == 0o700


@pytest.mark.skipif(os.getuid() != 0, reason="making a folder another user's needs root")
def test_another_user_s_run_folder_of_the_same_name_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr("tempfile.tempdir", None)
    theirs = tmp_path / "ffstate-shared"
    theirs.mkdir()
    os.chown(theirs, 65534, 65534)  # nobody's
    with pytest.raises(FFStateError, match="belongs to another user.*FFSTATE_JOB_ID"):
        run_dir("shared")
