"""Queries over node records: the manifests beside the outputs, and a node's lineage.

Node records never go to Prefect's or MLflow's database (neither survives 10^5
rows per run); they are Parquet files under `<root>/manifests/<kind>/`, a folder
per run with a file per shard, and every query here is an Arrow filter over them,
read a file at a time: a query holds the columns it filters on and the rows it shows.
"""

from __future__ import annotations

import datetime as dt
import json
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from quantloop.tasks.data.catalog import Catalog
from quantloop.tasks.engine import MANIFEST_SCHEMA, NodeStore, recorded_runs, run_parts, storage

RECORDS_SCHEMA = MANIFEST_SCHEMA.append(pa.field("run", pa.string()))


def manifest_runs(root: str, kind: str) -> list[str]:
    """Recorded runs, oldest first (their names start with a UTC timestamp)."""
    return recorded_runs(storage.join(root, "manifests", kind))


@dataclass(frozen=True, slots=True)
class NodeQuery:
    """What `query` found: the first rows that match, and counts over all of them."""

    rows: pa.Table  # RECORDS_SCHEMA: the manifest's columns and the run's name
    total: int  # nodes in the runs queried
    matched: int
    cache_hits: int  # of those matched
    failed: int


def query(
    root: str,
    kind: str = "features",
    *,
    all_runs: bool = False,
    limit: int = 20,
    product: str | None = None,
    date: dt.date | None = None,
    status: str | None = None,
    cache_hit: bool | None = None,
    key: str | None = None,
    run_url: str | None = None,
) -> NodeQuery:
    """The latest run's node records, or every run's, that match every given filter
    (a key may be given by a prefix): counted over all, the first `limit` kept.

    Two passes, a file at a time: the columns the filters and counts need, then, for
    the files that hold matches, whole rows until `limit` are found."""
    filters = dict(product=product, date=date, status=status, cache_hit=cache_hit, key=key)
    columns = list(dict.fromkeys(["cache_hit", "status", *(c for c, v in filters.items()
                                                            if v is not None)]))  # fmt: skip
    runs = [run_url] if run_url else manifest_runs(root, kind)
    total = matched = hits = failed = 0
    shown: list[pa.Table] = []
    for run in runs if all_runs else runs[-1:]:
        with_matches = []
        for part in run_parts(run):
            table = storage.read_parquet(part, columns)
            found = table.filter(select(table, **filters))
            total += table.num_rows
            matched += found.num_rows
            hits += pc.sum(found["cache_hit"]).as_py() or 0
            failed += pc.sum(pc.equal(found["status"], "failed")).as_py() or 0
            if found.num_rows:
                with_matches.append(part)
        name = run.rsplit("/", 1)[-1].removesuffix(".parquet")
        for part in with_matches:
            need = limit - sum(t.num_rows for t in shown)
            if need <= 0:
                break
            table = conform(storage.read_parquet(part))
            rows = table.filter(select(table, **filters)).slice(0, need)
            shown.append(rows.append_column("run", pa.array([name] * rows.num_rows, pa.string())))
    rows = pa.concat_tables(shown) if shown else RECORDS_SCHEMA.empty_table()
    return NodeQuery(rows, total, matched, hits, failed)


def conform(table: pa.Table) -> pa.Table:
    """A manifest part as MANIFEST_SCHEMA: parts written before sites were placed lack
    the placement columns (null there: not known)."""
    n = table.num_rows
    columns = {f.name: table[f.name] if f.name in table.column_names else pa.nulls(n, f.type)
               for f in MANIFEST_SCHEMA}  # fmt: skip
    return pa.table(columns).cast(MANIFEST_SCHEMA)


def select(
    table: pa.Table,
    *,
    product: str | None = None,
    date: dt.date | None = None,
    status: str | None = None,
    cache_hit: bool | None = None,
    key: str | None = None,
) -> pa.Array:
    """Which rows match every given filter (a key may be given by a prefix)."""
    mask = pa.array([True] * table.num_rows)
    if product is not None:
        mask = pc.and_(mask, pc.equal(table["product"], product))
    if date is not None:
        mask = pc.and_(mask, pc.equal(table["date"], date.isoformat()))
    if status is not None:
        mask = pc.and_(mask, pc.equal(table["status"], status))
    if cache_hit is not None:
        mask = pc.and_(mask, pc.equal(table["cache_hit"], cache_hit))
    if key is not None:
        mask = pc.and_(mask, pc.starts_with(table["key"], key))
    return mask


def lineage(root: str, catalog: Catalog, key: str, kind: str = "features") -> dict[str, Any]:
    """Everything a node came from and what was built from it, by key or key prefix."""
    found = NodeStore(root).find(kind, key)
    if found.num_rows == 0:
        raise LookupError(f"no committed {kind} node has a key starting with {key!r}")
    if found.num_rows > 1:
        raise LookupError(f"key prefix {key!r} matches {found.num_rows} nodes; give more of it")
    row = found.to_pylist()[0]
    params_url = storage.join(root, "params", f"{row['params']}.json")
    params = json.loads(storage.read_bytes(params_url)) if storage.exists(params_url) else None
    inputs = [
        {
            "dataset": e.dataset,
            "location": e.location,
            "offset": e.offset,
            "length": e.length,
            "rows": e.rows,
            "source": e.source,
            "site": e.site,
        }
        for e in catalog.with_digest(row["inputs"])
    ]
    if not inputs:
        raise LookupError(
            f"node {row['key'][:16]}: no partition with its input digest "
            f"{row['inputs'][:16]} in the catalog at {catalog.path} (another catalog, or "
            "the version was replaced): give --run, or the workspace that ran it"
        )
    models = []
    for url in storage.list_files(storage.join(root, "lineage", "models"), ".json"):
        record = json.loads(storage.read_bytes(url))
        if row["key"] in record.get("feature_keys", []):
            models.append({k: record[k] for k in ("model_key", "model_digest", "created_at")})
    return {
        "key": row["key"],
        "kind": row["kind"],
        "partition": f"{row['product']}/{row['date']}",
        "code_fingerprint": row["code"],
        "params_hash": row["params"],
        "params": params,
        "input_digest": row["inputs"],
        "inputs": inputs,
        "output": {
            "digest": row["output_digest"],
            "url": row["output_url"],
            "offset": row["output_offset"],
            "length": row["output_length"],
            "rows": row["rows"],
        },
        "written_at": row["written_at"],
        "used_by_models": models,
    }
