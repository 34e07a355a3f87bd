"""The `quantloop` command line: run the research loop, query nodes, run the ladder."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

# Options several commands share.
HomeOption = Annotated[
    str | None, typer.Option(help="Folder for the embedded defaults [default: .quantloop]")
]
TrackingUriOption = Annotated[
    str | None, typer.Option(help="MLflow tracking URI [default: SQLite in home]")
]

app = typer.Typer(add_completion=False, no_args_is_help=True, help=__doc__)
console = Console(stderr=True)


@app.callback()
def main() -> None:
    """quantloop: the research loop of a systematic trading desk, on Prefect, Dask and MLflow."""
    # The embedded Prefect server would try to send usage telemetry on start-up and log
    # an error on a machine without internet; an operator can still turn it back on.
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")


def _progress_sink(bar: Progress):
    tasks: dict[str, int] = {}

    def sink(stage: str, done: int, total: int) -> None:
        if stage not in tasks:
            tasks[stage] = bar.add_task(stage, total=total)
        bar.update(tasks[stage], completed=done, total=total)

    return sink


def _markout_table(summary: dict) -> Table:
    table = Table(title="Mark-out on held-out data (bps)")
    table.add_column("signal")
    table.add_column("trades", justify="right")
    horizons = list(summary["markout_bps"])
    for h in horizons:
        table.add_column(h, justify="right")
    table.add_column(f"hit {horizons[0]}", justify="right")
    for name, key, trades, hits in (
        ("model", "markout_bps", "trades", "hit_rate"),
        ("baseline", "baseline_markout_bps", "baseline_trades", "baseline_hit_rate"),
    ):
        cells = [
            "nan" if math.isnan(summary[key][h]) else f"{summary[key][h]:+.2f}" for h in horizons
        ]
        hit = summary[hits][horizons[0]]
        table.add_row(name, str(summary[trades]), *cells, f"{hit:.1%}")
    return table


@app.command()
def run(
    lobster: Annotated[
        Path | None, typer.Option(help="Folder or file of LOBSTER data; default: synthetic.")
    ] = None,
    summary_json: Annotated[
        Path | None, typer.Option("--summary-json", help="Also write the summary here.")
    ] = None,
    params: Annotated[
        Path | None,
        typer.Option(help="JSON file of research parameters (the flow's form, as JSON)."),
    ] = None,
    home: HomeOption = None,
    tracking_uri: TrackingUriOption = None,
    workers: Annotated[int | None, typer.Option(help="LocalCluster workers [default: 2]")] = None,
) -> None:
    """Run the research flow: data -> features -> train -> simulate -> MLflow."""
    from quantloop.flows.research import ResearchParams, research
    from quantloop.tasks import progress

    values = json.loads(params.read_text()) if params else {}
    ws = values.setdefault("workspace", {})
    if home is not None:
        ws["home"] = home
    if tracking_uri is not None:
        ws["tracking_uri"] = tracking_uri
    if workers is not None:
        ws["n_workers"] = workers
    if lobster is not None:
        if not lobster.exists():
            raise typer.BadParameter(f"{lobster} does not exist", param_hint="--lobster")
        values.setdefault("data", {})["lobster_dir"] = str(lobster.resolve())
    try:
        research_params = ResearchParams.model_validate(values)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--params") from exc

    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn())
    with Progress(*columns, TimeElapsedColumn(), console=console, transient=False) as bar:
        progress.install(_progress_sink(bar))
        try:
            summary = research(research_params)
        finally:
            progress.install(None)
    console.print(_markout_table(summary))
    console.print(
        f"feature nodes: {summary['nodes']} ({summary['cache_hits']} cache hits, "
        f"{summary['computed']} computed); wall {summary['wall_s']:.1f} s"
    )
    cached = [n for n, hit in (("model", summary["model_cached"]),
                               ("simulation", summary["simulation_cached"])) if hit]  # fmt: skip
    if cached:
        console.print(f"cached, not recomputed: {', '.join(cached)}")
    console.print(f"MLflow run {summary['mlflow_run_id']} at {summary['tracking_uri']}")
    if summary_json is not None:
        summary_json.parent.mkdir(parents=True, exist_ok=True)
        tmp = summary_json.with_name(f".{summary_json.name}.tmp-{os.getpid()}")
        tmp.write_text(json.dumps(summary, indent=2, default=str))
        os.replace(tmp, summary_json)
        console.print(f"summary written to {summary_json}")


@app.command()
def ladder(
    preset: Annotated[
        str, typer.Option(help="auto (h200 with CUDA, else cpu_tiny), h200 or cpu_tiny")
    ] = "auto",
    rungs: Annotated[
        str, typer.Option(help="Comma-separated rung numbers (1 always runs); default: all")
    ] = "",
    out: Annotated[Path | None, typer.Option(help="Folder for traces and the report")] = None,
    home: HomeOption = None,
    tracking_uri: TrackingUriOption = None,
) -> None:
    """Run the GPU optimization ladder flow and print its report (docs/ladder.md)."""
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
    result = ladder_flow(params)
    print(report_markdown(result), end="")
    console.print(
        f"MLflow run {result['mlflow_run_id']}; report in {params.out_dir or 'home/ladder'}"
    )


@app.command()
def nodes(
    home: Annotated[str, typer.Option(help="The workspace folder")] = ".quantloop",
    site: Annotated[str | None, typer.Option(help="A saved Site block, if not local")] = None,
    kind: Annotated[str, typer.Option(help="Node kind")] = "features",
    product: Annotated[str | None, typer.Option(help="Only this product")] = None,
    date: Annotated[str | None, typer.Option(help="Only this date (YYYY-MM-DD)")] = None,
    status: Annotated[str | None, typer.Option(help="ok or failed")] = None,
    cache_hit: Annotated[
        bool | None, typer.Option("--cache-hit/--computed", help="Only hits / only computed")
    ] = None,
    all_runs: Annotated[bool, typer.Option("--all-runs", help="Every run, not the last")] = False,
    lineage: Annotated[
        str | None, typer.Option(help="Show the lineage of the node with this key (or prefix)")
    ] = None,
    limit: Annotated[int, typer.Option(help="Rows to show")] = 20,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of a table")] = False,
) -> None:
    """Query node records: filter the run manifests, or show one node's lineage."""
    import datetime as dt

    from quantloop.tasks import manifest
    from quantloop.tasks.workspace import Workspace

    ws = Workspace(home=home, site=site)
    root = ws.resolve_site().root
    if lineage is not None:
        try:
            found = manifest.lineage(root, ws.catalog(), lineage, kind)
        except LookupError as exc:
            raise typer.BadParameter(str(exc), param_hint="--lineage") from exc
        typer.echo(json.dumps(found, indent=2, default=str))
        return
    if status not in (None, "ok", "failed"):
        raise typer.BadParameter("status must be ok or failed", param_hint="--status")
    try:
        day = dt.date.fromisoformat(date) if date else None
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--date") from exc
    records = manifest.load_manifests(root, kind, all_runs=all_runs)
    if records.num_rows == 0:
        console.print(f"no {kind} runs recorded under {root}")
        raise typer.Exit(1)
    rows = manifest.select(records, product=product, date=day, status=status, cache_hit=cache_hit)
    if as_json:
        typer.echo(json.dumps(rows.slice(0, limit).to_pylist(), indent=1, default=str))
        return
    hits = pa_sum(rows, "cache_hit")
    failed = rows.num_rows - pa_sum(rows, "status", "ok")
    console.print(
        f"{rows.num_rows} of {records.num_rows} nodes match ({hits} cache hits, "
        f"{rows.num_rows - hits - failed} computed, {failed} failed)"
    )
    table = Table()
    for col in ("key", "product", "date", "status", "hit", "reason", "rows", "ms", "site", "run"):
        table.add_column(col, justify="right" if col in ("rows", "ms") else "left")
    for r in rows.slice(0, limit).to_pylist():
        table.add_row(
            r["key"][:16], r["product"], r["date"], r["status"], "yes" if r["cache_hit"] else "",
            r["reason"] or r["error"][:40], str(r["rows"]), f"{r['duration_s'] * 1e3:.2f}",
            r["site"], r["run"][:15],
        )  # fmt: skip
    console.print(table)


def pa_sum(table, column: str, equal_to=None) -> int:
    import pyarrow.compute as pc

    values = table[column] if equal_to is None else pc.equal(table[column], equal_to)
    return int(pc.sum(values).as_py() or 0)


if __name__ == "__main__":
    app()
