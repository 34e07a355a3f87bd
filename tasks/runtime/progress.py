"""Progress of long stages, shown by whoever is watching.

Stages run in the process of the flow that calls them (Prefect's ephemeral API runs
tasks in threads), so watchers install sinks here and stages report to them: the
CLI's bars and lines (`install`), and the research flow's own run, whose log and
progress artifact the Prefect UI shows (`adding`). With no sink, reports cost nothing.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Protocol


class Sink(Protocol):
    def report(self, stage: str, done: int, total: int) -> None:
        """A stage's count of finished items (a progress bar)."""

    def note(self, stage: str, message: str) -> None:
        """One line about a stage: what it found or did."""


_sink: Sink | None = None
_more: list[Sink] = []


def install(sink: Sink | None) -> None:
    """The process's main sink (the CLI's), or None."""
    global _sink
    _sink = sink


@contextlib.contextmanager
def adding(sink: Sink) -> Iterator[None]:
    """`sink` also receives the reports made inside this block."""
    _more.append(sink)
    try:
        yield
    finally:
        _more.remove(sink)


def _sinks() -> list[Sink]:
    return ([_sink] if _sink is not None else []) + _more


def report(stage: str, done: int, total: int) -> None:
    for sink in _sinks():
        sink.report(stage, done, total)


def note(stage: str, message: str) -> None:
    for sink in _sinks():
        sink.note(stage, message)
