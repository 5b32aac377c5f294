"""The watchdog's rules on fake slots and a fake clock: the deadline from the median step (floor, ceiling, the
first steps' allowance), a declared pause, the stacks asked for before the kill, once per attach; stragglers."""

import contextlib
import os
import signal
from pathlib import Path

from ffstate.config import DaemonConfig
from ffstate.daemon import stacks
from ffstate.daemon.stacks import where
from ffstate.daemon.watchdog import STRAGGLER_LOOKS, Watchdog
from ffstate.ids import ShardKey
from ffstate.shm.slots import WorkerRecord


class FakeSlots:
    def __init__(self, pid: int, attached: float, stacks: str = ""):
        self.record = WorkerRecord(pid, attached, 0.0, stacks)
        self.done: list[tuple[int, float]] = []
        self.intervals: list[tuple[float, float]] = []
        self.held = 0.0  # seconds its commit has been held by the lag policy (0: not held)
        self.count = 0  # commits since the attach, as the worker counts them

    def commit(self, version: int, t: float, waited: float = 0.0, held: float = 0.0) -> None:
        self.done = (self.done + [(version, t, held)])[-2:]
        self.count += 1
        if waited:
            self.intervals.append((t - waited - 0.01, t - 0.01))

    def worker(self):
        return self.record

    def commits(self):
        return list(self.done)

    def comm_marks(self):
        return 0, list(self.intervals), [t for _, t, _ in self.done]

    def lag_held(self):
        return self.held

    def commit_count(self):
        return self.count


def make(cfg: DaemonConfig, shards: dict):
    clock = {"now": 1000.0}
    signals: list[tuple[int, int]] = []
    dog = Watchdog(cfg, lambda: list(shards.items()), kill=lambda pid, sig: signals.append((pid, sig)),
                   clock=lambda: clock["now"], sleep=lambda s: None)
    return dog, clock, signals


def steps(dog, clock, slots: FakeSlots, n: int, step: float, start: int = 1) -> None:
    for v in range(start, start + n):
        clock["now"] += step
        slots.commit(v, clock["now"])
        dog.look()


def together(dog, clock, shards: dict, n: int, step: float) -> None:
    """``n`` steps of ``step`` seconds, every rank committing at the same moment (a job's ranks do, give or take)."""
    for v in range(1, n + 1):
        clock["now"] += step
        for s in shards.values():
            s.commit(v, clock["now"])
        dog.look()


def test_the_deadline_is_ten_median_steps_within_floor_and_ceiling_after_the_first_steps(monkeypatch):
    monkeypatch.setattr("ffstate.daemon.watchdog.alive", lambda pid: True)
    key = ShardKey("j", 0, 2)
    slots = FakeSlots(os.getpid() + 10_000, 1000.0)
    cfg = DaemonConfig(hang_floor=2.0, hang_ceiling=8.0, hang_startup=30.0, hang_multiple=10.0)
    dog, clock, signals = make(cfg, {key: slots})
    dog.look()
    assert dog.report(key).deadline_seconds == 30.0  # no commit yet: the first steps' allowance
    steps(dog, clock, slots, 2, 0.5)
    assert dog.report(key).deadline_seconds == 30.0  # two commits: still the allowance
    steps(dog, clock, slots, 3, 0.5, start=3)
    assert dog.report(key).deadline_seconds == 5.0 and dog.report(key).step_seconds == 0.5  # 10 x 0.5 s
    steps(dog, clock, slots, 40, 0.1, start=6)
    assert dog.report(key).deadline_seconds == 2.0  # 10 x 0.1 s, raised to the floor
    steps(dog, clock, slots, 40, 2.0, start=46)
    assert dog.report(key).deadline_seconds == 8.0  # 10 x 2 s, cut to the ceiling
    clock["now"] += 7.9
    dog.look()
    assert not signals and abs(dog.report(key).since_seconds - 7.9) < 1e-6
    clock["now"] += 0.2
    dog.look()
    assert signals == [(slots.record.pid, signal.SIGKILL)]  # no stacks file registered: straight to the kill
    assert dog.report(key).hangs == 1
    clock["now"] += 100
    dog.look()
    assert len(signals) == 1  # once per attach: the restart's worker is watched afresh


