"""Each test's CPU seconds, for finding where the suite's time goes (docs/testing.md).

On the 2-core CI machine the suite is bound by CPU, not by waits: a test's wall time
there says more about what ran beside it than about what it costs. With
`QUANTLOOP_TEST_CPU=FILE` (tests/conftest.py loads this plugin then), every test
appends one JSON line to FILE: its id, its wall seconds (setup, call and teardown) and
its CPU seconds, user plus system, of the pytest process and its descendants, those
alive at the test's end and those reaped during it (by the pytest process or by a
descendant still alive: a module's Prefect worker reaping its flow runs, `quantloop
serve` the services it restarts).

What it misses: processes that left the tree (a server started in a session of its own
and re-parented to init, as the resident Prefect API is) and module- or session-scoped
fixtures' later work, which counts in the test running when it happens.
"""

from __future__ import annotations

import json
import os
import time

import psutil
import pytest


def _tree() -> dict[int, tuple[float, float]]:
    """{pid: (create time, CPU seconds)} of this process's live descendants, each with
    the children it reaped: a descendant reaped by another moves its CPU there, so the
    sum over the tree loses nothing when it ends."""
    out = {}
    for p in psutil.Process().children(recursive=True):
        try:
            with p.oneshot():
                t = p.cpu_times()
                out[p.pid] = (p.create_time(),
                              t.user + t.system + t.children_user + t.children_system)  # fmt: skip
        except psutil.Error:
            pass
    return out


def _own() -> float:
    """This process's CPU seconds and those of the children it reaped."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


class CpuUse:
    def __init__(self, path: str):
        self.path = path

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_protocol(self, item, nextitem):
        wall, own, tree = time.monotonic(), _own(), _tree()
        try:
            return (yield)
        finally:
            after = _tree()
            cpu = _own() - own
            for pid, (created, seconds) in after.items():
                before = tree.get(pid)
                cpu += seconds - (before[1] if before and before[0] == created else 0.0)
            # a process that was running at the start and was reaped during the test: its
            # whole CPU is in _own() or its reaper's now, its part before the start counted
            # already
            for pid, (created, seconds) in tree.items():
                if after.get(pid, (None,))[0] != created:
                    cpu -= seconds
            line = {
                "test": item.nodeid,
                "wall_s": round(time.monotonic() - wall, 2),
                "cpu_s": round(cpu, 2),
                "worker": os.environ.get("PYTEST_XDIST_WORKER"),
            }
            with open(self.path, "a") as out:
                out.write(json.dumps(line) + "\n")
