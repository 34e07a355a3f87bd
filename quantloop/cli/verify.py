"""`quantloop verify`: re-hash the workspace's stored outputs, models and inputs at every
site; damaged outputs are dropped.
"""

from __future__ import annotations

from typing import Annotated

import typer

from quantloop.cli.common import (
    HomeOption,
    SummaryJsonOption,
    VerboseOption,
    console,
    prefect_api,
    quiet_console,
    workspace_of,
    write_json,
)


def verify(
    sample: Annotated[
        int, typer.Option(help="Stored feature outputs to re-hash, drawn with a fixed seed; 0: all")
    ] = 0,
    repair: Annotated[
        bool, typer.Option("--repair/--check-only", help="Drop damaged outputs from the cache")
    ] = True,
    summary_json: SummaryJsonOption = None,
    home: HomeOption = None,
    verbose: VerboseOption = False,
) -> None:
    """Re-hash the workspace's stored outputs, models and inputs, at every site the catalog
    knows; damaged outputs are dropped from the cache (the next run recomputes them).
    Exits 1 if anything is damaged, or a site's store did not answer."""
    if not verbose:
        quiet_console()
    with prefect_api(home, wait=False) as api:  # a server's start overlaps the imports
        from quantloop.tasks.runtime import collector

        with collector.paused():  # then frozen: later collections skip the stack
            from quantloop.flows.verify import verify as verify_flow

        api.ready()
        report = verify_flow(workspace_of(home, None), sample=sample or None, repair=repair)
    for key, reason in report["outputs_damaged"].items():
        console.print(f"output {key[:16]}: {reason}")
    for line in report["models_damaged"] + report["stage_outputs_damaged"] + report[
            "inputs_damaged"]:  # fmt: skip
        console.print(line, soft_wrap=True)
    for line in report["unreachable"]:
        console.print(f"not checked: {line}", soft_wrap=True)
    if report["not_on_this_host"]:
        console.print(f"{len(report['not_on_this_host'])} recorded copies are in folders this "
                      "host does not have: not checked here")  # fmt: skip
    sites = ", ".join(f"{name} {c['outputs_checked']:,}" for name, c in report["sites"].items())
    console.print(
        f"{report['outputs_checked']:,} of {report['outputs_committed']:,} outputs checked, "
        f"{len(report['outputs_damaged'])} damaged ({sites or 'no site'}); "
        f"{len(report['models_damaged'])} models, {len(report['stage_outputs_damaged'])} "
        f"simulation files, {len(report['inputs_damaged'])} inputs damaged "
        f"({report['seconds']:.1f} s)"
    )
    write_json(summary_json, report)
    if (report["outputs_damaged"] or report["models_damaged"] or report["stage_outputs_damaged"]
            or report["inputs_damaged"] or report["unreachable"]):  # fmt: skip
        raise typer.Exit(1)
