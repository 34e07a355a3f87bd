"""Where the catalog's rows live: a SQLite file (the embedded default) or a PostgreSQL
database (a desk's catalog, shared by flows on several hosts). The same SQL runs on both.

The SQL is written once, in the dialect both accept: `?` placeholders (given to psycopg2
as `%s`), `INSERT ... ON CONFLICT ... DO UPDATE` (SQLite 3.24+), `"offset"` quoted (a
reserved word in PostgreSQL). The schema is its migrations, applied in order and
recorded in `schema_version`; the DDL says INTEGER and BLOB, which PostgreSQL is given as
BIGINT (sizes and offsets past 2^31) and BYTEA.

Adding a migration: append `(N + 1, [statements])` to MIGRATIONS, never edit an applied
one. A catalog opened by a newer quantloop is brought up to date under a lock (SQLite's
write lock, PostgreSQL's advisory lock), so two hosts opening it at once apply it once;
one whose schema is newer than this code's is refused, naming both versions.
"""

from __future__ import annotations

import collections
import contextlib
import datetime as dt
import sqlite3
import threading
import urllib.parse
import zlib
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

SCHEMES = ("postgresql", "postgres")

# Version 1 is the catalog as it was before migrations were versioned: a catalog.sqlite
# made then holds exactly these tables and opens as version 1 (IF NOT EXISTS: unchanged).
_V1 = [
    """CREATE TABLE IF NOT EXISTS partitions (
    dataset TEXT NOT NULL,
    product TEXT NOT NULL,
    date TEXT NOT NULL,
    digest TEXT NOT NULL,
    rows INTEGER NOT NULL,
    bytes INTEGER NOT NULL,
    levels INTEGER NOT NULL,
    location TEXT NOT NULL,
    "offset" INTEGER NOT NULL,
    length INTEGER NOT NULL,
    site TEXT NOT NULL,
    source TEXT NOT NULL,
    landed_at TEXT NOT NULL,
    PRIMARY KEY (dataset, product, date)
)""",
    """CREATE TABLE IF NOT EXISTS versions (
    dataset TEXT PRIMARY KEY,
    version INTEGER NOT NULL  -- bumped by every write, in the write's transaction
)""",
    # Every version ever landed (partitions keeps the current one): a run pinned to an
    # older version, a lineage or a reproduction still finds where its bytes are.
    """CREATE TABLE IF NOT EXISTS history (
    dataset TEXT NOT NULL,
    product TEXT NOT NULL,
    date TEXT NOT NULL,
    digest TEXT NOT NULL,
    rows INTEGER NOT NULL,
    bytes INTEGER NOT NULL,
    levels INTEGER NOT NULL,
    location TEXT NOT NULL,
    "offset" INTEGER NOT NULL,
    length INTEGER NOT NULL,
    site TEXT NOT NULL,
    source TEXT NOT NULL,
    landed_at TEXT NOT NULL,
    PRIMARY KEY (dataset, product, date, digest)
)""",
    "CREATE INDEX IF NOT EXISTS history_digest ON history (digest)",
    # Copies of a version at other sites (replicate): the same digest, another location.
    # The site a version landed at is its history row's; a placement reads both.
    """CREATE TABLE IF NOT EXISTS replicas (
    dataset TEXT NOT NULL,
    product TEXT NOT NULL,
    date TEXT NOT NULL,
    digest TEXT NOT NULL,
    site TEXT NOT NULL,
    location TEXT NOT NULL,
    "offset" INTEGER NOT NULL,
    length INTEGER NOT NULL,
    copied_at TEXT NOT NULL,
    PRIMARY KEY (digest, site)
)""",
]

# Version 2: pins in the catalog itself (they were files beside the SQLite file, which a
# flow on another host cannot read). A pin is its Arrow IPC bytes, as the file held.
_V2 = [
    """CREATE TABLE IF NOT EXISTS pins (
    pin TEXT PRIMARY KEY,
    dataset TEXT NOT NULL,
    data BLOB NOT NULL,
    pinned_at TEXT NOT NULL
)""",
]

