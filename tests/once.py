"""Runs that several tests compare against (a job without failures and without ffstate), made once per test
session whichever pytest-xdist worker asks first: each costs a job's start (~10 s of 4 processes importing torch),
and a module-scoped fixture is made again on every worker that runs one of the module's tests."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Callable

import pytest
from filelock import FileLock


@pytest.fixture(scope="session")
def once(tmp_path_factory) -> Callable[[str, Callable[[Path], None]], Path]:
    """``once(name, make)``: the folder ``make(folder)`` filled, made by the first test of the session to ask (the
    others wait for it); a ``make`` that raised is made again by the next one to ask, and raises there too."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # the workers' base folders are under the session's
    root = root / "made-once"
    root.mkdir(exist_ok=True)

    def made(name: str, make: Callable[[Path], None]) -> Path:
        folder = root / name
        with FileLock(str(folder) + ".lock"):
            if not (folder / ".made").exists():
                shutil.rmtree(folder, ignore_errors=True)
                folder.mkdir()
                make(folder)
                (folder / ".made").touch()
        return folder

    return made