def test_a_declared_pause_is_not_a_hang_and_the_deadline_counts_from_its_end(monkeypatch):
    monkeypatch.setattr("ffstate.daemon.watchdog.alive", lambda pid: True)
    key = ShardKey("j", 0, 1)
    slots = FakeSlots(4242, 1000.0)
    dog, clock, signals = make(DaemonConfig(hang_floor=2.0, hang_startup=30.0), {key: slots})
    steps(dog, clock, slots, 5, 0.1)
    slots.record = WorkerRecord(4242, slots.record.alive, clock["now"] + 60.0, "")
    clock["now"] += 50
    dog.look()
    assert not signals and dog.report(key).paused
    clock["now"] += 20  # the pause ran out without its end written: watched again, and long silent
    dog.look()
    assert signals
    slots.record = WorkerRecord(4243, clock["now"], 0.0, "")  # a new worker attached
    signals.clear()
    steps(dog, clock, slots, 5, 0.1, start=6)
    slots.record = WorkerRecord(4243, clock["now"] + 1.0, 0.0, "")  # the end of a pause: a sign of life
    clock["now"] += 2.5
    dog.look()
    assert not signals and abs(dog.report(key).since_seconds - 1.5) < 1e-6


def test_a_commit_held_by_the_lag_policy_is_not_a_hang_for_any_local_rank_of_its_job(monkeypatch):
    """A held commit is bounded on its own (lag.py), and the node's other ranks wait for it in their collectives:
    while it lasts, none of the job's local ranks is declared hung, and their deadlines count from its end."""
    monkeypatch.setattr("ffstate.daemon.watchdog.alive", lambda pid: True)
    held, waiting = ShardKey("j", 0, 2), ShardKey("j", 1, 2)
    shards = {held: FakeSlots(31, 1000.0), waiting: FakeSlots(32, 1000.0)}
    dog, clock, signals = make(DaemonConfig(hang_floor=2.0, hang_startup=30.0), shards)
    together(dog, clock, shards, 5, 0.1)
    shards[held].held = 0.1
    for _ in range(20):  # 10 s held: five deadlines
        clock["now"] += 0.5
        dog.look()
    assert not signals
    shards[held].held = 0.0
    clock["now"] += 1.5
    dog.look()
    assert not signals and abs(dog.report(waiting).since_seconds - 1.5) < 1e-6  # from the hold's end
    clock["now"] += 1.0
    dog.look()
    assert (31, signal.SIGKILL) in signals and (32, signal.SIGKILL) in signals  # silent past it: hung


def test_stacks_are_asked_for_before_the_kill_and_every_local_rank_of_the_job_goes(monkeypatch, tmp_path):
    monkeypatch.setattr("ffstate.daemon.watchdog.alive", lambda pid: True)
    a, b, other = ShardKey("j", 0, 2), ShardKey("j", 1, 2), ShardKey("k", 0, 1)
    shards = {a: FakeSlots(11, 1000.0, str(tmp_path / "a.txt")), b: FakeSlots(12, 1000.0, str(tmp_path / "b.txt")),
              other: FakeSlots(13, 1000.0)}
    dog, clock, signals = make(DaemonConfig(hang_floor=2.0, hang_startup=30.0), shards)
    together(dog, clock, shards, 5, 0.1)
    clock["now"] += 1.0
    shards[other].commit(6, clock["now"])  # job k goes on
    clock["now"] += 1.5
    dog.look()
    assert signals == [(11, signal.SIGUSR1), (12, signal.SIGUSR1), (11, signal.SIGKILL), (12, signal.SIGKILL)]


