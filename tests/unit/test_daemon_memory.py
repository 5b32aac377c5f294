"""The daemon's default budget follows its container's memory limit (cgroup v2 or v1, its own cgroup's or an
ancestor's), not only the host's RAM: in a pod limited to a fraction of the host, a quarter of the host's RAM
would let the daemon grow past the limit, to be ended by the OOM killer rather than refuse. The kernel's files
are laid out here as the kernel lays them out."""

from pathlib import Path

import pytest

from ffstate.daemon import memory

UNLIMITED_V1 = "9223372036854771712"  # what cgroup v1 says of no limit


def _write(root: Path, rel: str, text: str) -> None:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text + "\n")


def test_cgroup_v2_the_smallest_limit_of_the_cgroup_and_its_ancestors(tmp_path):
    root, me = tmp_path / "cgroup", tmp_path / "self"
    _write(root, "cgroup.controllers", "cpu memory")
    _write(root, "kubepods/memory.max", str(8 << 30))
    _write(root, "kubepods/pod1/memory.max", "max")
    _write(root, "kubepods/pod1/c1/memory.max", str(64 << 30))  # larger than its parent's: the parent's applies
    me.write_text("0::/kubepods/pod1/c1\n")
    assert memory.cgroup_limit(root, me) == 8 << 30
    me.write_text("0::/\n")  # a cgroup namespace: the container's own cgroup is the root
    _write(root, "memory.max", str(2 << 30))
    assert memory.cgroup_limit(root, me) == 2 << 30


def test_cgroup_v1_and_hybrid(tmp_path):
    root, me = tmp_path / "cgroup", tmp_path / "self"
    _write(root, "memory/memory.limit_in_bytes", UNLIMITED_V1)
    _write(root, "memory/job/memory.limit_in_bytes", str(3 << 30))
    me.write_text("5:cpu,cpuacct:/job\n4:memory:/job\n0::/job\n")  # hybrid: a v2 line too, no memory there
    (root / "unified").mkdir()
    assert memory.cgroup_limit(root, me) == 3 << 30
    me.write_text("4:memory:/\n")
    assert memory.cgroup_limit(root, me) == int(UNLIMITED_V1)  # no limit: larger than the host, not taken


def test_no_cgroup_files_no_limit(tmp_path):
    assert memory.cgroup_limit(tmp_path / "none", tmp_path / "none-self") is None
    (tmp_path / "self").write_text("0::/a\n")
    assert memory.cgroup_limit(tmp_path / "none", tmp_path / "self") is None


@pytest.mark.parametrize("limit", [None, 1 << 30, 1 << 60])
def test_the_default_budget_is_a_quarter_of_the_lower_of_the_host_and_its_limit(monkeypatch, limit):
    monkeypatch.setattr(memory, "cgroup_limit", lambda: limit)
    host = memory.host_bytes()
    assert memory.default_memory_limit() == min(host, limit or host) // 4


def test_files_not_as_the_kernel_writes_them_never_stop_the_daemon_s_start(tmp_path, monkeypatch, caplog):
    root, me = tmp_path / "cgroup", tmp_path / "self"
    _write(root, "cgroup.controllers", "memory")
    _write(root, "a/memory.max", "²")  # a digit to str.isdigit, not to int()
    me.write_text("0::/a\n")
    assert memory.cgroup_limit(root, me) is None
    me.write_bytes(b"0::/a\xff/b\n")  # not UTF-8
    monkeypatch.setattr(memory, "CGROUP", root)
    monkeypatch.setattr(memory, "SELF", me)
    monkeypatch.setattr(memory.cgroup_limit, "__defaults__", (root, me))
    assert memory.default_memory_limit() == memory.host_bytes() // 4
    assert "could not read this process's cgroup memory limit" in caplog.text
