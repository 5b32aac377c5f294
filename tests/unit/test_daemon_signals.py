"""The daemon's stop signals (``StopSignals``): a SIGTERM handled while the main thread holds the stop event's
own lock, as ``Event.wait`` and a first handler's ``Event.set`` hold it. Each case runs in a process of its own
(signals are process-wide, and the old handler deadlocked there): the process must finish within its timeout."""

import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.timeout(120)


def run(body: str) -> str:
    script = textwrap.dedent("""
        import os, signal, threading, time
        from ffstate.daemon.main import StopSignals
        done = threading.Event()
        stop = StopSignals(done)
    """) + textwrap.dedent(body)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_a_sigterm_while_the_main_thread_holds_the_event_s_lock_sets_it_once_the_lock_is_free():
    # The handler runs right after os.kill, inside the `with`: a handler calling done.set() itself waits there for
    # the lock its own thread holds, forever (the daemon stuck in CI, its slots never removed).
    out = run("""
        with done._cond:
            os.kill(os.getpid(), signal.SIGTERM)
            for _ in range(1000):  # bytecodes: the handler has run by now
                pass
            print("held", done.is_set())
        print("set", done.wait(10))
    """)
    assert out.split() == ["held", "False", "set", "True"]


def test_sigint_stops_too_and_signals_after_the_first_or_after_close_change_nothing():
    out = run("""
        for _ in range(200):
            os.kill(os.getpid(), signal.SIGINT)
            os.kill(os.getpid(), signal.SIGTERM)
        print("set", done.wait(10))
        stop.close()
        os.kill(os.getpid(), signal.SIGTERM)  # ignored: the process goes on to print
        time.sleep(0.2)
        print("alive", threading.active_count())
    """)
    assert out.split() == ["set", "True", "alive", "1"]  # the reading thread has gone too