def test_every_local_rank_of_a_stalled_job_is_named_whichever_showed_life_last(monkeypatch, caplog):
    """The ranks of a job stall together, and which one crosses its deadline first is a matter of milliseconds: the
    one that never reached the collective may have ended a held commit after the others committed (a later sign of
    life). Each is named hung, with its stacks, not only the first across (which named the waiting one alone in a
    test's run and called the culprit waiting); a rank still committing is not named."""
    monkeypatch.setattr("ffstate.daemon.watchdog.alive", lambda pid: True)
    waiting, culprit, going = ShardKey("j", 0, 3), ShardKey("j", 1, 3), ShardKey("j", 2, 3)
    shards = {waiting: FakeSlots(51, 1000.0), culprit: FakeSlots(52, 1000.0), going: FakeSlots(53, 1000.0)}
    dog, clock, signals = make(DaemonConfig(hang_floor=2.0, hang_startup=30.0), shards)
    together(dog, clock, shards, 5, 0.1)
    shards[culprit].record = WorkerRecord(52, clock["now"] + 0.4, 0.0, "")  # its commit's hold ended 0.4 s later
    with caplog.at_level("ERROR", logger="ffstate.daemon.watchdog"):
        for v in range(6, 12):  # 2.1 s: the waiting rank is past its 2-s deadline, the culprit silent 1.7 s
            clock["now"] += 0.35
            shards[going].commit(v, clock["now"])
            dog.look()
    assert _named(caplog) == {str(waiting), str(culprit)}, caplog.text
    assert (51, signal.SIGKILL) in signals and (52, signal.SIGKILL) in signals
    # Steps of 5 s under an 8-s ceiling: a rank mid-step is silent for more than half the deadline, but not for two
    # of its steps; it is not named.
    caplog.clear()
    stuck, going = ShardKey("k", 0, 2), ShardKey("k", 1, 2)
    shards = {stuck: FakeSlots(61, 1000.0), going: FakeSlots(62, 1000.0)}
    dog, clock, signals = make(DaemonConfig(hang_floor=2.0, hang_ceiling=8.0, hang_startup=30.0), shards)
    together(dog, clock, shards, 5, 5.0)
    with caplog.at_level("ERROR", logger="ffstate.daemon.watchdog"):
        clock["now"] += 3.5
        shards[going].commit(6, clock["now"])
        for _ in range(10):  # 'stuck' silent 8.5 s, past its 8-s deadline; 'going' 5 s into its step, past half of it
            clock["now"] += 0.5
            dog.look()
    assert _named(caplog) == {str(stuck)}, caplog.text


def _named(caplog) -> set[str]:
    return {r.getMessage().split(" is silent:")[0] for r in caplog.records if " is silent: no commit" in r.getMessage()}


def test_a_straggler_is_reported_from_its_compute_against_its_node_s_other_ranks(monkeypatch):
    monkeypatch.setattr("ffstate.daemon.watchdog.alive", lambda pid: True)
    fast, slow = ShardKey("j", 0, 2), ShardKey("j", 1, 2)
    shards = {fast: FakeSlots(21, 1000.0), slow: FakeSlots(22, 1000.0)}
    dog, clock, _ = make(DaemonConfig(), shards)
    for v in range(1, 6 + STRAGGLER_LOOKS):
        clock["now"] += 0.5
        shards[fast].commit(v, clock["now"], waited=0.3)  # waits 0.3 s of its 0.5 s step for the other
        shards[slow].commit(v, clock["now"], waited=0.0)
        dog.look()
    assert abs(dog.report(slow).straggler_ratio - 0.5 / 0.2) < 1e-6 and dog.report(fast).straggler_ratio < 1
    assert dog.ranks[slow].warned and not dog.ranks[fast].warned


def test_a_rank_held_by_the_lag_policy_is_not_a_straggler(monkeypatch):
    """After a restart its commits are held until replication catches up (lag.py): the others wait for it in
    their collectives, but the held time is not its compute."""
    monkeypatch.setattr("ffstate.daemon.watchdog.alive", lambda pid: True)
    held, other = ShardKey("j", 0, 2), ShardKey("j", 1, 2)
    shards = {held: FakeSlots(41, 1000.0), other: FakeSlots(42, 1000.0)}
    dog, clock, _ = make(DaemonConfig(), shards)
    for v in range(1, 6 + STRAGGLER_LOOKS):
        clock["now"] += 0.5
        shards[held].commit(v, clock["now"], waited=0.0, held=0.3)  # 0.3 s of its 0.5 s step held
        shards[other].commit(v, clock["now"], waited=0.3)
        dog.look()
    assert dog.report(held).straggler_ratio < 1.5 and not dog.ranks[held].warned


