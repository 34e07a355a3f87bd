"""tasks/runtime/collector.py: the cyclic collector paused while a stack is imported, and
what was imported frozen, so a later full collection (or one in a child forked from the
warm process) scans only what was made after."""

from __future__ import annotations

import gc
import os

import pytest

from quantloop.tasks.runtime import collector


class Cycle:
    def __init__(self) -> None:
        self.me = self


@pytest.fixture
def collector_on():
    """Each test starts with the collector on and nothing frozen, and leaves it so."""
    was_on = gc.isenabled()
    gc.enable()
    gc.unfreeze()
    yield
    gc.unfreeze()
    (gc.enable if was_on else gc.disable)()


def test_paused_then_frozen_then_on_again(collector_on):
    with collector.paused():
        assert not gc.isenabled()
        made = [Cycle() for _ in range(1_000)]
        before = gc.get_count()[0]
        [Cycle() for _ in range(5_000)]  # garbage cycles past gen 0's threshold (700)
        assert gc.get_count()[0] >= before + 5_000  # nothing collected meanwhile
    assert gc.isenabled()
    assert gc.get_freeze_count() >= len(made)
    tracked = {id(o) for o in gc.get_objects()}  # the generations a collection scans
    assert not any(id(o) in tracked for o in made)


def test_a_caller_that_turned_it_off_keeps_it_off(collector_on):
    gc.disable()
    with collector.paused():
        pass
    assert not gc.isenabled() and gc.get_freeze_count() == 0


def test_a_forked_child_scans_only_what_it_made(collector_on):
    """The warm process's case: objects frozen before the fork are not in any generation
    the child's collections scan."""
    with collector.paused():
        inherited = [Cycle() for _ in range(20_000)]
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: how many objects would a full collection scan?
        os.close(read)
        os.write(write, str(len(gc.get_objects())).encode())
        os._exit(0)
    os.close(write)
    scanned = int(os.read(read, 64))
    os.close(read)
    os.waitpid(pid, 0)
    assert scanned < len(inherited) // 4
