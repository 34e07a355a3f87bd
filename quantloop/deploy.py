"""Deployments from infra/prefect.yaml, the one place they are written.

`quantloop deploy` and `quantloop serve` read the file, create the work pools it
names (process pools), and create each deployment as `prefect deploy` would: the
flow loaded from its entrypoint for its name and parameter schema, the file's pull
steps, pool, queue, schedules, parameters, tags and description. An existing
deployment with other settings is never replaced silently: the call fails naming each
difference, unless asked to replace.

The file's top-level `work_queues` (which `prefect deploy` ignores) gives each queue's
priority; every pool the deployments name gets those queues with those priorities, so
a worker serves the research queue before the batch queue (retrain, backtest).
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any
from uuid import UUID

import yaml

# The checkout: entrypoints (flows/research.py:research) are relative to it.
REPO_ROOT = Path(__file__).resolve().parents[1]
PREFECT_YAML = REPO_ROOT / "infra" / "prefect.yaml"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Deployment:
    """One deployment of prefect.yaml, as it will be applied."""

    flow: str  # the flow's name (@flow(name=...)), the first half of "flow/name"
    name: str
    entrypoint: str
    pool: str
    queue: str = "default"
    parameters: dict[str, Any] = dataclasses.field(default_factory=dict)
    pull_steps: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    tags: list[str] = dataclasses.field(default_factory=list)
    description: str | None = None
    job_variables: dict[str, Any] = dataclasses.field(default_factory=dict)
    # as prefect.yaml writes them: {"cron": ..., "timezone": ..., "active": ...}
    schedules: list[dict[str, Any]] = dataclasses.field(default_factory=list)

    @property
    def full_name(self) -> str:
        return f"{self.flow}/{self.name}"


# The workspace fields that say where a run's data and records are.
WHERE = ("home", "site", "tracking", "data_catalog", "tracking_uri")


class DeploymentConflict(RuntimeError):
    """A deployment exists with other settings; nothing was changed."""


def flow_name(entrypoint: str, root: Path = REPO_ROOT) -> str:
    from prefect.flows import load_flow_from_entrypoint

    return load_flow_from_entrypoint(str(root / entrypoint)).name


def read_deployments(path: Path = PREFECT_YAML, root: Path = REPO_ROOT) -> list[Deployment]:
    """The deployments of a prefect.yaml (YAML anchors resolved), in the file's order."""
    config = yaml.safe_load(Path(path).read_text())
    pull = config.get("pull") or []
    out = []
    for d in config["deployments"]:
        pool = d["work_pool"]
        out.append(
            Deployment(
                flow=flow_name(d["entrypoint"], root),
                name=d["name"],
                entrypoint=d["entrypoint"],
                pool=pool["name"],
                queue=pool.get("work_queue_name") or "default",
                parameters=copy.deepcopy(d.get("parameters") or {}),
                pull_steps=copy.deepcopy(d.get("pull") or pull),
                tags=list(d.get("tags") or []),
                description=d.get("description"),
                job_variables=copy.deepcopy(pool.get("job_variables") or {}),
                schedules=[schedule_spec(x) for x in d.get("schedules") or []],
            )
        )
    names = [d.full_name for d in out]
    if len(set(names)) != len(names):
        raise ValueError(f"{path}: deployment names repeat: {sorted(names)}")
    return out


def schedule_spec(item: Mapping[str, Any]) -> dict[str, Any]:
    """A prefect.yaml schedule as quantloop applies and compares it: cron schedules only
    (the file's), with the timezone and whether it is active spelled out."""
    unknown = set(item) - {"cron", "timezone", "active"}
    if "cron" not in item or unknown:
        raise ValueError(f"a schedule is {{cron, timezone, active}} here, got {dict(item)}")
    return {"cron": item["cron"], "timezone": item.get("timezone") or "UTC",
            "active": bool(item.get("active", True))}  # fmt: skip


