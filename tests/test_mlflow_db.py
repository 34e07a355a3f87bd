"""A new MLflow SQLite store made as a copy of a migrated empty one
(tasks/records/mlflow_db.py): the copy is at MLflow's head and holds no experiment, a
client in this process and a real `mlflow server` each make their own Default experiment
on it and record runs, and nothing but a missing SQLite file is ever touched."""

from __future__ import annotations

import contextlib
import os
import sqlite3
import stat
import tempfile
from pathlib import Path

import pytest

from quantloop.tasks.records import mlflow_db
from tests import servers
from tests.forking import in_forked_child


def rows(db: Path, sql: str) -> list[tuple]:
    with contextlib.closing(sqlite3.connect(db)) as conn:
        return conn.execute(sql).fetchall()


def test_a_new_store_is_a_migrated_copy_that_a_client_records_in(tmp_path):
    from mlflow import MlflowClient
    from mlflow.store.db.utils import _get_latest_schema_revision

    template = mlflow_db.template()
    assert template is not None and template.name.startswith("mlflow-")
    assert rows(template, "SELECT version_num FROM alembic_version") == [
        (_get_latest_schema_revision(),)
    ]
    assert rows(template, "SELECT count(*) FROM experiments") == [(0,)]

    db = tmp_path / "home" / "mlflow.db"
    uri = f"sqlite:///{db}"
    assert mlflow_db.seed(uri) is True
    assert db.read_bytes() == template.read_bytes()
    assert stat.S_IMODE(db.stat().st_mode) == 0o644 & ~_umask()
    assert [p.name for p in db.parent.iterdir()] == ["mlflow.db"]  # no partial copy left

    client = MlflowClient(tracking_uri=uri)
    # made by this store's first open, not copied: as on a store migrated from nothing
    scratch = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'scratch' / 'mlflow.db'}")
    assert client.get_experiment("0").name == "Default"
    assert client.get_experiment("0").artifact_location == (
        scratch.get_experiment("0").artifact_location
    )
    run = client.create_run("0")
    client.log_metric(run.info.run_id, "m", 1.5)
    assert client.get_run(run.info.run_id).data.metrics == {"m": 1.5}
    client.search_registered_models()  # the registry's tables are there too
    assert rows(template, "SELECT count(*) FROM runs") == [(0,)]  # the copy alone written


def test_only_a_missing_sqlite_store_is_made(tmp_path):
    existing = tmp_path / "existing.db"
    existing.write_bytes(b"someone's store")
    assert mlflow_db.seed(f"sqlite:///{existing}") is False
    assert existing.read_bytes() == b"someone's store"
    assert mlflow_db.seed("http://127.0.0.1:5000") is False
    assert mlflow_db.seed("postgresql://u:p@db/mlflow") is False
    assert mlflow_db.seed(f"sqlite:///{tmp_path / 'options.db'}?timeout=10") is False
    assert sorted(p.name for p in tmp_path.iterdir()) == ["existing.db"]

    private = tmp_path / "serve" / "mlflow.db"
    assert mlflow_db.seed(f"sqlite:///{private}", mode=0o600) is True  # quantloop serve's
    assert stat.S_IMODE(private.stat().st_mode) == 0o600


@pytest.mark.slow
@pytest.mark.server
def test_a_server_starts_on_a_seeded_store_and_records(tmp_path):
    from mlflow import MlflowClient

    with servers.mlflow_server(tmp_path) as uri:  # seeds tmp_path/mlflow.db first
        client = MlflowClient(tracking_uri=uri)
        # the server's own Default experiment: its proxied artifact root, not a path
        assert client.get_experiment("0").artifact_location == "mlflow-artifacts:/0"
        experiment = client.create_experiment("seeded")
        run = client.create_run(experiment)
        client.log_text(run.info.run_id, "hello", "note.txt")
        assert client.download_artifacts(run.info.run_id, "note.txt", str(tmp_path))
    assert rows(tmp_path / "mlflow.db", "SELECT name FROM experiments ORDER BY 1") == [
        ("Default",),
        ("seeded",),
    ]


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_the_warm_process_makes_a_runs_first_calls_and_leaves_nothing_open(tmp_path, monkeypatch):
    """tracking.warm_client (a warm process's warm-up): a run's first MLflow calls on a
    scratch store, which leaves no engine, folder, thread, timeline entry or setting
    behind; a child forked after it opens its own store and records a run there."""
    import threading

    from mlflow.store.model_registry.sqlalchemy_store import SqlAlchemyStore as Registry
    from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore

    from quantloop.blocks import MlflowTracking
    from quantloop.tasks.records import tracking
    from quantloop.tasks.runtime import timeline

    engines = set(SqlAlchemyStore._engine_map) | set(Registry._engine_map)
    threads = {t.ident for t in threading.enumerate()}
    telemetry = os.environ.get("MLFLOW_DISABLE_TELEMETRY")
    calls = dict(timeline.TIMELINE.totals)
    scratch = tmp_path / "tmp"  # its own, not /tmp, where other tests' warm processes warm
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    tracking.warm_client()
    assert set(SqlAlchemyStore._engine_map) | set(Registry._engine_map) == engines
    assert {t.ident for t in threading.enumerate()} <= threads
    assert os.environ.get("MLFLOW_DISABLE_TELEMETRY") == telemetry
    assert dict(timeline.TIMELINE.totals) == calls
    assert list(scratch.iterdir()) == []  # its folder removed

    block = MlflowTracking(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")

    def child_records() -> bool:
        client, experiment = tracking._client_for(block, block.tracking_uri)
        with tracking.run(client, experiment, "child") as run:
            run.metrics({"m": 2.0})
        return client.get_run(run.run_id).data.metrics == {"m": 2.0}

    assert in_forked_child(child_records)
