"""Queries over node records: the manifests beside the outputs, and a node's lineage.

Node records never go to Prefect's or MLflow's database (neither survives 10^5
rows per run); they are Parquet files under `<root>/manifests/<kind>/`, one per
run, and every query here is an Arrow filter over them.
"""

from __future__ import annotations

import datetime as dt
import json
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from quantloop.tasks import storage
from quantloop.tasks.catalog import Catalog
from quantloop.tasks.engine import MANIFEST_SCHEMA, NodeStore
from quantloop.tasks.engine.store import latest_per


def manifest_urls(root: str, kind: str) -> list[str]:
    """One manifest per run, oldest first (their names start with a UTC timestamp)."""
    return storage.list_files(storage.join(root, "manifests", kind), ".parquet")


def load_manifests(root: str, kind: str = "features", *, all_runs: bool = False) -> pa.Table:
    """The latest run's node records, or every run's (with a `run` column)."""
    urls = manifest_urls(root, kind)
    if not urls:
        return MANIFEST_SCHEMA.append(pa.field("run", pa.string())).empty_table()
    chosen = urls if all_runs else urls[-1:]
    tables = []
    for url in chosen:
        t = storage.read_parquet(url).cast(MANIFEST_SCHEMA)
        run = url.rsplit("/", 1)[-1].removesuffix(".parquet")
        tables.append(t.append_column("run", pa.array([run] * t.num_rows, pa.string())))
    return pa.concat_tables(tables)


def select(
    table: pa.Table,
    *,
    product: str | None = None,
    date: dt.date | None = None,
    status: str | None = None,
    cache_hit: bool | None = None,
    key: str | None = None,
) -> pa.Table:
    """Rows matching every given filter (a key may be given by a prefix)."""
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
    return table.filter(mask)


def lineage(root: str, catalog: Catalog, key: str, kind: str = "features") -> dict[str, Any]:
    """Everything a node came from and what was built from it, by key or key prefix."""
    index = NodeStore(root).index(kind)
    found = latest_per(index.filter(pc.starts_with(index["key"], key)), ["key"])
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
        for dataset in catalog.datasets()
        for e in catalog.entries(dataset)
        if e.digest == row["inputs"]
    ]
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
