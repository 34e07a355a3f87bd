"""tasks/runtime/overlap.py: work started ahead in a thread, joined where it is needed;
its seconds a total of the run's timeline; off with QUANTLOOP_OVERLAP=0. (Calls handed
to the warm process: tests/test_forkserver.py.)"""

from __future__ import annotations

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
