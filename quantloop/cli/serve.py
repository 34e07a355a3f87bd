"""`quantloop serve`: run the local stack: Prefect server and UI, MLflow, a worker with the
deployments.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from quantloop.cli.common import (
    console,
    fail,
)


def serve(
    home: Annotated[
        Path, typer.Option(help="Workspace folder: stores, and the stack's state in home/serve")
    ] = Path(".quantloop"),
    host: Annotated[str, typer.Option(help="Address the servers listen on")] = "127.0.0.1",
    prefect_port: Annotated[int, typer.Option(help="Prefect server and UI port")] = 4200,
    mlflow_port: Annotated[int, typer.Option(help="MLflow server and UI port")] = 5000,
    pool: Annotated[str, typer.Option(help="Work pool of the stack's worker")] = (
        "quantloop-local"
    ),
    prefect_file: Annotated[
        Path | None, typer.Option(help="The deployments file [default: infra/prefect.yaml]")
    ] = None,
    auth: Annotated[
        bool,
        typer.Option("--auth/--no-auth", help="Lock both servers (credentials in home/serve)"),
    ] = True,
) -> None:
    """Run the local stack: Prefect server and UI, MLflow, a worker with the deployments."""
    from quantloop.deploy import PREFECT_YAML, DeploymentConflict
    from quantloop.serve import StackConfig, serve_forever
    from quantloop.supervisor import PortInUse

    cfg = StackConfig(
        home=home.resolve(), host=host, prefect_port=prefect_port, mlflow_port=mlflow_port,
        pool=pool, prefect_file=(prefect_file or PREFECT_YAML).resolve(), auth=auth,
    )  # fmt: skip
    try:
        serve_forever(cfg, say=lambda line: console.print(line, highlight=False, soft_wrap=True))
    except PortInUse as exc:  # nothing started: the line says which port and who holds it
        fail(str(exc), code=1)
    except (RuntimeError, TimeoutError, DeploymentConflict, OSError) as exc:
        fail(f"{type(exc).__name__}: {exc}", code=1)
