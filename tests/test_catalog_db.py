"""The catalog's database: versioned migrations, and the same catalog on SQLite and on
PostgreSQL (the session's real server, tests/servers.py)."""

from __future__ import annotations

import dataclasses
import datetime as dt
import sqlite3

import pytest

from quantloop.tasks.data import catalog_db
from quantloop.tasks.data.catalog import Catalog, OutputCopy
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
    # A pin made before version 2 is a file beside the catalog: still read.
    pin = landed.pin("d", [entry])
    with sqlite3.connect(landed.path) as new:
        [(data,)] = new.execute("SELECT data FROM pins WHERE pin = ?", (pin,)).fetchall()
    (tmp_path / "catalog.sqlite.pins").mkdir()
    (tmp_path / "catalog.sqlite.pins" / f"{pin}.arrows").write_bytes(data)
    assert catalog.pinned(pin).equals(landed.pinned(pin))
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


def test_a_sqlite_catalog_does_not_checkpoint_its_wal_on_every_call(tmp_path):
    """A write's connection closing is not the file's last: SQLite checkpoints and
    deletes the WAL when its last connection closes, which with a connection per call
    made every write 2.5x slower (0.8 -> 2.2 ms a write here)."""
    catalog = Catalog(tmp_path / "catalog.sqlite")
    root = str(tmp_path / "store")
    for day in DAYS[:2]:
        catalog.land("d", Partition("AAA", day), random_book(30), root=root)
        assert (tmp_path / "catalog.sqlite-wal").exists()


# ------------------------------------------------------------------ PostgreSQL

DAYS = [dt.date(2026, 1, 5) + dt.timedelta(days=i) for i in range(4)]


def exercise(catalog: Catalog, root: str) -> dict:
    """Every call the flows make of a catalog, on a fixed sequence of landings; what each
    returned (locations under `root`, so two catalogs given one root compare equal)."""
    out: dict = {}
    parts = [(Partition(p, d), random_book(60, seed=i)) for i, (p, d) in
             enumerate((p, d) for p in ("AAA", "BBB") for d in DAYS)]  # fmt: skip
    out["land"] = [catalog.land("d", p, t, root=root).status for p, t in parts]
    out["again"] = [catalog.land("d", p, t, root=root).status for p, t in parts[:2]]
    changed = catalog.land("d", parts[0][0], random_book(60, seed=99), root=root)
    out["changed"] = (changed.status, changed.previous_digest)
    out["packed"] = catalog.land_packed("p", iter(parts), root=root)
    out["packed_again"] = catalog.land_packed("p", iter(parts), root=root)
    entries = catalog.entries("d")
    out["entries"] = [e._replace(partition=(e.partition.product, e.partition.date))
                      for e in entries]  # fmt: skip
    out["table"] = catalog.table("d").to_pylist()
    out["table_p"] = catalog.table("p").to_pylist()
    pin = catalog.pin("d", entries[:3])
    out["pinned"] = catalog.pinned(pin).to_pylist()
    copy = dataclasses.replace(entries[1].blob, url="s3://b/x")
    catalog.add_copy("d", entries[1].partition, copy, "s3")
    out["copies"] = catalog.copies("d").to_pylist()
    out["with_digest"] = [e.location for e in catalog.with_digest(out["changed"][1])]
    blobs = catalog.blobs([e.digest for e in entries] + [out["changed"][1]])
    out["blobs"] = {k: dataclasses.astuple(v) for k, v in blobs.items()}
    out["datasets"] = sorted(catalog.datasets())
    # stage outputs at sites: a model trained at B, copied to A for a reader there
    made = OutputCopy("B", "s3://b/models/k.pt", "d" * 64, 10, "B")
    catalog.record_output("model", "k", made)
    catalog.record_output("model", "k", made._replace(site="A", url=f"{root}/models/k.pt"))
    catalog.record_output("model", "k", made)  # again: still one row per copy
    out["outputs"] = [tuple(c) for c in catalog.output_copies("model", "k")]
    catalog.drop_output("model", "k", made.url)
    out["outputs_left"] = [(kind, key, tuple(c)) for kind, key, c in catalog.outputs()]
    catalog.note_sites([("A", root), ("B", "s3://b"), ("A", root)])
    out["site_roots"] = catalog.site_roots()
    return out


