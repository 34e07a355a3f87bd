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
    database: Annotated[
        str | None,
        typer.Option(
            help="PostgreSQL for both servers' stores: postgresql://USER:PASSWORD@HOST:PORT/NAME "
            "(databases NAME_prefect, NAME_mlflow, NAME_mlflow_auth, created if missing; "
            "infra/README.md). Also read from QUANTLOOP_SERVE_DATABASE, which keeps the "
            "password off the command line [default: SQLite files under home/serve]",
            envvar="QUANTLOOP_SERVE_DATABASE",
            show_envvar=False,
        ),
    ] = None,
) -> None:
    """Run the local stack: Prefect server and UI, MLflow, a worker with the deployments."""
    from quantloop.database import DatabaseError, ServerDatabases
    from quantloop.deploy import PREFECT_YAML, DeploymentConflict
    from quantloop.serve import StackConfig, serve_forever
    from quantloop.supervisor import PortInUse

    if database:
        try:
            ServerDatabases(database)  # a bad URL is said before anything starts
        except DatabaseError as exc:
            fail(str(exc), code=2)
    cfg = StackConfig(
        home=home.resolve(), host=host, prefect_port=prefect_port, mlflow_port=mlflow_port,
        pool=pool, prefect_file=(prefect_file or PREFECT_YAML).resolve(), auth=auth,
        database=database,
    )  # fmt: skip
    try:
        serve_forever(cfg, say=lambda line: console.print(line, highlight=False, soft_wrap=True))
    except PortInUse as exc:  # nothing started: the line says which port and who holds it
        fail(str(exc), code=1)
    except DatabaseError as exc:  # it names the URL, password masked
        fail(str(exc), code=1)
    except (RuntimeError, TimeoutError, DeploymentConflict, OSError) as exc:
        fail(f"{type(exc).__name__}: {exc}", code=1)
