"""Deploy quantloop's flows from this checkout to a process work pool, from Python.

The programmatic twin of `prefect deploy --prefect-file infra/prefect.yaml`: it
creates the work pool if it is missing, then registers a deployment whose pull
step sets the working directory to this checkout, so a `process` worker on this
machine (or on one with the checkout at the same path) runs the flow from here.
No image is built and nothing is pushed.

    PREFECT_API_URL=http://127.0.0.1:4200/api python infra/deploy.py quantloop-cpu
    PREFECT_API_URL=... python infra/deploy.py quantloop-gpu train
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any
from uuid import UUID

from prefect import Flow
from prefect.client.orchestration import get_client
from prefect.client.schemas.actions import WorkPoolCreate
from prefect.exceptions import ObjectNotFound
from prefect.workers.process import ProcessWorker

REPO_ROOT = Path(__file__).resolve().parents[1]

# Entrypoints relative to the repo root, as in infra/prefect.yaml.
ENTRYPOINTS = {
    "research": "flows/research.py:research",
    "features": "flows/features.py:features",
    "train": "flows/train.py:train",
    "simulate": "flows/simulate.py:simulate",
}


def ensure_pool(pool: str) -> bool:
    """Create `pool` as a process work pool unless it exists; True if it was created.

    An existing pool of another type is an error: a deployment from local source
    needs a worker that runs the flow in a process on a machine holding the code.
    """
    with get_client(sync_client=True) as client:
        try:
            found = client.read_work_pool(pool)
        except ObjectNotFound:
            client.create_work_pool(
                WorkPoolCreate(
                    name=pool,
                    type="process",
                    base_job_template=ProcessWorker.get_default_base_job_template(),
                    description="quantloop flows run as local processes from a checkout",
                )
            )
            return True
    if found.type != "process":
        raise ValueError(
            f"work pool {pool!r} has type {found.type!r}; deploying from local source "
            "needs a 'process' pool (prefect work-pool create NAME --type process)"
        )
    return False


def deploy(
    pool: str,
    *,
    flow: str = "research",
    name: str = "default",
    parameters: Mapping[str, Any] | None = None,
    tags: Sequence[str] = ("quantloop",),
    description: str | None = None,
    job_variables: Mapping[str, Any] | None = None,
    source: str | Path = REPO_ROOT,
) -> UUID:
    """Deploy one of quantloop's flows (`research` by default) from `source` to `pool`.

    Returns the deployment id; run it with
    `prefect.deployments.run_deployment(f"{flow}/{name}", parameters=...)`.
    """
    if flow not in ENTRYPOINTS:
        raise ValueError(f"flow {flow!r} is not one of {sorted(ENTRYPOINTS)}")
    ensure_pool(pool)
    loaded = Flow.from_source(source=str(Path(source).resolve()), entrypoint=ENTRYPOINTS[flow])
    return loaded.deploy(
        name,
        work_pool_name=pool,
        parameters=dict(parameters or {}),
        tags=list(tags),
        description=description,
        job_variables=dict(job_variables or {}),
        # A process pool has no image: the pull step's working directory is the code.
        build=False,
        push=False,
        print_next_steps=False,
        ignore_warnings=True,
    )


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(f"usage: python {sys.argv[0]} POOL [FLOW ...]  (flows: {', '.join(ENTRYPOINTS)})")
    for flow_name in sys.argv[2:] or ["research"]:
        deployment_id = deploy(sys.argv[1], flow=flow_name)
        print(f"{flow_name}/default -> {sys.argv[1]}: deployment {deployment_id}")
