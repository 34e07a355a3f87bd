"""The catalog's database: versioned migrations, and the same catalog on SQLite and on
PostgreSQL (the session's real server, tests/servers.py)."""

from __future__ import annotations

import datetime as dt
import sqlite3

import pytest

from quantloop.tasks.data import catalog_db
from quantloop.tasks.data.catalog import Catalog
from quantloop.tasks.data.schema import Partition
from tests.books import random_book

# The catalog's schema as tasks/data/catalog.py created it before migrations were
# versioned (its text at 72d8cc4): an existing workspace's catalog.sqlite holds this.
OLD_SCHEMA = """
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
-- Every version ever landed (partitions keeps the current one): a run pinned to an
-- older version, a lineage or a reproduction still finds where its bytes are.
CREATE TABLE IF NOT EXISTS history (
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
    PRIMARY KEY (dataset, product, date, digest)
);
CREATE INDEX IF NOT EXISTS history_digest ON history (digest);
-- Copies of a version at other sites (replicate): the same digest, another location.
-- The site a version landed at is its history row's; a placement reads both.
CREATE TABLE IF NOT EXISTS replicas (
    dataset TEXT NOT NULL,
    product TEXT NOT NULL,
    date TEXT NOT NULL,
    digest TEXT NOT NULL,
    site TEXT NOT NULL,
    location TEXT NOT NULL,
    offset INTEGER NOT NULL,
    length INTEGER NOT NULL,
    copied_at TEXT NOT NULL,
    PRIMARY KEY (digest, site)
);
"""


def tables(path) -> dict[str, str]:
    with sqlite3.connect(path) as db:
        return dict(db.execute("SELECT name, sql FROM sqlite_master WHERE name != 'schema_version'"
                               " AND name NOT LIKE 'sqlite_%'"))  # fmt: skip


def test_a_catalog_made_before_migrations_opens_as_version_1_unchanged(tmp_path):
    """A catalog.sqlite of the code before is version 1: it opens with its tables and rows
    as they were (only schema_version, and later migrations' tables, are added), and
    reads and lands as before."""
    path = tmp_path / "catalog.sqlite"
    with sqlite3.connect(path) as db:
        db.executescript(OLD_SCHEMA)
    before = tables(path)
    landed = Catalog(tmp_path / "made-now.sqlite")  # a row landed by the new code...
    entry = landed.land("d", Partition("AAA", dt.date(2026, 1, 5)), random_book(50),
                        root=str(tmp_path / "store")).entry  # fmt: skip
    with sqlite3.connect(path) as db, sqlite3.connect(landed.path) as new:
        row = new.execute("SELECT * FROM partitions").fetchone()
        db.execute("INSERT INTO partitions VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?)", row)
        db.execute("INSERT INTO history VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?)", row)
    catalog = Catalog(path)  # ...found by the catalog made before
    after = tables(path)
    assert {k: after[k] for k in before} == before
    with sqlite3.connect(path) as db:
        versions = [r[0] for r in db.execute("SELECT version FROM schema_version ORDER BY 1")]
    assert versions == [v for v, _ in catalog_db.MIGRATIONS]
    assert catalog.entries("d") == [entry]
    assert catalog.land("d", entry.partition, random_book(50), root=str(tmp_path / "store")
                        ).status == "unchanged"  # fmt: skip
    Catalog(path)  # opening again applies nothing
    with sqlite3.connect(path) as db:
        assert db.execute("SELECT COUNT(*) FROM schema_version").fetchone()[0] == len(versions)


def test_a_catalog_of_a_newer_schema_is_refused_naming_both_versions(tmp_path):
    path = tmp_path / "catalog.sqlite"
    Catalog(path)
    with sqlite3.connect(path) as db:
        db.execute("INSERT INTO schema_version VALUES (?, '2099-01-01')",
                   (catalog_db.LATEST + 1,))  # fmt: skip
    with pytest.raises(catalog_db.CatalogDatabaseError,
                       match=rf"schema version {catalog_db.LATEST + 1}, newer than this "
                             rf"quantloop's {catalog_db.LATEST}"):  # fmt: skip
        Catalog(path)