def test_where_reads_the_main_thread_from_a_faulthandler_dump():
    dump = ('Thread 0x00007f (most recent call first):\n  File "/x/threading.py", line 320 in wait\n\n'
            'Current thread 0x00007e (most recent call first):\n'
            '  File "/v/site-packages/torch/autograd/graph.py", line 829 in _engine_run_backward\n'
            '  File "/v/site-packages/torch/_tensor.py", line 625 in backward\n'
            '  File "/w/train.py", line 40 in step\n')
    assert where(dump) == ('File "/v/site-packages/torch/autograd/graph.py", line 829 in _engine_run_backward; in '
                           'its own code: File "/w/train.py", line 40 in step')
    assert where('Current thread 0x1 (most recent call first):\n  File "/w/train.py", line 9 in hang\n') == \
        'File "/w/train.py", line 9 in hang'
    assert where("") == "no stack written"
    in_hook = ('Current thread 0x1 (most recent call first):\n'
               '  File "/v/site-packages/torch/distributed/distributed_c10d.py", line 2800 in all_reduce\n'
               '  File "/v/site-packages/ffstate/scheduling/marks.py", line 65 in marked\n'
               '  File "/v/site-packages/torch/nn/parallel/distributed.py", line 1600 in forward\n'
               '  File "/w/train.py", line 40 in step\n')  # ffstate's frames are not the user's code either
    assert where(in_hook, "/v/site-packages/ffstate/").endswith('in its own code: File "/w/train.py", line 40 in step')
    assert stacks.PACKAGE.endswith("/ffstate/") and (Path(stacks.PACKAGE) / "daemon" / "watchdog.py").exists()


def test_steps_much_shorter_than_a_look_end_the_warm_up_and_a_hang_after_them_is_acted_on(monkeypatch):
    """30 ms steps: a rank's first 7 commits all come between two looks, and then it hangs. Its warm-up counts its
    commits (7), not the looks that saw them (1), so its deadline is the step-based one (the floor), not the
    startup allowance, and it is acted on once past it."""
    monkeypatch.setattr("ffstate.daemon.watchdog.alive", lambda pid: True)
    key = ShardKey("j", 0, 4)
    slots = FakeSlots(os.getpid() + 10_000, 1000.0)
    cfg = DaemonConfig(hang_floor=2.0, hang_ceiling=8.0, hang_startup=600.0, hang_multiple=10.0)
    dog, clock, signals = make(cfg, {key: slots})
    for v in range(1, 8):  # between two looks
        clock["now"] += 0.03
        slots.commit(v, clock["now"])
    dog.look()
    assert dog.report(key).deadline_seconds == 2.0  # 10 x 0.03 s, raised to the floor
    clock["now"] += 1.5
    dog.look()
    assert not signals
    clock["now"] += 1.0  # 2.5 s after its last commit: past the deadline
    dog.look()
    assert (slots.record.pid, signal.SIGKILL) in signals


@contextlib.contextmanager
def warm_real_ranks(tmp_path, monkeypatch, ranks: dict[str, tuple[ShardKey, int, str]]):
    """Real slots for each named rank (key, pid, stacks file or ""), each with 5 commits written as its worker writes
    them, 10 ms apart, and a watchdog on a clock set just after them: yields (the watchdog, the clock, the signals it
    sent, name -> (the worker's slots, the daemon's))."""
    import time

    import torch

    from ffstate import layout, shm
    from ffstate.commit import SlotWriter

    monkeypatch.setattr("ffstate.daemon.watchdog.alive", lambda pid: True)
    monkeypatch.setattr(shm.slots, "SHM_DIR", tmp_path)
    state = {"w": torch.zeros(10)}
    manifest = layout.describe(state)
    slots = {}
    for name, (key, _, _) in ranks.items():
        paths = shm.slot_paths("n0", key.job_id, key.rank, key.world_size)
        shm.create_slots(paths, manifest, 4096)
        slots[name] = (shm.Slots(paths, manifest), shm.Slots(paths, manifest, tensors=False))  # (the worker's, the daemon's)
    clock = {"now": time.time()}
    signals: list[tuple[int, int]] = []
    # hang_multiple 2: the deadline stays at the floor unless a gap between these real commits passes 1 s (at the
    # default 10, one of 0.2 s on a loaded machine would have raised it past the 3 s the tests move the clock by).
    dog = Watchdog(DaemonConfig(hang_floor=2.0, hang_startup=30.0, hang_multiple=2.0),
                   lambda: [(ranks[n][0], slots[n][1]) for n in ranks], kill=lambda pid, sig: signals.append((pid, sig)),
                   clock=lambda: clock["now"], sleep=lambda s: None)
    try:
        for name, (worker, _) in slots.items():
            worker.set_worker(ranks[name][1], ranks[name][2])
            writer = SlotWriter(worker)
            for v in range(1, 6):
                writer.commit(state, v)
                time.sleep(0.01)
        clock["now"] = time.time()
        yield dog, clock, signals, slots
    finally:
        for pair in slots.values():
            for sl in pair:
                sl.close()