# Version 3: stage outputs (models, simulations, statistics) at the sites that hold them,
# a row per copy: where it is, the sha256 and size of its bytes, and the site that computed
# it (`origin`; another site for a copy made for a reader there). And the storage roots
# the workspaces' sites had, so `verify` and `nodes --lineage` find every site's store
# from the catalog alone.
_V3 = [
    """CREATE TABLE IF NOT EXISTS outputs (
    kind TEXT NOT NULL,
    key TEXT NOT NULL,
    site TEXT NOT NULL,
    url TEXT NOT NULL,
    digest TEXT NOT NULL,
    length INTEGER NOT NULL,
    origin TEXT NOT NULL,
    written_at TEXT NOT NULL,
    PRIMARY KEY (kind, key, url)
)""",
    """CREATE TABLE IF NOT EXISTS site_roots (
    site TEXT NOT NULL,
    root TEXT NOT NULL,
    seen_at TEXT NOT NULL,
    PRIMARY KEY (site, root)
)""",
]

MIGRATIONS: list[tuple[int, list[str]]] = [(1, _V1), (2, _V2), (3, _V3)]
LATEST = MIGRATIONS[-1][0]

_VERSION_TABLE = (
    "CREATE TABLE IF NOT EXISTS schema_version ("
    "version INTEGER PRIMARY KEY, applied_at TEXT NOT NULL)"
)


class CatalogDatabaseError(RuntimeError):
    """A catalog database that cannot be used, said in one line (never its password)."""


def is_url(where: str) -> bool:
    return urllib.parse.urlsplit(str(where)).scheme in SCHEMES


def without_password(url: str) -> str:
    """The URL without its password: what may be shown or recorded (a run's catalog tag).
    libpq still opens it, taking the password from PGPASSWORD or ~/.pgpass."""
    parts = urllib.parse.urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.rsplit("@", 1)[1]
    login = f"{parts.netloc.rsplit('@', 1)[0].split(':', 1)[0]}@" if parts.username else ""
    return urllib.parse.urlunsplit(parts._replace(netloc=login + netloc))


class Connection:
    """One transaction on the catalog's database: the same SQL on sqlite3 and psycopg2."""

    def __init__(self, raw: Any, postgres: bool):
        self.raw, self.postgres = raw, postgres

    def _sql(self, statement: str) -> str:
        return statement.replace("?", "%s") if self.postgres else statement

    def execute(self, statement: str, params: Sequence[Any] = ()) -> Any:
        if not self.postgres:
            return self.raw.execute(statement, params)
        cur = self.raw.cursor()
        cur.execute(self._sql(statement), tuple(params))
        return cur

    def executemany(self, statement: str, rows: Iterable[Sequence[Any]]) -> None:
        if not self.postgres:
            self.raw.executemany(statement, rows)
            return
        from psycopg2.extras import execute_batch

        # executemany is a round trip a row; a batch is one per 1000 rows
        execute_batch(self.raw.cursor(), self._sql(statement), list(rows), page_size=1000)

    def lock(self, key: str) -> None:
        """Hold `key` until this transaction ends: PostgreSQL's advisory lock (other hosts
        wait on it); on SQLite the file's write lock, which is one for every key."""
        if self.postgres:
            # crc32: the same bigint on every host (Python's hash() is salted per process)
            self.execute("SELECT pg_advisory_xact_lock(?)", (zlib.crc32(key.encode()),))
        elif not self.raw.in_transaction:
            self.raw.execute("BEGIN IMMEDIATE")

    def repeatable_read(self) -> None:
        """The rest of this transaction reads from one snapshot (its first statement)."""
        if self.postgres:
            self.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
        else:
            self.raw.execute("BEGIN")  # a read transaction: one snapshot of the WAL


