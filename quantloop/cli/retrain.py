"""`quantloop retrain`: retrain a registered version's recipe (the champion's by default)
on the newest.
"""

from __future__ import annotations

from typing import Annotated

import typer

from quantloop.cli.common import (
    HomeOption,
    ModelOption,
    SummaryJsonOption,
    TrackingUriOption,
    VerboseOption,
    check_version,
    console,
    fail,
    prefect_api,
    quiet_console,
    workspace_of,
    write_json,
)


def retrain(
    model: ModelOption = None,
    alias: Annotated[
        str, typer.Option(help="Whose recipe: an alias or a version number")
    ] = "champion",
    days: Annotated[
        int | None,
        typer.Option(help="Newest landed trading days to use [default: as many as the version's]"),
    ] = None,
    summary_json: SummaryJsonOption = None,
    home: HomeOption = None,
    tracking_uri: TrackingUriOption = None,
    verbose: VerboseOption = False,
) -> None:
    """Retrain a registered version's recipe (the champion's by default) on the newest
    landed days and register a new version; the alias does not move (promote moves it)."""
    check_version("--alias", alias)
    if days is not None and days < 1:
        fail(f"--days must be >= 1, got {days}")
    if model is not None and not model.strip():
        fail("--model must not be empty")
    if not verbose:
        quiet_console()
    with prefect_api(home, wait=False) as api:  # a server's start overlaps the imports
        from quantloop.tasks.runtime import collector

        with collector.paused():  # then frozen: later collections skip the stack
            from quantloop.flows.retrain import retrain as retrain_flow

        api.ready()
        try:
            summary = retrain_flow(model=model, alias=alias, days=days,
                                   workspace=workspace_of(home, tracking_uri))  # fmt: skip
        except LookupError as exc:
            fail(str(exc))
    made = f"new version {summary.new_version}"
    if summary.new_version is None:
        made = f"no new version (this model of these days is version {summary.version})"
    console.print(
        f"{summary.model} version {summary.from_version} ({summary.alias}) retrained on "
        f"{summary.start}..{summary.end}: {made}; {summary.alias} unchanged. MLflow run "
        f"{summary.mlflow_run_id} (quantloop promote {summary.mlflow_run_id})",
        soft_wrap=True,
    )
    write_json(summary_json, summary.model_dump(mode="json"))