def test_a_worker_that_left_replicate_is_not_asked_for_stacks_and_has_the_startup_allowance(tmp_path, monkeypatch):
    """Under the in-process engine a rank leaves ``ffstate.replicate`` at a restart and stays in its process, its
    SIGUSR1 handler (``faulthandler``) unregistered, until it enters again. Its record (real slots, as the worker
    writes them) then names no stacks file and restarts the warm-up: the restart is not taken for a hang at the
    step-based deadline, and the signal that would end a process without the handler is never sent to it."""
    keys = {"left": ShardKey("a", 0, 1), "stays": ShardKey("b", 0, 1)}
    ranks = {"left": (keys["left"], 51, str(tmp_path / "stacks-left.txt")),
             "stays": (keys["stays"], 52, str(tmp_path / "stacks-stays.txt"))}
    with warm_real_ranks(tmp_path, monkeypatch, ranks) as (dog, clock, signals, slots):
        dog.look()
        assert dog.report(keys["left"]).deadline_seconds == 2.0  # warm: the floor
        slots["left"][0].set_left()
        clock["now"] += 3.0  # past the floor for both
        dog.look()
        assert dog.report(keys["left"]).deadline_seconds == 30.0  # the startup allowance, from the leave
        assert signals == [(52, signal.SIGUSR1), (52, signal.SIGKILL)]
        clock["now"] += 30.0  # past the allowance: acted on, without the signal it has no handler for
        dog.look()
        assert signals[2:] == [(51, signal.SIGKILL)]


def test_a_process_that_left_unwatched_is_forgotten_and_not_taken_along_by_another_rank_s_hang(tmp_path, monkeypatch):
    """One process, no launcher: a rank that leaves ``ffstate.replicate`` with an error and goes on is no longer the
    watchdog's (``set_left(watched=False)``), at once: when another rank of its job hangs later, the job's local
    ranks are acted on, and the process that left is not one of them (its stale watch took it along before)."""
    keys = [ShardKey("j", 0, 2), ShardKey("j", 1, 2)]
    with warm_real_ranks(tmp_path, monkeypatch, {"0": (keys[0], 61, ""), "1": (keys[1], 62, "")}) as (dog, clock,
                                                                                                      signals, slots):
        dog.look()
        assert dog.report(keys[0]).deadline_seconds == 2.0 and dog.report(keys[1]).deadline_seconds == 2.0
        slots["0"][0].set_left(watched=False)
        dog.look()
        assert slots["0"][1].worker() is None and dog.report(keys[0]) is None
        clock["now"] += 3.0  # rank 1 past its deadline
        dog.look()
        assert signals == [(62, signal.SIGKILL)], signals
        for _ in range(3):
            clock["now"] += 100.0  # far past every deadline and allowance
            dog.look()
        assert all(pid != 61 for pid, _ in signals), signals


class Header:
    def __init__(self) -> None:
        self.comm_inflight = 0


