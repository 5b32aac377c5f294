"""The replica daemon end to end: real ``ffstate serve`` processes on loopback, real writer processes,
real SIGKILLs. Two daemons act as two nodes: A holds the writer's slots and pushes to B."""

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from daemons import TOKEN, held_version, make_tls, wait_until
from ffstate import codec, layout, recovery, shm
from ffstate.client import Client, Tls, fetch_striped
from ffstate.commit import SlotWriter
from ffstate.errors import ReplicaError, ReplicaUnavailable
from helpers import assert_bitwise_equal

pytestmark = pytest.mark.timeout(180)
WRITER = Path(__file__).parents[1] / "procs" / "writer.py"


def run_writer(a, job, steps, tmp_path, *extra, rank=0, world=2, check=True):
    dump = tmp_path / f"states-{job}-{rank}.pt"
    proc = subprocess.run(
        [sys.executable, str(WRITER), a.address, job, str(rank), str(world), str(steps), "--dump", str(dump), *extra],
        capture_output=True, text=True, timeout=120, env={**os.environ, "FFSTATE_TOKEN": TOKEN},
    )
    if check:
        assert proc.returncode == 0, proc.stderr
    return proc, torch.load(dump, weights_only=False)


def attached_slots(a, job, steps, states=None):
    """An in-process worker's slots (rank 0 of 1) attached at daemon ``a``, and ``steps`` training states to commit
    (or ``states``, made beforehand)."""
    from helpers import train_states

    states = list(states or train_states(steps))
    manifest = layout.describe(states[0])
    with a.client() as c:
        return shm.Slots(list(c.attach(job, 0, 1, manifest).slot_paths), manifest), states


@pytest.fixture
def pair(daemons):  # keeping 5 deltas (W + 1 for a job's max_lag 4): the step-back tests reach that far
    b = daemons.start("--keep-deltas", "5")
    a = daemons.start("--peer", b.address, "--keep-deltas", "5")
    return a, b


@pytest.fixture(scope="module")
def shared_pair(module_daemons):
    """A and its holder B, shared by the tests that each use a job of their own and kill neither."""
    b = module_daemons.start("--keep-deltas", "5")
    a = module_daemons.start("--peer", b.address, "--keep-deltas", "5")
    return a, b


def test_commits_replicate_bit_exact_full_then_deltas(shared_pair, tmp_path):
    a, b = shared_pair
    _, states = run_writer(a, "j1", 6, tmp_path, "--wait-replicated")
    cb = b.client()
    wait_until(lambda: held_version(cb, "j1", 0) == 6, what="B to hold version 6")
    assert_bitwise_equal(codec.decode(cb.fetch("j1", 0, 2)), states[-1])
    inv = cb.inventory("j1")
    # Deltas, after one full version: B can step back to 5 and 4 (it keeps the deltas it applied; a full version
    # would have left nothing to step back through), and A's log names one full push, the seed.
    assert list(inv.shards[0].versions)[:3] == [6, 5, 4]
    assert len(re.findall(r"pushed j1/rank 0 of 2 version \d+ to \S+: full", a.log())) == 1, a.log()[-2000:]
    mine = [s for s in a.client().inventory("j1").shards if s.local]
    assert mine[0].pushed_versions == 6
    # A serves its own rank from the slots: the node-local copy.
    assert_bitwise_equal(codec.decode(a.client().fetch("j1", 0, 2)), states[-1])
    # And tells the worker what its holders have through the slot header: a commit reads its lag there.
    desc = a.client().lookup("j1", 0, 2)
    slots = shm.Slots([Path(p) for p in desc.slot_paths], layout.Manifest.from_json(desc.manifest_json))
    try:
        assert slots.replicated() == 6
    finally:
        slots.close()


def test_writer_killed_mid_write_leaves_the_previous_version_intact(shared_pair, tmp_path):
    a, b = shared_pair
    proc, states = run_writer(a, "j2", 5, tmp_path, "--die-mid-write", "4", check=False)
    assert proc.returncode == -signal.SIGKILL and "committed 3" in proc.stdout
    ca, cb = a.client(), b.client()
    assert_bitwise_equal(codec.decode(ca.fetch("j2", 0, 2)), states[2])  # the slot of version 3
    wait_until(lambda: held_version(cb, "j2", 0) == 3, what="B at version 3")
    time.sleep(0.3)  # a torn slot must never be picked up
    assert held_version(cb, "j2", 0) == 3
    assert_bitwise_equal(codec.decode(cb.fetch("j2", 0, 2)), states[2])
    # The restarted worker re-attaches, learns version 3 is committed, and carries on.
    proc, states = run_writer(a, "j2", 5, tmp_path, "--from", "3")
    assert "attached 3" in proc.stdout
    wait_until(lambda: held_version(cb, "j2", 0) == 5, what="B at version 5")
    assert_bitwise_equal(codec.decode(cb.fetch("j2", 0, 2)), states[4])


