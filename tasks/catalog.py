"""The data catalog: which version of each input partition exists, and where.

Partitions are immutable versions. Landing a table writes it content-addressed
(`<root>/datasets/<dataset>/product=X/date=D/<digest>.parquet`, hive-style, so
pyarrow.dataset reads the tree as one table) and records partition -> digest,
rows, bytes, levels, location and site in a SQLite table. Landing the same
content again is a no-op; landing new content for a partition records a new
version (the old file stays, so older runs remain reproducible).
"""

from __future__ import annotations

import datetime as dt
import os
import sqlite3
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa

from tasks import storage
from tasks.schema import Partition, levels_of

_SCHEMA = """
CREATE TABLE IF NOT EXISTS partitions (
    dataset TEXT NOT NULL,
    product TEXT NOT NULL,
    date TEXT NOT NULL,
    digest TEXT NOT NULL,
    rows INTEGER NOT NULL,
    bytes INTEGER NOT NULL,
    levels INTEGER NOT NULL,
    location TEXT NOT NULL,
    site TEXT NOT NULL,
    source TEXT NOT NULL,
    landed_at TEXT NOT NULL,
    PRIMARY KEY (dataset, product, date)
);
"""


@dataclass(frozen=True, slots=True)
class Entry:
    """One catalog row: the current version of a partition."""

    dataset: str
    partition: Partition
    digest: str
    rows: int
    bytes: int
    levels: int
    location: str
    site: str
    source: str


@dataclass(frozen=True, slots=True)
class Landed:
    entry: Entry
    status: str  # "new", "unchanged" or "changed"
    previous_digest: str | None = None


class Catalog:
    """SQLite-backed catalog; safe for several processes (WAL, short transactions)."""

    def __init__(self, path: str | os.PathLike[str]):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self._connect() as db:
            db.executescript(_SCHEMA)

    def _connect(self) -> sqlite3.Connection:
        db = sqlite3.connect(self.path, timeout=30)
        db.execute("PRAGMA journal_mode=WAL")
        return db

    def land(
        self,
        dataset: str,
        partition: Partition,
        table: pa.Table,
        *,
        root: str,
        site: str = "local",
        source: str = "",
    ) -> Landed:
        """Write `table` as the partition's content-addressed file and record it."""
        data = storage.parquet_bytes(table)
        digest = storage.sha256_hex(data)
        location = storage.join(root, "datasets", dataset, partition.path, f"{digest}.parquet")
        previous = self.get(dataset, partition)
        if previous is not None and previous.digest == digest:
            if storage.exists(previous.location):
                return Landed(previous, "unchanged")
        if not storage.exists(location):
            storage.write_bytes_atomic(location, data)
        entry = Entry(
            dataset=dataset,
            partition=partition,
            digest=digest,
            rows=table.num_rows,
            bytes=len(data),
            levels=levels_of(table.schema),
            location=location,
            site=site,
            source=source,
        )
        # Recorded only after the file is complete: a crash above leaves the old entry.
        with self._connect() as db:
            db.execute(
                "INSERT OR REPLACE INTO partitions VALUES (?,?,?,?,?,?,?,?,?,?,?)",
                (
                    dataset,
                    partition.product,
                    partition.date.isoformat(),
                    digest,
                    entry.rows,
                    entry.bytes,
                    entry.levels,
                    location,
                    site,
                    source,
                    dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
                ),
            )
        if previous is None:
            return Landed(entry, "new")
        return Landed(entry, "changed", previous.digest)

    def get(self, dataset: str, partition: Partition) -> Entry | None:
        rows = self.entries(dataset, [partition])
        return rows[0] if rows else None

    def entries(self, dataset: str, partitions: Iterable[Partition] | None = None) -> list[Entry]:
        """Current entries of a dataset, all of them or those of `partitions`, sorted."""
        with self._connect() as db:
            found = db.execute(
                "SELECT dataset, product, date, digest, rows, bytes, levels, location, site,"
                " source FROM partitions WHERE dataset = ? ORDER BY product, date",
                (dataset,),
            ).fetchall()
        entries = [Entry(r[0], Partition(r[1], dt.date.fromisoformat(r[2])), *r[3:]) for r in found]
        if partitions is None:
            return entries
        wanted = set(partitions)
        return [e for e in entries if e.partition in wanted]

    def datasets(self) -> list[str]:
        with self._connect() as db:
            return [r[0] for r in db.execute("SELECT DISTINCT dataset FROM partitions")]

    def to_arrow(self) -> pa.Table:
        with self._connect() as db:
            cur = db.execute("SELECT * FROM partitions ORDER BY dataset, product, date")
            names = [d[0] for d in cur.description]
            rows = cur.fetchall()
        return pa.table({n: [r[i] for r in rows] for i, n in enumerate(names)})
