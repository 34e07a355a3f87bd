"""`quantloop run`: run the research flow: data -> features -> train -> simulate -> MLflow."""

from __future__ import annotations

import datetime as dt
import logging
import os
from pathlib import Path
from typing import Annotated

import typer
from pydantic import ValidationError
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from quantloop.cli.common import (
    ConsoleSink,
    HomeOption,
    SummaryJsonOption,
    TrackingUriOption,
    VerboseOption,
    console,
    fail,
    log_file,
    prefect_api,
    quiet_console,
    read_params,
    rich_table,
    served_tracking,
    validation_errors,
)

# Imported with the CLI, before any library that registers an exit handler: its own
# handler runs after theirs, so a run's breakdown counts their shutdown.
from quantloop.tasks.runtime import collector, timeline


def run(
    lobster: Annotated[
        Path | None, typer.Option(help="Folder or file of LOBSTER data [default: synthetic]")
    ] = None,
    summary_json: SummaryJsonOption = None,
    params: Annotated[
        Path | None,
        typer.Option(help="JSON file of research parameters (the flow's form, as JSON)."),
    ] = None,
    home: HomeOption = None,
    tracking_uri: TrackingUriOption = None,
    workers: Annotated[int | None, typer.Option(help="LocalCluster workers [default: 2]")] = None,
    profile: Annotated[
        bool,
        typer.Option(
            "--profile",
            help="Print where the time went, from process start to exit (always in the log "
            "and in <log>.profile.json)",
        ),
    ] = False,
    verbose: VerboseOption = False,
) -> None:
    """Run the research flow: data -> features -> train -> simulate -> MLflow."""
    timeline.since_start("start and imports (cli)")
    if not verbose:
        quiet_console()
    checks = timeline.TIMELINE.begin("checks")
    from quantloop.flows.params import ResearchParams
    from quantloop.tasks.runtime import progress
    from quantloop.tasks.runtime.reaper import reap_on_death

    values = read_params(params) if params else {}
    ws = values.setdefault("workspace", {})
    if home is not None:
        ws["home"] = home
    if tracking_uri is not None:
        ws["tracking_uri"] = tracking_uri
    if workers is not None:
        ws["n_workers"] = workers
    if lobster is not None:
        if not lobster.exists():
            fail(f"--lobster: {lobster} does not exist")
        values.setdefault("data", {})["lobster_dir"] = str(lobster.resolve())
    source = f"--params {params}" if params else "the parameters"
    try:
        research_params = ResearchParams.model_validate(values)
    except ValidationError as exc:
        fail(f"{source}: " + "; ".join(validation_errors(exc)))
    # Bad input fails here, in seconds, before any server starts: the LOBSTER folder
    # is read and validated whole, overrides checked against its products.
    try:
        research_params.preflight()
    except (ValueError, OSError) as exc:
        fail(str(exc), verbose=verbose, exc=exc)

    # On a home that `quantloop serve` serves, record through its MLflow (as its
    # researcher), unless the parameters or --tracking-uri name a store.
    ws_params = research_params.workspace
    if tracking_uri is None and ws_params.tracking is None and ws_params.tracking_uri is None:
        served = served_tracking(ws_params.home_abs)
        if served is not None:
            research_params = research_params.model_copy(
                update={"workspace": ws_params.model_copy(update={"tracking_uri": served})}
            )

    timeline.TIMELINE.end(checks)

    # The Prefect API the run records to: a configured one, `quantloop serve`'s, or the
    # home's resident server, started if need be (tasks/runtime/local_api.py); after the
    # checks, so bad input starts nothing, and before the flow's imports, which overlap
    # a start.
    with prefect_api(research_params.workspace.home_abs, wait=False) as api:
        # Imported after the checks (Prefect and MLflow take seconds to import) but before the
        # log file's set-up, which quiets the console handler MLflow adds to its logger on
        # import.
        with timeline.phase("imports (flow)"), collector.paused():
            from quantloop.flows.research import research
            from quantloop.tasks.records.summary import markout_table, sweep_table, validity_notes
        api.ready()

        # the process id too: two runs started in one second (two terminals, a script)
        # each get a log of their own, not one log of both, and each its own breakdown
        stamp = dt.datetime.now().strftime("%Y%m%dT%H%M%S")
        log_path = (Path(research_params.workspace.home_abs) / "logs"
                    / f"run-{stamp}-{os.getpid()}.log")  # fmt: skip
        timeline.write_at_exit(log_path, show=print_profile if profile else None)
        columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn())
        with (
            log_file(log_path, quiet=not verbose),
            Progress(*columns, TimeElapsedColumn(), console=console, transient=False) as bar,
        ):
            progress.install(ConsoleSink(bar))
            try:
                # A kill -9 of this command ends the Dask processes with it
                # (tasks/runtime/reaper.py); the resident Prefect API is not its child.
                with reap_on_death(), timeline.phase("flow"):
                    summary = research(research_params)
            except Exception as exc:  # noqa: BLE001 - one line for the user, the rest in the log
                bar.stop()
                logging.getLogger("quantloop").exception("the research run failed")
                fail(
                    f"{type(exc).__name__}: {exc}\nfull traceback: {log_path}"
                    + ("" if verbose else " (or run with --verbose)"),
                    code=1, verbose=verbose, exc=exc,
                )  # fmt: skip
            finally:
                progress.install(None)
    shown = timeline.TIMELINE.begin("output")
    if summary.sweep:
        console.print(rich_table(sweep_table(summary)))
        console.print(f"best: {summary.sweep[0]['label']}, the registered model; below, its "
                      "mark-out", soft_wrap=True)  # fmt: skip
    console.print(rich_table(markout_table(summary)))
    for note in validity_notes(summary):
        console.print(note, soft_wrap=True)
    cached = [n for n, hit in (("model", summary.model_cached),
                               ("simulation", summary.simulation_cached)) if hit]  # fmt: skip
    console.print(
        f"feature nodes: {summary.nodes:,} ({summary.cache_hits:,} cache hits, "
        f"{summary.computed:,} computed); wall {summary.wall_s:.1f} s"
        + (f"; cached, not recomputed: {', '.join(cached)}" if cached else "")
    )
    console.print(f"MLflow run {summary.mlflow_run_id} at {summary.tracking_uri}", soft_wrap=True)
    console.print(f"log: {log_path}", soft_wrap=True)
    if summary_json is not None:
        summary_json.parent.mkdir(parents=True, exist_ok=True)
        tmp = summary_json.with_name(f".{summary_json.name}.tmp-{os.getpid()}")
        tmp.write_text(summary.model_dump_json(indent=2))
        os.replace(tmp, summary_json)
        console.print(f"summary written to {summary_json}", soft_wrap=True)
    timeline.TIMELINE.end(shown)


def print_profile(rows: list[tuple[str, str, str, str]]) -> None:
    """The breakdown as a table on the console (`--profile`)."""
    from rich import box
    from rich.table import Table

    table = Table(title="Where the time went (s since the process started)", box=box.SIMPLE_HEAD,
                  collapse_padding=True)  # fmt: skip
    for col in ("phase", "starts", "seconds", "share"):
        table.add_column(col, justify="left" if col == "phase" else "right")
    for row in rows:
        table.add_row(*row)
    console.print(table)
