"""Test setup: Triton kernels run under the interpreter on a machine without a GPU; the daemons' slots
go to a directory of this session's own (every process the tests start inherits it), removed at the end,
so that the slots of a daemon a test kills for good (a lost node) do not pile up in /dev/shm."""

import os
import shutil
import tempfile

if "FFSTATE_SHM_DIR" not in os.environ:  # before ffstate.shm is imported: it reads it once
    os.environ["FFSTATE_SHM_DIR"] = tempfile.mkdtemp(prefix="ffstate-tests-", dir="/dev/shm")
    _OWN_SHM_DIR = os.environ["FFSTATE_SHM_DIR"]
else:
    _OWN_SHM_DIR = None

import torch  # noqa: E402

if not torch.cuda.is_available():
    # Must be set before triton is first imported; lets the kernels run on CPU tensors (DESIGN.md I7).
    os.environ.setdefault("TRITON_INTERPRET", "1")

from daemons import daemons, module_daemons  # noqa: E402,F401  (fixtures that run real `ffstate serve` processes)


def pytest_sessionfinish(session, exitstatus):
    if _OWN_SHM_DIR:
        shutil.rmtree(_OWN_SHM_DIR, ignore_errors=True)
