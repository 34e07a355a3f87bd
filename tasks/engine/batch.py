"""One batch of nodes, run as one Dask task on a worker: read and verify each input,
compute, pack the outputs, then commit the pack to the index."""

from __future__ import annotations

import datetime as dt
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from quantloop.tasks.engine import storage
from quantloop.tasks.engine.plan import NodeKind
from quantloop.tasks.engine.records import manifest_rows
from quantloop.tasks.engine.store import INDEX_SCHEMA, NodeStore

BATCH_S = "quantloop.batch_s"  # manifest-table metadata: the batch task's wall time


def run_batch(
    kind: NodeKind,
    params: Mapping[str, dict],
    nodes: pa.Table,
    store_root: str,
    site: str,
) -> pa.Table:
    """Compute a batch of nodes. Returns manifest rows; the outputs stay in storage,
    never travel to the driver.

    nodes: rows of a plan (NODES_SCHEMA), with a "reason" column when the caller
    knows why they run.
    """
    started = time.perf_counter()
    store = NodeStore(store_root)
    reader = storage.BlobReader()
    if kind.prepare is not None:
        params = {digest: kind.prepare(values) for digest, values in params.items()}
    pack = storage.PackWriter(store.pack_url(kind.name))
    n = nodes.num_rows
    urls, offsets, lengths, digests, param_digests = (
        nodes[c].to_pylist() for c in ("url", "offset", "length", "digest", "params")
    )

    def label(i: int) -> str:  # only for error messages
        return f"{nodes['product'][i].as_py()}/{nodes['date'][i].as_py()}"

    seconds = [0.0] * n  # each node's own time: read, its share of compute, write
    errors: list[str] = [""] * n
    tables: list[pa.Table | None] = [None] * n
    for i in range(n):
        t0 = time.perf_counter()
        try:
            blob = storage.Blob(urls[i], offsets[i], lengths[i], digests[i])
            tables[i] = reader.table(blob)
        except Exception as exc:  # recorded per node; the caller reports every failure
            errors[i] = f"{label(i)}: {type(exc).__name__}: {exc}"
        seconds[i] += time.perf_counter() - t0
    outputs = _compute(kind, params, param_digests, tables, seconds, errors, label)
    out_cols: dict[str, list] = {
        k: [] for k in ("output_digest", "output_url", "output_offset", "output_length", "rows")
    }
    for i, out in enumerate(outputs):
        t0 = time.perf_counter()
        values: tuple = ("", "", 0, 0, 0)
        if out is not None and not errors[i]:
            blob = pack.add(out)
            values = (blob.digest, blob.url, blob.offset, blob.length, out.num_rows)
        # Done with the node's tables: freed now, on its clock, not all at the end.
        tables[i] = outputs[i] = out = None
        for name, v in zip(out_cols, values, strict=True):
            out_cols[name].append(v)
        seconds[i] += time.perf_counter() - t0
    if len(pack):
        # Writing the pack is writing the nodes' outputs: each node is charged its
        # share, by bytes. The pack is complete before any index row points into it.
        t0 = time.perf_counter()
        pack.write()
        per_byte = (time.perf_counter() - t0) / max(pack.size, 1)
        for i, length in enumerate(out_cols["output_length"]):
            seconds[i] += length * per_byte
    out_cols["duration_s"] = seconds
    rows = manifest_rows(
        nodes,
        out_cols,
        site,
        cache_hit=False,
        reason=nodes["reason"] if "reason" in nodes.column_names else [""] * n,
        errors=errors,
    )
    ok = rows.filter(pc.equal(rows["status"], "ok")) if any(errors) else rows
    if ok.num_rows:
        now = dt.datetime.now(dt.UTC).isoformat(timespec="microseconds")
        store.commit(
            kind.name,
            ok.select([c for c in INDEX_SCHEMA.names if c != "written_at"]).append_column(
                "written_at", pa.array([now] * ok.num_rows, pa.string())
            ),
        )
    # The whole task's time, fixed costs included: what batch sizing is fitted to.
    return rows.replace_schema_metadata({BATCH_S: str(time.perf_counter() - started)})


def run_batch_ipc(kind, params, data: bytes, root: str, site: str) -> pa.Table:
    """run_batch on a batch sent as an Arrow IPC stream (pickling a slice of a table
    would send the whole table)."""
    return run_batch(kind, params, storage.decode_table(data), root, site)


def batch_seconds(rows: pa.Table) -> float:
    """The wall time of the batch task that made these manifest rows."""
    return float((rows.schema.metadata or {}).get(BATCH_S.encode(), b"0"))


def _compute(
    kind: NodeKind,
    params: Mapping[str, Any],
    param_digests: Sequence[str],
    tables: list[pa.Table | None],
    seconds: list[float],
    errors: list[str],
    label: Callable[[int], str],
) -> list[pa.Table | None]:
    """Outputs of the nodes whose input was read; failures go to `errors`.

    With `kind.compute_many`, nodes of one parameter set and input layout are
    computed in one call and each is charged an equal share of its time; if that
    call fails, its nodes are computed one by one so only the bad ones fail.
    """
    outputs: list[pa.Table | None] = [None] * len(tables)
    singles: list[int] = []
    if kind.compute_many is None:
        singles = [i for i, t in enumerate(tables) if t is not None]
    else:
        # Groups of one parameter set and one input layout (a book's depth decides its
        # columns). Keyed by column count: comparing schemas costs ~6 us a node here,
        # more than the node's share of the compute; a group that still mixes layouts
        # fails in compute_many and falls back to one node at a time, so the key only
        # has to be right in the common case, never for correctness.
        groups: dict[tuple[str, int], list[int]] = {}
        for i, (digest, table) in enumerate(zip(param_digests, tables, strict=True)):
            if table is not None:
                groups.setdefault((digest, table.num_columns), []).append(i)
        for (digest, _), members in groups.items():
            t0 = time.perf_counter()
            try:
                many = kind.compute_many([tables[i] for i in members], params[digest])
            except Exception:
                singles += members  # find which node it was
                continue
            share = (time.perf_counter() - t0) / len(members)
            for i, out in zip(members, many, strict=True):
                outputs[i] = out
                seconds[i] += share
    for i in singles:
        t0 = time.perf_counter()
        try:
            outputs[i] = kind.compute(tables[i], params[param_digests[i]])
        except Exception as exc:  # recorded per node; the caller reports every failure
            errors[i] = f"{label(i)}: {type(exc).__name__}: {exc}"
        seconds[i] += time.perf_counter() - t0
    return outputs
