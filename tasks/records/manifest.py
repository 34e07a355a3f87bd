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


def lineage(
    roots: str | list[tuple[str, str]], catalog: Catalog, key: str, kind: str = "features"
) -> dict[str, Any]:
    """Everything a node came from and what was built from it, by key or key prefix,
    followed to every site: `roots` are (site, storage root) pairs (the default first; one
    root alone: that store only). The output is its first copy (the one written first:
    where it was computed); `stored_at` lists every site holding a copy; `used_by_models`
    the models trained from it, whichever site trained them."""
    pairs = [("", roots)] if isinstance(roots, str) else list(roots)
    found: list[tuple[str, str, dict]] = []  # (site, root, index row)
    unreachable = []
    for site, root in pairs:
        try:
            rows = NodeStore(root).find(kind, key)
        except OSError as exc:  # a site's store that does not answer: named, passed over
            unreachable.append(f"{site} ({root}): {type(exc).__name__}: {exc}")
            continue
        found += [(site, root, r) for r in rows.to_pylist()]
    keys = {r["key"] for _, _, r in found}
    if not keys:
        where = ", ".join(root for _, root in pairs)
        raise LookupError(f"no committed {kind} node has a key starting with {key!r} at "
                          f"{where}" + (f" (not answering: {'; '.join(unreachable)})"
                                        if unreachable else ""))  # fmt: skip
    if len(keys) > 1:
        raise LookupError(f"key prefix {key!r} matches {len(keys)} nodes; give more of it")
    found.sort(key=lambda f: f[2]["written_at"])
    site, root, row = found[0]
    params = None
    for _, at in [(site, root), *pairs]:
        params_url = storage.join(at, "params", f"{row['params']}.json")
        if storage.exists(params_url):
            params = json.loads(storage.read_bytes(params_url))
            break
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
    models: dict[str, dict] = {}
    for at_site, at in pairs:
        try:
            urls = storage.list_files(storage.join(at, "lineage", "models"), ".json")
        except OSError:
            continue
        for url in urls:
            record = json.loads(storage.read_bytes(url))
            if row["key"] in record.get("feature_keys", []):
                model = models.setdefault(record["model_key"], {
                    k: record[k] for k in ("model_key", "model_digest", "created_at")})  # fmt: skip
                model["trained_at"] = model.get("trained_at") or at_site
    for model in models.values():  # where each model is stored now (the catalog's copies)
        copies = catalog.output_copies("model", model["model_key"])
        model["stored_at"] = [{"site": c.site, "url": c.url, "origin": c.origin} for c in copies]
    stored_at = [{"site": s, "url": r["output_url"], "offset": r["output_offset"],
                  "written_at": r["written_at"]} for s, _, r in found]  # fmt: skip
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
            "site": site,
            "digest": row["output_digest"],
            "url": row["output_url"],
            "offset": row["output_offset"],
            "length": row["output_length"],
            "rows": row["rows"],
        },
        "written_at": row["written_at"],
        # every copy: where it was computed (first), then those made for readers elsewhere
        "stored_at": stored_at,
        "used_by_models": list(models.values()),
        **({"not_answering": unreachable} if unreachable else {}),
    }
