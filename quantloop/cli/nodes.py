"""`quantloop nodes`: query node records: filter the run manifests, or show one node's lineage."""

from __future__ import annotations

import json
from typing import Annotated

import typer
from rich.table import Table

from quantloop.cli.common import (
    TrackingUriOption,
    console,
    fail,
    workspace_of,
)


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
    run: Annotated[
        str | None,
        typer.Option(
            help="A research run (MLflow run id or Prefect flow run id): its nodes, "
            "found from the run's record, wherever its workspace is"
        ),
    ] = None,
    tracking_uri: TrackingUriOption = None,
) -> None:
    """Query node records: filter the run manifests, or show one node's lineage."""
    import datetime as dt

    from quantloop.tasks.data.catalog import Catalog
    from quantloop.tasks.records import manifest, runs, tracking
    from quantloop.tasks.runtime.workspace import Workspace

    ws = Workspace(home=home, site=site)
    run_url = None
    if run is not None:
        try:
            client, _ = tracking.client_for(workspace_of(home, tracking_uri).resolve_tracking())
            research = runs.find_research_run(client, run)
            features_run = runs.stage_runs(client, research)["features"]
            root = research.data.tags[tracking.STORE_TAG]
            catalog = Catalog(research.data.tags[tracking.CATALOG_TAG])
            run_url = features_run.data.tags[tracking.MANIFEST_TAG]
        except (LookupError, KeyError) as exc:
            fail(f"--run {run}: {exc}")
    else:
        root, catalog = ws.resolve_site().root, ws.catalog()
    if lineage is not None:
        try:
            found = manifest.lineage(root, catalog, lineage, kind)
        except LookupError as exc:
            fail(f"--lineage {lineage}: {exc}")
        typer.echo(json.dumps(found, indent=2, default=str))
        return
    if status not in (None, "ok", "failed"):
        raise typer.BadParameter("status must be ok or failed", param_hint="--status")
    try:
        day = dt.date.fromisoformat(date) if date else None
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--date") from exc
    found = manifest.query(root, kind, all_runs=all_runs, limit=limit, product=product,
                           date=day, status=status, cache_hit=cache_hit,
                           run_url=run_url)  # fmt: skip
    if found.total == 0:
        fail(f"no {kind} runs recorded under {root}", code=1)
    if found.matched == 0:
        given = {k: v for k, v in dict(product=product, date=date, status=status,
                                       cache_hit=cache_hit).items() if v is not None}  # fmt: skip
        fail(f"none of the {found.total:,} recorded nodes matches {given}", code=1)
    if as_json:
        typer.echo(json.dumps(found.rows.to_pylist(), indent=1, default=str))
        return
    computed = found.matched - found.cache_hits - found.failed
    console.print(
        f"{found.matched} of {found.total} nodes match ({found.cache_hits} cache hits, "
        f"{computed} computed, {found.failed} failed)"
    )
    table = Table()
    for col in ("key", "product", "date", "status", "hit", "reason", "rows", "ms", "site", "run"):
        table.add_column(col, justify="right" if col in ("rows", "ms") else "left")
    for r in found.rows.to_pylist():
        table.add_row(
            r["key"][:16], r["product"], r["date"], r["status"], "yes" if r["cache_hit"] else "",
            r["reason"] or r["error"][:40], str(r["rows"]), f"{r['duration_s'] * 1e3:.2f}",
            r["site"], r["run"][:15],
        )  # fmt: skip
    console.print(table)
