"""`quantloop deploy`: apply the deployments of infra/prefect.yaml to the server at
PREFECT_API_URL.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from quantloop.cli.common import (
    console,
    fail,
)


def deploy(
    prefect_file: Annotated[
        Path | None, typer.Option(help="The deployments file [default: infra/prefect.yaml]")
    ] = None,
    only: Annotated[
        list[str] | None, typer.Option(help="Only these deployments (flow/name); repeatable")
    ] = None,
    replace: Annotated[
        bool, typer.Option(help="Replace deployments that exist with other settings")
    ] = False,
) -> None:
    """Apply the deployments of infra/prefect.yaml to the server at PREFECT_API_URL.

    Creates their work pools (process pools) when missing; refuses, changing nothing,
    when a deployment exists with other settings, naming each difference (--replace).
    """
    from prefect.settings import PREFECT_API_URL

    from quantloop.deploy import (
        PREFECT_YAML,
        DeploymentConflict,
        apply,
        read_deployments,
        read_queues,
    )

    if not PREFECT_API_URL.value():
        # Prefect would start a temporary server and deploy there, to be lost on exit.
        fail(
            "PREFECT_API_URL is not set: `prefect config set PREFECT_API_URL=http://HOST:4200/api`"
        )
    specs = read_deployments(prefect_file or PREFECT_YAML)
    if only:
        unknown = set(only) - {d.full_name for d in specs}
        if unknown:
            fail(f"--only: no deployment {sorted(unknown)}; known: {[d.full_name for d in specs]}")
        specs = [d for d in specs if d.full_name in only]
    try:
        queues = read_queues(prefect_file or PREFECT_YAML)
        ids = apply(specs, replace=replace, queues=queues)
    except DeploymentConflict as exc:
        fail(str(exc), code=1)
    for d in specs:
        console.print(f"{d.full_name} -> work pool {d.pool}, queue {d.queue}: deployment "
                      f"{ids[d.full_name]}")  # fmt: skip
    if queues:
        ranked = sorted(queues.items(), key=lambda x: x[1])
        console.print(
            "work queues by priority (lower first): " + ", ".join(f"{q} {p}" for q, p in ranked)
        )
