"""Where a command's time goes, from process start to exit.

A command opens phases (`phase("api")`, `phase("features")`) as it goes; work that is
spread over a run in many small pieces (MLflow calls, registration) adds its seconds
and count to a named total (`add("mlflow", dt)`) instead. `report()` gives the rows a
`--profile` table and bench/turnaround.py show: each phase's start and length since the
process started, each total, and what no phase covered ("other").

Recording costs two clock reads a phase and nothing when no one reads the report, so it
is always on: every run's log ends with its breakdown.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field


def _process_start() -> float:
    """The process's start on the wall clock: the interpreter's own start-up and the
    imports before the first line of ours count too. /proc gives the start in clock
    ticks since boot; its age against CLOCK_BOOTTIME (the same clock) is exact to a tick
    (10 ms), where the boot time /proc/stat gives is whole seconds."""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        age = time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK")
        return time.time() - age
    except (OSError, ValueError, IndexError, AttributeError):
        return time.time()  # not Linux: from the first import of this module


@dataclass(slots=True)
class Span:
    name: str
    start_s: float  # since the process started
    seconds: float = float("nan")
    depth: int = 0


@dataclass(slots=True)
class Timeline:
    origin: float = field(default_factory=_process_start)
    spans: list[Span] = field(default_factory=list)
    totals: dict[str, list[float]] = field(default_factory=dict)  # name -> [seconds, count]
    # "in-process", or "warm" for a warm server's child (quantloop/forkserver.py)
    process: str = "in-process"
    _open: list[Span] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def now(self) -> float:
        return time.time() - self.origin

    def begin(self, name: str) -> Span:
        """Open a phase (`end` closes it); `phase` is the same as a context manager."""
        span = Span(name, self.now(), depth=len(self._open))
        with self._lock:
            self.spans.append(span)
            self._open.append(span)
        return span

    def end(self, span: Span) -> None:
        span.seconds = self.now() - span.start_s
        with self._lock:
            if span in self._open:
                self._open.remove(span)

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[Span]:
        """A phase of the command's main thread (phases nest: `train` inside `flow`)."""
        span = self.begin(name)
        try:
            yield span
        finally:
            self.end(span)

    def since_start(self, name: str) -> None:
        """A phase from the process's start to now: the interpreter's start-up and the
        imports before the command's first line."""
        with self._lock:
            self.spans.append(Span(name, 0.0, self.now(), depth=0))

    def add(self, name: str, seconds: float, count: int = 1) -> None:
        """Seconds spent in many small pieces, from any thread (MLflow calls)."""
        with self._lock:
            total = self.totals.setdefault(name, [0.0, 0])
            total[0] += seconds
            total[1] += count

    @contextlib.contextmanager
    def timed(self, name: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.add(name, time.perf_counter() - t0)

    def report(self, end_s: float | None = None) -> dict:
        """{"wall_s", "phases": [{name, start_s, seconds, depth}], "totals": {name:
        {seconds, count}}, "other_s", "process"}: other is the wall time no top-level
        phase covered; process says whether a warm server's child ran the command."""
        end_s = self.now() if end_s is None else end_s
        with self._lock:
            phases = [
                {"name": s.name, "start_s": round(s.start_s, 3), "depth": s.depth,
                 "seconds": round((end_s - s.start_s) if s.seconds != s.seconds else s.seconds, 3)}
                for s in self.spans
            ]  # fmt: skip
            totals = {k: {"seconds": round(v[0], 3), "count": int(v[1])}
                      for k, v in self.totals.items()}  # fmt: skip
        covered = sum(p["seconds"] for p in phases if p["depth"] == 0)
        return {"wall_s": round(end_s, 3), "phases": phases, "totals": totals,
                "other_s": round(max(end_s - covered, 0.0), 3),
                "process": self.process}  # fmt: skip


class Chain:
    """Phases one after another, one open at a time: switch() ends the last and opens the
    next (the parts of a loop, where a `with` per part would not fit)."""

    def __init__(self, timeline: Timeline | None = None) -> None:
        self.timeline = timeline or TIMELINE
        self.span: Span | None = None

    def switch(self, name: str) -> None:
        self.close()
        self.span = self.timeline.begin(name)

    def close(self) -> None:
        if self.span is not None:
            self.timeline.end(self.span)
            self.span = None


# The process's timeline: a command has one.
TIMELINE = Timeline()
phase = TIMELINE.phase
add = TIMELINE.add
timed = TIMELINE.timed
report = TIMELINE.report
since_start = TIMELINE.since_start


_exit: dict = {}


def write_at_exit(log: str | os.PathLike, show: Callable[[list], None] | None = None) -> None:
    """At the interpreter's exit, call what followed the last phase "shutdown", append
    the breakdown to the run's log, write it as JSON beside the log
    (`<log>.profile.json`) and hand its rows to `show`. The handler is registered when
    this module is first imported (the CLI imports it first), so it runs after every
    handler registered later: Prefect's server, Dask's cluster and multiprocessing's
    children are stopped by then, and "shutdown" counts them."""
    _exit.update(log=log, show=show, started=TIMELINE.now())


@atexit.register
def _write() -> None:
    if not _exit:
        return
    log, show = _exit["log"], _exit["show"]
    with TIMELINE._lock:
        ends = [s.start_s + s.seconds for s in TIMELINE.spans if s.seconds == s.seconds]
        last = max([_exit["started"], *ends])
        TIMELINE.spans.append(Span("shutdown", last, TIMELINE.now() - last, depth=0))
    rep = report()
    rows = table(rep)
    with contextlib.suppress(OSError):
        tmp = f"{log}.profile.json.tmp-{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump(rep, f, indent=1)
        os.replace(tmp, f"{log}.profile.json")
        with open(log, "a") as f:
            f.write("where the time went (s since the process started):\n")
            f.writelines(f"  {r[0]:<48} {r[1]:>8} {r[2]:>8} {r[3]:>5}\n" for r in rows)
    if show is not None:
        show(rows)


def table(rep: dict) -> list[tuple[str, str, str, str]]:
    """Rows (what, starts at s, seconds, share of the wall) for a terminal or a log."""
    wall = rep["wall_s"] or float("nan")
    rows = []
    for p in rep["phases"]:
        rows.append(("  " * p["depth"] + p["name"], f"{p['start_s']:.2f}", f"{p['seconds']:.2f}",
                     f"{p['seconds'] / wall:.0%}"))  # fmt: skip
    rows.append(("other (no phase)", "", f"{rep['other_s']:.2f}", f"{rep['other_s'] / wall:.0%}"))
    for name, t in rep["totals"].items():
        rows.append((f"{name} ({t['count']:,} calls, within phases)", "", f"{t['seconds']:.2f}",
                     f"{t['seconds'] / wall:.0%}"))  # fmt: skip
    rows.append(("wall, process start to exit", "", f"{rep['wall_s']:.2f}", "100%"))
    return rows
