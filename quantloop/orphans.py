"""Runs a stopped stack leaves in flight, closed in its records.

A flow run whose process `serve` ended (Ctrl-C, a dead worker restarted) never reports
its end: Prefect would show it RUNNING for ever, its subflows too, and the MLflow runs it
opened in the workspace's store would stay RUNNING. `close_runs` marks them: the Prefect
flow runs of the stack's work pool that are not final, and their subflows, get a final
state (Cancelled when `serve` ended them, Crashed when an earlier stack died with them),
and the MLflow runs those flow runs opened (tagged prefect_flow_run_id) and their child
runs get KILLED.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

IN_FLIGHT = ("PENDING", "RUNNING", "CANCELLING")


def in_flight(pool: str) -> list:
    """The flow runs of `pool` that are not final, and their subflows (of any depth), from
    the Prefect API of the current settings."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (
        FlowRunFilter,
        FlowRunFilterParentFlowRunId,
        FlowRunFilterState,
        FlowRunFilterStateType,
        WorkPoolFilter,
        WorkPoolFilterName,
    )
    from prefect.client.schemas.objects import StateType

    state = FlowRunFilterState(type=FlowRunFilterStateType(any_=[StateType(s) for s in IN_FLIGHT]))
    with get_client(sync_client=True) as client:
        found = client.read_flow_runs(
            flow_run_filter=FlowRunFilter(state=state),
            work_pool_filter=WorkPoolFilter(name=WorkPoolFilterName(any_=[pool])),
        )
        parents = [r.id for r in found]
        while parents:  # subflows run in their parent's process: ended with it
            children = client.read_flow_runs(
                flow_run_filter=FlowRunFilter(
                    state=state, parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=parents)
                )
            )
            children = [r for r in children if r.id not in {f.id for f in found}]
            found += children
            parents = [r.id for r in children]
    return found


def mark_flow_runs(runs: Iterable, *, crashed: bool, message: str) -> list[str]:
    """Give each flow run a final state (forced: no orchestration rule may keep it
    running); their ids."""
    from prefect.client.orchestration import get_client
    from prefect.states import Cancelled, Crashed

    done = []
    with get_client(sync_client=True) as client:
        for run in runs:
            state = Crashed(message=message) if crashed else Cancelled(message=message)
            client.set_flow_run_state(run.id, state, force=True)
            done.append(str(run.id))
    return done


def kill_mlflow_runs(store: str, flow_run_ids: Iterable[str]) -> list[str]:
    """KILLED for the RUNNING MLflow runs in `store` tagged with one of `flow_run_ids`,
    and their RUNNING child runs (any depth); their ids."""
    ids = set(flow_run_ids)
    if not ids or (store.startswith("sqlite:///") and not Path(store[10:]).exists()):
        return []
    from mlflow.entities import ViewType
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=store)
    experiments = [e.experiment_id for e in client.search_experiments(view_type=ViewType.ALL)]
    if not experiments:
        return []
    running = client.search_runs(experiments, "attributes.status = 'RUNNING'",
                                 run_view_type=ViewType.ALL, max_results=10_000)  # fmt: skip
    ended = {r.info.run_id for r in running if r.data.tags.get("prefect_flow_run_id") in ids}
    grew = True
    while grew:  # child runs of the ended ones
        more = {r.info.run_id for r in running if r.data.tags.get("mlflow.parentRunId") in ended}
        grew = not more <= ended
        ended |= more
    for run_id in sorted(ended):
        client.set_terminated(run_id, "KILLED")
    return sorted(ended)


def close_runs(pool: str, store: str, *, crashed: bool, message: str) -> tuple[int, int]:
    """Close the runs of `pool` left in flight (Prefect, then the MLflow runs they opened
    in `store`): (flow runs, MLflow runs) closed."""
    flow_runs = mark_flow_runs(in_flight(pool), crashed=crashed, message=message)
    return len(flow_runs), len(kill_mlflow_runs(store, flow_runs))