def test_step_back_w_versions_bit_exact(shared_pair, tmp_path):
    a, b = shared_pair
    _, states = run_writer(a, "j3", 7, tmp_path, "--wait-replicated")
    cb = b.client()
    wait_until(lambda: held_version(cb, "j3", 0) == 7, what="B at version 7")
    versions = list(cb.inventory("j3").shards[0].versions)
    assert versions == [7, 6, 5, 4, 3, 2]  # the held version and keep_deltas (W + 1 = 5) deltas back
    assert_bitwise_equal(codec.decode(cb.fetch("j3", 0, 2, version=4)), states[3])  # a stepped-back copy
    assert cb.step_back("j3", 0, 2, 2).version == 2
    assert_bitwise_equal(codec.decode(cb.fetch("j3", 0, 2)), states[1])
    with pytest.raises(ReplicaError) as e:
        cb.step_back("j3", 0, 2, 1)
    assert e.value.code == "NOT_FOUND"


def test_reattach_after_a_restore_resumes_replication_at_v_star_with_deltas(shared_pair, tmp_path):
    """A worker restored to v* = 3 re-attaches while the slots still hold 4 and 5 of the run that died, and the
    holder has them too: the daemon un-commits them (never re-read as new versions), steps its own copy back to
    3, and asks the holder to step back to 3; the redone steps (different here: another seed) then go out as
    deltas on 3, no full version. Both keep their reach back across the restart."""
    a, b = shared_pair
    _, old = run_writer(a, "j9", 5, tmp_path, "--wait-replicated")
    cb, ca = b.client(), a.client()
    wait_until(lambda: held_version(cb, "j9", 0) == 5, what="B at version 5")
    assert sorted(ca.lookup("j9", 0, 2).committed_versions) == [4, 5]
    fulls = len(re.findall(r"version \d+ to \S+: full", a.log()))
    proc, new = run_writer(a, "j9", 7, tmp_path, "--resume-at", "3", "--seed", "1", "--wait-replicated")
    assert "attached 0" in proc.stdout  # described after the discard, in the same call
    wait_until(lambda: held_version(cb, "j9", 0) == 7, what="B at version 7")
    assert len(re.findall(r"version \d+ to \S+: full", a.log())) == fulls, a.log()[-3000:]
    assert re.search(r"stepped j9/rank 0 of 2 back to version 3, where the job resumed", a.log())
    assert list(cb.inventory("j9").shards[0].versions)[:5] == [7, 6, 5, 4, 3]  # 5, 4: the redone ones
    for v, want in ((7, new[6]), (4, new[3]), (3, old[2])):
        assert_bitwise_equal(codec.decode(cb.fetch("j9", 0, 2, version=v)), want)
    assert_bitwise_equal(codec.decode(ca.fetch("j9", 0, 2, version=3)), old[2])  # the node's copy reaches back


def test_remote_daemon_killed_and_restarted_is_reseeded(daemons, tmp_path):
    b = daemons.start()
    a = daemons.start("--peer", b.address)
    _, states = run_writer(a, "j4", 3, tmp_path)
    wait_until(lambda: held_version(b.client(), "j4", 0) == 3, what="B at version 3")
    b.kill()
    b2 = daemons.restart(b)
    assert held_version(b2.client(), "j4", 0) == 0  # its memory died with it
    _, states = run_writer(a, "j4", 5, tmp_path, "--from", "3")
    cb = b2.client()
    wait_until(lambda: held_version(cb, "j4", 0) == 5, what="the restarted B re-seeded at version 5")
    assert_bitwise_equal(codec.decode(cb.fetch("j4", 0, 2)), states[4])
    # The restarted B had nothing to apply a delta to, so A re-seeded it with a full version (of whichever
    # version its slots held when the worker re-attached: 2, 3, 4 or 5).
    def fulls() -> list[str]:  # A logs a push once B has answered it: after B holds it
        return re.findall(r"pushed j4/rank 0 of 2 version (\d) to \S+: full", a.log())

    wait_until(lambda: len(fulls()) >= 2, 10.0, "A's log line of the re-seed")
    assert len(fulls()) == 2, a.log()[-2000:]  # the first seed, then the re-seed