def test_a_hang_kills_the_rank_that_never_reached_the_collective_not_those_waiting_for_it(monkeypatch):
    """A hang stops every rank of the job together: the hung one in its own code, the others waiting in the
    collective for it (their marks say one is on the wire). Only the hung one is killed: a launcher restarts every
    rank whichever dies, and the in-process engine keeps the others in their processes (killing every local rank,
    as before, cost each node its ranks there and left no spare). A node whose ranks all wait leaves the act to the
    node they wait for, and kills them one deadline later if no restart came."""
    monkeypatch.setattr("ffstate.daemon.watchdog.alive", lambda pid: True)
    keys = [ShardKey("j", r, 4) for r in range(4)]
    shards = {k: FakeSlots(5000 + k.rank, 1000.0) for k in keys}
    for s in shards.values():
        s.headers = [Header()]
    node0, node1 = {k: shards[k] for k in keys[:2]}, {k: shards[k] for k in keys[2:]}
    cfg = DaemonConfig(hang_floor=2.0, hang_startup=30.0)
    dog0, clock, signals0 = make(cfg, node0)
    dog1, _, signals1 = make(cfg, node1)
    dog1.clock = dog0.clock  # one clock for both nodes
    for v in range(1, 8):
        clock["now"] += 0.1
        for s in shards.values():
            s.commit(v, clock["now"])
        dog0.look()
        dog1.look()
    for r in (0, 2, 3):  # rank 1 hangs in its own code; the others wait for it in DDP's all-reduce
        shards[keys[r]].headers[0].comm_inflight = 1
    clock["now"] += 2.1
    dog0.look()
    dog1.look()
    assert signals0 == [(5001, signal.SIGKILL)]  # the hung rank alone
    assert signals1 == []  # both wait on the wire: the rank they wait for is node 0's
    clock["now"] += 1.0  # the restart has not come yet: node 1 waits one more deadline
    dog1.look()
    assert signals1 == []
    clock["now"] += 1.5  # past it: a hang inside the collectives themselves, as far as node 1 can tell
    dog1.look()
    assert sorted(signals1) == [(5002, signal.SIGKILL), (5003, signal.SIGKILL)]
    clock["now"] += 10
    dog0.look()
    assert signals0 == [(5001, signal.SIGKILL)]  # rank 0, waiting, was not taken for the hang's


def test_ranks_waiting_on_the_wire_are_not_killed_when_the_restart_comes_before_their_second_deadline(monkeypatch):
    monkeypatch.setattr("ffstate.daemon.watchdog.alive", lambda pid: True)
    keys = [ShardKey("j", r, 4) for r in range(2)]  # ranks 2 and 3 on another node
    shards = {k: FakeSlots(6000 + k.rank, 1000.0) for k in keys}
    for s in shards.values():
        s.headers = [Header()]
        s.headers[0].comm_inflight = 0
    dog, clock, signals = make(DaemonConfig(hang_floor=2.0, hang_startup=30.0), shards)
    together(dog, clock, shards, 7, 0.1)
    for s in shards.values():
        s.headers[0].comm_inflight = 1
    clock["now"] += 2.1
    dog.look()
    assert not signals
    for s in shards.values():  # the other node's rank was killed; the engine's restart: each left its step
        s.headers[0].comm_inflight = 0
        s.record, s.count = WorkerRecord(s.record.pid, clock["now"], 0.0, ""), 0  # as set_left writes it
    for _ in range(8):
        clock["now"] += 0.5
        dog.look()
    assert not signals and not dog.deferred


def test_a_one_node_job_whose_ranks_all_wait_is_killed_at_once_and_log_only_names_every_rank_once(monkeypatch):
    """No other node to act: every rank waiting on the wire (a hang inside the collective itself) is killed at its
    deadline, not one later. Under hang_action=log nothing is killed and each rank's stacks are asked for once."""
    monkeypatch.setattr("ffstate.daemon.watchdog.alive", lambda pid: True)
    for action, expected in (("kill", signal.SIGKILL), ("log", None)):
        keys = [ShardKey("j", r, 2) for r in range(2)]
        shards = {k: FakeSlots(7000 + k.rank, 1000.0) for k in keys}
        for s in shards.values():
            s.headers = [Header()]
        dog, clock, signals = make(DaemonConfig(hang_floor=2.0, hang_startup=30.0, hang_action=action), shards)
        together(dog, clock, shards, 7, 0.1)
        for s in shards.values():
            s.headers[0].comm_inflight = 1
        for _ in range(12):
            clock["now"] += 0.5
            dog.look()
        kills = sorted(pid for pid, sig in signals if sig == signal.SIGKILL)
        assert kills == ([7000, 7001] if expected else []), (action, signals)
        assert not dog.deferred