@pytest.mark.slow
def test_the_catalog_on_postgresql_answers_as_on_sqlite(postgres_db, tmp_path):
    """The same landings, pins and copies on a SQLite file and on a PostgreSQL database
    (one store root): every call returns the same, and PostgreSQL's schema is version
    LATEST."""
    import psycopg2

    root = str(tmp_path / "store")
    on_sqlite = exercise(Catalog(tmp_path / "catalog.sqlite"), root)
    on_postgres = exercise(Catalog(postgres_db), root)
    for key in on_sqlite:
        assert on_postgres[key] == on_sqlite[key], key
    assert on_sqlite["land"] == ["new"] * 8 and on_sqlite["changed"][0] == "changed"
    assert on_sqlite["packed_again"] == {"new": 0, "unchanged": 8, "changed": 0}
    # the copy at the site that computed it first, then the others
    assert [(c[0], c[4]) for c in on_sqlite["outputs"]] == [("B", "B"), ("A", "B")]
    assert [c[2][0] for c in on_sqlite["outputs_left"]] == ["A"]
    assert on_sqlite["site_roots"] == [("A", root), ("B", "s3://b")]
    with psycopg2.connect(postgres_db) as conn, conn.cursor() as cur:
        cur.execute("SELECT version FROM schema_version ORDER BY 1")
        assert [r[0] for r in cur.fetchall()] == [v for v, _ in catalog_db.MIGRATIONS]
        cur.execute("SELECT data_type FROM information_schema.columns"
                    " WHERE table_name = 'partitions' AND column_name = 'offset'")  # fmt: skip
        assert cur.fetchone()[0] == "bigint"
    # A catalog on PostgreSQL keeps nothing on this host's disk (no pins, no snapshots):
    # what is here besides the store is the SQLite catalog's.
    assert {p.name for p in tmp_path.iterdir() if not p.name.startswith("catalog.sqlite")} == {
        "store"
    }


def _land_as_a_host(url: str, folder: str, host: int, start: float) -> dict:
    """One host's flow: land the shared days into its own store folder (the same content
    as the other host's), pin them, record a copy of each at its own site."""
    import time

    from quantloop.tasks.data.landing import land_synthetic
    from quantloop.tasks.data.synthetic import SyntheticConfig

    root = f"{folder}/host{host}/store"
    time.sleep(max(0.0, start - time.time()))  # both start together
    catalog = Catalog(url)  # both bring a new database's schema up at once: once
    statuses, pins = [], []
    for round_ in range(3):  # the same days again: the other host may be landing them now
        landed = land_synthetic(catalog, root, ["SHARED", f"OWN{host}"], DAYS,
                                SyntheticConfig(events_per_day=200, levels=1, seed=0))  # fmt: skip
        statuses += [(x.entry.partition.product, str(x.entry.partition.date), x.status,
                      x.entry.digest, f"host{host}-{round_}") for x in landed]  # fmt: skip
        pins.append(catalog.pin("synthetic", [x.entry for x in landed]))
        for x in landed:
            catalog.add_copy("synthetic", x.entry.partition,
                             dataclasses.replace(x.entry.blob, url=f"{root}/copy/{x.entry.digest}"),
                             f"host{host}-{round_}")  # fmt: skip
    return {"statuses": statuses, "pins": pins}


