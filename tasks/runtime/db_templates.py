"""New SQLite databases as copies of migrated empty ones: the mechanism Prefect's
(tasks/runtime/prefect_db.py) and MLflow's (tasks/records/mlflow_db.py) share.

A template is made once per machine and version, in the user's cache, by one process at
a time (the others wait for it); a new database is a copy of it, made whole under a
temporary name and linked into place, so it never lands over one another process made.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import sqlite3
import subprocess
from collections.abc import Callable
from pathlib import Path


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "quantloop"


def made_once(path: Path, build: Callable[[Path], None]) -> Path | None:
    """The template at `path`, made by `build(path)` if missing (under a lock beside it,
    looked for again once held); None when it cannot be made (the caller's database then
    migrates from nothing, as without a template)."""
    if path.exists():
        return path
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path.parent / f".{path.name}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not path.exists():
                build(path)
    except (OSError, subprocess.SubprocessError, sqlite3.Error):
        return None
    return path


def copy_new(source: Path, db: Path, mode: int = 0o644) -> None:
    """`db` as a copy of `source` (`mode` less the umask: 0644, as SQLite makes a file),
    unless a file is there by the time the copy is whole."""
    db.parent.mkdir(parents=True, exist_ok=True)
    partial = db.with_name(f".{db.name}.{os.getpid()}.tmp")
    made = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with open(source, "rb") as src, open(made, "wb") as dst:
        shutil.copyfileobj(src, dst)
    try:
        os.link(partial, db)  # never over a database another process made meanwhile
    except FileExistsError:
        pass
    except OSError:  # a filesystem without hard links
        if not db.exists():
            os.replace(partial, db)
    finally:
        partial.unlink(missing_ok=True)
