"""Test setup: Triton kernels run under the interpreter on a machine without a GPU; the daemons' slots
go to a directory of this session's own (every process the tests start inherits it), removed at the end,
so that the slots of a daemon a test kills for good (a lost node) do not pile up in /dev/shm."""

import os
import shutil
import tempfile

import pytest

if "FFSTATE_SHM_DIR" not in os.environ:  # before ffstate.shm is imported: it reads it once
    os.environ["FFSTATE_SHM_DIR"] = tempfile.mkdtemp(prefix="ffstate-tests-", dir="/dev/shm")
    _OWN_SHM_DIR = os.environ["FFSTATE_SHM_DIR"]
else:
    _OWN_SHM_DIR = None

import torch  # noqa: E402

if not torch.cuda.is_available():
    # Must be set before triton is first imported; lets the kernels run on CPU tensors (docs/design.md I7).
    os.environ.setdefault("TRITON_INTERPRET", "1")

from daemons import daemons, module_daemons  # noqa: E402,F401  (fixtures that run real `ffstate serve` processes)
from once import once  # noqa: E402,F401  (runs several tests compare against, made once per session)


def pytest_sessionfinish(session, exitstatus):
    if _OWN_SHM_DIR:
        shutil.rmtree(_OWN_SHM_DIR, ignore_errors=True)


# The jobs whose assertions count steps or seconds (a node's loss within the replication lag, a hang found
# within its deadline) run one after another on one worker, so that they never share the 2 cores with each
# other; every other test (daemons, codec, benchmarks' smoke runs, and jobs asserting bits alone) goes to
# whichever worker is free. make test runs two: this machine waits on process starts more than it computes.
TIMED = {"test_trainer", "test_chaos", "test_hangs", "test_shaped_link"}


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the groups into the tests' ids
def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.path.stem in TIMED:
            item.add_marker(pytest.mark.xdist_group("timed"))


def pytest_collection_finish(session):
    if getattr(session.config.option, "loadgroup", False) and any(
            i.path.stem in TIMED and not i.nodeid.endswith("@timed") for i in session.items):
        import warnings

        warnings.warn("--dist loadgroup did not group the timed jobs (a pytest that pytest-xdist does not follow?): "
                      "they may run side by side")