def test_an_unreachable_holder_gets_nothing_encoded_until_it_answers_then_its_full_version(daemons, tmp_path):
    """A holder found unreachable costs its peers no encoding (a full version of a large state is seconds of CPU)
    while it stays down: looks at its connection, no pushes. Once it answers, its full version goes at once."""
    b = daemons.start()
    a = daemons.start("--peer", b.address)
    run_writer(a, "j6", 2, tmp_path)
    wait_until(lambda: held_version(b.client(), "j6", 0) == 2, what="B at version 2")
    b.kill()
    _, states = run_writer(a, "j6", 4, tmp_path, "--from", "2")
    time.sleep(2.5)  # B down: pushes were retried (each a full version) 5 times in this while before
    b2 = daemons.restart(b)
    cb = b2.client()
    wait_until(lambda: held_version(cb, "j6", 0) == 4, what="the restarted B re-seeded at version 4")
    log = a.log()
    assert len(re.findall(r"push of j6/rank 0 of 2 version \d+ to \S+ failed", log)) == 1, log[-3000:]  # found down
    assert re.search(r"holder \S+ answers again after [\d.]+s: j6/rank 0 of 2 goes to it next", log), log[-3000:]
    assert_bitwise_equal(codec.decode(cb.fetch("j6", 0, 2)), states[3])


def test_a_holder_that_stalls_or_is_lost_holds_back_neither_the_other_holder_nor_its_lag_bound(daemons, tmp_path):
    """With two holders (``replicas`` 2) each gets its pushes on its own: one whose daemon stops answering (its push
    hangs until its deadline, minutes) held back the other's deltas all that while. One found unreachable is not
    counted in the version the worker's lag check reads (nor in its down count, which made the check hold for
    none), so the bound holds for the other while it is gone; ``ffstate status`` and the metrics say it is down."""
    import urllib.request

    b, c = daemons.start(), daemons.start()
    a = daemons.start("--peer", b.address, "--peer", c.address, metrics=True)
    slots, states = attached_slots(a, "j8", 8)
    cb, cc = b.client(), c.client()
    writer = SlotWriter(slots)
    try:
        writer.commit(states[0], 1)
        wait_until(lambda: held_version(cb, "j8", 0) == 1 and held_version(cc, "j8", 0) == 1, what="both at 1")
        b.proc.send_signal(signal.SIGSTOP)  # B's pushes hang
        for v in range(2, 6):
            writer.commit(states[v - 1], v)
            wait_until(lambda v=v: held_version(cc, "j8", 0) == v, timeout=15, what=f"C at {v}, B stopped")
        b.kill()  # B's node lost: its pushes now fail, it is down
        for v in range(6, 9):
            writer.commit(states[v - 1], v)
            wait_until(lambda v=v: held_version(cc, "j8", 0) == v, timeout=15, what=f"C at {v}, B lost")
        wait_until(lambda: (slots.replicated(), slots.holders_down()) == (8, 0), timeout=15,
                   what=f"the header at C's version, no holder down to skip the hold for: {slots.replicated()}, "
                        f"{slots.holders_down()}")
        assert_bitwise_equal(codec.decode(cc.fetch("j8", 0, 1)), states[7])
        with a.client() as ca:  # the lag is C's (0); B is not hidden by it
            local = next(s for s in ca.inventory("j8").shards if s.local)
        assert (local.version, local.replicated_version, local.holders_down) == (8, 8, 1)
        text = urllib.request.urlopen(f"http://127.0.0.1:{a.metrics_port}/metrics", timeout=10).read().decode()
        assert f'ffstate_holders_down{{job="j8",node="{a.node_id}",rank="0"}} 1.0' in text, text
        out = subprocess.run([sys.executable, "-m", "ffstate.cli", "status", "--daemon", a.address],
                             capture_output=True, text=True, timeout=60,
                             env={**os.environ, "FFSTATE_TOKEN": TOKEN, "COLUMNS": "200"})
        assert re.search(r"j8 +│ +0/1 +│ +local +│ +8 .*│ +0 \(1 holder down\)", out.stdout), out.stdout
    finally:
        slots.close()
        b.kill()  # stopped still, if a check above failed


