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

app = typer.Typer(add_completion=False, no_args_is_help=True, help=__doc__)
console = Console(stderr=True)


@app.callback()
def main() -> None:
    """quantloop: the research loop of a systematic trading desk, on Prefect, Dask and MLflow."""


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
    home: Annotated[
        str | None, typer.Option(help="Folder for the embedded defaults [default: .quantloop]")
    ] = None,
    tracking_uri: Annotated[
        str | None, typer.Option(help="MLflow tracking URI [default: SQLite in home]")
    ] = None,
    workers: Annotated[int | None, typer.Option(help="LocalCluster workers [default: 2]")] = None,
) -> None:
    """Run the research flow: data -> features -> train -> simulate -> MLflow."""
    from flows.research import ResearchParams, research
    from quantloop import progress

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


if __name__ == "__main__":
    app()
