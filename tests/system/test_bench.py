"""The benchmarks run end to end (tiny sizes; the numbers are not looked at here, only that they exist)."""

import json
import os
import subprocess
import sys

import pytest


@pytest.mark.timeout(300)
@pytest.mark.parametrize("args, name", [
    (["codec", "--size", "small", "--steps", "2", "--repeats", "1", "--threads", "1"], "codec-cpu"),
    (["bandwidth", "--size", "1M", "--chunks", "256K", "--repeats", "1"], "bandwidth"),
    (["push", "--sizes", "64K,4M", "--pushes", "20", "--rounds", "2"], "push"),
    (["capture", "--size", "small", "--repeats", "1"], "capture"),
    (["recovery", "--sizes", "small", "--repeats", "1", "--resize"], "recovery"),
    (["overhead", "--parallel", "ddp", "--modes", "off,naive,persist,async-save", "--steps", "4", "--repeats",
      "1", "--ranks-per-node", "1", "--persist-nice", "0"], "overhead"),  # not idle: the suite keeps the cores busy
])
def test_benchmark_writes_its_results(tmp_path, args, name):
    out = subprocess.run([sys.executable, "-m", "ffstate.cli", "bench", *args, "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=280, env={**os.environ, "MPLBACKEND": "Agg"})
    assert out.returncode == 0, out.stderr
    result = json.loads((tmp_path / f"{name}.json").read_text())
    assert result["benchmark"] == name.split("-")[0]
    assert (tmp_path / f"{name}.png").exists()
    if name == "bandwidth":  # a local daemon: the CPU a push costs it and the client, measured
        row = result["grpc"][str(256 << 10)]
        assert row["push_holder_cpu_s_per_GB"] is not None and row["push_client_cpu_s_per_GB"] is not None
    if name == "push":  # the three ways measured, on both sides of the one-call limit
        for size, ones in ((64 << 10, 19), (4 << 20, 0)):
            row = result["sizes"][str(size)]
            assert row["deltas_in_one_call"] == ones and set(row["ways"]) == {"stream", "one call", "bulk socket"}
            assert all(len(w["holder_seconds"]) == 2 and min(w["wall_seconds"]) > 0 for w in row["ways"].values())
    if name == "overhead":
        naive = result["jobs"]["ddp @ loopback"]["naive"]
        assert naive["commit_seconds"] > 0 and naive["wire_bytes_per_step_per_rank"] > 0
        assert naive["train_bytes_per_step_per_rank"] > 0 and naive["daemon_cpu_seconds_per_step"] >= 0
        # ... by the daemons' threads, named in the system (the replicator's, the RPCs' pool); the arithmetic is
        # tests/unit/test_overhead_split.py's. The kernel counts CPU in ticks of 10 ms: over 2 timed steps of a tiny
        # model on a fast machine the daemons can use less than one, so a 0 here is a measurement, not a failure;
        # that the daemons' threads were found and read is what is asserted.
        threads = naive["daemon_cpu_ms_per_step_by_thread"]
        assert {"repl", "rpc", "ended threads"} <= set(threads) and min(threads.values()) >= 0, threads
        for mode in ("persist", "async-save"):  # versions written to disk (or skipped while one was written)
            row = result["jobs"]["ddp @ loopback"][mode]
            assert row["saved"] > 0 and row["saved"] + row["skipped"] > 0, (mode, row)
    if name == "recovery":  # the resize from the replicas (the drain: test_elastic_torchrun.py)
        from ffstate import Config

        assert 0 <= result["resize"]["steps_lost"] <= Config().max_lag and result["resize"]["dcp_load_seconds"] > 0


def test_simulation_answers_the_way_the_model_says():
    """The scale model (bench/simulate.py): a faster link never costs more; the razor divides the bytes by DP;
    a step whose link is busy with the training's own all-reduce has less room for replication."""
    from ffstate.bench.simulate import JOBS, Job, simulate

    for job in JOBS:
        rows = [simulate(job, g) for g in (100, 200, 400)]
        assert all(a["replication_seconds"] > b["replication_seconds"] and a["overhead"] >= b["overhead"]
                   for a, b in zip(rows, rows[1:]))
        on, off = simulate(job, 200, razor=True), simulate(job, 200, razor=False)
        assert off["replicated_bytes_per_node"] == job.dp * on["replicated_bytes_per_node"]
        assert simulate(job, 200, k=2)["replicated_bytes_per_node"] == 2 * on["replicated_bytes_per_node"]
    slow = Job("tiny step", 7e9, 64, tp=1, tokens_per_step=1e4)  # almost no compute: the link is never idle
    assert simulate(slow, 100)["idle_fraction"] == 0 and simulate(slow, 100)["overhead"] > 0


def test_overhead_paired_ratio_cancels_the_machine_drifting_between_repeats():
    """bench overhead's summary: in repeat 1 the whole machine runs 50% slower; the pooled median sees a
    mode's phases against off's across repeats, the paired ratio each phase against its own repeat's off."""
    from ffstate.bench.overhead import summarize

    def rank(off: list, on: list) -> dict:
        return {"results": {"off": {"step_seconds": off}, "naive": {
            "step_seconds": on, "wire_bytes": 1, "wire_versions": 1, "shard_bytes": 1, "state_bytes": 1}}}

    # 3 repeats of 2 timed steps; naive costs 10% in every repeat; repeat 1 runs at 1.5x for both modes.
    off = [1.0, 1.0, 1.5, 1.5, 1.0, 1.0]
    on = [1.1, 1.1, 1.65, 1.65, 1.1, 1.1]
    out = summarize("ddp", [rank(off, on), rank(off, on)], ["off", "naive"], repeats=3)
    assert out["naive"]["step_ratio_per_repeat"] == pytest.approx([1.1, 1.1, 1.1])
    assert out["naive"]["step_ratio_paired"] == pytest.approx(1.1)
    assert out["off"]["step_ratio_paired"] == 1.0
    # The step's parts are the slowest rank's, per step, then the median over steps.
    fast = {"results": {"off": {"step_seconds": off, "part_seconds": [[0.1, 0.2, 0.3]] * 6}}}
    slow = {"results": {"off": {"step_seconds": off, "part_seconds": [[0.2, 0.1, 0.3]] * 5 + [[9, 9, 9]]}}}
    assert summarize("ddp", [fast, slow], ["off"], repeats=3)["off"]["part_seconds"] == [0.2, 0.2, 0.3]
    # Where the phases do not split evenly into repeats there is no paired ratio, only the pooled one.
    assert "step_ratio_paired" not in summarize("ddp", [rank(off, on)], ["off", "naive"], repeats=4)["naive"]


@pytest.mark.parametrize("n", [2, 3, 4, 5])
def test_overhead_phases_follow_every_other_mode_equally_often(n):
    """bench overhead's phase order: over a full cycle of repeats (n, or 2n for odd n) every mode runs in
    every position equally often and directly after every other mode equally often."""
    import collections
    import itertools

    from ffstate.bench._report import phase_order

    modes = [f"m{i}" for i in range(n)]
    cycle = n if n % 2 == 0 else 2 * n
    rows = [phase_order(modes, r) for r in range(cycle)]
    assert all(sorted(row) == modes for row in rows)
    positions = collections.Counter((i, m) for row in rows for i, m in enumerate(row))
    assert set(positions.values()) == {cycle // n}
    after = collections.Counter(pair for row in rows for pair in zip(row, row[1:]))
    assert set(after) == set(itertools.permutations(modes, 2)) and len(set(after.values())) == 1
