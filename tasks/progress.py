"""Progress of long stages, shown by whoever is watching (the CLI's bars and lines).

Flows run in the CLI's process (Prefect's ephemeral API runs tasks in threads),
so the CLI installs a sink here and stages report to it; with no sink installed
(a deployment on a worker) reports go nowhere and cost nothing: there the flow
run's logs say the same in the Prefect UI.
"""

from __future__ import annotations

from typing import Protocol


class Sink(Protocol):
    def report(self, stage: str, done: int, total: int) -> None:
        """A stage's count of finished items (a progress bar)."""

    def note(self, stage: str, message: str) -> None:
        """One line about a stage: what it found or did."""


_sink: Sink | None = None


def install(sink: Sink | None) -> None:
    global _sink
    _sink = sink


def report(stage: str, done: int, total: int) -> None:
    if _sink is not None:
        _sink.report(stage, done, total)


def note(stage: str, message: str) -> None:
    if _sink is not None:
        _sink.note(stage, message)
