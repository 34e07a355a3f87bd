"""tests/cpu_use.py, the suite's per-test CPU measure (docs/testing.md), on real processes."""

from __future__ import annotations

import json
import subprocess
import sys
from types import SimpleNamespace

import pytest

from tests.cpu_use import CpuUse

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
