"""A new MLflow SQLite store, without its migrations.

MLflow creates a store's tables by running its migration scripts from nothing (68 of
them in 3.17) the first time a process opens a new SQLite file: 0.7 CPU-s of an embedded
run on a new home on this 2-core VM (the tracking and registry stores opened in-process),
and 1.3-2.5 CPU-s of a new `mlflow server`'s start (6.1-7.3 against 4.8-4.9 CPU-s to its
first answer). Every new workspace pays it, and so does every test with a home of its
own. So the empty store, migrated once per MLflow version, is kept in the user's cache
(as Prefect's: tasks/runtime/prefect_db.py; the mechanism, tasks/runtime/db_templates.py), and
a new store starts as a copy of it.

The template holds no experiment: the store makes its Default experiment (id 0) on its
first open, with the artifact location of whoever opens it (a folder beside the store,
or a server's proxied `mlflow-artifacts:/`), as on a store made from nothing. MLflow
still checks the schema on every open: a copy made by another version would be refused
there, and none is made (the file is named by the version).
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
import tempfile
from pathlib import Path

from quantloop.tasks.runtime.db_templates import cache_dir, copy_new, made_once

URL_PREFIX = "sqlite:///"


def template_path() -> Path:
    from mlflow import __version__

    return cache_dir() / f"mlflow-{__version__}-empty.db"


def store_path(uri: str) -> Path | None:
    """The file of a SQLite store URI; None for a server, another database, or a URI with
    options (`?...`: left to MLflow as it is)."""
    if not uri.startswith(URL_PREFIX) or "?" in uri:
        return None
    return Path(uri[len(URL_PREFIX) :])


def template() -> Path | None:
    """The migrated empty store of this MLflow version, made if missing (one process at a
    time, the others waiting for it); None when it cannot be made."""
    return made_once(template_path(), _build)


def _build(path: Path) -> None:
    from mlflow.store.model_registry.sqlalchemy_store import SqlAlchemyStore as RegistryStore
    from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore

    with tempfile.TemporaryDirectory(prefix="quantloop-mlflow-db-") as tmp:
        db = Path(tmp) / "mlflow.db"
        uri = URL_PREFIX + str(db)
        # both stores' tables (one set of migrations), as a first run opens them
        for store in (SqlAlchemyStore(uri, str(Path(tmp) / "artifacts")), RegistryStore(uri)):
            store.engine.dispose()
        # One self-contained file (no -wal beside it), without the Default experiment that
        # the first open made with this folder's artifact location, written whole before
        # it is named.
        whole = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        with contextlib.closing(sqlite3.connect(db)) as conn:
            with conn:
                conn.execute("DELETE FROM experiments")
            conn.execute("VACUUM INTO ?", (str(whole),))
        os.replace(whole, path)


def seed(uri: str, mode: int = 0o644) -> bool:
    """Before a store is first opened: if `uri` is a SQLite file that does not exist yet,
    make it a copy of the template (`mode` less the umask; 0644, as SQLite makes a file).
    Returns whether it did; a file made meanwhile by another process is left."""
    db = store_path(uri)
    if db is None or db.exists():
        return False
    source = template()
    if source is None:
        return False
    copy_new(source, db, mode)
    return True
