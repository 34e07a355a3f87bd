"""`quantloop promote`: gate a run's candidate version; when it passes, copy it into the
guarded registered model and move `champion` to the copy. Records as the promoter.
"""

from __future__ import annotations

from typing import Annotated

import typer

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


def promote(
    run: RunArgument,
    horizon: Annotated[
        str, typer.Option(help="Mark-out horizon the gate tests ('5s', '100ev')")
    ] = "5s",
    alpha: Annotated[
        float,
        typer.Option(
            min=0.0,
            max=0.5,
            help="Level of the one-sided paired test, after the "
            "trials adjustment (0 to 0.5, exclusive)",
        ),
    ] = 0.05,
    min_improvement_bps: Annotated[
        float,
        typer.Option(
            min=0.0,
            max=100.0,
            help="Margin in bps by which the candidate must "
            "beat the champion (or, for the first one, the baseline)",
        ),
    ] = 0.0,
    sample: Annotated[int, typer.Option(help="Feature nodes the reproduction gate re-runs")] = 20,
    summary_json: SummaryJsonOption = None,
    home: HomeOption = None,
    tracking_uri: TrackingUriOption = None,
    verbose: VerboseOption = False,
) -> None:
    """Move the `champion` alias to the run's model version if its gates pass: on one
    held-out window neither model trained on, its mark-out beats the champion's (the
    first champion: the baseline's) by a one-sided paired test at --alpha, trials counted;
    reproduced; ladder proven. The decision and the test's figures are recorded on the
    version. Exits 1 when refused."""
    if not verbose:
        quiet_console()
    # Checked first: a missing store or a refused identity is one line, before any start.
    workspace = records_workspace(home, tracking_uri, role="promoter")
    with prefect_api(home, wait=False) as api:  # a server's start overlaps the imports
        from quantloop.tasks.runtime import collector

        with collector.paused():  # then frozen: later collections skip the stack
            from quantloop.flows.promote import promote as promote_flow

        api.ready()
        try:
            decision = promote_flow(run, horizon=horizon, alpha=alpha,
                                    min_improvement_bps=min_improvement_bps,
                                    reproduce_sample=sample,
                                    workspace=workspace)  # fmt: skip
        except LookupError as exc:
            fail(str(exc))
        except Exception as exc:
            if (code := refused(exc)) is None:
                raise
            uri = workspace.resolve_tracking().resolved_uri()
            fail(refusal_line(code, uri, home, "promoter"), verbose=verbose, exc=exc)
    for gate, values in decision["gates"].items():
        verdict = ("passed" if values["passed"] else "skipped" if values.get("skipped")
                   else "[bold red]failed[/bold red]")  # fmt: skip
        console.print(f"{gate}: {verdict} ({values.get('why', values)})", soft_wrap=True)
    time_s = decision.get("promotion_time_s")
    console.print(
        f"{decision['model']} version {decision['version']}: {decision['decision']}"
        + (f" in {time_s:.1f} s after its research run" if time_s else "")
        + (f"; {decision['alias']} is {decision['guarded_model']} version "
           f"{decision['champion_version']}" if decision.get("champion_version") else "")
    )  # fmt: skip
    write_json(summary_json, decision)
    if decision["decision"] != "promoted":
        raise typer.Exit(1)
