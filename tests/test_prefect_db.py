"""A Prefect server's new SQLite database made as a copy of a migrated empty one
(tasks/runtime/prefect_db.py): the copy is at Prefect's head, a real server starts on it
and records a flow run, and nothing but a missing SQLite file is ever touched."""

from __future__ import annotations

import contextlib
import sqlite3
from pathlib import Path

import pytest

from quantloop.tasks.runtime import prefect_db
from tests import servers


def alembic_version(db: Path) -> str:
    with contextlib.closing(sqlite3.connect(db)) as conn:
        [(version,)] = conn.execute("SELECT version_num FROM alembic_version").fetchall()
    return version


def env_for(db: Path) -> dict[str, str]:
    return {"PREFECT_API_DATABASE_CONNECTION_URL": prefect_db.URL_PREFIX + str(db)}


@pytest.mark.slow
@pytest.mark.server
def test_a_new_database_is_a_migrated_copy_that_a_server_runs_on(tmp_path):
    template = prefect_db.template()
    assert template is not None and template == prefect_db.template_path()
    assert prefect_db.template_path().name.startswith("prefect-")
    head = alembic_version(template)

    # Seeded before any server runs: a byte-for-byte copy of the template (after a start
    # the version alone could not tell a copy from a database migrated from nothing).
    db = tmp_path / "server" / "prefect.db"
    assert prefect_db.seed(env_for(db)) is True
    assert db.read_bytes() == template.read_bytes()
    with servers.prefect_server(tmp_path / "server") as api:  # starts on that copy
        assert alembic_version(db) == head  # the server's migrations found nothing to do
        from prefect.client.orchestration import get_client
        from prefect.settings import PREFECT_API_URL, temporary_settings

        with temporary_settings({PREFECT_API_URL: api}), get_client(sync_client=True) as client:
            flow_id = client.create_flow_from_name("seeded")
            assert client.read_flow(flow_id).name == "seeded"
    # the template is as it was: the server wrote into its copy only
    with contextlib.closing(sqlite3.connect(template)) as conn:
        assert conn.execute("SELECT count(*) FROM flow").fetchone() == (0,)


def test_only_a_missing_sqlite_database_is_made(tmp_path):
    existing = tmp_path / "existing.db"
    existing.write_bytes(b"someone's database")
    assert prefect_db.seed(env_for(existing)) is False
    assert existing.read_bytes() == b"someone's database"
    pg = {"PREFECT_API_DATABASE_CONNECTION_URL": "postgresql+asyncpg://u:p@db/prefect"}
    assert prefect_db.seed(pg) is False
    assert prefect_db.seed({}) is False  # Prefect's own default under PREFECT_HOME

    new = tmp_path / "home" / "prefect.db"
    assert prefect_db.seed(env_for(new)) is True
    assert alembic_version(new) == alembic_version(prefect_db.template_path())
    assert [p.name for p in new.parent.iterdir()] == ["prefect.db"]  # no partial copy left