C10D = os.sep.join(["", "v", "torch", "distributed", "distributed_c10d.py"])
ALL_REDUCE = ('Thread 0x00007f (most recent call first):\n  File "/x/ffstate/shm/worker.py", line 9 in _wait\n\n'
              'Current thread 0x00007e (most recent call first):\n'
              f'  File "{C10D}", line 2938 in all_reduce\n'
              '  File "/v/torch/distributed/c10d_logger.py", line 81 in wrapper\n'
              '  File "/job/train.py", line 50 in main\n')
OWN = 'Current thread 0x00007e (most recent call first):\n  File "/job/train.py", line 44 in slow_thing\n'


def test_a_rank_waiting_in_the_loop_s_own_collective_is_read_from_its_stacks_and_not_killed(monkeypatch, tmp_path,
                                                                                            caplog):
    """The loop's own ``dist.all_reduce`` (a loss logged each step) is not one of the collectives ffstate marks: a
    rank waiting in it for a hung one was taken for hung and killed too, which in the in-process mode costs a spare
    for each. A stuck rank with nothing marked is now asked for its stacks first: inside torch.distributed, it
    waits. The hung rank alone is killed; a node whose ranks all wait there defers as with marked collectives."""
    monkeypatch.setattr("ffstate.daemon.watchdog.alive", lambda pid: True)
    keys = [ShardKey("j", r, 4) for r in range(4)]
    shards = {k: FakeSlots(6000 + k.rank, 1000.0, str(tmp_path / f"s{k.rank}.txt")) for k in keys}
    node0, node1 = {k: shards[k] for k in keys[:2]}, {k: shards[k] for k in keys[2:]}
    cfg = DaemonConfig(hang_floor=2.0, hang_startup=30.0)
    dog0, clock, signals0 = make(cfg, node0)
    dog1, _, signals1 = make(cfg, node1)
    dog1.clock = dog0.clock

    def stacks_on_signal(dog, signals):
        def kill(pid, sig):
            signals.append((pid, sig))
            if sig == signal.SIGUSR1:  # the worker's faulthandler writes its stacks
                with open(tmp_path / f"s{pid - 6000}.txt", "a") as f:
                    f.write(OWN if pid == 6001 else ALL_REDUCE)
        dog.kill = kill

    stacks_on_signal(dog0, signals0)
    stacks_on_signal(dog1, signals1)
    together(dog0, clock, shards, 7, 0.1)
    for _ in range(7):
        dog1.look()
    clock["now"] += 2.5  # rank 1 hangs in its own code; 0, 2 and 3 wait for it in the loop's all_reduce
    with caplog.at_level("ERROR"):
        dog0.look()
        dog1.look()
    assert [s for s in signals0 if s[1] == signal.SIGKILL] == [(6001, signal.SIGKILL)]  # the hung rank alone
    assert [s for s in signals1 if s[1] == signal.SIGKILL] == []  # both wait: the rank they wait for is node 0's
    assert "j/rank 0 of 4 (pid 6000) waits" in caplog.text and "(pid 6001) is hung" in caplog.text
    asked = len(signals1)
    clock["now"] += 1.0
    dog1.look()  # deferring: its ranks' stacks were read once this silence, not at every look
    assert len(signals1) == asked
    clock["now"] += 1.5  # past one more deadline with no restart: a hang inside the collective itself
    dog1.look()
    assert sorted(s for s in signals1 if s[1] == signal.SIGKILL) == [(6002, signal.SIGKILL), (6003, signal.SIGKILL)]


