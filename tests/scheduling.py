"""The suite's order on pytest-xdist workers: each worker starts with a share of the
tests balanced by their measured time, a module's tests together, the longest first.

xdist's worksteal gives each worker an equal count of tests, cut from the collection in
file order, then lets an idle worker take half of the longest queue. On this suite the
counts are far from the time (37 CLI tests take ~90 s, two `quantloop serve` tests
~130 s), a module's tests can land on two workers (and its module-scoped servers and
research runs are built twice), and a two-minute test met late holds the last worker
alone while the others idle. Here the first share is planned instead (`plan`): modules
are dealt by time, longest first, to the worker with the least so far (LPT), and each
worker runs its modules longest first, so the short ones are left at the end of its
queue, where stealing takes them from. Stealing then works as in worksteal.

Times come from tests/durations.json (test id -> seconds, setup and teardown included,
from suite runs: `python -m tests.scheduling JUNIT_XML...` rewrites it); a test not in it
counts as its module's median there, or DEFAULT_S.
"""

from __future__ import annotations

import json
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path

from xdist.scheduler import WorkStealingScheduling

DURATIONS = Path(__file__).with_name("durations.json")
DEFAULT_S = 0.5


def read_durations(path: Path = DURATIONS) -> dict[str, float]:
    try:
        return {k: float(v) for k, v in json.loads(path.read_text()).items()}
    except (OSError, ValueError):
        return {}


def estimate(ids: Sequence[str], durations: dict[str, float]) -> list[float]:
    """Each test's expected seconds: its own, else its module's median, else DEFAULT_S."""
    by_module: dict[str, list[float]] = {}
    for test, s in durations.items():
        by_module.setdefault(test.split("::")[0], []).append(s)
    out = []
    for test in ids:
        base = test.split("[")[0]
        if test in durations:
            out.append(durations[test])
        elif base in durations:  # a parametrization not measured: its siblings' time
            out.append(durations[base])
        elif test.split("::")[0] in by_module:
            out.append(statistics.median(by_module[test.split("::")[0]]))
        else:
            out.append(DEFAULT_S)
    return out


def plan(ids: Sequence[str], workers: int, durations: dict[str, float]) -> list[list[int]]:
    """`workers` lists of indices into `ids`: every test once, a module's tests in one
    list and in their collection order, the lists' expected times balanced (modules dealt
    longest first to the least loaded list), each list's modules longest first."""
    seconds = estimate(ids, durations)
    modules: dict[str, list[int]] = {}
    for i, test in enumerate(ids):
        modules.setdefault(test.split("::")[0], []).append(i)
    cost = {m: sum(seconds[i] for i in idx) for m, idx in modules.items()}
    bins: list[list[str]] = [[] for _ in range(max(1, workers))]
    load = [0.0] * len(bins)
    for m in sorted(modules, key=lambda m: (-cost[m], m)):
        k = min(range(len(bins)), key=lambda b: (load[b], b))
        bins[k].append(m)
        load[k] += cost[m]
    return [[i for m in b for i in modules[m]] for b in bins]


class BalancedWorkStealing(WorkStealingScheduling):
    """worksteal, its first share planned by time (module docstring)."""

    def schedule(self) -> None:
        assert self.collection_is_completed
        if self.collection is not None:  # the first share was given: steal as worksteal
            self.check_schedule()
            return
        if not self._check_nodes_have_same_collection():
            self.log("**Different tests collected, aborting run**")
            return
        self.collection = next(iter(self.node2collection.values()))
        if not self.collection:
            return
        nodes = [node for node in self.node2pending if not node.shutting_down]
        for node, share in zip(nodes, plan(self.collection, len(nodes), read_durations()),
                               strict=True):  # fmt: skip
            if share:
                self.node2pending[node].extend(share)
                node.send_runtest_some(share)
        self.check_schedule()


def write_durations(junit_xmls: Sequence[str], path: Path = DURATIONS) -> dict[str, float]:
    """tests/durations.json from suites' `--junitxml` files (each test's setup, call and
    teardown; the mean where a test is in several)."""
    import xml.etree.ElementTree as ET

    seen: dict[str, list[float]] = {}
    for junit_xml in junit_xmls:
        for case in ET.parse(junit_xml).iter("testcase"):
            test = case.get("classname", "").replace(".", "/") + ".py::" + case.get("name", "")
            seen.setdefault(test, []).append(float(case.get("time") or 0))
    found = {t: round(statistics.mean(s), 1) for t, s in sorted(seen.items())}
    path.write_text(json.dumps(found, indent=0) + "\n")
    return found


if __name__ == "__main__":
    written = write_durations(sys.argv[1:])
    print(f"{len(written)} tests, {sum(written.values()):.0f} s, in {DURATIONS}")