def read_queues(path: Path = PREFECT_YAML) -> dict[str, int]:
    """The work queues' priorities of a prefect.yaml (`work_queues`: name -> priority;
    lower is served first)."""
    queues = yaml.safe_load(Path(path).read_text()).get("work_queues") or {}
    for name, priority in queues.items():
        if not isinstance(priority, int) or priority < 1:
            raise ValueError(
                f"{path}: work_queues.{name} must be an integer >= 1, got {priority!r}"
            )
    return dict(queues)


def ensure_queues(pool: str, priorities: Mapping[str, int]) -> list[str]:
    """Give `pool` the queues with the priorities of `priorities`, creating missing
    ones; returns what changed ("batch: created, priority 10")."""
    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound

    changed = []
    with get_client(sync_client=True) as client:
        # highest priority first: Prefect shifts queues when a priority is taken
        for name, priority in sorted(priorities.items(), key=lambda kv: kv[1]):
            try:
                queue = client.read_work_queue_by_name(name, work_pool_name=pool)
            except ObjectNotFound:
                client.create_work_queue(
                    name,
                    priority=priority,
                    work_pool_name=pool,
                    description=f"priority {priority} (infra/prefect.yaml)",
                )
                changed.append(f"{pool}/{name}: created, priority {priority}")
                continue
            if queue.priority != priority:
                client.update_work_queue(queue.id, priority=priority)
                changed.append(f"{pool}/{name}: priority {queue.priority} -> {priority}")
    return changed


def for_stack(
    deployments: Iterable[Deployment],
    *,
    pool: str,
    checkout: Path,
    workspace: Mapping[str, Any],
) -> list[Deployment]:
    """The same deployments for one machine's stack (`quantloop serve`): every one on
    `pool`, run from `checkout`, with `workspace` in place of where the file's records
    go (the desk's site and tracking blocks are not saved on a researcher's own server;
    its other workspace settings stay)."""
    out = []
    for d in deployments:
        parameters = copy.deepcopy(d.parameters)
        # a flow's workspace: a parameter of its own (retrain, backtest), or a field of
        # its one parameter (research's params, a stage's stage)
        holders = [parameters] + [v for v in parameters.values() if isinstance(v, dict)]
        for holder in holders:
            if isinstance(holder.get("workspace"), dict):
                kept = {k: v for k, v in holder["workspace"].items() if k not in WHERE}
                holder["workspace"] = {**kept, **workspace}
        steps = [{"prefect.deployments.steps.set_working_directory": {"directory": str(checkout)}}]
        out.append(dataclasses.replace(d, pool=pool, pull_steps=steps, parameters=parameters))
    return out


def ensure_pool(pool: str) -> bool:
    """Create `pool` as a process work pool unless it exists; True if it was created.

    An existing pool of another type is an error: these deployments run from a
    checkout on the worker's machine, which only a process worker does.
    """
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.exceptions import ObjectNotFound
    from prefect.workers.process import ProcessWorker

    with get_client(sync_client=True) as client:
        try:
            found = client.read_work_pool(pool)
        except ObjectNotFound:
            client.create_work_pool(
                WorkPoolCreate(
                    name=pool,
                    type="process",
                    base_job_template=ProcessWorker.get_default_base_job_template(),
                    description="quantloop flows run as processes from a checkout",
                )
            )
            return True
    if found.type != "process":
        raise ValueError(
            f"work pool {pool!r} has type {found.type!r}; quantloop's deployments need a "
            "'process' pool (prefect work-pool create NAME --type process)"
        )
    return False


