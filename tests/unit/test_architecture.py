"""The tree keeps docs/design.md's picture: imports point one way, files and classes stay readable in one
sitting, and the layers that must not know each other do not (issue: one idea per file)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "ffstate"
MAX_FILE_LINES = 400
MAX_CLASS_LINES = 300


def modules() -> dict[str, Path]:
    """ffstate's own modules (generated stubs aside), by dotted name."""
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        if "_proto" in path.parts:
            continue
        parts = path.relative_to(ROOT).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def imports(path: Path, known: dict[str, Path]) -> set[str]:
    """The ffstate modules ``path`` imports, at any depth of its code (a lazy import is still a dependency)."""
    got = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        else:
            continue
        for n in names:
            while n and n not in known:
                n = n.rpartition(".")[0]
            if n and n != "ffstate":
                got.add(n)
    return got


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports(path, known) - {name} for name, path in known.items()}


def test_no_import_cycle():
    g = graph()
    state: dict[str, int] = {}

    def visit(n: str, trail: list[str]) -> None:
        state[n] = 1
        for m in sorted(g.get(n, ())):
            if state.get(m) == 1:
                raise AssertionError("import cycle: " + " -> ".join(trail[trail.index(m):] + [m]))
            if m not in state:
                visit(m, trail + [m])
        state[n] = 2

    for n in sorted(g):
        if n not in state:
            visit(n, [n])


def test_nothing_below_the_trainer_imports_it():
    users = {n for n, deps in graph().items() if "ffstate.trainer" in deps}
    assert users <= {"ffstate", "ffstate.cli"}, f"below the trainer, yet importing it: {sorted(users - {'ffstate'})}"


def test_layers_that_must_not_know_each_other():
    g = graph()
    slots = {n for n in g if n.startswith("ffstate.shm")}
    assert not {n for n in slots if any(d.startswith("ffstate.codec") for d in g[n])}, "the slots hand out bytes"
    assert not any(d.startswith("ffstate.codec") for n in g if n.startswith("ffstate.layout") for d in g[n])
    # The node's runtime, its store and replicator know no protobuf: the servicer and the client translate.
    for n in ("ffstate.daemon.node", "ffstate.daemon.store", "ffstate.daemon.replicator", "ffstate.reports"):
        text = modules()[n].read_text()
        assert "_proto" not in text and "import grpc" not in text, f"{n} speaks protobuf"


def test_files_and_classes_stay_small():
    for name, path in modules().items():
        lines = path.read_text().count("\n")
        assert lines <= MAX_FILE_LINES, f"{path.relative_to(ROOT)}: {lines} lines (at most {MAX_FILE_LINES})"
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                size = node.end_lineno - node.lineno + 1
                assert size <= MAX_CLASS_LINES, f"{name}.{node.name}: {size} lines (at most {MAX_CLASS_LINES})"


def test_test_files_have_unique_names():
    """pytest imports test files without packages (rootdir-relative basenames): two files with one basename
    in different folders stop the whole collection on a clean checkout."""
    seen: dict[str, Path] = {}
    for path in sorted((ROOT / "tests").rglob("test_*.py")):
        assert path.name not in seen, f"{path.relative_to(ROOT)} and {seen[path.name].relative_to(ROOT)} share a name"
        seen[path.name] = path


NO_TORCH = """
import importlib, sys, traceback
class Refuse:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            trail = [f"{f.filename}:{f.lineno}" for f in traceback.extract_stack() if "/ffstate/" in f.filename]
            raise ImportError("torch imported from " + " <- ".join(reversed(trail)))
sys.meta_path.insert(0, Refuse())
for name in sys.argv[1:]:
    importlib.import_module(name)
"""


def test_the_daemon_and_the_command_line_import_without_torch():
    """The daemon encodes, holds and serves buffers as NumPy arrays: torch (a second and 180 MB a process) is the
    training side's, and its flushing process's. Every module a daemon imports at its start imports without it
    (what it imports later is checked by every daemon test: tests/daemons.py looks for torch's library in its
    memory map before stopping it)."""
    import subprocess
    import sys

    names = ["ffstate.daemon.main", "ffstate.daemon.launch", "ffstate.cli", "ffstate.status"]
    got = subprocess.run([sys.executable, "-c", NO_TORCH, *names], capture_output=True, text=True, timeout=60)
    assert got.returncode == 0, got.stderr[-3000:]


TRAINING_SIDE = """
import sys, tempfile
import torch
import torch.distributed as dist
import ffstate.trainer
from ffstate import capture, lazy

model = torch.nn.Linear(8, 8)
opt = torch.optim.AdamW(model.parameters())
model(torch.randn(2, 8)).sum().backward()
opt.step()
assert capture.plain_optimizer(opt) and not lazy.is_zero(opt)
capture.load_optimizer(opt, capture.optimizer_state(opt))
assert "torch.distributed.optim" not in sys.modules, "loaded by a job without ZeRO"
dist.init_process_group("gloo", init_method=f"file://{tempfile.mktemp()}", rank=0, world_size=1)
from torch.distributed.optim import ZeroRedundancyOptimizer
zero = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW)
assert lazy.is_zero(zero) and not capture.plain_optimizer(torch.optim.SGD(model.parameters(), differentiable=True))
assert capture.optimizer_state(zero).keys() == {"shard", "groups"}
dist.destroy_process_group()
"""


def test_a_training_process_without_zero_never_loads_it():
    """``torch.distributed.optim`` is loaded only by a job that uses ZeRO: 0.2 s of CPU at every rank's start, and
    inside every restore's load of the optimizer, which the checks of an optimizer's class paid."""
    import subprocess
    import sys

    got = subprocess.run([sys.executable, "-c", TRAINING_SIDE], capture_output=True, text=True, timeout=120)
    assert got.returncode == 0, got.stderr[-3000:]


def test_every_package_is_in_the_distribution():
    """pyproject.toml lists the packages a wheel holds: one missing installs, and fails at its first import (the bulk
    socket's was, and only the editable install of the Makefile hid it)."""
    import tomllib

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {".".join(p.parent.relative_to(ROOT).parts) for p in PACKAGE.rglob("__init__.py")}
    found |= {f"ffstate.{d.name}" for d in (ROOT / "kernels", ROOT / "bench", ROOT / "demo", ROOT / "testing")}
    assert found - listed == set(), f"packages missing from pyproject.toml: {sorted(found - listed)}"
