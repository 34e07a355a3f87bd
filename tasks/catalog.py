"""The data catalog: which version of each input partition exists, and where.

Partitions are immutable versions. Landing a table writes it content-addressed
(`<root>/datasets/<dataset>/product=X/date=D/<digest>.parquet`, hive-style, so
pyarrow.dataset reads the tree as one table) and records partition -> digest,
rows, bytes, levels, location and site in a SQLite table. Landing the same
content again is a no-op; landing new content for a partition records a new
version (the old file stays, so older runs remain reproducible).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import os
import sqlite3
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import pyarrow as pa

from quantloop.tasks import storage
from quantloop.tasks.schema import Partition, levels_of

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
    offset INTEGER NOT NULL,
    length INTEGER NOT NULL,
    site TEXT NOT NULL,
    source TEXT NOT NULL,
    landed_at TEXT NOT NULL,
    PRIMARY KEY (dataset, product, date)
);
CREATE TABLE IF NOT EXISTS versions (
    dataset TEXT PRIMARY KEY,
    version INTEGER NOT NULL  -- bumped by every write, in the write's transaction
);
"""


def _day(cache: dict[str, dt.date], text: str) -> dt.date:
    cache[text] = dt.date.fromisoformat(text)
    return cache[text]


class Entry(NamedTuple):
    """One catalog row: the current version of a partition.

    A NamedTuple, not a dataclass: a 10^5-partition plan builds one per row, and a
    tuple is built several times faster.
    """

    dataset: str
    partition: Partition
    digest: str
    rows: int
    bytes: int
    levels: int
    location: str
    offset: int
    length: int
    site: str
    source: str

    @property
    def blob(self) -> storage.Blob:
        return storage.Blob(self.location, self.offset, self.length, self.digest)


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
            offset=0,
            length=len(data),
            site=site,
            source=source,
        )
        # Recorded only after the file is complete: a crash above leaves the old entry.
        self._record([entry])
        if previous is None:
            return Landed(entry, "new")
        return Landed(entry, "changed", previous.digest)

    def land_packed(
        self,
        dataset: str,
        items: Iterable[tuple[Partition, pa.Table]],
        *,
        root: str,
        site: str = "local",
        source: str = "",
    ) -> list[Landed]:
        """Land many small partitions: one pack of Arrow IPC blobs per product.

        For datasets of many small days (scale tests, tick-size samples), where a
        Parquet file per partition costs more to open than to compute on.
        Unchanged partitions are left as they are; the others are recorded in one
        transaction after their pack is complete.
        """
        current = {e.partition: e for e in self.entries(dataset)}
        by_product: dict[str, list[tuple[Partition, pa.Table]]] = {}
        for part, table in items:
            by_product.setdefault(part.product, []).append((part, table))
        landed: list[Landed] = []
        for product, parts in sorted(by_product.items()):
            blobs = [(p, t, storage.arrow_bytes(t)) for p, t in parts]
            digests = [storage.sha256_hex(b) for _, _, b in blobs]
            if all(
                p in current and current[p].digest == d
                for (p, _, _), d in zip(blobs, digests, strict=True)
            ):
                landed += [Landed(current[p], "unchanged") for p, _, _ in blobs]
                continue
            pack = b"".join(b for _, _, b in blobs)
            location = storage.join(
                root, "datasets", dataset, f"product={product}",
                f"pack-{storage.sha256_hex(pack)[:32]}.arrows",
            )  # fmt: skip
            storage.write_bytes_atomic(location, pack)
            entries, offset = [], 0
            for (part, table, data), digest in zip(blobs, digests, strict=True):
                entries.append(
                    Entry(dataset, part, digest, table.num_rows, len(data),
                          levels_of(table.schema), location, offset, len(data), site, source)
                )  # fmt: skip
                offset += len(data)
            self._record(entries)
            for e in entries:
                old = current.get(e.partition)
                if old is None:
                    landed.append(Landed(e, "new"))
                elif old.digest == e.digest:
                    landed.append(Landed(e, "unchanged"))
                else:
                    landed.append(Landed(e, "changed", old.digest))
        self.table(dataset)  # the columnar snapshot, built with the landing
        return landed

    def _record(self, entries: list[Entry]) -> None:
        now = dt.datetime.now(dt.UTC).isoformat(timespec="seconds")
        with self._connect() as db:  # one transaction: the rows and their versions
            db.executemany(
                "INSERT INTO versions VALUES (?, 1)"
                " ON CONFLICT(dataset) DO UPDATE SET version = version + 1",
                [(d,) for d in sorted({e.dataset for e in entries})],
            )
            db.executemany(
                "INSERT OR REPLACE INTO partitions VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?)",
                [
                    (e.dataset, e.partition.product, e.partition.date.isoformat(), e.digest,
                     e.rows, e.bytes, e.levels, e.location, e.offset, e.length, e.site,
                     e.source, now)
                    for e in entries
                ],
            )  # fmt: skip

    def get(self, dataset: str, partition: Partition) -> Entry | None:
        rows = self.entries(dataset, [partition])
        return rows[0] if rows else None

    def entries(self, dataset: str, partitions: Iterable[Partition] | None = None) -> list[Entry]:
        """Current entries of a dataset, all of them or those of `partitions`, sorted."""
        with self._connect() as db:
            found = db.execute(
                "SELECT dataset, product, date, digest, rows, bytes, levels, location, offset,"
                " length, site, source FROM partitions WHERE dataset = ? ORDER BY product, date",
                (dataset,),
            ).fetchall()
        dates: dict[str, dt.date] = {}  # a few hundred distinct days among 10^5 rows
        entries = [
            Entry(r[0], Partition.trusted(r[1], dates.get(r[2]) or _day(dates, r[2])), *r[3:])
            for r in found
        ]
        if partitions is None:
            return entries
        wanted = set(partitions)
        return [e for e in entries if e.partition in wanted]

    # The columns a plan needs, in `table`'s order.
    TABLE_COLUMNS = ("product", "date", "digest", "location", "offset", "length")
    _TABLE_TYPES = (pa.string(), pa.string(), pa.string(), pa.string(), pa.int64(), pa.int64())

    def table(self, dataset: str) -> pa.Table:
        """Current entries of a dataset as Arrow columns (TABLE_COLUMNS), sorted by
        product and date: what a large plan reads instead of one Entry per row.

        Served from a columnar snapshot of the dataset's version: reading 10^5 rows
        out of SQLite costs ~0.5 s, the snapshot ~10 ms. Every write bumps the
        version in its own transaction, so a snapshot is never older than the rows.
        """
        with self._connect() as db:
            db.execute("BEGIN")  # the version and the rows from one read snapshot
            row = db.execute(
                "SELECT version FROM versions WHERE dataset = ?", (dataset,)
            ).fetchone()
            path = self._snapshot(dataset, row[0] if row else 0)
            with contextlib.suppress(FileNotFoundError):  # absent, or just replaced
                return storage.decode_table(path.read_bytes())
            found = db.execute(
                f"SELECT {', '.join(self.TABLE_COLUMNS)} FROM partitions WHERE dataset = ?"
                " ORDER BY product, date",
                (dataset,),
            ).fetchall()
        columns = list(zip(*found, strict=True)) if found else [()] * len(self._TABLE_TYPES)
        table = pa.table(
            [pa.array(c, t) for c, t in zip(columns, self._TABLE_TYPES, strict=True)],
            names=list(self.TABLE_COLUMNS),
        )
        try:
            storage.write_bytes_atomic(str(path), storage.arrow_bytes(table))
            for old in path.parent.glob(f"{path.name.rsplit('-', 1)[0]}-*.arrows"):
                if old != path:
                    old.unlink(missing_ok=True)  # other versions: not current any more
        except OSError:
            pass  # a read-only catalog folder: serve the rows without a snapshot
        return table

    def _snapshot(self, dataset: str, version: int) -> Path:
        name = storage.sha256_hex(dataset.encode())[:16]
        return self.path.parent / f"{self.path.name}.snapshots" / f"{name}-{version}.arrows"

    def datasets(self) -> list[str]:
        with self._connect() as db:
            return [r[0] for r in db.execute("SELECT DISTINCT dataset FROM partitions")]
