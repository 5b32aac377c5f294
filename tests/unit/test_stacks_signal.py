"""A rank that left ``ffstate.replicate`` ignores SIGUSR1: the daemon may have read its record just before it left its
step and signal it for stacks a moment later, and the signal's default action would end the process (a survivor
of an in-process restart, kept for the next entry). The next entry registers faulthandler again."""

import subprocess
import sys

CHILD = """
import faulthandler, os, signal, tempfile, time
from ffstate.trainer import _stop_stacks
f = tempfile.TemporaryFile("w")
for entry in range(2):  # an entry, then the next one after a restart
    assert signal.getsignal(signal.SIGUSR1) in (signal.SIG_DFL, signal.SIG_IGN)  # what _register_stacks accepts
    faulthandler.register(signal.SIGUSR1, file=f, all_threads=True, chain=False)
    _stop_stacks()
    os.kill(os.getpid(), signal.SIGUSR1)  # the daemon's signal, late
    time.sleep(0.1)
print("alive")
"""


def test_a_rank_that_left_survives_a_late_stacks_signal_and_the_next_entry_registers_again():
    got = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=120)
    assert got.returncode == 0 and got.stdout.strip() == "alive", (got.returncode, got.stderr[-2000:])
