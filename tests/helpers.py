"""The small training jobs the tests replay, one rank's slots as its worker and its daemon map them, and the
bitwise comparison the tests assert with (the one in ``ffstate.testing.bitwise``, which the demo and the benchmarks
use too)."""

from __future__ import annotations

import contextlib
import os
import queue
import random
import signal
import subprocess
import threading
from pathlib import Path
from typing import Any, Iterable, Iterator

import numpy as np
import pytest
import torch

from ffstate import layout, shm
from ffstate.testing.bitwise import assert_bitwise_equal, bits, contiguous_bits  # noqa: F401
from ffstate.testing.models import TinyGPT

# Triton runs its kernels on CPU tensors only under its interpreter, chosen as a kernel is defined: conftest.py sets
# TRITON_INTERPRET=1 where no GPU is seen. On a CUDA machine the kernels are compiled for the GPU and a CPU tensor's
# pointer is refused at launch, so the tests that use the CPU as the device are skipped there; the tests that need a
# CUDA device run the same paths on it.
cpu_as_device = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                   reason="the Triton kernels on CPU tensors: only under TRITON_INTERPRET=1, which a "
                                          "machine with a GPU does not set (its CUDA tests run these paths)")


def train_states(steps: int, seed: int = 0, **model_kw: Any):
    """Trains TinyGPT with AdamW + a cosine schedule and yields the full training state after each step.

    The state holds model, optimizer, scheduler, the three RNG states and a data-loader position,
    i.e. what a trainer snapshots. Yielded states are deep copies (safe to keep).
    """
    import copy

    torch.manual_seed(seed)
    np.random.seed(seed)
    random.seed(seed)
    model = TinyGPT(**model_kw)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=max(1, steps))
    vocab = model.tok.num_embeddings
    for step in range(steps):
        loss = model.loss(torch.randint(0, vocab, (8, model.seq + 1)))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        random.random()
        np.random.rand()
        yield copy.deepcopy(
            {
                "model": model.state_dict(),
                "optim": opt.state_dict(),
                "sched": sched.state_dict(),
                "rng": {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()},
                "extra": {"step": step + 1, "loss": loss.item(), "loader": {"epoch": 0, "offset": (step + 1) * 8}},
            }
        )


# A torchrun entry point that runs a script (argv[1]) with rank 1 SIGKILLed right after its commit of step
# $KILL_AT, once ($KILL_MARKER): the failure injected into the README's and the docs' examples as written.
KILL_WRAPPER = '''
import os, runpy, signal, sys
import ffstate.trainer

KILL_AT, MARKER = int(os.environ.get("KILL_AT", "0")), os.environ.get("KILL_MARKER", "")
real = ffstate.trainer.Replicated.commit


def commit(self, step):
    real(self, step)
    if step == KILL_AT and self.rank == 1 and not os.path.exists(MARKER):
        open(MARKER, "w").close()
        os.kill(os.getpid(), signal.SIGKILL)


ffstate.trainer.Replicated.commit = commit
runpy.run_path(sys.argv[1], run_name="__main__")
'''


@contextlib.contextmanager
def worker_and_daemon_slots(tmp_path, monkeypatch, state: dict | None = None,
                            world: int = 1) -> Iterator[tuple[dict, shm.Slots, shm.Slots]]:
    """Rank 0's slots of job ``j`` (of ``world`` ranks) for ``state`` (default: ten zeros), in shared memory under
    ``tmp_path``, as its worker and its daemon map them; yields (the state, the worker's, the daemon's)."""
    monkeypatch.setattr(shm.slots, "SHM_DIR", tmp_path)
    state = {"w": torch.zeros(10)} if state is None else state
    manifest = layout.describe(state)
    paths = shm.slot_paths("n0", "j", 0, world)
    shm.create_slots(paths, manifest, 4096)
    worker, daemon = shm.Slots(paths, manifest), shm.Slots(paths, manifest, tensors=False)  # as each maps them
    try:
        yield state, worker, daemon
    finally:
        worker.close()
        daemon.close()


class Lines:
    """A child process's stdout read on a thread of its own: ``next(timeout)`` returns its next line, or fails saying
    what it printed so far and whether it exited (a bare ``readline()`` waits for pytest's timeout and says nothing)."""

    def __init__(self, proc: subprocess.Popen):
        self.proc, self.seen, self._lines = proc, [], queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in iter(self.proc.stdout.readline, ""):
            self._lines.put(line)
        self._lines.put("")  # closed: the process exited

    def next(self, timeout: float = 60.0) -> str:
        try:
            line = self._lines.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"no line within {timeout}s from process {self.proc.pid} (exit code "
                                 f"{self.proc.poll()}); it printed {self.seen!r}") from None
        if not line:
            raise AssertionError(f"process {self.proc.pid} closed its output (exit code {self.proc.poll()}); "
                                 f"it printed {self.seen!r}")
        self.seen.append(line)
        return line.strip()


def torch_loaded(pid: int) -> bool:
    """Whether process ``pid`` has torch's library mapped (a daemon never should: ffstate/codec/host.py)."""
    try:
        return "libtorch" in Path(f"/proc/{pid}/maps").read_text()
    except OSError:  # gone
        return False


def daemons_torch(pid_files: Iterable[Path]) -> dict[str, bool]:
    """For each running daemon the pid files name (by file name): whether it has torch loaded."""
    out = {}
    for pid_file in pid_files:
        with contextlib.suppress(OSError, ValueError):
            pid = int(pid_file.read_text())
            if Path(f"/proc/{pid}").exists():
                out[pid_file.name] = torch_loaded(pid)
    return out


def kill_daemons(pid_files: Iterable[Path], sig: int = signal.SIGKILL) -> None:
    """Signals the daemons that ``pid_files`` name; a file or a process gone meanwhile is skipped (a daemon whose job
    left unlinks its file as it exits: between the glob and the read, in a test's cleanup)."""
    for pid_file in pid_files:
        with contextlib.suppress(OSError, ValueError):
            os.kill(int(pid_file.read_text()), sig)
