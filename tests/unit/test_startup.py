"""ffstate/startup.py: a process's imports run without the cyclic collector, what they made is frozen after, and the
collector is on again only if it was; ``exit_now`` ends a process with its code, its output and logs flushed, and no
finalization."""

import gc
import os
import subprocess
import sys
import textwrap

import pytest

from ffstate import startup


@pytest.fixture(autouse=True)
def _collector_as_it_was():
    was = gc.isenabled()
    yield
    gc.unfreeze()
    (gc.enable if was else gc.disable)()


def test_the_block_runs_without_the_collector_and_what_it_made_is_frozen_after():
    gc.enable()
    gc.unfreeze()
    with startup.collector_paused():
        assert not gc.isenabled()
        made = [[i] for i in range(10_000)]  # tracked containers, as a module's objects are
    assert gc.isenabled()
    assert gc.get_freeze_count() >= len(made)
    walked = {id(o) for g in range(3) for o in gc.get_objects(generation=g)}
    assert not walked & {id(x) for x in made}  # in no generation the collector walks


def test_a_collector_that_was_off_stays_off():
    gc.disable()
    gc.unfreeze()
    was = startup.pause()
    assert was is False and not gc.isenabled()
    startup.imported(was)
    assert not gc.isenabled() and gc.get_freeze_count() > 0


def test_imports_that_fail_still_give_the_collector_back():
    gc.enable()
    with pytest.raises(ImportError):
        with startup.collector_paused():
            import ffstate_no_such_module  # noqa: F401
    assert gc.isenabled()


def test_exit_now_flushes_the_logs_and_streams_returns_the_code_and_skips_finalization(tmp_path):
    log = tmp_path / "job.log"
    script = textwrap.dedent(f"""
        import atexit, io, logging, sys
        from ffstate.startup import exit_now
        logging.basicConfig(filename={str(log)!r}, level=logging.INFO)
        logging.getLogger("job").info("last step written")
        atexit.register(lambda: print("finalized", flush=True))
        sys.stdout.write("out, no newline")  # buffered: only a flush gets it out
        sys.stderr.write("err, no newline")
        sys.stdout = io.StringIO()  # replaced (a framework capturing output): the original is flushed as well
        exit_now(3)
        print("after exit_now")
    """)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}  # buffered, as a job's output often is
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, env=env)
    assert proc.returncode == 3
    assert proc.stdout == "out, no newline" and proc.stderr == "err, no newline"  # no atexit, nothing after
    assert log.read_text() == "INFO:job:last step written\n"


def test_exit_now_is_reached_as_the_docs_write_it_after_a_plain_import():
    script = "import ffstate\nffstate.startup.exit_now(5)\n"  # docs/operations.md, integration.md, inprocess.md
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 5, proc.stderr
