"""Prefect's flow-run heartbeats, sent by a thread that stops the moment its flow ends.

Prefect 3.9 sends a flow run's heartbeat (the `prefect.flow-run.heartbeat` event that a
zombie-detection automation watches) from a thread that sleeps in steps of one second
and is joined when the flow ends: every flow run waits up to a second after its last
line. Measured on a cached research re-run here: 1.00 s after an empty flow's body,
0.71 s of a 2.8 s re-run, 0.33 s of an H200 run. `prompt` (around a flow called in this
thread) turns Prefect's thread off and hands its frequency to `beating` (inside the
flow), which sends the same events from a thread that waits on an event instead.
Deployment runs, where Prefect's engine calls the flow, keep Prefect's own. `off` is for
subflows, whose process already beats for its top-level flow run.
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
from collections.abc import Iterator

from quantloop.tasks.runtime.prefect_settings import overridden

# The heartbeat frequency `prompt` took over from Prefect's setting (seconds), if any.
_TAKEN_OVER: contextvars.ContextVar[int | None] = contextvars.ContextVar(
    "quantloop_heartbeat_s", default=None
)


@contextlib.contextmanager
def prompt() -> Iterator[None]:
    """Flows called in this block send no heartbeat of Prefect's; the one that enters
    `beating` sends them itself, at PREFECT_FLOWS_HEARTBEAT_FREQUENCY."""
    from prefect.settings import PREFECT_FLOWS_HEARTBEAT_FREQUENCY

    seconds = PREFECT_FLOWS_HEARTBEAT_FREQUENCY.value()
    if seconds is None:  # heartbeats are off: nothing to take over
        yield
        return
    token = _TAKEN_OVER.set(seconds)
    try:
        with overridden({"flows.heartbeat_frequency": None}):
            yield
    finally:
        _TAKEN_OVER.reset(token)


@contextlib.contextmanager
def off() -> Iterator[None]:
    """Flows called in this block send no heartbeat: for stage subflows, run in the process
    of a flow whose own heartbeats already tell Prefect's zombie detection it is alive.
    Each stage's thread was joined at its exit, ~1 s per stage flow (Prefect 3.9)."""
    with overridden({"flows.heartbeat_frequency": None}):
        yield


@contextlib.contextmanager
def beating() -> Iterator[None]:
    """Inside a flow run: its heartbeats, as Prefect's engine sends them (one at once,
    then one each period, none once the block ends), when `prompt` took them over."""
    from prefect.context import FlowRunContext

    seconds = _TAKEN_OVER.get()
    context = FlowRunContext.get()
    run = context.flow_run if context else None
    if seconds is None or run is None:
        yield
        return
    from prefect import __version__
    from prefect.events import RelatedResource, emit_event
    from prefect.events.related import tags_as_related_resources

    resource = {
        "prefect.resource.id": f"prefect.flow-run.{run.id}",
        "prefect.resource.name": run.name or "",
        "prefect.version": __version__,
    }
    related = [
        RelatedResource.model_validate({
            "prefect.resource.id": f"prefect.flow.{run.flow_id}",
            "prefect.resource.role": "flow",
            "prefect.resource.name": context.flow.name,
        })
    ]  # fmt: skip
    if run.deployment_id:
        related.append(RelatedResource.model_validate(
            {"prefect.resource.id": f"prefect.deployment.{run.deployment_id}",
             "prefect.resource.role": "deployment"}))  # fmt: skip
    related += tags_as_related_resources(set(run.tags or []))
    stop = threading.Event()

    def beat() -> None:
        while True:
            try:
                emit_event(event="prefect.flow-run.heartbeat", resource=resource, related=related)
            except Exception:  # noqa: BLE001 - a lost heartbeat is Prefect's to tolerate, as its own
                pass
            if stop.wait(seconds):
                return

    # Prefect's settings context, as its own thread copies it (the API the events go to)
    thread = threading.Thread(target=contextvars.copy_context().run, args=(beat,),
                              name="quantloop-heartbeat", daemon=True)  # fmt: skip
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(timeout=2)
