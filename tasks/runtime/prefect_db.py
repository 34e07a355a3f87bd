"""A Prefect server's first start on a new SQLite database, without its migrations.

A server started on a database that does not exist yet migrates it from nothing: 9.3 s
to its first answer on this 2-core VM, against 3.6-4.2 s on a database already at head.
Every new home pays that (the resident local API, `quantloop serve`), and so does every
test that starts a server of its own. So the empty database, migrated once per Prefect
version (`prefect server database upgrade`, 7.8 s), is kept in the user's cache, and a
server's new database starts as a copy of it. The server still runs its migrations on
start: on a copy at head they find nothing to do; a copy of another version is never
made (the file is named by the version).
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
import subprocess
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path

from quantloop.tasks.runtime.db_templates import cache_dir, copy_new, made_once

URL_PREFIX = "sqlite+aiosqlite:///"
BUILD_TIMEOUT_S = 600  # migrations from nothing, on a machine as busy as it gets


def template_path() -> Path:
    from prefect import __version__

    return cache_dir() / f"prefect-{__version__}-empty.db"


def _database(env: Mapping[str, str]) -> Path | None:
    url = env.get("PREFECT_API_DATABASE_CONNECTION_URL", "")
    if not url.startswith(URL_PREFIX):
        return None  # PostgreSQL, or Prefect's default under PREFECT_HOME: left alone
    return Path(url[len(URL_PREFIX) :])


def template() -> Path | None:
    """The migrated empty database of this Prefect version, made if missing (one process
    at a time, the others waiting for it); None when it cannot be made."""
    return made_once(template_path(), _build)


def _build(path: Path) -> None:
    with tempfile.TemporaryDirectory(prefix="quantloop-prefect-db-") as tmp:
        db = Path(tmp) / "prefect.db"
        env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
        env.update(PREFECT_HOME=tmp, PREFECT_API_DATABASE_CONNECTION_URL=URL_PREFIX + str(db),
                   PREFECT_SERVER_ANALYTICS_ENABLED="false")  # fmt: skip
        subprocess.run(
            [sys.executable, "-m", "prefect", "server", "database", "upgrade", "-y"],
            env=env, cwd=tmp, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE, timeout=BUILD_TIMEOUT_S, check=True,
        )  # fmt: skip
        # One self-contained file (no -wal beside it), written whole before it is named.
        whole = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        with contextlib.closing(sqlite3.connect(db)) as conn:
            conn.execute("VACUUM INTO ?", (str(whole),))
        os.replace(whole, path)


def seed(env: Mapping[str, str]) -> bool:
    """Before a server starts with `env`: if its database is a SQLite file that does not
    exist yet, make it a copy of the template. Returns whether it did."""
    db = _database(env)
    if db is None or db.exists():
        return False
    source = template()
    if source is None:
        return False
    copy_new(source, db)
    return True
