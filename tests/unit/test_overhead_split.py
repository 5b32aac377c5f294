"""bench overhead's split of the daemons' CPU by thread (``by_thread``): roles by name less their number, threads
gone by the phase's end as the rest of the processes' whole, a thread id taken again counted from zero."""

import pytest

from ffstate.bench._overhead_worker import by_thread


def test_the_roles_and_the_ended_threads_sum_to_the_whole():
    before = {"/proc/7": ("", 10.0), "/proc/7/task/7": ("python", 1.0), "/proc/7/task/8": ("codec_0", 4.0),
              "/proc/7/task/9": ("codec_1", 3.0), "/proc/7/task/10": ("_run", 0.5),
              "/proc/9": ("", 2.0), "/proc/9/task/20": ("rpc_0", 1.0)}
    after = {"/proc/7": ("", 20.0), "/proc/7/task/7": ("python", 1.5), "/proc/7/task/8": ("codec_0", 7.0),
             "/proc/7/task/9": ("codec_1", 5.0),  # _run ended; repl-0 began
             "/proc/7/task/11": ("repl-0", 1.0), "/proc/9": ("", 4.5), "/proc/9/task/20": ("rpc_0", 3.0)}
    split = by_thread(before, after)
    assert split == pytest.approx({"python": 0.5, "codec": 5.0, "repl": 1.0, "rpc": 2.0, "ended threads": 4.0,
                                   "whole": 12.5})
    assert sum(v for k, v in split.items() if k != "whole") == pytest.approx(split["whole"])


def test_a_thread_id_taken_again_counts_from_zero_and_the_rest_is_never_negative():
    before = {"/proc/7": ("", 10.0), "/proc/7/task/8": ("_run", 6.0)}
    after = {"/proc/7": ("", 10.5), "/proc/7/task/8": ("_run", 0.3)}  # a new feeder with the old one's id
    assert by_thread(before, after) == pytest.approx({"_run": 0.3, "ended threads": 0.2, "whole": 0.5})
    # the kernel scales a thread's ticks and the process's apart: a tick more in the threads than in the whole
    after = {"/proc/7": ("", 10.5), "/proc/7/task/8": ("_run", 6.6)}
    assert by_thread(before, after) == pytest.approx({"_run": 0.6, "ended threads": 0.0, "whole": 0.5})
