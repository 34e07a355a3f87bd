"""The data catalog: which version of each input partition exists, and where.

Partitions are immutable versions. Landing a table writes it content-addressed
(`<root>/datasets/<dataset>/product=X/date=D/<digest>.parquet`, hive-style, so
pyarrow.dataset reads the tree as one table) and records partition -> digest,
rows, bytes, levels, location and site in a table: of a SQLite file (the embedded
default) or of a PostgreSQL database (catalog_db.py: the same SQL on both). Landing the same
content again is a no-op; landing new content for a partition records a new
version (the old file stays, so older runs remain reproducible).
"""

from __future__ import annotations

import collections
import contextlib
import datetime as dt
import itertools
import os
import threading
import uuid
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import pyarrow as pa
import pyarrow.ipc as ipc

from quantloop.tasks.data.catalog_db import Connection, Database, is_url
from quantloop.tasks.data.schema import Partition, levels_of
from quantloop.tasks.engine import COPIES_SCHEMA, sha256_json, storage

_COLUMNS = (
    'dataset, product, date, digest, rows, bytes, levels, location, "offset", length,'
    " site, source, landed_at"
)
_UPDATE = ", ".join(f"{c} = excluded.{c}" for c in
                    ("rows", "bytes", "levels", "location", '"offset"', "length", "site",
                     "source", "landed_at"))  # fmt: skip
# INSERT OR REPLACE, as both SQLite and PostgreSQL say it
_UPSERT_PARTITION = (f"INSERT INTO partitions ({_COLUMNS}) VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?)"
                     f" ON CONFLICT (dataset, product, date) DO UPDATE SET"
                     f" digest = excluded.digest, {_UPDATE}")  # fmt: skip
_UPSERT_HISTORY = (
    f"INSERT INTO history ({_COLUMNS}) VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?)"
    f" ON CONFLICT (dataset, product, date, digest) DO UPDATE SET {_UPDATE}"
)


def _day(cache: dict[str, dt.date], text: str) -> dt.date:
    cache[text] = dt.date.fromisoformat(text)
    return cache[text]


# A snapshot's location dictionary grows batch by batch: stored as deltas.
_DELTAS = ipc.IpcWriteOptions(emit_dictionary_deltas=True)


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


class OutputCopy(NamedTuple):
    """Where a copy of a stage output (a model, a simulation's mark-outs, its statistics)
    is: the site holding it, its URL, the sha256 and length of its bytes, and the site
    that computed it (`origin`: the same site for the output itself, another for a copy
    made for a reader there)."""

    site: str
    url: str
    digest: str
    length: int
    origin: str

    @property
    def blob(self) -> storage.Blob:
        return storage.Blob(self.url, 0, self.length, self.digest)


@dataclass(frozen=True, slots=True)
class Landed:
    entry: Entry
    status: str  # "new", "unchanged", "changed" or "repaired" (its stored bytes were bad)
    previous_digest: str | None = None


def data_digest(pairs: Iterable[tuple[str, str]]) -> str:
    """The digest of a set of partition versions: sorted (product/date, digest) pairs."""
    return sha256_json(sorted(pairs))


# The SQLite catalogs this process opened, each one Database: migrated once (its version
# read again on its idle connection at each open, as another quantloop may migrate it),
# and that connection kept between the Catalog objects that come and go (a run makes a
# dozen), so that SQLite does not checkpoint and delete the WAL each time the last
# connection closes (catalog_db.Database._keep_open): 13 opens took 0.24 s of a tiny
# research run on this VM, 0.03 s so. Keyed by the file's identity, so a catalog
# deleted and made again is checked again (the idle connection holds the old file open:
# its inode is not reused meanwhile); the last few only, each holding a connection.
_OPENED: collections.OrderedDict[tuple[str, int, int], Database] = collections.OrderedDict()
_OPENED_MAX = 8
_opened_lock = threading.Lock()
# A forked child's inherited connections: never used, and never closed (a close could
# checkpoint the parent's WAL from a process that holds none of its locks)
_INHERITED: list[Database] = []


