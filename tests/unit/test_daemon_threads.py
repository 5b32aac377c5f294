"""The daemon's threads carry their names into the operating system (top -H, perf --sort comm)."""

import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from ffstate.daemon.threads import name_new_threads, os_name

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="thread names through prctl: Linux")


def _seen() -> tuple[str, object]:
    """This thread's name as the kernel has it, and its profile function (None once the naming hook is off)."""
    comm = Path(f"/proc/self/task/{threading.get_native_id()}/comm").read_text().strip()
    return comm, sys.getprofile()


def test_short_names():
    assert os_name("ffstate-codec_0") == "codec_0"
    assert os_name("Thread-7 (_serve)") == "_serve"
    assert os_name("Thread-12 (consume_request_iterator)") == "consume_request"  # the kernel keeps 15 bytes
    assert os_name("ffstate-push-watchdog") == "push-watchdog"


def test_threads_started_after_it_name_themselves_and_run_unprofiled():
    got = {}
    threading.setprofile(None)  # whatever ran before in this process
    before = threading.Thread(target=lambda: got.setdefault("before", _seen()), name="ffstate-repl-9")
    before.start()
    before.join()
    name_new_threads()
    try:
        t = threading.Thread(target=lambda: got.setdefault("thread", _seen()), name="ffstate-repl-3")
        t.start()
        t.join()
        with ThreadPoolExecutor(1, thread_name_prefix="ffstate-codec") as pool:
            got["pool"] = pool.submit(_seen).result()
    finally:
        threading.setprofile(None)
    assert got["before"][0] != "repl-9"  # started before: the process's name, as Python leaves it
    assert got["thread"] == ("repl-3", None)
    assert got["pool"] == ("codec_0", None)
