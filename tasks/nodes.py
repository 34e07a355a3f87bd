"""The node engine: keys, packed content-addressed outputs, the cache index, execution.

A node is one unit of the research graph (a kind, e.g. "features", applied to
one input partition). Its key hashes everything that decides its output:

    key = sha256(kind, code fingerprint, canonical parameters, input digest)

Outputs are Arrow IPC blobs in pack files (`<root>/packs/<kind>/<uuid>.arrows`),
one pack per Dask task, each blob with its own sha256. The cache index is a
folder of Parquet segments, each written atomically *after* the pack it points
into is complete: a key is in the index only once its output is whole, and a
crash in between leaves an unreferenced pack that is never read. "Which of
these keys exist?" is one read of the index, never a storage call per node.

Nodes run on Dask in batches sized from the measured work per node, so a node
far smaller than Dask's per-task overhead still costs only its own work; every
node keeps its own key, output, digest and manifest row.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import inspect
import json
import math
import statistics
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from quantloop.tasks import storage
from quantloop.tasks.schema import Partition

_NODE = [("key", pa.string()), ("kind", pa.string()), ("product", pa.string()),
         ("date", pa.string())]  # fmt: skip
_KEY_PARTS = [("code", pa.string()), ("params", pa.string()), ("inputs", pa.string())]
_OUTPUT = [
    ("output_digest", pa.string()),
    ("output_url", pa.string()),
    ("output_offset", pa.int64()),
    ("output_length", pa.int64()),
    ("rows", pa.int64()),
    ("duration_s", pa.float64()),
]
# A plan: one row per node, what a batch ships to its worker (Arrow, not objects:
# 10^5 Node objects cost the driver seconds to build, pickle and walk).
NODES_SCHEMA = pa.schema(
    _NODE
    + [("code", pa.string()), ("params", pa.string())]
    + [("url", pa.string()), ("offset", pa.int64()), ("length", pa.int64()),
       ("digest", pa.string())]  # the input blob; its digest is the key's "inputs"
)  # fmt: skip
# The cache index: one row per committed node.
INDEX_SCHEMA = pa.schema(_NODE + _KEY_PARTS + _OUTPUT + [("written_at", pa.string())])
# A run's node records: every node of the run, hit, computed or failed.
MANIFEST_SCHEMA = pa.schema(
    _NODE
    + [("site", pa.string())]
    + _KEY_PARTS
    + _OUTPUT
    + [
        ("cache_hit", pa.bool_()),
        ("status", pa.string()),  # "ok" or "failed"
        ("reason", pa.string()),  # why it ran: new, code, params, input, missing; "" on a hit
        ("error", pa.string()),
    ]
)

# A Dask task should hold about this much node work: long enough to bury its fixed
# cost (Dask's ~3 ms, reading packs, writing a pack and an index segment); the load
# balance at the end comes from batches shrinking as the work runs out.
TARGET_TASK_S = 1.0
IN_FLIGHT_PER_WORKER = 2  # one running, one waiting: a worker never waits on the driver
FIRST_BATCH_NODES = 256  # batch size until the work per node has been measured
BATCH_S = "quantloop.batch_s"  # manifest-table metadata: the batch task's wall time


def sha256_json(value: Any) -> str:
    """Digest of a value's canonical JSON (sorted keys, no whitespace)."""
    text = json.dumps(value, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def code_fingerprint(*objects: Callable | ModuleType) -> str:
    """Digest of the source of functions or modules: edit them and the keys change."""
    h = hashlib.sha256()
    for obj in objects:
        h.update(getattr(obj, "__qualname__", getattr(obj, "__name__", "")).encode())
        h.update(inspect.getsource(obj).encode())
    return h.hexdigest()


_KEY_PREFIXES: dict[tuple[str, str, str], Any] = {}


def _key_state(kind: str, code: str, params: str) -> Any:
    # sha256 streams: a copy of the state of "kind|code|params|" updated with the input
    # digest equals sha256(f"{kind}|{code}|{params}|{digest}"), at a third of the cost.
    prefix = (kind, code, params)
    state = _KEY_PREFIXES.get(prefix)
    if state is None:
        state = _KEY_PREFIXES.setdefault(prefix, hashlib.sha256("|".join(prefix + ("",)).encode()))
    return state


def node_keys(kind: str, code: str, params: Sequence[str], inputs: Sequence[str]) -> list[str]:
    """Keys of many nodes of one kind and code: what `Node.key` gives each of them."""
    keys = []
    for p, digest in zip(params, inputs, strict=True):
        h = _key_state(kind, code, p).copy()
        h.update(digest.encode())
        keys.append(h.hexdigest())
    return keys


@dataclass(frozen=True, slots=True)
class Node:
    """One node: a kind applied to one version of an input partition."""

    kind: str
    partition: Partition
    code: str  # code fingerprint
    params: str  # sha256 of canonical parameters
    input: storage.Blob  # where the input lives; its digest is part of the key
    key: str = field(init=False, compare=False)

    def __post_init__(self) -> None:
        # Computed once: a plan asks for every key several times.
        key = _key_state(self.kind, self.code, self.params).copy()
        key.update(self.input.digest.encode())
        object.__setattr__(self, "key", key.hexdigest())


@dataclass(frozen=True, slots=True)
class NodeKind:
    """How to compute a kind of node: compute(input table, params) -> output table.

    prepare(params dict) -> params as compute takes them, called once per batch and
    parameter set (parsing and validating per node would cost more than a small node).
    compute_many must give each node exactly what compute gives it alone.
    """

    name: str
    compute: Callable[[pa.Table, Any], pa.Table]
    code: str
    prepare: Callable[[dict], Any] | None = None
    # compute_many(tables, params) -> outputs: the same results for many small
    # inputs in one vectorized call, when the kind has one
    compute_many: Callable[[list[pa.Table], Any], list[pa.Table]] | None = None


def output_blob(row: Mapping[str, Any]) -> storage.Blob:
    """The stored output of an index or manifest row."""
    return storage.Blob(
        row["output_url"], row["output_offset"], row["output_length"], row["output_digest"]
    )


class NodeStore:
    """Packed node outputs and the cache index, under one storage root."""

    def __init__(self, root: str):
        self.root = root.rstrip("/")

    def pack_url(self, kind: str) -> str:
        day = dt.datetime.now(dt.UTC).strftime("%Y%m%d")
        return storage.join(self.root, "packs", kind, day, f"{uuid.uuid4().hex}.arrows")

    def index_url(self, kind: str) -> str:
        return storage.join(self.root, "index", kind)

    def index(self, kind: str) -> pa.Table:
        """Every committed node of a kind: one pass over the index segments."""
        return _read_segments(storage.list_files(self.index_url(kind), ".parquet"))

    def existing(self, kind: str, keys: Sequence[str] | pa.Array) -> pa.Table:
        """Index rows (the latest per key) of those `keys` that are committed."""
        return committed(self.index(kind), pa.array(keys, pa.string()))

    def commit(self, kind: str, rows: pa.Table) -> None:
        """Make outputs visible to later runs: one atomic index segment."""
        if rows.num_rows:
            name = f"{dt.datetime.now(dt.UTC):%Y%m%dT%H%M%S}-{uuid.uuid4().hex[:12]}.parquet"
            storage.write_parquet_atomic(storage.join(self.index_url(kind), name), rows)

    def compact(self, kind: str, *, min_segments: int = 64) -> int:
        """Merge the index segments into one (latest row per key); returns segments merged.

        Safe beside writers: it merges the segments it listed, writes the merged
        segment atomically, then deletes only those. A reader in between sees
        duplicates, which `existing` resolves by keeping the latest row per key.
        """
        segments = storage.list_files(self.index_url(kind), ".parquet")
        if len(segments) < min_segments:
            return 0
        self.commit(kind, latest_per(_read_segments(segments), ["key"]))
        fs, _ = storage.filesystem(segments[0])
        for s in segments:
            fs.rm_file(storage.filesystem(s)[1])
        return len(segments)

    def read(self, row: Mapping[str, Any]) -> pa.Table:
        """One node's output, checked against its digest."""
        return storage.read_table(output_blob(row))


def _read_segments(segments: list[str]) -> pa.Table:
    if not segments:
        return INDEX_SCHEMA.empty_table()
    # Segments are read side by side: fetching and decoding release the GIL, so
    # 100 segments cost about what 30 do one after the other.
    with ThreadPoolExecutor(max_workers=min(8, len(segments))) as pool:
        parts = list(pool.map(storage.read_parquet, segments))
    return pa.concat_tables(p.cast(INDEX_SCHEMA) for p in parts)


def committed(index: pa.Table, keys: pa.Array) -> pa.Table:
    """The index rows (the latest per key) of those `keys` that are committed."""
    return latest_per(index.filter(pc.is_in(index["key"], value_set=keys)), ["key"])


def latest_per(table: pa.Table, columns: list[str]) -> pa.Table:
    """The last row (by written_at) for each distinct value of `columns`."""
    if table.num_rows == 0:
        return table
    if len(columns) == 1 and pc.count_distinct(table[columns[0]]).as_py() == table.num_rows:
        return table  # no duplicates (the usual case): skip the sort
    order = table.sort_by([(c, "ascending") for c in columns] + [("written_at", "ascending")])
    keys = [order[c] for c in columns]
    same_as_next = None
    for k in keys:
        eq = pc.equal(k.slice(0, len(k) - 1), k.slice(1))
        same_as_next = eq if same_as_next is None else pc.and_(same_as_next, eq)
    last = pc.invert(same_as_next).to_numpy(zero_copy_only=False).tolist() + [True]
    return order.filter(pa.array(last))


# Why a node runs, by which parts of its key differ from the partition's last
# committed node: bit 1 code, 2 params, 4 input; 8: the partition has none.
_REASONS = pa.array(
    ["missing", "code", "params", "code+params", "input", "code+input", "params+input",
     "code+params+input", "new"]
)  # fmt: skip


def explain(idx: pa.Table, nodes: pa.Table) -> pa.Array:
    """Why each node (a row of a plan) must run: which part of its key differs from the
    last version of the same (kind, partition) in the index `idx`; "new" if there is
    none, "missing" if all parts match but the output is not committed."""
    n = nodes.num_rows
    if n == 0 or idx.num_rows == 0:
        return pc.take(_REASONS, pa.array([8] * n, pa.int8()))
    last = latest_per(
        idx.select(["product", "date", "code", "params", "inputs", "written_at"]),
        ["product", "date"],
    ).select(["product", "date", "code", "params", "inputs"])
    last = last.rename_columns(["product", "date", "last_code", "last_params", "last_inputs"])
    joined = (
        nodes.select(["product", "date", "code", "params", "digest"])
        .append_column("row", pa.array(range(n), pa.int64()))
        .join(last, keys=["product", "date"], join_type="left outer")
        .sort_by("row")
    )
    reason = pc.multiply(pc.cast(pc.is_null(joined["last_code"]), pa.int8()), 8)
    for bit, (now, before) in enumerate(
        [("code", "last_code"), ("params", "last_params"), ("digest", "last_inputs")]
    ):
        differs = pc.fill_null(pc.not_equal(joined[now], joined[before]), False)
        reason = pc.add(reason, pc.multiply(pc.cast(differs, pa.int8()), 1 << bit))
    return pc.take(_REASONS, reason).combine_chunks()


def node_table(nodes: Sequence[Node]) -> pa.Table:
    """A plan as Arrow columns, from Node objects."""
    return pa.table(
        {
            "key": [n.key for n in nodes],
            "kind": [n.kind for n in nodes],
            "product": [n.partition.product for n in nodes],
            "date": [n.partition.date.isoformat() for n in nodes],
            "code": [n.code for n in nodes],
            "params": [n.params for n in nodes],
            "url": [n.input.url for n in nodes],
            "offset": [n.input.offset for n in nodes],
            "length": [n.input.length for n in nodes],
            "digest": [n.input.digest for n in nodes],
        },
        schema=NODES_SCHEMA,
    )


def run_batch(
    kind: NodeKind,
    params: Mapping[str, dict],
    nodes: pa.Table,
    store_root: str,
    site: str,
) -> pa.Table:
    """Compute a batch of nodes (one Dask task): read and verify each input, compute,
    pack the outputs, then commit the pack to the index. Returns manifest rows; the
    outputs stay in storage, never travel to the driver.

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
    rows = _manifest_rows(
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


def batch_size(remaining: int, workers: int, node_s: float | None) -> int:
    """Nodes for the next Dask task (guided self-scheduling): about TARGET_TASK_S of
    work, but at most a 1/(2 x workers) share of what remains, so batches shrink toward
    the end and the workers finish together; not below a sixteenth of the target
    (~60 ms of work), where a task's own cost would start to show. Before anything is
    measured (node_s None), FIRST_BATCH_NODES."""
    share = max(1, math.ceil(remaining / (2 * workers)))
    if node_s is None:
        return min(FIRST_BATCH_NODES, share)
    by_work = max(1, int(TARGET_TASK_S / max(node_s, 1e-6)))
    return min(max(share, by_work // 16), by_work, remaining)


def _batch_s(rows: pa.Table) -> float:
    return float((rows.schema.metadata or {}).get(BATCH_S.encode(), b"0"))


def typical_node_s(index: pa.Table) -> float | None:
    """Median work per node of a kind from its committed history, if there is any."""
    if index.num_rows == 0:
        return None
    recent = index["duration_s"].slice(max(0, index.num_rows - 2_000))
    values = [v for v in recent.to_pylist() if v is not None]
    return statistics.median(values) if values else None


@dataclass(frozen=True, slots=True)
class RunResult:
    manifest: pa.Table
    nodes: int
    cache_hits: int
    computed: int
    failed: int
    wall_s: float
    batch_size: int = 0  # the largest batch (nodes per Dask task)
    batches: int = 0  # Dask tasks
    mlflow_run_id: str | None = None  # set by a flow that records the run

    @property
    def failures(self) -> list[str]:
        failed = self.manifest.filter(pc.equal(self.manifest["status"], "failed"))
        return failed["error"].to_pylist()


def run_nodes(
    kind: NodeKind,
    params: Mapping[str, dict],
    nodes: Sequence[Node] | pa.Table,
    store: NodeStore,
    *,
    client: Any | None = None,
    site: str = "local",
    progress: Callable[[int, int], None] | None = None,
    index: pa.Table | None = None,
) -> RunResult:
    """Run the nodes that are not cached; returns the manifest of all of them.

    nodes: Node objects, or a plan table (NODES_SCHEMA) as the planner builds for
      large runs.
    params: parameter dicts by their digest (`Node.params`); products may differ.
    client: a `distributed.Client` (the site's cluster); None runs in-process.
    progress(done, total) is called as batches finish.
    index: the kind's index, when the caller has read it already (one read per run,
      not one per shard).
    """
    t0 = time.perf_counter()
    plan = nodes if isinstance(nodes, pa.Table) else node_table(nodes)
    total = plan.num_rows
    index = store.index(kind.name) if index is None else index
    keys = plan["key"].combine_chunks()
    hits = committed(index, keys)
    todo, parts, cached = plan, [], 0
    if hits.num_rows:
        hit = pc.is_in(keys, value_set=hits["key"].combine_chunks())
        todo, hit_plan = plan.filter(pc.invert(hit)), plan.filter(hit)
        # Each hit node gets its own row, from its plan row and its key's index row:
        # two partitions with identical content share a key and an output, not a row.
        found = hits.take(pc.index_in(hit_plan["key"], value_set=hits["key"]))
        no_errors = [""] * hit_plan.num_rows
        parts.append(_manifest_rows(hit_plan, found, site, cache_hit=True, reason=no_errors,
                                    errors=no_errors))  # fmt: skip
        cached = hit_plan.num_rows
    done = cached
    size = batches_run = 0
    if todo.num_rows:
        todo = todo.append_column("reason", explain(index, todo))
        workers = len(client.scheduler_info()["workers"]) if client is not None else 1
        # Work per node: from the kind's history, then from this run's own batches
        # (whole task times over their nodes, so each task's fixed cost is included).
        history_s = typical_node_s(index)
        measured_s, measured_n = 0.0, 0
        batches = _Batches(client, kind, params, store.root, site)
        finished: list[pa.Table] = []
        pos = 0

        def submit_more() -> None:
            nonlocal pos, size
            while pos < todo.num_rows and batches.pending < workers * IN_FLIGHT_PER_WORKER:
                node_s = measured_s / measured_n if measured_n else history_s
                n = batch_size(todo.num_rows - pos, workers, node_s)
                batches.submit(todo.slice(pos, n))
                pos += n
                size = max(size, n)

        submit_more()
        if progress:  # after submitting: the workers start while this reports
            progress(done, total)
        for batch_rows in batches:
            finished.append(batch_rows)
            batches_run += 1
            measured_s += _batch_s(batch_rows)
            measured_n += batch_rows.num_rows
            submit_more()
            done += batch_rows.num_rows
            if progress:
                progress(done, total)
        # in plan order, whatever order the batches finished in
        parts.append(pa.concat_tables(batches.in_order(finished)).replace_schema_metadata(None))
    elif progress:
        progress(done, total)
    manifest = pa.concat_tables(parts) if parts else MANIFEST_SCHEMA.empty_table()
    if cached and todo.num_rows:  # hits and computed rows together, in plan order
        manifest = manifest.take(pc.sort_indices(pc.index_in(manifest["key"], value_set=keys)))
    failed = pc.sum(pc.equal(manifest["status"], "failed")).as_py() or 0
    return RunResult(
        manifest=manifest,
        nodes=total,
        cache_hits=cached,
        computed=total - cached - failed,
        failed=failed,
        wall_s=time.perf_counter() - t0,
        batch_size=size,
        batches=batches_run,
    )


def _manifest_rows(
    nodes: pa.Table,
    outputs: Mapping[str, Any],
    site: str,
    *,
    cache_hit: bool,
    reason: Any,
    errors: list[str],
) -> pa.Table:
    """Manifest rows: a plan's rows, their outputs (the _OUTPUT columns), and how each
    ended."""
    n = nodes.num_rows
    return pa.table(
        {
            **{c: nodes[c] for c in ("key", "kind", "product", "date")},
            "site": pa.array([site] * n, pa.string()),
            **{c: nodes[c] for c in ("code", "params")},
            "inputs": nodes["digest"],
            **{name: outputs[name] for name, _ in _OUTPUT},
            "cache_hit": pa.array([cache_hit] * n),
            "status": ["failed" if e else "ok" for e in errors],
            "reason": reason,
            "error": errors,
        },
        schema=MANIFEST_SCHEMA,
    )


def _run_batch_ipc(kind, params, data: bytes, root: str, site: str) -> pa.Table:
    return run_batch(kind, params, storage.decode_table(data), root, site)


class _Batches:
    """Batches in flight on a Dask cluster (or run in-process without a client, each
    when the iteration reaches it); iterating yields manifest rows as batches finish,
    and more may be submitted meanwhile."""

    def __init__(self, client, kind: NodeKind, params: Mapping[str, dict], root: str, site: str):
        self.client, self.kind, self.root, self.site = client, kind, root, site
        self.params = dict(params)
        self._submitted = 0
        self._queue: list[tuple[int, pa.Table]] = []  # in-process: not run yet
        self._number: dict[Any, int] = {}  # Dask future key -> submission number
        self._done: list[int] = []  # submission numbers, in the order batches finished
        if client is not None:
            from distributed import as_completed

            self._running = as_completed()

    @property
    def pending(self) -> int:
        return len(self._queue) if self.client is None else self._running.count()

    def submit(self, batch: pa.Table) -> None:
        number, self._submitted = self._submitted, self._submitted + 1
        if self.client is None:
            self._queue.append((number, batch))
            return
        # kind and params travel inside each task (small); scattered data would be lost
        # with a dying worker, and the batch could not be retried elsewhere. A batch goes
        # as an IPC stream: pickling a slice of a table would send the whole table.
        future = self.client.submit(_run_batch_ipc, self.kind, self.params,
                                    storage.arrow_bytes(batch), self.root, self.site,
                                    pure=False)  # fmt: skip
        self._number[future.key] = number
        self._running.add(future)

    def __iter__(self) -> Iterator[pa.Table]:
        if self.client is None:
            while self._queue:
                number, batch = self._queue.pop(0)
                self._done.append(number)
                yield run_batch(self.kind, self.params, batch, self.root, self.site)
            return
        for future in self._running:
            self._done.append(self._number[future.key])
            yield future.result()

    def in_order(self, finished: list[pa.Table]) -> list[pa.Table]:
        """The batches' rows (given in the order they finished) in submission order."""
        return [finished[i] for i in sorted(range(len(finished)), key=self._done.__getitem__)]