class Database:
    """A catalog's database: `where` is a SQLite file's path or a postgresql:// URL."""

    def __init__(self, where: str):
        self.where = str(where)
        self.postgres = is_url(self.where)
        self.shown = without_password(self.where) if self.postgres else self.where
        self._keeper: sqlite3.Connection | None = None
        self._keeper_lock = threading.Lock()
        # pins read, decoded: a pin's row is written once and never changed (its id is the
        # digest of its versions), and a run reads its pin at each stage's plan
        self.pins: collections.OrderedDict[str, Any] = collections.OrderedDict()

    def _keep_open(self) -> None:
        """SQLite: one idle connection for the life of this object. When the last
        connection to a WAL database closes, SQLite checkpoints and deletes the WAL: with
        a connection per call that was every call (a write took 2.2 ms instead of 0.8 ms
        here). It reads once (to attach to the WAL index), then holds no snapshot or
        lock: no statement of it stays open."""
        if self._keeper is None and not self.postgres:
            keeper = sqlite3.connect(self.where, timeout=30, check_same_thread=False)
            keeper.execute("SELECT COUNT(*) FROM sqlite_master").fetchall()
            self._keeper = keeper

    def at_latest(self) -> bool:
        """Whether the schema is still LATEST, read on the idle connection (a few
        microseconds, no new connection): another quantloop may have migrated the file
        since this object checked it. False where there is no idle connection."""
        with self._keeper_lock:  # one statement at a time on the shared connection
            if self._keeper is None:
                return False
            query = "SELECT MAX(version) FROM schema_version"
            try:
                [(version,)] = self._keeper.execute(query).fetchall()
            except sqlite3.Error:  # not a catalog as it was: migrate() looks again
                return False
        return version == LATEST

    def close(self) -> None:
        """Let go of the idle connection (the next use opens connections as it needs)."""
        with self._keeper_lock:
            keeper, self._keeper = self._keeper, None
        if keeper is not None:
            keeper.close()

    def __getstate__(self) -> dict[str, Any]:
        # a connection does not travel, nor what was read through it
        return {**self.__dict__, "_keeper": None, "_keeper_lock": None,
                "pins": collections.OrderedDict()}  # fmt: skip

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state, _keeper_lock=threading.Lock())

    @contextlib.contextmanager
    def connect(self) -> Iterator[Connection]:
        """A transaction: committed when the block ends, rolled back on an error."""
        if not self.postgres:
            raw = sqlite3.connect(self.where, timeout=30)
            try:
                raw.execute("PRAGMA journal_mode=WAL")
                with raw:
                    yield Connection(raw, False)
            finally:
                raw.close()
            return
        import psycopg2

        try:
            raw = psycopg2.connect(self.where, connect_timeout=30)
        except psycopg2.OperationalError as err:
            # libpq's message names the host and the role, never the password
            reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise CatalogDatabaseError(f"catalog database {self.shown}: {reason}") from None
        try:
            with raw:  # psycopg2: commit or roll back (the connection stays open)
                yield Connection(raw, True)
        finally:
            raw.close()

    def ddl(self, statement: str) -> str:
        if not self.postgres:
            return statement
        return statement.replace(" INTEGER", " BIGINT").replace(" BLOB", " BYTEA")

    def version(self, db: Connection) -> int:
        try:
            row = db.execute("SELECT MAX(version) FROM schema_version").fetchone()
        except (sqlite3.OperationalError, _pg_errors()):
            return -1  # no schema_version table yet
        return row[0] or 0

    def migrate(self) -> int:
        """Bring the schema to LATEST; returns the version it was at (0: a new catalog)."""
        with self.connect() as db:
            found = self.version(db)
        if found == LATEST:
            self._keep_open()
            return found
        if found > LATEST:
            raise CatalogDatabaseError(
                f"catalog {self.shown} has schema version {found}, newer than this "
                f"quantloop's {LATEST}: upgrade quantloop to use it"
            )
        with self.connect() as db:
            db.lock("quantloop catalog schema")
            db.execute(_VERSION_TABLE)
            found = self.version(db)  # another process may have migrated meanwhile
            now = dt.datetime.now(dt.UTC).isoformat(timespec="seconds")
            for version, statements in MIGRATIONS:
                if version <= found:
                    continue
                for statement in statements:
                    db.execute(self.ddl(statement))
                db.execute("INSERT INTO schema_version VALUES (?, ?)", (version, now))
        self._keep_open()
        return found


def _pg_errors() -> type[Exception]:
    try:
        import psycopg2
    except ImportError:  # pragma: no cover - a dependency, but SQLite needs none of it
        return sqlite3.OperationalError
    return psycopg2.errors.UndefinedTable
