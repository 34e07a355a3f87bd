"""`quantloop reproduce`: re-run a research run's nodes, model and simulation from their
recorded inputs,.
"""

from __future__ import annotations

from typing import Annotated

import typer
from rich import box
from rich.table import Table

from quantloop.cli.common import (
    HomeOption,
    RunArgument,
    SummaryJsonOption,
    TrackingUriOption,
    VerboseOption,
    console,
    fail,
    prefect_api,
    quiet_console,
    records_workspace,
    refusal_line,
    refused,
    write_json,
)


def reproduce(
    run: RunArgument,
    sample: Annotated[
        int, typer.Option(help="Feature nodes to re-run, drawn with a fixed seed; 0: all")
    ] = 20,
    models: Annotated[
        bool, typer.Option("--models/--nodes-only", help="Also re-train the model and replay")
    ] = True,
    summary_json: SummaryJsonOption = None,
    home: HomeOption = None,
    tracking_uri: TrackingUriOption = None,
    verbose: VerboseOption = False,
) -> None:
    """Re-run a research run's nodes, model and simulation from their recorded inputs,
    without the cache, and compare; exits 1 if anything does not reproduce."""
    if not verbose:
        quiet_console()
    # Checked first: a missing store or a refused identity is one line, before any start.
    workspace = records_workspace(home, tracking_uri, role="researcher")
    with prefect_api(home, wait=False) as api:  # a server's start overlaps the imports
        from quantloop.tasks.runtime import collector

        with collector.paused():  # then frozen: later collections skip the stack
            from quantloop.flows.reproduce import reproduce as reproduce_flow

        api.ready()
        try:
            report = reproduce_flow(run, sample=sample or None, models=models,
                                    workspace=workspace)  # fmt: skip
        except LookupError as exc:
            fail(str(exc))
        except Exception as exc:
            if (code := refused(exc)) is None:
                raise
            uri = workspace.resolve_tracking().resolved_uri()
            fail(refusal_line(code, uri, home, "researcher"), verbose=verbose, exc=exc)
    table = Table(title="Reproduction", box=box.SIMPLE_HEAD, collapse_padding=True)
    for col in ("what", "of", "key", "reproduced", "reason"):
        table.add_column(col, no_wrap=col != "reason")
    for c in report["checks"]:
        table.add_row(c["what"], c["label"], c["key"][:12], "yes" if c["reproduced"] else "NO",
                      c["reason"])  # fmt: skip
    console.print(table)
    console.print(f"{report['nodes']} re-run, {report['failures']} failed: failure rate "
                  f"{report['failure_rate']:.3f} ({report['seconds']:.1f} s)")  # fmt: skip
    write_json(summary_json, report)
    if report["failures"]:
        raise typer.Exit(1)
