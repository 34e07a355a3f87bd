"""Prefect's flow-run heartbeats, from a thread that stops the moment its flow run ends.

Prefect (3.9) sends every flow run's heartbeat (the `prefect.flow-run.heartbeat` event a
zombie-detection automation watches: by default every 180 s) from a thread that sleeps
in steps of one second, and joins that thread when the flow run ends: each flow run,
subflows included, waits up to a second after its last line. Measured here: 1.00 s
after an empty flow's body, 0.71 s of a 2.8 s cached research re-run (its three stage
subflows too, ~1 s each, before they were exempted), 0.33 s of an H200 run.

`install` replaces Prefect's heartbeat context (prefect.flow_engine._send_heartbeats)
with the same one whose thread waits on its stop event instead: the same events, from
the same engine methods, at the same period, for every flow run (top-level, subflow,
deployment), ended at once. Earlier, quantloop turned Prefect's off and sent the
research flow's own, leaving its stage subflows and every deployment run without or
with the join; a stage subflow training longer than the automation's threshold would
then have been crashed as a zombie.

The replaced function is Prefect's, private: `install` checks its signature and the
engine methods it calls, and leaves Prefect's in place (returning False) when they
differ, so a Prefect release that changes them costs the second, not the heartbeats.
"""

from __future__ import annotations

import contextlib
import contextvars
import inspect
import logging
import threading
from collections.abc import Iterator
from typing import Any

THREAD_NAME = "quantloop-heartbeat"
# What the replacement calls on Prefect's flow run engine (3.9's names).
_ENGINE_MEMBERS = ("heartbeat_seconds", "_build_heartbeat_event_template",
                   "_emit_flow_run_heartbeat")  # fmt: skip

_installed = False


def install() -> bool:
    """Put `send_heartbeats` in place of Prefect's heartbeat context, once a process;
    whether it is in place."""
    global _installed
    if _installed:
        return True
    from prefect import flow_engine

    original = getattr(flow_engine, "_send_heartbeats", None)
    engine = getattr(flow_engine, "BaseFlowRunEngine", None)
    if (
        original is None
        or engine is None
        or list(inspect.signature(original).parameters) != ["engine", "join_on_exit"]
        or not all(hasattr(engine, m) for m in _ENGINE_MEMBERS)
        or not hasattr(flow_engine, "MINIMUM_HEARTBEAT_INTERVAL")
    ):
        logging.getLogger(__name__).debug(
            "Prefect's heartbeat context is not the one quantloop replaces: left as it is"
        )
        return False
    flow_engine._send_heartbeats = send_heartbeats
    _installed = True
    return True


@contextlib.contextmanager
def send_heartbeats(engine: Any, join_on_exit: bool = True) -> Iterator[None]:
    """Prefect 3.9's `_send_heartbeats`, whose thread waits on the stop event between
    heartbeats: one at once, one each period while the run is not final, none after the
    block (its thread ends when the block does, and is joined)."""
    from prefect.flow_engine import MINIMUM_HEARTBEAT_INTERVAL

    seconds = engine.heartbeat_seconds
    if seconds is None:
        yield
        return
    seconds = max(seconds, MINIMUM_HEARTBEAT_INTERVAL)
    resource, related = engine._build_heartbeat_event_template()
    stop = threading.Event()

    def beat() -> None:
        while not stop.is_set():
            run = engine.flow_run
            if run and run.state and run.state.is_final():
                return
            try:
                engine._emit_flow_run_heartbeat(resource, related)
            except Exception:  # noqa: BLE001 - a lost heartbeat is Prefect's to tolerate, as its own
                engine.logger.debug("Failed to emit heartbeat", exc_info=True)
            if stop.wait(seconds):
                return

    # The caller's context, as Prefect copies it: the heartbeat goes to the run's API.
    thread = threading.Thread(target=contextvars.copy_context().run, args=(beat,),
                              name=THREAD_NAME, daemon=True)  # fmt: skip
    thread.start()
    try:
        yield
    finally:
        stop.set()
        if join_on_exit:
            thread.join(timeout=2)
