"""tests/cpu_use.py, the suite's per-test CPU measure (docs/testing.md), on real processes."""

from __future__ import annotations

import json
import subprocess
import sys
from types import SimpleNamespace

import pytest

from tests.cpu_use import CpuUse, session_line

# A child that runs a grandchild burning 1 CPU-s, reaps it, says so and stays: as a
# module's Prefect worker reaps its flow runs and outlives the test.
CHILD = """
import subprocess, sys, time
subprocess.run([sys.executable, "-c",
                "import time\\nwhile time.process_time() < 1.0: pass"], check=True)
print("reaped", flush=True)
time.sleep(120)
"""


def measured(tmp_path, during) -> float:
    """The CPU seconds the plugin writes for a test that runs `during()`."""
    out = tmp_path / "cpu.jsonl"
    hook = CpuUse(str(out)).pytest_runtest_protocol(SimpleNamespace(nodeid="t::t"), None)
    next(hook)  # the test starts
    during()
    with pytest.raises(StopIteration):
        hook.send(None)  # and ends
    [line] = out.read_text().splitlines()
    return json.loads(line)["cpu_s"]


def test_a_grandchild_reaped_by_a_child_alive_at_the_end_is_counted(tmp_path):
    child = subprocess.Popen([sys.executable, "-c", CHILD], stdout=subprocess.PIPE, text=True)
    try:
        cpu = measured(tmp_path, lambda: child.stdout.readline())
    finally:
        child.kill()
        child.wait()
    assert cpu >= 1.0, cpu


def test_a_child_reaped_during_the_test_is_counted_once(tmp_path):
    burn = [sys.executable, "-c", "import time\nwhile time.process_time() < 1.0: pass"]
    cpu = measured(tmp_path, lambda: subprocess.run(burn, check=True))
    # its 1 CPU-s and its interpreter's start, not twice that
    assert 1.0 <= cpu < 1.9, cpu


def test_the_session_line_has_the_machines_busy_seconds_and_the_probe(tmp_path):
    out = tmp_path / "cpu.jsonl"
    plugin = CpuUse(str(out))
    session = SimpleNamespace(config=SimpleNamespace())  # the controller: no workerinput
    plugin.pytest_sessionstart(session)
    burn = [sys.executable, "-c", "import time\nwhile time.process_time() < 1.0: pass"]
    subprocess.run(burn, check=True)
    plugin.pytest_sessionfinish(session)
    [line] = [json.loads(s)["session"] for s in out.read_text().splitlines()]
    assert line["busy_cpu_s"] >= 1.0, line  # the burn at least, whatever else ran
    assert line["probe_ms"]["start"] > 0 and line["probe_ms"]["end"] > 0, line


def test_an_xdist_worker_writes_no_session_line(tmp_path):
    out = tmp_path / "cpu.jsonl"
    plugin = CpuUse(str(out))
    worker = SimpleNamespace(config=SimpleNamespace(workerinput={"workerid": "gw0"}))
    plugin.pytest_sessionstart(worker)
    plugin.pytest_sessionfinish(worker)
    assert not out.exists()


def test_kernel_threads_are_counted_from_the_start_or_from_zero():
    start = {"busy_cpu_s": 100.0, "steal_s": 1.0, "refaulted_file_pages": 10,
             "kernel_threads_cpu_s": {"kdamond.0": 50.0, "kworker": 5.0}}  # fmt: skip
    end = {"busy_cpu_s": 160.0, "steal_s": 1.0, "refaulted_file_pages": 30,
           "kernel_threads_cpu_s": {"kdamond.0": 62.0, "kworker": 5.2, "kswapd0": 3.0}}  # fmt: skip
    line = session_line(start, end, 60.0, (120.0, 130.0))
    assert line["busy_cpu_s"] == 60.0
    # kworker's 0.2 s is under the half second kept; kswapd0 started during the session
    assert line["kernel_threads_cpu_s"] == {"kdamond.0": 12.0, "kswapd0": 3.0}
    assert line["refaulted_file_pages"] == 20
    assert line["probe_ms"] == {"start": 120.0, "end": 130.0}