def differences(existing: Any, wanted: Deployment) -> list[str]:
    """What an existing deployment (the API's record) has that `wanted` does not."""
    have = {
        "entrypoint": existing.entrypoint,
        "work pool": existing.work_pool_name,
        "work queue": existing.work_queue_name,
        "parameters": existing.parameters or {},
        "pull steps": existing.pull_steps or [],
        "tags": sorted(existing.tags or []),
        "description": existing.description or None,
        "job variables": existing.job_variables or {},
        "schedules": sorted(
            (
                {
                    "cron": getattr(x.schedule, "cron", repr(x.schedule)),
                    "timezone": getattr(x.schedule, "timezone", None) or "UTC",
                    "active": x.active,
                }
                for x in existing.schedules or []
            ),
            key=repr,
        ),  # fmt: skip
    }
    want = {
        "entrypoint": wanted.entrypoint,
        "work pool": wanted.pool,
        "work queue": wanted.queue,
        "parameters": wanted.parameters,
        "pull steps": wanted.pull_steps,
        "tags": sorted(wanted.tags),
        "description": wanted.description or None,
        "job variables": wanted.job_variables,
        "schedules": sorted(wanted.schedules, key=repr),
    }
    return [f"{k}: {have[k]!r} -> {want[k]!r}" for k in want if have[k] != want[k]]


def apply(
    deployments: Sequence[Deployment],
    *,
    replace: bool = False,
    root: Path = REPO_ROOT,
    queues: Mapping[str, int] | None = None,
) -> dict[str, UUID]:
    """Create (or leave as they are) the deployments; returns their ids by full name.
    `queues` (read_queues()) are made in every pool the deployments name.

    Raises DeploymentConflict, before changing anything, when a deployment of the same
    name exists with other settings, unless `replace`.
    """
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import DeploymentScheduleCreate
    from prefect.client.schemas.schedules import CronSchedule
    from prefect.exceptions import ObjectNotFound
    from prefect.flows import load_flow_from_entrypoint
    from prefect.utilities.callables import parameter_schema

    from quantloop.tasks.research.form import form_schema

    with get_client(sync_client=True) as client:
        conflicts = []
        for d in deployments:
            try:
                existing = client.read_deployment_by_name(d.full_name)
            except ObjectNotFound:
                continue
            changed = differences(existing, d)
            if changed:
                conflicts.append(f"{d.full_name}: " + "; ".join(changed))
        if conflicts and not replace:
            raise DeploymentConflict(
                "deployments exist with other settings (replace them with --replace):\n  "
                + "\n  ".join(conflicts)
            )
        for pool in dict.fromkeys(d.pool for d in deployments):
            ensure_pool(pool)
            ensure_queues(pool, queues or {})
        ids = {}
        for d in deployments:
            flow = load_flow_from_entrypoint(str(root / d.entrypoint))
            flow_id = client.create_flow_from_name(flow.name)
            ids[d.full_name] = client.create_deployment(
                flow_id=flow_id,
                name=d.name,
                entrypoint=d.entrypoint,
                work_pool_name=d.pool,
                work_queue_name=d.queue,
                parameters=d.parameters,
                pull_steps=d.pull_steps,
                tags=d.tags,
                description=d.description,
                job_variables=d.job_variables,
                schedules=[
                    DeploymentScheduleCreate(
                        schedule=CronSchedule(cron=x["cron"], timezone=x["timezone"]),
                        active=x["active"],
                    )
                    for x in d.schedules
                ],
                # The run form offers no 'Property is type "None"' tab (form_schema)
                parameter_openapi_schema=form_schema(
                    parameter_schema(flow).model_dump_for_openapi()
                ),
                enforce_parameter_schema=True,
            )
    return ids


def asks_for_cuda(d: Deployment) -> bool:
    """Whether the deployment's parameters ask for a CUDA device (train/gpu's
    `config.device: cuda`): its runs need a worker that has one."""

    def found(value: Any) -> bool:
        if isinstance(value, dict):
            return any(
                (k == "device" and isinstance(v, str) and v.startswith("cuda")) or found(v)
                for k, v in value.items()
            )
        return isinstance(value, list) and any(found(v) for v in value)

    return found(d.parameters)
