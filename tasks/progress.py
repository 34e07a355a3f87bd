"""Progress of long stages, shown by whoever is watching (the CLI's progress bars).

Flows run in the CLI's process (Prefect's ephemeral API runs tasks in threads),
so the CLI installs a sink here and stages report to it; with no sink installed
(a deployment on a worker) reports go nowhere and cost nothing.
"""

from __future__ import annotations

from collections.abc import Callable

Sink = Callable[[str, int, int], None]  # (stage, done, total)
_sink: Sink | None = None


def install(sink: Sink | None) -> None:
    global _sink
    _sink = sink


def report(stage: str, done: int, total: int) -> None:
    if _sink is not None:
        _sink(stage, done, total)