def test_a_rank_in_a_receive_the_others_are_not_in_is_the_hang_s_beside_ranks_waiting_in_a_marked_collective(
        monkeypatch, tmp_path, caplog):
    """A rank stuck in a receive no rank answers (a mismatched collective) is inside torch.distributed too, but the
    other local rank waits in DDP's marked all-reduce: the one in a call the others are not in is the hang's, killed
    alone, with no deferral, and without a second's wait for its stacks before the act (its outcome is the old
    rule's: this guards it against the stacks rule)."""
    monkeypatch.setattr("ffstate.daemon.watchdog.alive", lambda pid: True)
    keys = [ShardKey("j", r, 4) for r in (2, 3)]
    shards = {k: FakeSlots(7000 + k.rank, 1000.0, str(tmp_path / f"s{k.rank}.txt")) for k in keys}
    for s in shards.values():
        s.headers = [Header()]
    dog, clock, signals = make(DaemonConfig(hang_floor=2.0, hang_startup=30.0), shards)

    def kill(pid, sig):
        signals.append((pid, sig))
        if sig == signal.SIGUSR1:
            with open(tmp_path / f"s{pid - 7000}.txt", "a") as f:
                f.write(ALL_REDUCE.replace("2938 in all_reduce", "2799 in recv") if pid == 7002 else OWN)
    dog.kill = kill
    waited: list[float] = []
    dog.sleep = waited.append
    together(dog, clock, shards, 7, 0.1)
    shards[keys[1]].headers[0].comm_inflight = 1  # rank 3 waits in DDP's all-reduce
    clock["now"] += 2.5
    with caplog.at_level("ERROR"):
        dog.look()
    assert [s for s in signals if s[1] == signal.SIGKILL] == [(7002, signal.SIGKILL)]
    assert len(waited) == 1  # one round of stacks, for the log: none asked before the act
    assert "(pid 7002) is hung: File" in caplog.text and "(pid 7003) waits: File" in caplog.text


def test_a_survivor_s_next_entry_in_the_same_process_is_a_new_silence_and_log_names_a_waiting_rank_waits(
        monkeypatch, tmp_path, caplog):
    """In-process, a survivor enters again with the same pid: what its stacks said in the last hang (it waited) is not
    kept past its next sign of life; asked again, it is found hung in its own code and killed alone. Under
    ``hang_action=log`` a rank read waiting in the loop's all-reduce is named as waiting."""
    import dataclasses

    monkeypatch.setattr("ffstate.daemon.watchdog.alive", lambda pid: True)
    a, b = ShardKey("j", 0, 2), ShardKey("j", 1, 2)
    shards = {a: FakeSlots(8000, 1000.0, str(tmp_path / "a.txt")), b: FakeSlots(8001, 1000.0, str(tmp_path / "b.txt"))}
    dog, clock, signals = make(DaemonConfig(hang_floor=2.0, hang_startup=5.0), shards)
    says = {8000: ALL_REDUCE, 8001: OWN}

    def kill(pid, sig):
        signals.append((pid, sig))
        if sig == signal.SIGUSR1:
            with open(tmp_path / ("a.txt" if pid == 8000 else "b.txt"), "a") as f:
                f.write(says[pid])
    dog.kill = kill
    together(dog, clock, shards, 7, 0.1)
    clock["now"] += 2.5
    dog.look()
    assert [s for s in signals if s[1] == signal.SIGKILL] == [(8001, signal.SIGKILL)]  # rank 0 waited
    # The restart: rank 1's spare (a new pid), rank 0 enters again in its process (its record's sign of life moves).
    shards[b] = FakeSlots(8002, clock["now"], str(tmp_path / "b.txt"))
    shards[a].record = dataclasses.replace(shards[a].record, alive=clock["now"])
    says.update({8000: OWN, 8002: ALL_REDUCE})  # now rank 0 hangs in its own code, before its first commit
    signals.clear()
    clock["now"] += 5.5  # past the startup allowance
    dog.look()
    assert [s for s in signals if s[1] == signal.SIGKILL] == [(8000, signal.SIGKILL)], signals

    logged = {k: FakeSlots(8100 + k.rank, 1000.0, str(tmp_path / f"l{k.rank}.txt")) for k in (a, b)}
    dog, clock, signals = make(DaemonConfig(hang_floor=2.0, hang_startup=30.0, hang_action="log"), logged)

    def write(pid, sig):
        signals.append((pid, sig))
        with open(tmp_path / f"l{pid - 8100}.txt", "a") as f:
            f.write(ALL_REDUCE if pid == 8100 else OWN)
    dog.kill = write
    together(dog, clock, logged, 7, 0.1)
    clock["now"] += 2.5
    with caplog.at_level("ERROR"):
        dog.look()
    assert "(pid 8100) waits: File" in caplog.text and "(pid 8101) is hung: File" in caplog.text
    assert not [s for s in signals if s[1] == signal.SIGKILL]
