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

The session (the controller of an xdist run, or the one process of `-n 0`) also appends a
line `{"session": ...}` at its end: the machine's busy CPU seconds over the session (from
/proc/stat), the kernel's own threads' share of them by name (on this VM DAMON's page-out
thread, kdamond, took 294 of a suite's 2,414 CPU-s on 2026-12-07), the page-cache pages
read back after being reclaimed, and a fixed pure-Python probe's CPU milliseconds at the
start and the end: how fast the machine ran the interpreter that day, so that suites of
different days can be compared by measure rather than by guess.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

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


PF_KTHREAD = 0x00200000  # /proc/PID/stat's flags: a kernel thread (linux/sched.h)


def _work() -> int:
    """A fixed pure-Python workload (~0.2 CPU-s here): integer arithmetic, strings,
    sorting and a dict, the interpreter's common paths."""
    words = sorted(str(i * 7919 % 100_003) for i in range(150_000))
    counts: dict[str, int] = {}
    for w in words:
        counts[w[:3]] = counts.get(w[:3], 0) + len(w)
    return sum(counts.values())


def probe_ms() -> float:
    """CPU milliseconds of _work(), the least of three runs (its thread's CPU time: what a
    busy neighbour takes from the wall does not count, a slower core does)."""
    best = float("inf")
    for _ in range(3):
        start = time.thread_time()
        _work()
        best = min(best, time.thread_time() - start)
    return round(best * 1000, 1)


def machine() -> dict:
    """The machine's CPU seconds so far: busy (every core), the kernel threads' by name,
    and the file pages read back after reclaim (Linux; {} elsewhere)."""
    try:
        tick = os.sysconf("SC_CLK_TCK")
        user, nice, system, _idle, _io, irq, softirq, steal = (
            int(v) for v in Path("/proc/stat").read_text().split("\n")[0].split()[1:9]
        )
        vmstat = dict(line.split() for line in Path("/proc/vmstat").read_text().splitlines())
    except (OSError, ValueError):
        return {}
    kernel: dict[str, float] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue
        name = text[text.index("(") + 1 : text.rindex(")")]
        fields = text[text.rindex(")") + 2 :].split()  # from the state, field 3
        if int(fields[6]) & PF_KTHREAD:
            name = name.split("/")[0]  # kworker/1:1H-kblockd and its kind: one name
            kernel[name] = kernel.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / tick
    return {
        "busy_cpu_s": (user + nice + system + irq + softirq + steal) / tick,
        "steal_s": steal / tick,
        "kernel_threads_cpu_s": kernel,
        "refaulted_file_pages": int(vmstat.get("workingset_refault_file", 0)),
    }


def session_line(start: dict, end: dict, wall_s: float, probes: tuple[float, float]) -> dict:
    """What the session's line holds: the machine's figures over the session (the end's
    less the start's; kernel threads started during it counted from zero)."""
    line: dict = {"wall_s": round(wall_s, 1), "probe_ms": {"start": probes[0], "end": probes[1]}}
    if start and end:
        kernel = {
            name: round(s - start["kernel_threads_cpu_s"].get(name, 0.0), 2)
            for name, s in end["kernel_threads_cpu_s"].items()
        }
        line |= {
            "busy_cpu_s": round(end["busy_cpu_s"] - start["busy_cpu_s"], 1),
            "steal_s": round(end["steal_s"] - start["steal_s"], 1),
            "kernel_threads_cpu_s": dict(
                sorted(((k, v) for k, v in kernel.items() if v >= 0.5), key=lambda kv: -kv[1])
            ),
            "refaulted_file_pages": end["refaulted_file_pages"] - start["refaulted_file_pages"],
        }
    return line


class CpuUse:
    def __init__(self, path: str):
        self.path = path
        self.start: tuple[float, dict, float] | None = None

    def _controller(self, config) -> bool:
        return not hasattr(config, "workerinput")  # xdist's workers have it

    def pytest_sessionstart(self, session) -> None:
        if self._controller(session.config):
            self.start = (time.monotonic(), machine(), probe_ms())

    def pytest_sessionfinish(self, session) -> None:
        if self.start is None:
            return
        wall, before, probe = self.start
        line = session_line(before, machine(), time.monotonic() - wall, (probe, probe_ms()))
        with open(self.path, "a") as out:
            out.write(json.dumps({"session": line}) + "\n")

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
