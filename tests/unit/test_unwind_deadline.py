"""ffstate/inprocess/unwind.py: a process whose training thread is still in its step the deadline's grace after an
abort ends itself (SIGKILL) with a report; one whose thread came out in time goes on. Each case is a child process
whose main thread waits inside C (``time.sleep``), where an asynchronous exception is not delivered, as a survivor
waiting on a send gloo had queued is (the engine's job with such a survivor: tests/system/test_inprocess.py)."""

import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("nvidia_resiliency_ext.inprocess", reason="the in-process mode's engine (nvidia-resiliency-ext) "
                    "is not installed")


def child(body: str, timeout: float = 90) -> subprocess.CompletedProcess:
    code = "import datetime, time\nfrom ffstate.inprocess.unwind import UnwindDeadline, Unwound\n" + \
        "from ffstate.inprocess.abort import GroupAbort\n" + textwrap.dedent(body)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout)


def test_a_thread_still_in_its_step_after_the_grace_of_an_abort_ends_the_process_with_where_it_was(tmp_path):
    done = child(f"""
        import torch.distributed as dist
        dist.init_process_group("gloo", init_method="file://{tmp_path / 'store'}", rank=0, world_size=1)
        deadline = UnwindDeadline(1.0, what="rank 9 (process 11, iteration 2)")
        GroupAbort(datetime.timedelta(seconds=5), unwind=deadline)(None)  # the group's abort arms it
        time.sleep(120)  # line 9 of the child: inside C, where the engine's restart is not delivered
        print("came back")
    """)
    assert done.returncode == -9, (done.returncode, done.stderr[-2000:])
    assert "came back" not in done.stdout
    assert ("ffstate.inprocess: rank 9 (process 11, iteration 2): the training thread is still in its step 1 s after "
            "its process group was aborted (innermost Python frame: <string>:9 in <module>)") in done.stderr
    assert "Current thread" in done.stderr or "Thread 0x" in done.stderr  # every thread's stack follows


def test_without_a_group_none_is_armed_and_a_thread_that_came_out_in_time_disarms_it_through_finalize():
    done = child("""
        deadline = UnwindDeadline(1.0)
        GroupAbort(datetime.timedelta(seconds=5), unwind=deadline)(None)  # no process group: nothing to be stuck in
        time.sleep(4)  # four times the grace: not armed
        deadline.aborted()
        deadline.aborted()  # a second abort while armed keeps the first deadline
        time.sleep(0.2)
        assert Unwound(deadline)("state") == "state"  # the engine's finalize, on the training thread
        time.sleep(4)  # four times the grace
        deadline.aborted()  # the next failure arms it again
        Unwound(deadline)(None)
        time.sleep(2)
        print("went on")
    """)
    assert done.returncode == 0 and done.stdout.strip() == "went on", (done.returncode, done.stderr[-2000:])
    assert "still in its step" not in done.stderr
