"""The node engine: keys, the content-addressed store, its cache index, execution.

A node is one unit of the research graph (a kind, e.g. "features", applied to
one partition). Its key hashes everything that decides its output:

    key = sha256(kind, code fingerprint, canonical parameters, input digests)

Outputs live at `<root>/nodes/<kind>/<key[:2]>/<key>.parquet`. The cache index
is a folder of Parquet segments, each written atomically *after* the outputs it
lists are complete, so a key is in the index only once its output is whole; a
crash in between leaves an orphan file that the next run simply recomputes.
"Which of these keys exist?" is one read of the index, not a storage call per
node.

Nodes run on Dask in batches (one Dask task holds many nodes), each node keeping
its own key, output, digest and manifest row.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import inspect
import io
import json
import math
import time
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from tasks import storage
from tasks.schema import Partition

INDEX_SCHEMA = pa.schema(
    [
        ("key", pa.string()),
        ("kind", pa.string()),
        ("product", pa.string()),
        ("date", pa.string()),
        ("code", pa.string()),
        ("params", pa.string()),
        ("inputs", pa.string()),
        ("output_digest", pa.string()),
        ("output_url", pa.string()),
        ("rows", pa.int64()),
        ("bytes", pa.int64()),
        ("written_at", pa.string()),
    ]
)

MANIFEST_SCHEMA = pa.schema(
    [
        ("key", pa.string()),
        ("kind", pa.string()),
        ("product", pa.string()),
        ("date", pa.string()),
        ("site", pa.string()),
        ("code", pa.string()),
        ("params", pa.string()),
        ("inputs", pa.string()),
        ("output_digest", pa.string()),
        ("output_url", pa.string()),
        ("rows", pa.int64()),
        ("bytes", pa.int64()),
        ("duration_s", pa.float64()),
        ("cache_hit", pa.bool_()),
        ("status", pa.string()),  # "ok" or "failed"
        ("reason", pa.string()),  # why it ran: new, code, params, input, missing; "" on a hit
        ("error", pa.string()),
    ]
)


def sha256_json(value: Any) -> str:
    """Digest of a value's canonical JSON (sorted keys, no whitespace)."""
    text = json.dumps(value, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def code_fingerprint(*objects: Callable | ModuleType) -> str:
    """Digest of the source of functions or modules: edit them and the keys change."""
    h = hashlib.sha256()
    for obj in objects:
        h.update(f"{obj.__module__ if not isinstance(obj, ModuleType) else ''}".encode())
        h.update(inspect.getsource(obj).encode())
    return h.hexdigest()


@dataclass(frozen=True, slots=True)
class Node:
    """One node: a kind applied to one input partition version."""

    kind: str
    partition: Partition
    code: str  # code fingerprint
    params: str  # sha256 of canonical parameters
    inputs: str  # digest of the input partition
    input_url: str

    @property
    def key(self) -> str:
        return hashlib.sha256(
            f"{self.kind}|{self.code}|{self.params}|{self.inputs}".encode()
        ).hexdigest()


@dataclass(frozen=True, slots=True)
class NodeKind:
    """How to compute a kind of node: compute(input table, params dict) -> output table."""

    name: str
    compute: Callable[[pa.Table, dict], pa.Table]
    code: str


class NodeStore:
    """Content-addressed node outputs and the cache index, under one storage root."""

    def __init__(self, root: str):
        self.root = root.rstrip("/")
        self._index: dict[str, pa.Table] = {}

    def output_url(self, kind: str, key: str) -> str:
        return storage.join(self.root, "nodes", kind, key[:2], f"{key}.parquet")

    def index_url(self, kind: str) -> str:
        return storage.join(self.root, "index", kind)

    def index(self, kind: str, *, refresh: bool = False) -> pa.Table:
        """Every committed node of a kind, one pass over the index segments."""
        if refresh or kind not in self._index:
            segments = storage.list_files(self.index_url(kind), ".parquet")
            tables = [storage.read_parquet(s) for s in segments]
            self._index[kind] = (
                pa.concat_tables(tables).cast(INDEX_SCHEMA)
                if tables
                else INDEX_SCHEMA.empty_table()
            )
        return self._index[kind]

    def existing(self, kind: str, keys: Sequence[str]) -> pa.Table:
        """Index rows (one per key, the latest) of those `keys` that are committed."""
        idx = self.index(kind, refresh=True)
        hit = idx.filter(pc.is_in(idx["key"], value_set=pa.array(list(keys), pa.string())))
        return _latest_per(hit, "key") if hit.num_rows else hit

    def commit(self, kind: str, rows: pa.Table) -> None:
        """Make outputs visible to later runs: one atomic index segment."""
        if rows.num_rows == 0:
            return
        name = f"{dt.datetime.now(dt.UTC):%Y%m%dT%H%M%S}-{uuid.uuid4().hex[:12]}.parquet"
        storage.write_parquet_atomic(storage.join(self.index_url(kind), name), rows)
        self._index.pop(kind, None)


def _latest_per(table: pa.Table, column: str) -> pa.Table:
    """Last row (by written_at) for each value of `column`."""
    table = table.sort_by([(column, "ascending"), ("written_at", "ascending")])
    values = table[column].to_pylist()
    keep = [i for i in range(len(values)) if i + 1 == len(values) or values[i + 1] != values[i]]
    return table.take(pa.array(keep, pa.int64()))


def explain(store: NodeStore, nodes: Sequence[Node]) -> dict[str, str]:
    """Why each node must run: which part of its key differs from the last version
    of the same (kind, partition) in the index ("new" if there is none, "missing"
    if all parts match but the output is gone)."""
    if not nodes:
        return {}
    kind = nodes[0].kind
    idx = store.index(kind)
    if idx.num_rows == 0:
        return {n.key: "new" for n in nodes}
    idx = idx.append_column(
        "partition", pc.binary_join_element_wise(idx["product"], idx["date"], "/")
    )
    last = _latest_per(idx, "partition")
    previous = {
        p: (c, pr, i)
        for p, c, pr, i in zip(
            last["partition"].to_pylist(),
            last["code"].to_pylist(),
            last["params"].to_pylist(),
            last["inputs"].to_pylist(),
            strict=True,
        )
    }
    reasons = {}
    for n in nodes:
        prev = previous.get(str(n.partition))
        if prev is None:
            reasons[n.key] = "new"
            continue
        changed = [
            name
            for name, old, new in (
                ("code", prev[0], n.code),
                ("params", prev[1], n.params),
                ("input", prev[2], n.inputs),
            )
            if old != new
        ]
        reasons[n.key] = "+".join(changed) if changed else "missing"
    return reasons


def _record(node: Node, site: str, **values: Any) -> dict:
    row = {
        "key": node.key,
        "kind": node.kind,
        "product": node.partition.product,
        "date": node.partition.date.isoformat(),
        "site": site,
        "code": node.code,
        "params": node.params,
        "inputs": node.inputs,
        "output_digest": "",
        "output_url": "",
        "rows": 0,
        "bytes": 0,
        "duration_s": 0.0,
        "cache_hit": False,
        "status": "ok",
        "reason": "",
        "error": "",
    }
    row.update(values)
    return row


def run_batch(
    kind: NodeKind,
    params: Mapping[str, dict],
    nodes: Sequence[Node],
    store_root: str,
    site: str,
) -> list[dict]:
    """Compute a batch of nodes (on a Dask worker): read, verify, compute, write, commit.

    Returns manifest rows only; outputs stay in storage, never in the driver.
    """
    store = NodeStore(store_root)
    rows, committed = [], []
    for node in nodes:
        t0 = time.perf_counter()
        try:
            data = storage.read_bytes(node.input_url)
            if storage.sha256_hex(data) != node.inputs:
                raise ValueError(
                    f"input partition {node.partition} at {node.input_url} does not match "
                    f"its catalog digest {node.inputs[:12]}: storage was changed in place"
                )
            out = kind.compute(pq.read_table(io.BytesIO(data)), params[node.params])
            url = store.output_url(kind.name, node.key)
            digest, size = storage.write_parquet_atomic(url, out)
        except Exception as exc:  # recorded per node; the shard reports all failures
            rows.append(
                _record(
                    node,
                    site,
                    status="failed",
                    error=f"{node.partition}: {type(exc).__name__}: {exc}",
                    duration_s=time.perf_counter() - t0,
                )
            )
            continue
        rows.append(
            _record(
                node,
                site,
                output_digest=digest,
                output_url=url,
                rows=out.num_rows,
                bytes=size,
                duration_s=time.perf_counter() - t0,
            )
        )
        committed.append(rows[-1])
    now = dt.datetime.now(dt.UTC).isoformat(timespec="microseconds")
    store.commit(
        kind.name,
        pa.Table.from_pylist(
            [
                {**{k: r[k] for k in INDEX_SCHEMA.names if k in r}, "written_at": now}
                for r in committed
            ],
            schema=INDEX_SCHEMA,
        ),
    )
    return rows


def batches(items: Sequence[Any], n_batches: int) -> list[list[Any]]:
    """Split into at most `n_batches` contiguous, near-equal batches."""
    if not items:
        return []
    size = math.ceil(len(items) / max(1, n_batches))
    return [list(items[i : i + size]) for i in range(0, len(items), size)]


@dataclass(frozen=True, slots=True)
class RunResult:
    manifest: pa.Table
    nodes: int
    cache_hits: int
    computed: int
    failed: int
    wall_s: float

    @property
    def failures(self) -> list[str]:
        failed = self.manifest.filter(pc.equal(self.manifest["status"], "failed"))
        return failed["error"].to_pylist()


def run_nodes(
    kind: NodeKind,
    params: Mapping[str, dict],
    nodes: Sequence[Node],
    store: NodeStore,
    *,
    client: Any | None = None,
    site: str = "local",
    tasks_per_worker: int = 4,
    progress: Callable[[int, int], None] | None = None,
) -> RunResult:
    """Run the nodes that are not cached; returns the manifest of all of them.

    params: parameter dicts by their digest (`Node.params`); products may differ.
    client: a `distributed.Client` (the site's cluster); None runs in-process.
    progress(done, total) is called as batches finish.
    """
    t0 = time.perf_counter()
    keys = [n.key for n in nodes]
    hits = store.existing(kind.name, keys)
    hit_rows = {
        r["key"]: r
        for r in hits.select(["key", "output_digest", "output_url", "rows", "bytes"]).to_pylist()
    }
    todo = [n for n in nodes if n.key not in hit_rows]
    reasons = explain(store, todo)
    rows = [
        _record(n, site, cache_hit=True, **{k: v for k, v in hit_rows[n.key].items() if k != "key"})
        for n in nodes
        if n.key in hit_rows
    ]
    done = len(rows)
    if progress:
        progress(done, len(nodes))
    if todo:
        n_workers = len(client.scheduler_info()["workers"]) if client is not None else 1
        groups = batches(todo, max(1, n_workers) * tasks_per_worker)
        if client is None:
            results: Iterable[list[dict]] = (
                run_batch(kind, params, g, store.root, site) for g in groups
            )
            for batch_rows in results:
                rows += batch_rows
                done += len(batch_rows)
                if progress:
                    progress(done, len(nodes))
        else:
            from distributed import as_completed

            futures = client.map(
                run_batch,
                [kind] * len(groups),
                [params] * len(groups),
                groups,
                [store.root] * len(groups),
                [site] * len(groups),
                pure=False,
            )
            for future in as_completed(futures):
                batch_rows = future.result()
                rows += batch_rows
                done += len(batch_rows)
                if progress:
                    progress(done, len(nodes))
        for r in rows:
            if not r["cache_hit"]:
                r["reason"] = reasons.get(r["key"], "")
    manifest = pa.Table.from_pylist(rows, schema=MANIFEST_SCHEMA).sort_by(
        [("product", "ascending"), ("date", "ascending")]
    )
    failed = sum(1 for r in rows if r["status"] == "failed")
    return RunResult(
        manifest=manifest,
        nodes=len(nodes),
        cache_hits=len(hit_rows),
        computed=len(todo) - failed,
        failed=failed,
        wall_s=time.perf_counter() - t0,
    )
