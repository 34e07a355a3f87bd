"""A flow run from `quantloop run` keeps its Prefect heartbeats, sent by quantloop's thread
(tasks/runtime/heartbeats.py) in place of Prefect's, which is joined a second late."""

from __future__ import annotations

import json
import threading
import time
import urllib.request

import pytest
from prefect import flow
from prefect.events.worker import EventsWorker
from prefect.runtime import flow_run

from quantloop.tasks.runtime import heartbeats


def senders() -> dict[str, bool]:
    """Which heartbeat threads run now: Prefect's (its engine's loop) and quantloop's."""
    out = {"prefect": False, "quantloop": False}
    for thread in threading.enumerate():
        target = getattr(thread, "_args", ())
        if target and getattr(target[0], "__qualname__", "").endswith("heartbeat_loop"):
            out["prefect"] = True
        if thread.name == "quantloop-heartbeat":
            out["quantloop"] = True
    return out


@flow
def beating_flow() -> tuple[str, dict[str, bool]]:
    with heartbeats.beating():
        return str(flow_run.id), senders()


def heartbeat_events(api: str, run_id: str) -> list[dict]:
    body = {"filter": {"event": {"name": ["prefect.flow-run.heartbeat"]},
                       "resource": {"id": [f"prefect.flow-run.{run_id}"]}},
            "limit": 10}  # fmt: skip
    request = urllib.request.Request(f"{api}/events/filter", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})  # fmt: skip
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.load(response)["events"]


@pytest.mark.server
def test_a_prompted_flow_sends_its_heartbeats_from_quantloops_thread(prefect_api):
    with heartbeats.prompt():
        run_id, during = beating_flow()
    assert during == {"prefect": False, "quantloop": True}
    assert not senders()["quantloop"], "the heartbeat thread outlived its flow"
    # Without `prompt`, the same flow has Prefect's thread, and quantloop sends none
    _, unprompted = beating_flow()
    assert unprompted == {"prefect": True, "quantloop": False}

    # The event reached the server, as Prefect's engine would have sent it
    EventsWorker.drain_all()
    deadline = time.monotonic() + 60
    while not (events := heartbeat_events(prefect_api, run_id)):
        assert time.monotonic() < deadline, f"no heartbeat event for flow run {run_id}"
        time.sleep(0.5)
    [event] = events
    related = {r["prefect.resource.role"]: r["prefect.resource.id"] for r in event["related"]}
    assert related["flow"].startswith("prefect.flow.")
    assert event["resource"]["prefect.resource.name"]


@flow
def plain_flow() -> dict[str, bool]:
    return senders()


@pytest.mark.server
def test_off_stops_prefects_heartbeats_and_keeps_every_other_setting(prefect_api):
    from prefect.settings import PREFECT_API_URL, PREFECT_FLOWS_HEARTBEAT_FREQUENCY

    before = PREFECT_FLOWS_HEARTBEAT_FREQUENCY.value()
    assert before is not None and PREFECT_API_URL.value() == prefect_api
    with heartbeats.off():
        assert PREFECT_FLOWS_HEARTBEAT_FREQUENCY.value() is None
        assert PREFECT_API_URL.value() == prefect_api
        assert plain_flow() == {"prefect": False, "quantloop": False}
    assert PREFECT_FLOWS_HEARTBEAT_FREQUENCY.value() == before
    assert plain_flow()["prefect"]
