"""tasks/runtime/overlap.py: work started ahead in a thread, joined where it is needed;
its seconds a total of the run's timeline; off with QUANTLOOP_OVERLAP=0. (Calls handed
to the warm process: tests/test_forkserver.py.)"""

from __future__ import annotations

import os
import threading
import time

import pytest

from quantloop.tasks.runtime import overlap, timeline


@pytest.fixture(autouse=True)
def _fresh(monkeypatch):
    monkeypatch.setattr(overlap, "_ahead", {})


def test_work_ahead_runs_in_a_thread_once_and_is_waited_for():
    started, release = threading.Event(), threading.Event()
    ran = []

    def work():
        started.set()
        release.wait(10)
        ran.append(threading.current_thread().name)

    assert overlap.ahead("t1", work)
    assert started.wait(10) and ran == []  # the caller went on meanwhile
    assert overlap.ahead("t1", lambda: ran.append("again"))  # once a process
    threading.Timer(0.2, release.set).start()
    waited = overlap.wait("t1")
    assert ran == ["ahead-t1"] and 0.1 < waited < 10
    assert timeline.TIMELINE.totals["ahead: t1"][1] == 1
    assert overlap.wait("never started") is None


def test_a_failure_ahead_is_left_to_the_callers_own_path():
    def work():
        raise RuntimeError("boom")

    assert overlap.ahead("t2", work)
    assert overlap.wait("t2") is not None  # joined, nothing raised here


def test_off_runs_nothing(monkeypatch):
    monkeypatch.setenv("QUANTLOOP_OVERLAP", "0")
    ran = []
    assert not overlap.ahead("t3", lambda: ran.append(1))
    time.sleep(0.05)
    assert ran == [] and overlap.wait("t3") is None
    assert not overlap.available()
    with pytest.raises(overlap.Unavailable):
        overlap.call("quantloop.tasks.records.registry:export_stored", {})


def test_no_call_outside_a_warm_process_command(monkeypatch):
    monkeypatch.setattr(overlap, "SERVER", None)
    assert not overlap.available()
    with pytest.raises(overlap.Unavailable, match="not a command of a warm process"):
        overlap.call("quantloop.tasks.records.registry:export_stored", {})


def test_the_environment_is_copied_whole_while_another_thread_changes_it(monkeypatch):
    """The warm process's child gets this process's environment: copied in one step,
    while a thread sets and removes a variable (iterating os.environ then can raise
    KeyError: a removed key's value is read after the keys)."""
    stop = threading.Event()

    def churn():
        while not stop.is_set():
            os.environ["QUANTLOOP_TEST_CHURN"] = "1"
            os.environ.pop("QUANTLOOP_TEST_CHURN", None)

    thread = threading.Thread(target=churn, daemon=True)
    thread.start()
    try:
        for _ in range(3000):
            env = overlap.environment()
            assert env.get("PATH") == os.environ["PATH"]
    finally:
        stop.set()
        thread.join()
    assert overlap.environment() == dict(os.environ)


def test_ending_a_run_removes_no_variable(monkeypatch):
    """tracking.end_run sets MLflow's switch for its call and never removes it: runs end
    on background threads, and a removal raced Prefect's read of os.environ (KeyError,
    a failed research run on this VM)."""
    from quantloop.tasks.records import tracking

    name = "MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT"
    monkeypatch.delenv(name, raising=False)
    seen = []

    class Client:
        def set_terminated(self, run_id, status):
            seen.append((run_id, status, os.environ.get(name)))

    tracking.end_run(Client(), "r1", "FINISHED")
    assert seen == [("r1", "FINISHED", "true")] and os.environ[name] == "true"
    monkeypatch.setenv(name, "false")  # a value of the user's own is put back
    tracking.end_run(Client(), "r2", "FINISHED")
    assert seen[-1][2] == "true" and os.environ[name] == "false"


GAP_PROBE = r"""
import sys, threading, time
import torch
from quantloop.tasks.research.training import open_cuda_context, start_cuda_driver
out = {}
def start():
    out.update(up=start_cuda_driver(), cuda=torch.cuda.is_available())
    out.update(context=open_cuda_context(torch.device("cuda")) if out["cuda"] else False)
t = threading.Thread(target=start)
last, gap = time.perf_counter(), 0.0
t.start()
while t.is_alive():
    now = time.perf_counter()
    gap, last = max(gap, now - last), now
if out["context"]:  # the runtime takes the context made ahead
    assert torch.ones(2, device="cuda").sum().item() == 2
print(out["up"], out["cuda"], out["context"], gap)
"""


def test_starting_cuda_in_a_thread_leaves_the_main_thread_running():
    """The ahead thread starts the CUDA driver and the device's context through ctypes (the
    interpreter's lock let go), then torch finds them up: the main thread is never held
    for them (0.24 s for the driver's start from torch alone on an H100). Without a driver
    (CI) it says so and torch agrees; a fresh interpreter, since CUDA starts once a
    process."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", GAP_PROBE], capture_output=True, text=True,
                          timeout=120, check=True)  # fmt: skip
    up, cuda, context, gap = done.stdout.split()
    assert up == cuda == context  # driver and context up exactly where torch finds CUDA
    if cuda == "True":
        assert float(gap) < 0.05, f"the main thread was held {float(gap):.3f} s"