def _forget_inherited() -> None:
    global _opened_lock
    _opened_lock = threading.Lock()  # a thread of the parent may have held it at the fork
    _INHERITED.extend(_OPENED.values())
    _OPENED.clear()


os.register_at_fork(after_in_child=_forget_inherited)


def _sqlite_database(path: Path) -> Database:
    path.parent.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(FileNotFoundError), _opened_lock:
        found = path.stat()
        key = (str(path.absolute()), found.st_dev, found.st_ino)
        if key in _OPENED and _OPENED[key].at_latest():
            _OPENED.move_to_end(key)
            return _OPENED[key]
    db = Database(str(path))
    db.migrate()  # creates the file if it is new
    made = path.stat()
    with _opened_lock:
        key = (str(path.absolute()), made.st_dev, made.st_ino)
        if (before := _OPENED.pop(key, None)) is not None:
            before.close()  # checked again: this one is the file's now
        _OPENED[key] = db
        while len(_OPENED) > _OPENED_MAX:
            _OPENED.popitem(last=False)[1].close()
    return db


class Catalog:
    """The partition catalog on a SQLite file (`where` a path) or a PostgreSQL database
    (`where` a postgresql:// URL); safe for several processes, and on PostgreSQL for
    several hosts (short transactions; catalog_db.py)."""

    def __init__(self, where: str | os.PathLike[str]):
        if is_url(str(where)):
            self._db = Database(str(where))
            # What is shown and recorded (a run's catalog tag): the URL without its password,
            # which reopens it where libpq finds the password (PGPASSWORD, ~/.pgpass)
            self.path: Path | str = self._db.shown
            self._db.migrate()
        else:
            self.path = Path(where)
            self._db = _sqlite_database(self.path)

    @property
    def on_postgres(self) -> bool:
        return self._db.postgres

    def _connect(self) -> contextlib.AbstractContextManager[Connection]:
        return self._db.connect()

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
        return self._land(
            dataset, partition, storage.sha256_hex(data), len(data), table.num_rows,
            levels_of(table.schema), lambda location: storage.write_bytes_atomic(location, data),
            root=root, site=site, source=source,
        )  # fmt: skip

    def stage(
        self, dataset: str, partition: Partition, schema: pa.Schema, *, root: str
    ) -> storage.ParquetStream:
        """A partition's file to write block by block (a day too large to hold as a table),
        under a temporary name in the partition's folder; `land_stream` lands it once it
        is whole, its `discard` drops it."""
        return storage.ParquetStream(self._folder(root, dataset, partition), schema)

    def land_stream(
        self,
        dataset: str,
        partition: Partition,
        written: storage.ParquetStream,
        *,
        root: str,
        site: str = "local",
        source: str = "",
    ) -> Landed:
        """Land a partition written block by block (`stage`), as `land` lands a table:
        the same bytes, so the same digest, for the same rows."""
        try:
            digest, size = written.finish()
            return self._land(dataset, partition, digest, size, written.rows,
                              levels_of(written.schema), written.publish, root=root, site=site,
                              source=source)  # fmt: skip
        finally:
            written.discard()  # unpublished (unchanged, or a failure): its temporary file

    @staticmethod
    def _folder(root: str, dataset: str, partition: Partition) -> str:
        return storage.join(root, "datasets", dataset, partition.path)

    def _land(
        self,
        dataset: str,
        partition: Partition,
        digest: str,
        size: int,
        rows: int,
        levels: int,
        write: Callable[[str], None],
        *,
        root: str,
        site: str,
        source: str,
    ) -> Landed:
        location = storage.join(self._folder(root, dataset, partition), f"{digest}.parquet")
        previous = self.get(dataset, partition)
        if previous is not None and previous.digest == digest and self.intact(previous):
            return Landed(previous, "unchanged")
        if not storage.exists(location) or not self._intact_at(location, digest):
            # absent, or its bytes no longer hash to the digest: landing the same source
            # again repairs a corrupted partition
            write(location)
        entry = Entry(
            dataset=dataset,
            partition=partition,
            digest=digest,
            rows=rows,
            bytes=size,
            levels=levels,
            location=location,
            offset=0,
            length=size,
            site=site,
            source=source,
        )
        # Recorded only after the file is complete: a crash above leaves the old entry.
        # What it replaces is read again under the product's lock: another process (or
        # host) may have landed this partition since `previous` was read.
        repair = previous is not None and previous.digest == digest
        replaced = self._record([entry], keep_same=not repair)[partition]
        if replaced is None:
            return Landed(entry, "new")
        if replaced == digest:
            if repair:
                return Landed(entry, "repaired", digest)
            # landed by another meanwhile, the same content: theirs stays recorded
            return Landed(self.get(dataset, partition) or entry, "unchanged")
        return Landed(entry, "changed", replaced)

    def land_packed(
        self,
        dataset: str,
        items: Iterable[tuple[Partition, pa.Table]],
        *,
        root: str,
        site: str = "local",
        source: str = "",
    ) -> dict[str, int]:
        """Land many small partitions: one pack of Arrow IPC blobs per product; returns
        how many partitions were new, unchanged and changed.

        For datasets of many small days (scale tests, tick-size samples), where a
        Parquet file per partition costs more to open than to compute on. Streamed:
        items given product by product are landed one product at a time (a product's
        tables, its pack and its rows are all that is held; 10^6 partitions held
        at once took ~10 GB). A product whose items are not consecutive gets one pack
        per run of them. Unchanged partitions are left as they are; the others are
        recorded in one transaction per product after their pack is complete.
        """
        counts = {"new": 0, "unchanged": 0, "changed": 0}
        for product, group in itertools.groupby(items, key=lambda item: item[0].product):
            parts = list(group)
            current = self._digests(dataset, product)
            blobs = [storage.arrow_bytes(t) for _, t in parts]
            digests = [storage.sha256_hex(b) for b in blobs]
            before = [current.get(part.date.isoformat()) for part, _ in parts]
            if all(old == d for old, d in zip(before, digests, strict=True)):
                counts["unchanged"] += len(parts)
                continue
            pack = b"".join(blobs)
            location = storage.join(
                root, "datasets", dataset, f"product={product}",
                f"pack-{storage.sha256_hex(pack)[:32]}.arrows",
            )  # fmt: skip
            storage.write_bytes_atomic(location, pack)
            del pack
            entries, offset = [], 0
            for (part, table), data, digest in zip(parts, blobs, digests, strict=True):
                entries.append(
                    Entry(dataset, part, digest, table.num_rows, len(data),
                          levels_of(table.schema), location, offset, len(data), site, source)
                )  # fmt: skip
                offset += len(data)
            replaced = self._record(entries)  # read under the lock: the rows it replaced
            for (part, _), digest in zip(parts, digests, strict=True):
                old = replaced[part]
                counts["new" if old is None else "unchanged" if old == digest else "changed"] += 1
        self.table(dataset)  # the columnar snapshot, built with the landing
        return counts

    @staticmethod
    def _intact_at(location: str, digest: str) -> bool:
        try:
            return storage.sha256_range(location) == digest
        except OSError:
            return False

    def intact(self, entry: Entry) -> bool:
        """Whether the stored bytes of an entry are there and still have its digest."""
        try:
            # read a block at a time: a landed LOBSTER day can be hundreds of MB
            return storage.sha256_range(entry.location, entry.offset, entry.length) == entry.digest
        except OSError:
            return False

    # ---------------------------------------------------------------- copies at sites

    def copies(self, dataset: str) -> pa.Table:
        """Every copy of every version of a dataset's partitions (COPIES_SCHEMA: digest,
        site, url, offset, length): where it landed, and each replica."""
        with self._connect() as db:
            rows = db.execute(
                'SELECT digest, site, location, "offset", length FROM history WHERE dataset = ?'
                ' UNION SELECT digest, site, location, "offset", length FROM partitions'
                " WHERE dataset = ?"
                ' UNION SELECT digest, site, location, "offset", length FROM replicas'
                " WHERE dataset = ? ORDER BY 1, 2",
                (dataset, dataset, dataset),
            ).fetchall()
        columns = list(zip(*rows, strict=True)) if rows else [[] for _ in COPIES_SCHEMA]
        return pa.table([pa.array(c, f.type) for c, f in zip(columns, COPIES_SCHEMA, strict=True)],
                        schema=COPIES_SCHEMA)  # fmt: skip

    def add_copy(self, dataset: str, partition: Partition, blob: storage.Blob, site: str) -> None:
        """Record a verified copy of a version at another site (after its bytes are whole)."""
        now = dt.datetime.now(dt.UTC).isoformat(timespec="seconds")
        with self._connect() as db:
            db.execute(
                "INSERT INTO replicas VALUES (?,?,?,?,?,?,?,?,?) ON CONFLICT (digest, site)"
                " DO UPDATE SET dataset = excluded.dataset, product = excluded.product,"
                " date = excluded.date, location = excluded.location,"
                ' "offset" = excluded."offset", length = excluded.length,'
                " copied_at = excluded.copied_at",
                (dataset, partition.product, partition.date.isoformat(), blob.digest, site,
                 blob.url, blob.offset, blob.length, now),
            )  # fmt: skip

    # ---------------------------------------------------------------- stage outputs

    def record_output(self, kind: str, key: str, copy: OutputCopy) -> None:
        """Record a stage output's copy at a site (after its bytes are whole there)."""
        now = dt.datetime.now(dt.UTC).isoformat(timespec="seconds")
        with self._connect() as db:
            db.execute(
                "INSERT INTO outputs VALUES (?,?,?,?,?,?,?,?) ON CONFLICT (kind, key, url)"
                " DO UPDATE SET site = excluded.site, digest = excluded.digest,"
                " length = excluded.length, origin = excluded.origin,"
                " written_at = excluded.written_at",
                (kind, key, copy.site, copy.url, copy.digest, copy.length, copy.origin, now),
            )

    def output_copies(self, kind: str, key: str) -> list[OutputCopy]:
        """Every recorded copy of a stage output (at any site, under any root), those at
        the site that computed it first."""
        with self._connect() as db:
            rows = db.execute(
                "SELECT site, url, digest, length, origin FROM outputs"
                " WHERE kind = ? AND key = ? ORDER BY site != origin, site",
                (kind, key),
            ).fetchall()
        return [OutputCopy(*r) for r in rows]

    def outputs(self, kind: str | None = None) -> list[tuple[str, str, OutputCopy]]:
        """(kind, key, copy) of every recorded stage output copy, of one kind or all."""
        query = "SELECT kind, key, site, url, digest, length, origin FROM outputs"
        with self._connect() as db:
            rows = (db.execute(query + " WHERE kind = ? ORDER BY 1, 2, 3", (kind,)) if kind
                    else db.execute(query + " ORDER BY 1, 2, 3")).fetchall()  # fmt: skip
        return [(r[0], r[1], OutputCopy(*r[2:])) for r in rows]

    def drop_output(self, kind: str, key: str, url: str) -> None:
        """Forget a copy (its bytes were found damaged, or gone)."""
        with self._connect() as db:
            db.execute("DELETE FROM outputs WHERE kind = ? AND key = ? AND url = ?",
                       (kind, key, url))  # fmt: skip

    def note_sites(self, roots: Iterable[tuple[str, str]]) -> None:
        """Record (site name, storage root) pairs a workspace uses, so commands that are
        given only the catalog (verify, nodes --lineage) find every site's store."""
        now = dt.datetime.now(dt.UTC).isoformat(timespec="seconds")
        with self._connect() as db:
            db.executemany(
                "INSERT INTO site_roots VALUES (?,?,?) ON CONFLICT (site, root)"
                " DO UPDATE SET seen_at = excluded.seen_at",
                [(name, root, now) for name, root in roots],
            )

    def site_roots(self) -> list[tuple[str, str]]:
        """Every (site name, storage root) pair a run recorded, by site then root."""
        with self._connect() as db:
            return [tuple(r) for r in db.execute(
                "SELECT site, root FROM site_roots ORDER BY site, root").fetchall()]  # fmt: skip

    # ---------------------------------------------------------------- pinned versions

    def pin(self, dataset: str, entries: Iterable[Entry]) -> str:
        """Record exactly these partition versions as one immutable selection; returns
        its id, the digest of its sorted (product/date, digest) pairs (the run's data
        digest). A run reads its pin, never "the current version": another run landing
        new versions of the same partitions meanwhile cannot change what it reads."""
        rows = sorted((e.partition.product, e.partition.date.isoformat(), e.digest, e.location,
                       e.offset, e.length) for e in entries)  # fmt: skip
        if not rows:
            raise ValueError(f"nothing to pin in dataset {dataset!r}")
        pin = data_digest((f"{p}/{d}", digest) for p, d, digest, *_ in rows)
        with self._connect() as db:
            if db.execute("SELECT 1 FROM pins WHERE pin = ?", (pin,)).fetchone():
                return pin
        columns = list(zip(*rows, strict=True))
        table = pa.table(
            [pa.array(c, f.type.value_type if pa.types.is_dictionary(f.type) else f.type)
             for c, f in zip(columns, self.TABLE_SCHEMA, strict=True)],
            names=list(self.TABLE_COLUMNS),
        ).cast(self.TABLE_SCHEMA)  # fmt: skip
        now = dt.datetime.now(dt.UTC).isoformat(timespec="seconds")
        with self._connect() as db:  # in the catalog: a flow on another host reads it
            db.execute(
                "INSERT INTO pins VALUES (?, ?, ?, ?) ON CONFLICT (pin) DO NOTHING",
                (pin, dataset, storage.arrow_bytes(table), now),
            )
        return pin

    def pinned(self, pin: str) -> pa.Table:
        """The partition versions of a pin (TABLE_SCHEMA, sorted by product and date)."""
        if (known := self._db.pins.get(pin)) is not None:
            return known
        with self._connect() as db:
            row = db.execute("SELECT data FROM pins WHERE pin = ?", (pin,)).fetchone()
        if row is not None:
            table = self._db.pins[pin] = storage.decode_table(bytes(row[0]))
            while len(self._db.pins) > 4:  # the last few: a pin of 10^6 nodes is megabytes
                self._db.pins.popitem(last=False)
            return table
        # A SQLite catalog's pins made before schema version 2: files beside it
        if isinstance(self.path, Path):
            legacy = self.path.parent / f"{self.path.name}.pins" / f"{pin}.arrows"
            if legacy.exists():
                return storage.decode_table(legacy.read_bytes())
        raise LookupError(f"no pinned selection {pin[:16]} in the catalog at {self.path}")

    def _digests(self, dataset: str, product: str) -> dict[str, str]:
        """The current digest of each of a product's dates."""
        with self._connect() as db:
            return dict(
                db.execute(
                    "SELECT date, digest FROM partitions WHERE dataset = ? AND product = ?",
                    (dataset, product),
                )
            )

    def _record(
        self, entries: list[Entry], *, keep_same: bool = False
    ) -> dict[Partition, str | None]:
        """Record entries (of one dataset and product) in one transaction with the
        dataset's version; returns the digest each replaced (None: it was new), read
        under a lock on the product, so two writers of one partition see each other.
        keep_same: an entry whose digest is already current is left as it is (another
        process landed the same content meanwhile; its location stays)."""
        [(dataset, product)] = {(e.dataset, e.partition.product) for e in entries}
        now = dt.datetime.now(dt.UTC).isoformat(timespec="seconds")
        with self._connect() as db:  # one transaction: the rows and their versions
            # PostgreSQL: an advisory lock (a row lock cannot hold a partition not yet
            # there); SQLite: its write lock, taken before the read (BEGIN IMMEDIATE)
            db.lock(f"catalog partitions {dataset}/{product}")
            current = dict(
                db.execute(
                    "SELECT date, digest FROM partitions WHERE dataset = ? AND product = ?",
                    (dataset, product),
                ).fetchall()
            )
            replaced = {e.partition: current.get(e.partition.date.isoformat()) for e in entries}
            if keep_same:
                entries = [e for e in entries if replaced[e.partition] != e.digest]
            if not entries:
                return replaced
            db.execute(
                "INSERT INTO versions VALUES (?, 1)"
                " ON CONFLICT(dataset) DO UPDATE SET version = versions.version + 1",
                (dataset,),
            )
            rows = [
                (e.dataset, e.partition.product, e.partition.date.isoformat(), e.digest,
                 e.rows, e.bytes, e.levels, e.location, e.offset, e.length, e.site,
                 e.source, now)
                for e in entries
            ]  # fmt: skip
            db.executemany(_UPSERT_PARTITION, rows)
            db.executemany(_UPSERT_HISTORY, rows)
        return replaced

    def get(self, dataset: str, partition: Partition) -> Entry | None:
        rows = self.entries(dataset, [partition])
        return rows[0] if rows else None

    def with_digest(self, digest: str) -> list[Entry]:
        """Entries, of any dataset, current or replaced, whose content has this digest."""
        with self._connect() as db:
            found = db.execute(
                'SELECT dataset, product, date, digest, rows, bytes, levels, location, "offset",'
                " length, site, source FROM history WHERE digest = ?"
                " UNION SELECT dataset, product, date, digest, rows, bytes, levels, location,"
                ' "offset", length, site, source FROM partitions WHERE digest = ?'
                " ORDER BY 1, 2, 3",
                (digest, digest),
            ).fetchall()
        return [Entry(r[0], Partition.trusted(r[1], dt.date.fromisoformat(r[2])), *r[3:])
                for r in found]  # fmt: skip

    def blobs(self, digests: Iterable[str]) -> dict[str, storage.Blob]:
        """Where the bytes of each of these versions are, by digest, of any dataset,
        current or replaced: a run's pinned versions stay readable after newer ones of
        the same partitions land (their files are kept; nothing deletes a version). The
        copy where a version landed is taken; a replica only when that is all there is."""
        wanted = sorted(set(digests))
        found: dict[str, storage.Blob] = {}
        with self._connect() as db:
            for i in range(0, len(wanted), 500):  # SQLite's limit on bound parameters
                chunk = wanted[i : i + 500]
                marks = ",".join("?" * len(chunk))
                rows = db.execute(
                    'SELECT digest, location, "offset", length, 0 FROM history'
                    f" WHERE digest IN ({marks})"
                    ' UNION SELECT digest, location, "offset", length, 0 FROM partitions'
                    f" WHERE digest IN ({marks})"
                    ' UNION SELECT digest, location, "offset", length, 1 FROM replicas'
                    f" WHERE digest IN ({marks}) ORDER BY 5 DESC, 1, 2",
                    chunk * 3,
                ).fetchall()
                for digest, location, offset, length, _ in rows:  # landed copies last: kept
                    found[digest] = storage.Blob(location, offset, length, digest)
        return found

    def entries(self, dataset: str, partitions: Iterable[Partition] | None = None) -> list[Entry]:
        """Current entries of a dataset, all of them or those of `partitions`, sorted."""
        with self._connect() as db:
            found = db.execute(
                'SELECT dataset, product, date, digest, rows, bytes, levels, location, "offset",'
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

    # The columns a plan needs, in `table`'s order; the location is dictionary-encoded
    # (one pack per product: 10^6 rows hold ~10^3 distinct locations, 120 MB as plain
    # strings here).
    TABLE_COLUMNS = ("product", "date", "digest", "location", "offset", "length")
    _SELECT_TABLE = 'SELECT product, date, digest, location, "offset", length FROM partitions'

    TABLE_SCHEMA = pa.schema(
        [("product", pa.string()), ("date", pa.string()), ("digest", pa.string()),
         ("location", pa.dictionary(pa.int32(), pa.string())), ("offset", pa.int64()),
         ("length", pa.int64())]
    )  # fmt: skip
    _SNAPSHOT_ROWS = 1 << 16  # rows per record batch of a snapshot, as it is built

    def table(self, dataset: str) -> pa.Table:
        """Current entries of a dataset as Arrow columns (TABLE_SCHEMA), sorted by
        product and date: what a large plan reads instead of one Entry per row.

        Served from a columnar snapshot of the dataset's version, memory-mapped:
        reading 10^5 rows out of SQLite costs ~0.5 s, the snapshot ~10 ms, and a plan
        that walks it shard by shard touches its pages shard by shard. Every write
        bumps the version in its own transaction, so a snapshot is never older than
        the rows.
        """
        query = f"{self._SELECT_TABLE} WHERE dataset = ? ORDER BY product, date"
        with self._connect() as db:
            db.repeatable_read()  # the version and the rows from one read snapshot
            if self.on_postgres:
                # No snapshot file: a catalog shared by hosts has no folder of its own.
                rows = db.execute(query, (dataset,))
                return pa.Table.from_batches(
                    _batches(rows, self.TABLE_SCHEMA, self._SNAPSHOT_ROWS), self.TABLE_SCHEMA
                )
            row = db.execute(
                "SELECT version FROM versions WHERE dataset = ?", (dataset,)
            ).fetchone()
            path = self._snapshot(dataset, row[0] if row else 0)
            with contextlib.suppress(FileNotFoundError):  # absent, or just replaced
                return _read_snapshot(path)
            rows = db.execute(query, (dataset,))
            try:
                _write_snapshot(path, rows, self.TABLE_SCHEMA, self._SNAPSHOT_ROWS)
            except OSError:  # a read-only catalog folder: serve the rows without a snapshot
                rows = db.execute(query, (dataset,))
                return pa.Table.from_batches(
                    _batches(rows, self.TABLE_SCHEMA, self._SNAPSHOT_ROWS), self.TABLE_SCHEMA
                )
        for old in path.parent.glob(f"{path.name.rsplit('-', 1)[0]}-*.arrows"):
            if old != path:
                old.unlink(missing_ok=True)  # other versions: not current any more
        return _read_snapshot(path)

    def _snapshot(self, dataset: str, version: int) -> Path:
        assert isinstance(self.path, Path)  # SQLite's: beside its file
        name = storage.sha256_hex(dataset.encode())[:16]
        return self.path.parent / f"{self.path.name}.snapshots" / f"{name}-{version}.arrows"

    def datasets(self) -> list[str]:
        with self._connect() as db:
            return [r[0] for r in db.execute("SELECT DISTINCT dataset FROM partitions")]


def _batches(rows: Any, schema: pa.Schema, size: int) -> Iterator[pa.RecordBatch]:
    """A query's rows as record batches of `size` rows: never all of them as tuples.

    A dictionary column's dictionary grows from batch to batch (each batch's is the one
    before plus its new values), which an IPC file stores as deltas.
    """
    codes: dict[int, dict[str, int]] = {
        i: {} for i, f in enumerate(schema) if pa.types.is_dictionary(f.type)
    }
    while chunk := rows.fetchmany(size):
        arrays = []
        for i, (column, field) in enumerate(zip(zip(*chunk, strict=True), schema, strict=True)):
            if i in codes:
                seen = codes[i]
                indices = pa.array([seen.setdefault(v, len(seen)) for v in column], pa.int32())
                arrays.append(pa.DictionaryArray.from_arrays(indices, pa.array(list(seen))))
            else:
                arrays.append(pa.array(column, field.type))
        yield pa.record_batch(arrays, schema=schema)


def _write_snapshot(path: Path, rows: Any, schema: pa.Schema, size: int) -> None:
    """An Arrow IPC file, written batch by batch under a temporary name, then renamed."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{storage.TMP_MARK}{uuid.uuid4().hex}-{path.name}")
    try:
        with pa.OSFile(str(tmp), "wb") as sink:
            with ipc.new_file(sink, schema, options=_DELTAS) as writer:
                for batch in _batches(rows, schema, size):
                    writer.write_batch(batch)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _read_snapshot(path: Path) -> pa.Table:
    # Not closed here: the table's buffers are the mapped pages, unmapped with the table.
    return ipc.open_file(pa.memory_map(str(path))).read_all()
