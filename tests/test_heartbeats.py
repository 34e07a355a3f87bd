"""Every flow run keeps its Prefect heartbeats, subflows included, sent by quantloop's
thread (tasks/runtime/heartbeats.py) in place of Prefect's, which is joined up to a
second late; and those events reach the server as Prefect's engine sends them."""

from __future__ import annotations

import json
import threading
import time
import urllib.request

import pytest
from prefect import flow, flow_engine
from prefect.events.worker import EventsWorker
from prefect.runtime import flow_run

import quantloop.flows  # noqa: F401 - installs the replacement, as every flow import does
from quantloop.tasks.runtime import heartbeats


def senders() -> dict[str, int]:
    """The heartbeat threads running now: Prefect's own (its heartbeat_loop) and
    quantloop's."""
    out = {"prefect": 0, "quantloop": 0}
    for thread in threading.enumerate():
        target = getattr(thread, "_args", ())
        if target and getattr(target[0], "__qualname__", "").endswith("heartbeat_loop"):
            out["prefect"] += 1
        if thread.name == heartbeats.THREAD_NAME and thread.is_alive():
            out["quantloop"] += 1
    return out


@flow
def child() -> tuple[str, dict[str, int]]:
    return str(flow_run.id), senders()


@flow
def parent() -> tuple[str, dict[str, int], str, dict[str, int]]:
    own = senders()
    child_id, in_child = child()
    return str(flow_run.id), own, child_id, in_child


def heartbeat_events(api: str, run_id: str) -> list[dict]:
    body = {"filter": {"event": {"name": ["prefect.flow-run.heartbeat"]},
                       "resource": {"id": [f"prefect.flow-run.{run_id}"]}},
            "limit": 10}  # fmt: skip
    request = urllib.request.Request(f"{api}/events/filter", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})  # fmt: skip
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.load(response)["events"]


def test_the_replacement_is_in_place_for_this_prefect():
    """A Prefect whose heartbeat context differs leaves `install` False: this fails then,
    so the release that changed it is seen here, not as a second per flow run."""
    assert heartbeats.install()
    assert flow_engine._send_heartbeats is heartbeats.send_heartbeats


@pytest.mark.slow
@pytest.mark.server
def test_every_flow_run_and_subflow_beats_from_a_thread_that_ends_with_it(prefect_api):
    before = senders()  # an earlier test's threads, if any were still ending
    run_id, own, child_id, in_child = parent()
    # one thread for the parent; the subflow's own beside it; none of Prefect's
    assert own == {"prefect": before["prefect"], "quantloop": before["quantloop"] + 1}
    assert in_child == {"prefect": before["prefect"], "quantloop": before["quantloop"] + 2}
    assert senders()["quantloop"] <= before["quantloop"], "a heartbeat thread outlived its run"

    # Each run's first heartbeat reached the server, as Prefect's engine builds it.
    EventsWorker.drain_all()
    for run in (run_id, child_id):
        deadline = time.monotonic() + 60
        while not (events := heartbeat_events(prefect_api, run)):
            assert time.monotonic() < deadline, f"no heartbeat event for flow run {run}"
            time.sleep(0.5)
        [event] = events
        related = {r["prefect.resource.role"]: r for r in event["related"]}
        assert related["flow"]["prefect.resource.id"].startswith("prefect.flow.")
        assert related["flow"]["prefect.resource.name"] in ("parent", "child")
        assert event["resource"]["prefect.resource.name"]