def test_daemon_exit_removes_its_shared_memory(daemons, tmp_path):
    a = daemons.start()
    run_writer(a, "j5", 2, tmp_path)
    slots = list(shm.slots.SHM_DIR.glob(f"ffstate-{a.node_id}-*"))
    assert len(slots) == 2
    assert a.terminate() == 0
    assert not any(p.exists() for p in slots)



def test_a_flood_of_sigterms_stops_the_daemon_cleanly(daemons, tmp_path):
    """Signals close behind each other (a supervisor's, a second Ctrl-C, the suite's own clean-up) deadlocked a
    daemon whose handler set its stop event itself (7 of 10 flooded for 0.5 s): it stops, its slots removed."""
    for i in range(3):
        a = daemons.start()
        run_writer(a, f"j5f{i}", 1, tmp_path)
        slots = list(shm.slots.SHM_DIR.glob(f"ffstate-{a.node_id}-*"))
        assert len(slots) == 2
        deadline = time.monotonic() + 0.5
        while time.monotonic() < deadline and a.proc.poll() is None:
            try:
                os.kill(a.proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                break
        try:
            code = a.proc.wait(20)
        except subprocess.TimeoutExpired:
            code = a.terminate()  # stuck: its stacks in the message
        assert code == 0, a.log()[-3000:]
        assert "SIGTERM: stopping" in a.log() and f"daemon {a.node_id} stopped" in a.log(), a.log()[-3000:]
        assert not any(p.exists() for p in slots)

def test_sigusr2_writes_every_thread_s_stack_to_the_daemon_s_log_and_it_goes_on(daemons):
    """What a stuck daemon is doing, read without stopping it (the suite's teardown asks for it before a SIGKILL)."""
    d = daemons.start()
    d.proc.send_signal(signal.SIGUSR2)
    deadline = time.monotonic() + 10
    # Every thread's stack, the main thread's among them ("Current thread" only when the kernel gave the signal to a
    # Python thread: a gRPC thread of C's gets it as often, and then every one is a "Thread").
    while "_run_module_as_main" not in d.log() and time.monotonic() < deadline:
        time.sleep(0.1)
    log = d.log()
    assert "most recent call first" in log and "serve" in log, log[-3000:]  # the main thread, in the daemon's loop
    with d.client() as c:
        assert c.inventory("").shards == []  # still serving
    assert d.terminate() == 0


def test_the_daemon_runs_on_the_cpus_it_is_given_every_thread_of_it(daemons):
    """``--cpus`` (Config.daemon_cpus for a started daemon): cores of its own for every thread it has, started from a
    process pinned to other cores (as a rank that starts its node's daemon may be)."""
    mine = os.sched_getaffinity(0)
    cpu = max(mine)
    os.sched_setaffinity(0, {min(mine)})  # started as from a rank pinned to another core: it moves off it
    try:
        d = daemons.start("--cpus", str(cpu))
    finally:
        os.sched_setaffinity(0, mine)
    with d.client() as c:
        assert c.inventory("").shards == []  # serving: its threads are up
    tasks = list(Path(f"/proc/{d.proc.pid}/task").iterdir())
    allowed = {t.name: (t / "status").read_text().split("Cpus_allowed_list:")[1].split()[0] for t in tasks}
    assert len(allowed) > 5 and set(allowed.values()) == {str(cpu)}, allowed
    assert f"running on CPUs {cpu}" in d.log()
    assert d.terminate() == 0


def test_cpus_the_daemon_may_not_use_are_refused_at_its_start_by_number(tmp_path):
    (tmp_path / "token").write_text(TOKEN)
    out = subprocess.run([sys.executable, "-m", "ffstate.cli", "serve", "--token-file", str(tmp_path / "token"),
                          "--host", "127.0.0.1", "--port", "0", "--cpus", "4000-4001"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and "--cpus 4000-4001: none of these CPUs can be used here" in out.stderr, out.stderr
    some = f"{min(os.sched_getaffinity(0))},4000"  # one it may use, one it may not: the kernel would keep the first
    out = subprocess.run([sys.executable, "-m", "ffstate.cli", "serve", "--token-file", str(tmp_path / "token"),
                          "--host", "127.0.0.1", "--port", "0", "--cpus", some], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode != 0 and "CPUs 4000 are offline or outside this process's cpuset" in out.stderr, out.stderr
    out = subprocess.run([sys.executable, "-m", "ffstate.cli", "serve", "--token-file", str(tmp_path / "token"),
                          "--host", "127.0.0.1", "--port", "0", "--cpus", "3-1"], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode != 0 and "a CPU list such as '60-63'" in out.stderr, out.stderr


def test_idle_daemon_exits_by_itself(daemons):
    d = daemons.start("--idle-exit", "1")
    assert d.proc.wait(20) == 0
    assert "idle" in d.log()


def test_an_auto_started_daemon_exits_at_the_jobs_drop_not_at_one_ranks(daemons):
    """A worker whose state changes layout drops its rank and attaches again at once: the daemon a worker
    started (--exit-when-empty) must not take that for the job's end, which a drop of the whole job is."""
    a = daemons.start("--exit-when-empty")
    slots, states = attached_slots(a, "j12", 1)
    slots.close()
    with a.client() as c:
        assert c.drop("j12", 0, 1) == 1
        time.sleep(1.0)  # the daemon's loop looks every 0.5 s
        assert a.proc.poll() is None, a.log()
        slots, _ = attached_slots(a, "j12", 1)  # the rank comes back with its new layout
        slots.close()
        assert c.drop("j12") == 1
    assert a.proc.wait(20) == 0
    assert "job's drop" in a.log()


def test_a_holder_address_that_reaches_this_nodes_own_daemon_is_refused(daemons):
    """What a node published for another node must not lead back to this node's daemon (an address that only
    works locally, two nodes publishing one address): the rank refuses at entry, naming both."""
    from types import SimpleNamespace

    from ffstate.daemon.launch import check_holders
    from ffstate.errors import FFStateError

    mine, other = daemons.start(node_id="nodeA"), daemons.start(node_id="nodeB")
    with mine.client() as a, other.client() as b:
        clients = {mine.address: a, other.address: b}
        job = SimpleNamespace(job="j13", rank=2, topology=SimpleNamespace(node_id="nodeA"), client=clients.get)
        check_holders(job, [1], [other.address])  # the other node's daemon: fine
        with pytest.raises(FFStateError, match=f"node 1's daemon was published at {mine.address}, but the daemon "
                                               "answering there is this node's own \\(nodeA\\)"):
            check_holders(job, [1], [mine.address])


def test_a_killed_daemons_slots_are_reclaimed_by_the_nodes_next_daemon(daemons):
    """SIGKILL leaves a daemon's slot files in /dev/shm (memory) with no one to remove them; the node's next
    daemon removes those whose daemon is gone at its start, and leaves a live daemon's alone."""
    a = daemons.start()
    slots, _ = attached_slots(a, "j14", 1)
    paths = list(slots.paths)
    slots.close()
    live = daemons.start()  # another node's live daemon: its slots stay
    live_slots, _ = attached_slots(live, "j14", 1)
    live_slots.close()
    a.kill()
    assert all(p.exists() for p in paths)
    b = daemons.start(node_id=a.node_id)
    assert not any(p.exists() for p in paths)
    assert all(p.exists() for p in live_slots.paths)
    assert f"removed {paths[0]}, left by a daemon of node {a.node_id} that is gone" in b.log()


def test_commits_alone_keep_an_idle_exit_daemon_serving(daemons):
    """A worker with no replicas (one node) commits into its slots and never calls its daemon: the daemon
    must count those commits as activity, or its --idle-exit would remove the only copy mid-training."""
    from helpers import train_states

    # The states are made before the daemon starts: its idle clock runs from its start, and making them took 1.25 s
    # here unloaded, long enough under load for the daemon to leave before the attach (3 failures in 3 loaded runs).
    states = list(train_states(2))
    a = daemons.start("--idle-exit", "4")
    slots, states = attached_slots(a, "j10", 2, states)
    try:
        for v in range(1, 41):  # 8 s of commits, twice the idle timeout, and no call to the daemon
            SlotWriter(slots).commit(states[v % 2], v)
            time.sleep(0.2)
            assert a.proc.poll() is None, f"the daemon exited while commits went on (version {v}):\n{a.log()}"
        assert all(p.exists() for p in slots.paths)
    finally:
        slots.close()
    assert a.proc.wait(30) == 0  # commits stopped: idle now
    assert "idle for 4s" in a.log()


def test_a_commit_rings_the_daemon_which_takes_it_at_once(daemons, tmp_path):
    """The worker rings its daemon's doorbell after each commit. With the daemon's own look at the slots
    an hour apart, only the ring can make it take each version (mark it taken and checksum it); rings that
    name no attached rank, or are malformed, change nothing."""
    import socket

    a = daemons.start("--slot-poll", "3600")
    slots, states = attached_slots(a, "j11", 3)
    try:
        address, ring = slots._bell.address, slots._bell.ring_bytes
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
            for junk in (b"", b"x", ring + b"x", (12345).to_bytes(8, "little"), os.urandom(64)):
                s.sendto(junk, address)
        for v, state in enumerate(states, 1):
            SlotWriter(slots).commit(state, v)
            k = next(k for version, k in slots.committed() if version == v)
            wait_until(lambda: slots.taken(k) == v and slots.view(k).checksum is not None, timeout=60,
                       what=f"the daemon to take version {v}")
            assert slots.view(k).checksum == codec.pack(state).checksum
        assert a.proc.poll() is None
    finally:
        slots.close()


def run_writer_tls(a, tls, tmp_path):
    """An in-process writer over TLS (the writer script speaks plaintext): attach, commit 2 versions."""
    from helpers import train_states

    states = list(train_states(2))
    manifest = layout.describe(states[0])
    with Client(a.address, TOKEN, tls=tls) as c:
        slots = shm.Slots(list(c.attach("j8", 0, 2, manifest).slot_paths), manifest)
        for v, s in enumerate(states, 1):
            SlotWriter(slots).commit(s, v)
            c.notify_commit("j8", 0, 2, v)
        slots.close()
    return None, states


def test_missing_daemon_is_a_clear_error():
    with Client("127.0.0.1:1", TOKEN, timeout=1.0, retries=1) as c:
        with pytest.raises(ReplicaUnavailable, match="127.0.0.1:1"):
            c.inventory()


def test_status_prints_the_replica_table(shared_pair, tmp_path):
    a, b = shared_pair
    run_writer(a, "j6", 3, tmp_path)
    wait_until(lambda: held_version(b.client(), "j6", 0) == 3, what="B at version 3")
    out = subprocess.run([sys.executable, "-m", "ffstate.cli", "status", "--daemon", a.address, "--daemon", b.address],
                         capture_output=True, text=True, timeout=60, env={**os.environ, "FFSTATE_TOKEN": TOKEN,
                                                                          "COLUMNS": "200"})
    assert out.returncode == 0, out.stderr
    assert "j6" in out.stdout and "local" in out.stdout and "replica" in out.stdout
    assert a.node_id in out.stdout and b.node_id in out.stdout


def test_the_command_line_answers_help_and_status_without_loading_torch(shared_pair, tmp_path):
    """torch takes a second and a half to import here: an operator's `ffstate status` (or --help) need not wait."""
    a, _ = shared_pair
    run_writer(a, "j6b", 2, tmp_path)
    script = ("import sys\nfrom ffstate import cli\ntry:\n    code = cli.main(sys.argv[1:])\nexcept SystemExit as e:\n"
              "    code = e.code\nprint('torch loaded' if 'torch' in sys.modules else f'no torch, exit {code}')")
    said = {}
    for args in (["--help"], ["status", "--daemon", a.address], ["bench", "--help"], ["drain", "--help"],
                 ["drop", "--help"]):
        out = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, timeout=60,
                             env={**os.environ, "FFSTATE_TOKEN": TOKEN, "COLUMNS": "200"})
        assert out.stdout.rstrip().endswith("no torch, exit 0"), (args, out.stdout[-1000:], out.stderr[-2000:])
        said[args[0]] = out.stdout
    assert "j6b" in said["status"] and "local" in said["status"], said["status"]
    assert "downtime" in said["bench"] and "--stay" in said["drain"], said


def test_striped_fetch_from_two_holders(daemons, tmp_path):
    b, c = daemons.start(), daemons.start()
    a = daemons.start("--peer", b.address, "--peer", c.address)
    _, states = run_writer(a, "j7", 3, tmp_path)
    cb, cc = b.client(), c.client()
    wait_until(lambda: held_version(cb, "j7", 0) == 3 and held_version(cc, "j7", 0) == 3, what="both holders at 3")
    packed = fetch_striped([cb, cc], "j7", 0, 2, version=3)
    assert len(packed.chunks) > 2
    assert_bitwise_equal(codec.decode(packed), states[2])
    # A restore streams both stripes into one decoder, bounded by what the holders say the shard takes.
    holders = {b.address: cb, c.address: cc}
    mine = recovery.survey_ranks("j7", [0], 2, {0: None}, holders)[0]
    assert set(mine.remote) == set(holders) and mine.nbytes >= packed.raw_nbytes
    got = recovery.fetch("j7", 0, 2, 3, mine, None, holders, 3)
    assert_bitwise_equal(got.state, states[2])
    assert got.source == f"{b.address},{c.address}" and got.nbytes == packed.raw_nbytes
    with pytest.raises(ReplicaUnavailable, match="more than the 1000 allowed"):
        recovery.fetch("j7", 0, 2, 3, recovery.Available(remote=mine.remote, nbytes=1000), None, holders, 3)
    c.kill()  # a holder gone: its stripe comes from the other
    assert_bitwise_equal(codec.decode(fetch_striped([cc, cb], "j7", 0, 2, version=3)), states[2])
    assert_bitwise_equal(recovery.fetch("j7", 0, 2, 3, mine, None, holders, 3).state, states[2])


def test_replication_over_mutual_tls_and_health(daemons, tmp_path):
    tls, cert, key, ca = make_tls(tmp_path)
    secure = ("--tls-cert", str(cert), "--tls-key", str(key), "--tls-ca", str(ca))
    b = daemons.start(*secure, "--tls-client-ca", str(ca))
    a = daemons.start(*secure[:4], "--peer", b.address, "--tls-ca", str(ca))
    # Mutual TLS: B wants a client certificate, so A pushes with its own (it is signed by the CA).
    proc, _ = run_writer_tls(a, tls, tmp_path)
    client_tls = Tls(ca, cert=cert, key=key)
    with Client(b.address, TOKEN, tls=client_tls) as cb:
        wait_until(lambda: held_version(cb, "j8", 0) == 2, what="B at version 2 over mTLS")
    with Client(b.address, TOKEN, tls=tls, timeout=2, retries=1) as no_cert, pytest.raises(ReplicaError):
        no_cert.inventory()  # no client certificate: the handshake fails
    with grpc.secure_channel(a.address, grpc.ssl_channel_credentials(ca.read_bytes())) as ch:
        resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service="ffstate.v1.Replica"))
        assert resp.status == health_pb2.HealthCheckResponse.SERVING


def test_daemon_checksums_each_commit_and_a_corrupted_slot_is_refused(daemons):
    """The worker commits without a checksum; the daemon computes it when it takes the slot and a reader
    verifies against it, so a slot whose memory changed after the commit is never restored."""
    a = daemons.start()
    slots, states = attached_slots(a, "j9", 2)
    with a.client() as c:
        try:
            for v, s in enumerate(states, 1):
                SlotWriter(slots).commit(s, v)
                c.notify_commit("j9", 0, 1, v)
            wait_until(lambda: all(slots.view(k).checksum is not None for k in range(2)), what="both slots checked")
            for k in range(2):
                view = slots.view(k)
                assert view.checksum == codec.pack(states[view.version - 1]).checksum
            got = slots.read(2, lambda view: (view.data.clone(), codec.buffer_checksum(view.data)))
            assert got is not None and torch.equal(got[1], codec.pack(states[1]).buffer)
            k = slots.view(0).index if slots.view(0).version == 2 else 1
            slots.data[k][12345] ^= 0x40  # one bit of version 2 flips in memory after the commit
            with pytest.raises(shm.SlotError, match="corrupted"):
                slots.read(2, lambda view: (view.data.clone(), codec.buffer_checksum(view.data)))
        finally:
            slots.close()


def test_prometheus_metrics_and_status_show_replication_and_the_links(daemons, tmp_path):
    import urllib.request

    b = daemons.start()
    a = daemons.start("--peer", b.address, "--link-share", "0.8", metrics=True)
    port = a.metrics_port
    run_writer(a, "j10", 4, tmp_path, "--wait-replicated")
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    metric = {line.split(" ")[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if line.startswith("ffstate_") and 'job="j10"' in line or line.startswith(("ffstate_link", "ffstate_scheduler"))}
    sent = next(v for k, v in metric.items() if k.startswith("ffstate_replicated_bytes_total"))
    assert sent > 1_000_000  # a full version and three deltas of a TinyGPT state
    assert next(v for k, v in metric.items() if k.startswith("ffstate_replicated_versions_total")) == 4
    assert next(v for k, v in metric.items() if k.startswith("ffstate_lag_versions")) == 0
    assert next(v for k, v in metric.items() if k.startswith("ffstate_holders_down")) == 0
    assert next(v for k, v in metric.items() if k.startswith("ffstate_holders_seeding")) == 0
    assert next(v for k, v in metric.items() if k.startswith("ffstate_link_estimate_bytes_per_second")) > 0
    assert next(v for k, v in metric.items() if k.startswith("ffstate_link_share")) == 0.8
    # The writer marks no collectives: nothing seen, nothing met.
    for name in ("collisions", "collectives", "overlap_seconds"):
        assert next(v for k, v in metric.items() if k.startswith(f"ffstate_scheduler_{name}_total")) == 0
    for name in ("catch_ups", "rushes"):  # exported, per holder
        assert any(k.startswith(f"ffstate_scheduler_{name}_total") for k in metric), name
    inv = a.client().inventory("j10")
    assert inv.scheduler == "windows" and inv.links[0].holder == b.address and inv.links[0].estimate_bytes_per_second > 0
    assert (inv.collectives, inv.collisions, inv.overlap_seconds, inv.links[0].collisions) == (0, 0, 0, 0)
    assert inv.shards[0].pushed_versions == 4 and inv.shards[0].pushed_bytes == sent
    assert not inv.shards[0].HasField("restore") and "ffstate_restore_seconds" not in "".join(metric)
    # A worker that restored records it in the slot header at attach (the trainer does; here by hand, twice).
    desc = a.client().lookup("j10", 0, 2)
    slots = shm.Slots([Path(p) for p in desc.slot_paths], layout.Manifest.from_json(desc.manifest_json))
    try:
        slots.record_restore(2, 1, 0.25, 3.5)
        slots.record_restore(3, 0, 0.125, 2.5)
    finally:
        slots.close()
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    labels = f'{{job="j10",node="{a.node_id}",rank="0"}}'
    for name, value in (("restores_total", 2), ("restore_seconds", 0.125), ("restore_version", 3),
                        ("restore_steps_lost", 0)):
        assert f"ffstate_{name}{labels} {float(value)}" in text, (name, text)
    r = a.client().inventory("j10").shards[0].restore
    assert (r.restores, r.version, r.steps_lost, r.seconds, r.entry_seconds) == (2, 3, 0, 0.125, 2.5)
    out = subprocess.run([sys.executable, "-m", "ffstate.cli", "status", "--daemon", a.address], capture_output=True,
                         text=True, timeout=60, env={**os.environ, "FFSTATE_TOKEN": TOKEN, "COLUMNS": "200"})
    assert re.search(r"j10 +│ +0/2 +│ +2 +│ +3 +│ +0 +│ +0\.125 +│ +2\.50", out.stdout), out.stdout


def test_local_copy_steps_back_through_the_deltas_it_keeps(pair, tmp_path):
    """The node's own copy of a rank reaches back keep_deltas (W + 1) versions, not just the two slots: after a
    node loss, its ranks may have to go back to the version the lost node's replicas had (docs/design.md I3)."""
    a, b = pair
    b.kill()  # the holder is gone: A's copy is all there is
    _, states = run_writer(a, "j11", 7, tmp_path, "--wait-taken")
    ca = a.client()
    wait_until(lambda: len(ca.inventory("j11").shards[0].versions) == 6, what="A took version 7")
    versions = list(ca.inventory("j11").shards[0].versions)
    assert versions == [7, 6, 5, 4, 3, 2], versions  # slots 7, 6; the daemon's copy and keep_deltas = 5 deltas
    for v in (7, 5, 2):
        assert_bitwise_equal(codec.decode(ca.fetch("j11", 0, 2, version=v)), states[v - 1])
    with pytest.raises(ReplicaError) as e:
        ca.fetch("j11", 0, 2, version=1)
    assert e.value.code == "NOT_FOUND" and "deltas kept" in str(e.value)
