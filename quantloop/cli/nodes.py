"""`quantloop nodes`: query node records: filter the run manifests, or show one node's lineage."""

from __future__ import annotations

import json
import sys
from enum import StrEnum
from typing import Annotated

import typer
from rich import box
from rich.console import Console
from rich.measure import Measurement
from rich.table import Table

from quantloop.cli.common import (
    TrackingUriOption,
    console,
    fail,
    records_workspace,
    refusal_line,
    refused,
)


class Format(StrEnum):
    auto = "auto"
    table = "table"
    tsv = "tsv"
    json = "json"


# The rows' columns, in the order a table and TSV show them.
COLUMNS = ("key", "product", "date", "status", "cache_hit", "reason", "error", "rows",
           "duration_ms", "site", "run")  # fmt: skip


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
    fmt: Annotated[
        Format,
        typer.Option(
            "--format",
            help="table (cut to the terminal's width), tsv or json (every value whole); "
            "auto: a table on a terminal, else tsv",
        ),
    ] = Format.auto,
    as_json: Annotated[bool, typer.Option("--json", help="The same as --format json")] = False,
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

    from quantloop.tasks.runtime import collector

    with collector.paused():  # then frozen: later collections skip the stack
        from quantloop.tasks.data.catalog import Catalog
        from quantloop.tasks.records import manifest, runs, tracking
        from quantloop.tasks.research.sited import site_roots
        from quantloop.tasks.runtime.workspace import Workspace

    ws = Workspace(home=home, site=site)
    run_url = None
    sites: list[tuple[str, str]] = []  # (site, root): where --lineage looks, the default first
    if run is not None:
        records = records_workspace(home, tracking_uri)  # a missing store, a refusal: one line
        try:
            client, _ = tracking.client_for(records.resolve_tracking())
            research = runs.find_research_run(client, run)
            features_run = runs.stage_runs(client, research)["features"]
            root = research.data.tags[tracking.STORE_TAG]
            catalog = Catalog(research.data.tags[tracking.CATALOG_TAG])
            run_url = features_run.data.tags[tracking.MANIFEST_TAG]
            sites = [(research.data.tags.get("site", ""), root)]
        except (LookupError, KeyError) as exc:
            if code := refused(exc):
                fail(
                    refusal_line(
                        code, records.resolve_tracking().resolved_uri(), home, "researcher"
                    )
                )
            fail(f"--run {run}: {exc}")
        except Exception as exc:
            if (code := refused(exc)) is None:
                raise
            fail(refusal_line(code, records.resolve_tracking().resolved_uri(), home, "researcher"))
    else:
        default = ws.resolve_site()
        root, catalog = default.root, ws.catalog()
        sites = [(default.name, root)]
    if lineage is not None:
        try:
            # every site the catalog has seen a run use: each output where it is
            found = manifest.lineage(site_roots(sites, catalog), catalog, lineage, kind)
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
        fmt = Format.json
    if fmt is Format.json:
        typer.echo(json.dumps(found.rows.to_pylist(), indent=1, default=str))
        return
    computed = found.matched - found.cache_hits - found.failed
    console.print(
        f"{found.matched} of {found.total} nodes match ({found.cache_hits} cache hits, "
        f"{computed} computed, {found.failed} failed)"
    )
    # The rows are the command's output: stdout, so `> file` and `| cut` get them whole.
    # Only a terminal gets a table, fitted (cut) to its width; elsewhere there is no width.
    rows = [row_values(r) for r in found.rows.to_pylist()]
    terminal = sys.stdout.isatty()
    if fmt is Format.tsv or (fmt is Format.auto and not terminal):
        for values in (COLUMNS, *rows):
            typer.echo("\t".join(tsv_field(v) for v in values))
        return
    if terminal:  # a key's first 16 digits name it to --lineage, which takes a prefix
        rows = [(values[0][:16], *values[1:]) for values in rows]
    console_out = Console(width=None if terminal else 1_000_000)
    console_out.print(fitted_table(rows, console_out.width))


def fitted_table(rows: list[tuple[str, ...]], width: int) -> Table:
    """The rows as a table `width` characters wide at most: the short columns keep
    their width; the key, the error and the run's name share what is left, each cut
    with an ellipsis only if it needs more than its share. (Left to Rich, a narrow
    terminal squeezed the short columns to nothing first.)"""
    heads = [{"cache_hit": "hit", "duration_ms": "ms"}.get(c, c) for c in COLUMNS]
    natural = [max([len(h), *(len(values[i]) for values in rows)]) for i, h in enumerate(heads)]
    flexible = [i for i, c in enumerate(COLUMNS) if c in ("key", "error", "run")]

    def table(widths: list[int]) -> Table:
        out = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, collapse_padding=True)
        for col, head, w in zip(COLUMNS, heads, widths, strict=True):
            out.add_column(head, justify="right" if col in ("rows", "duration_ms") else "left",
                           no_wrap=True, overflow="ellipsis", width=w)  # fmt: skip
        for values in rows:
            out.add_row(*values)
        return out

    # What the table adds to its columns' widths (padding, rules), measured by Rich.
    probe = Console(width=1_000_000)
    extra = Measurement.get(probe, probe.options, table(natural)).maximum - sum(natural)
    left = width - extra - sum(w for i, w in enumerate(natural) if i not in flexible)
    widths = list(natural)
    for n, i in enumerate(sorted(flexible, key=lambda i: natural[i])):  # narrowest first
        widths[i] = max(4, min(natural[i], left // (len(flexible) - n)))
        left -= widths[i]
    return table(widths)


def row_values(r: dict) -> tuple[str, ...]:
    """One record's values as text, in COLUMNS' order; a column a manifest predates
    (null) is empty."""
    ms = r["duration_s"]
    values = dict(r, cache_hit="yes" if r["cache_hit"] else "",
                  duration_ms="" if ms is None else f"{ms * 1e3:.2f}")  # fmt: skip
    return tuple("" if values[c] is None else str(values[c]) for c in COLUMNS)


def tsv_field(value: str) -> str:
    """A value on one line of one column: tabs and line breaks written as \\t, \\n."""
    return (
        value.replace("\\", "\\\\").replace("\t", "\\t").replace("\n", "\\n").replace("\r", "\\r")
    )
