"""`quantloop backtest`: run a registered model version over products x days as cached
nodes: predictions,.
"""

from __future__ import annotations

import datetime as dt
from typing import Annotated

import typer
from rich import box
from rich.table import Table

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


def backtest(
    model: ModelOption = None,
    version: Annotated[str, typer.Option(help="A version number or an alias")] = "champion",
    products: Annotated[
        str | None, typer.Option(help="Comma-separated products [default: the model's]")
    ] = None,
    start: Annotated[
        dt.datetime | None, typer.Option(formats=["%Y-%m-%d"], help="First day [default: all]")
    ] = None,
    end: Annotated[
        dt.datetime | None, typer.Option(formats=["%Y-%m-%d"], help="Last day [default: all]")
    ] = None,
    device: Annotated[
        str, typer.Option(help="auto (a GPU when the site has one), cpu or cuda")
    ] = "auto",
    shard_size: Annotated[int, typer.Option(help="Backtest nodes per Prefect task")] = 10_000,
    summary_json: SummaryJsonOption = None,
    home: HomeOption = None,
    tracking_uri: TrackingUriOption = None,
    verbose: VerboseOption = False,
) -> None:
    """Run a registered model version over products x days as cached nodes: predictions,
    trades and mark-out per product-day; a summary in MLflow. Exits 1 if nodes failed."""
    from quantloop.tasks.data.schema import Partition

    check_version("--version", version)
    names = [p.strip() for p in products.split(",")] if products else None
    try:
        for p in names or []:
            Partition(p, dt.date(2000, 1, 1))  # the product-name rule, with its message
    except ValueError as exc:
        fail(f"--products: {exc}")
    first, last = (d.date() if d else None for d in (start, end))
    if first and last and first > last:
        fail(f"--start {first} is after --end {last}")
    if device not in ("auto", "cpu", "cuda") and not device.startswith("cuda:"):
        fail(f"--device {device!r}: give auto, cpu, cuda or cuda:N")
    if shard_size < 1:
        fail(f"--shard-size must be >= 1, got {shard_size}")
    if not verbose:
        quiet_console()
    with prefect_api(home, wait=False) as api:  # a server's start overlaps the imports
        from quantloop.tasks.runtime import collector

        with collector.paused():  # then frozen: later collections skip the stack
            from quantloop.flows.backtest import BacktestFailed
            from quantloop.flows.backtest import backtest as backtest_flow

        api.ready()
        try:
            result = backtest_flow(model=model, version=version, products=names, start=first,
                                   end=last, device=device, shard_size=shard_size,
                                   workspace=workspace_of(home, tracking_uri))  # fmt: skip
        except (LookupError, ValueError) as exc:
            fail(str(exc))
        except BacktestFailed as exc:
            fail(str(exc), code=1)
    table = Table(title=f"Backtest of {result.model} version {result.version} (bps)",
                  box=box.SIMPLE_HEAD, collapse_padding=True)  # fmt: skip
    horizons = list(result.total["mean_bps"])
    for col in ("product", "trades", *horizons):
        table.add_column(col, justify="left" if col == "product" else "right")
    for product, f in {**result.products, "total": result.total}.items():
        table.add_row(product, f"{f['trades']:,}", *(f"{f['mean_bps'][h]:+.2f}" for h in horizons))
    console.print(table)
    console.print(
        f"{result.nodes:,} product-days: {result.cache_hits:,} cache hits, {result.computed:,} "
        f"computed on {result.device} in {result.wall_s:.1f} s; MLflow run {result.mlflow_run_id}"
    )
    write_json(summary_json, result.model_dump(mode="json"))
