"""The suite's own order on xdist workers (tests/scheduling.py): the first share of each
worker is planned by measured time, a module's tests together, the longest first."""

from __future__ import annotations

import json
from types import SimpleNamespace

from tests import conftest
from tests.scheduling import DEFAULT_S, BalancedWorkStealing, estimate, plan, write_durations

IDS = [
    "tests/test_a.py::test_slow_server",
    "tests/test_a.py::test_quick",
    "tests/test_b.py::test_one[x]",
    "tests/test_b.py::test_one[y]",  # a parametrization not measured
    "tests/test_c.py::test_unit",  # a module not measured
    "tests/test_d.py::test_d1",
    "tests/test_d.py::test_d2",
    "tests/test_e.py::test_new",  # a test not measured in a measured module
]
DURATIONS = {
    "tests/test_a.py::test_slow_server": 100.0,
    "tests/test_a.py::test_quick": 0.0,
    "tests/test_b.py::test_one[x]": 30.0,
    "tests/test_d.py::test_d1": 60.0,
    "tests/test_d.py::test_d2": 40.0,
    "tests/test_e.py::test_old": 10.0,
    "tests/test_e.py::test_older": 12.0,
}


def test_a_test_not_measured_counts_as_its_module_median_or_the_default():
    assert estimate(IDS, DURATIONS) == [100.0, 0.0, 30.0, 30.0, DEFAULT_S, 60.0, 40.0, 11.0]


def test_modules_are_dealt_longest_first_to_the_least_loaded_worker():
    shares = plan(IDS, 3, DURATIONS)
    assert sorted(i for share in shares for i in share) == list(range(len(IDS)))  # each once
    modules = [[IDS[i].split("::")[0] for i in share] for share in shares]
    # test_a (100 s) and test_d (100 s) alone; test_b (60 s), then test_e (11 s) and
    # test_c (0.5 s) to the least loaded, the longer module first; a module's tests in
    # their collection order
    a, b, c, d, e = (f"tests/test_{x}.py" for x in "abcde")
    assert modules == [[a, a], [d, d], [b, b, e, c]]
    assert shares[1] == [5, 6] and shares[2] == [2, 3, 7, 4]
    assert plan(IDS, 1, DURATIONS) == [[0, 1, 5, 6, 2, 3, 7, 4]]  # longest first
    assert plan(IDS, 2, DURATIONS) == [[0, 1, 2, 3], [5, 6, 7, 4]]  # 160 s and 111.5 s


class Node:
    """What the scheduler uses of xdist's WorkerController."""

    def __init__(self, n: int):
        self.sent: list[int] = []
        self.shutting_down = False
        self.gateway = SimpleNamespace(id=f"gw{n}")

    def send_runtest_some(self, indices):
        self.sent += indices


class Config:
    options = {"tx": ["3*popen"], "dist": "worksteal", "numprocesses": 3}

    def getvalue(self, name):
        return self.options[name]


def test_the_suite_uses_it_and_each_worker_gets_its_share(monkeypatch):
    sched = conftest.pytest_xdist_make_scheduler(Config(), None)
    assert isinstance(sched, BalancedWorkStealing)
    monkeypatch.setattr("tests.scheduling.read_durations", lambda: DURATIONS)
    nodes = [Node(0), Node(1), Node(2)]
    for node in nodes:
        sched.add_node(node)
        sched.add_node_collection(node, IDS)
    sched.schedule()
    assert [n.sent for n in nodes] == plan(IDS, 3, DURATIONS)
    assert sched.pending == []
    other = Config()
    other.options = {**Config.options, "dist": "load"}
    assert conftest.pytest_xdist_make_scheduler(other, None) is None  # xdist's own


def test_the_durations_file_is_written_from_junit_xml(tmp_path):
    junit = tmp_path / "junit.xml"
    junit.write_text(
        '<testsuites><testsuite name="pytest">'
        '<testcase classname="tests.test_a" name="test_slow" time="12.34"/>'
        '<testcase classname="tests.test_a" name="test_quick" time="0.01"/>'
        '<testcase classname="tests.test_b" name="test_p[x-1]" time="3.0"/>'
        "</testsuite></testsuites>"
    )
    again = tmp_path / "again.xml"
    again.write_text(junit.read_text().replace('time="12.34"', 'time="7.66"'))
    out = tmp_path / "durations.json"
    written = write_durations([str(junit), str(again)], out)
    assert written == {"tests/test_a.py::test_quick": 0.0, "tests/test_a.py::test_slow": 10.0,
                       "tests/test_b.py::test_p[x-1]": 3.0}  # fmt: skip
    assert json.loads(out.read_text()) == written
