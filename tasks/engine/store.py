"""Where node outputs live: packs of content-addressed blobs, and the cache index.

Outputs are Arrow IPC blobs in pack files (`<root>/packs/<kind>/<day>/<uuid>.arrows`),
one pack per Dask task, each blob with its own sha256. The cache index is a folder
of Parquet segments (`<root>/index/<kind>/`), each written atomically *after* the
pack it points into is complete: a key is in the index only once its output is
whole, and a crash in between leaves an unreferenced pack that is never read.
"Which of these keys exist?" is one read of the index, never a storage call per node.
"""

from __future__ import annotations

import datetime as dt
import uuid
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from quantloop.tasks import storage
from quantloop.tasks.engine.plan import NODE_COLUMNS

KEY_PARTS = [("code", pa.string()), ("params", pa.string()), ("inputs", pa.string())]
OUTPUT_COLUMNS = [
    ("output_digest", pa.string()),
    ("output_url", pa.string()),
    ("output_offset", pa.int64()),
    ("output_length", pa.int64()),
    ("rows", pa.int64()),
    ("duration_s", pa.float64()),
]
# The cache index: one row per committed node.
INDEX_SCHEMA = pa.schema(NODE_COLUMNS + KEY_PARTS + OUTPUT_COLUMNS + [("written_at", pa.string())])


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
