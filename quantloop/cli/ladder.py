"""`quantloop ladder`: run the GPU optimization ladder flow and print its report
(docs/ladder.md).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from quantloop.cli.common import (
    HomeOption,
    TrackingUriOption,
    console,
    prefect_api,
)


def ladder(
    preset: Annotated[
        str, typer.Option(help="auto (h200 with CUDA, else cpu_tiny), h200 or cpu_tiny")
    ] = "auto",
    rungs: Annotated[
        str, typer.Option(help="Comma-separated rung numbers (1 always runs) [default: all]")
    ] = "",
    out: Annotated[Path | None, typer.Option(help="Folder for traces and the report")] = None,
    home: HomeOption = None,
    tracking_uri: TrackingUriOption = None,
) -> None:
    """Run the GPU optimization ladder flow and print its report (docs/ladder.md)."""
    from quantloop.tasks.runtime import collector

    with collector.paused():  # then frozen: later collections skip the stack
        from quantloop.flows.ladder import LadderParams
        from quantloop.flows.ladder import ladder as ladder_flow
    from quantloop.profiling.report import report_markdown

    ws = {k: v for k, v in (("home", home), ("tracking_uri", tracking_uri)) if v is not None}
    try:
        params = LadderParams(
            workspace=ws,
            preset=preset,
            rungs=[int(r) for r in rungs.split(",") if r.strip()],
            out_dir=str(out.resolve()) if out else None,
        )
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from exc
    with prefect_api(params.workspace.home_abs):
        result = ladder_flow(params)
    print(report_markdown(result), end="")
    console.print(
        f"MLflow run {result['mlflow_run_id']}; report in {params.out_dir or 'home/ladder'}"
    )
