"""ffstate/startup.py: a process's imports run without the cyclic collector, what they made is frozen after, and the
collector is on again only if it was."""

import gc

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