@pytest.mark.slow
def test_two_hosts_landing_the_same_days_at_once_on_one_postgresql_catalog(postgres_db, tmp_path):
    """Two processes open a new PostgreSQL catalog at once (its schema made once), and,
    with store folders of their own (as two hosts would have; one
    machine here, so each can read the other's files when it checks a version is intact)
    land the same days at once, three times over, into one PostgreSQL catalog: one version
    per day, each day 'new' for exactly one of them, every write counted in the dataset's
    version, every pin and every copy found afterwards."""
    import multiprocessing
    import time

    import psycopg2

    context = multiprocessing.get_context("spawn")
    start = time.time() + 8  # past both processes' imports
    with context.Pool(2) as pool:
        hosts = [(postgres_db, str(tmp_path), host, start) for host in (1, 2)]
        done = pool.starmap(_land_as_a_host, hosts)
    catalog = Catalog(postgres_db)
    entries = catalog.entries("synthetic")
    assert len(entries) == 3 * len(DAYS)  # SHARED, OWN1, OWN2
    statuses = [s for d in done for s in d["statuses"]]
    shared = [s for s in statuses if s[0] == "SHARED"]
    for day in DAYS:
        of_day = sorted(s[2] for s in shared if s[1] == str(day))
        assert of_day == ["new"] + ["unchanged"] * 5, (day, of_day)  # 2 hosts x 3 rounds
    assert {s[2] for s in statuses if s[0] != "SHARED"} <= {"new", "unchanged"}
    with psycopg2.connect(postgres_db) as conn, conn.cursor() as cur:
        cur.execute("SELECT product, date, COUNT(*) FROM history GROUP BY 1, 2")
        assert {r[2] for r in cur.fetchall()} == {1}  # one version per day
        cur.execute("SELECT version FROM versions WHERE dataset = 'synthetic'")
        writes = sum(1 for s in statuses if s[2] != "unchanged")
        assert cur.fetchone()[0] == writes == 3 * len(DAYS)  # no write lost or doubled
        cur.execute("SELECT digest, site FROM replicas")
        assert set(cur.fetchall()) == {(s[3], s[4]) for s in statuses}  # every copy
    pins = {p for d in done for p in d["pins"]}
    for pin in pins:  # each host's pins, read through a new connection
        assert catalog.pinned(pin).num_rows == 2 * len(DAYS)
    assert len({s[3] for s in shared}) == len(DAYS)  # both hosts landed the same content


def test_a_database_url_is_secret_and_its_errors_never_show_the_password(tmp_path):
    """DataCatalog.database_url is a SecretStr: its repr, JSON and a failed connection's
    error hold no password; a URL of another scheme is refused naming the scheme only."""
    from pydantic import ValidationError

    from quantloop.blocks.catalog import DataCatalog
    from quantloop.tasks.runtime.workspace import Workspace
    from tests.servers import free_port

    url = f"postgresql://desk:pa%40ss-w0rd@127.0.0.1:{free_port()}/quant"  # nothing listens
    block = DataCatalog(database_url=url)
    for shown in (repr(block), str(block), block.model_dump_json()):
        assert "pa%40ss-w0rd" not in shown and "pa@ss-w0rd" not in shown
    assert block.where() == url
    with pytest.raises(catalog_db.CatalogDatabaseError) as err:
        Workspace(home=str(tmp_path), data_catalog=block).catalog()
    message = str(err.value)
    assert message.startswith(f"catalog database postgresql://desk@{url.split('@')[1]}: ")
    assert "pa%40ss" not in message and "pa@ss" not in message
    assert "\n" not in message
    with pytest.raises(ValidationError, match="database_url: a postgresql://") as bad:
        DataCatalog(database_url="mysql://desk:hunter2@db/quant")
    assert "hunter2" not in str(bad.value)
    assert DataCatalog(database_url="").where() == DataCatalog().resolved_path()


@pytest.mark.slow
def test_a_workspace_whose_catalog_block_names_a_database_uses_it(postgres, postgres_db, tmp_path):
    """The Workspace opens the block's PostgreSQL database (and the home's SQLite file
    without one); what it shows of the catalog (`path`, recorded as the run's catalog tag)
    is the URL without its password, which opens it again (trust auth here: that libpq
    then takes the password from PGPASSWORD or ~/.pgpass is not checked)."""
    from quantloop.blocks.catalog import DataCatalog
    from quantloop.tasks.runtime.workspace import Workspace

    name = postgres_db.rsplit("/", 1)[1]
    postgres.sql("CREATE ROLE desk LOGIN PASSWORD 'pa@ss'")
    postgres.sql(f'GRANT ALL ON DATABASE "{name}" TO desk; ALTER DATABASE "{name}" OWNER TO desk')
    url = postgres.url(name, user="desk", password="pa@ss")
    ws = Workspace(home=str(tmp_path / "h"), data_catalog=DataCatalog(database_url=url))
    catalog = ws.catalog()
    assert catalog.on_postgres and catalog.path == url.replace(":pa%40ss", "")
    catalog.land("d", Partition("AAA", DAYS[0]), random_book(40), root=str(tmp_path / "s"))
    assert [e.partition.product for e in Catalog(postgres_db).entries("d")] == ["AAA"]
    assert [e.partition.product for e in Catalog(catalog.path).entries("d")] == ["AAA"]
    assert not (tmp_path / "h").exists()  # no SQLite file made beside the home
    assert Workspace(home=str(tmp_path / "h")).catalog().path == tmp_path / "h" / "catalog.sqlite"
