"""What code produced a result: the git commit when there is one, and a source digest."""

from __future__ import annotations

import hashlib
import subprocess
from functools import lru_cache
from pathlib import Path

PACKAGES = ("quantloop", "flows", "tasks", "blocks", "models", "profiling")
_ROOT = Path(__file__).resolve().parents[1]


@lru_cache(maxsize=1)
def code_digest() -> str:
    """sha256 over the project's Python sources, in path order (stable across machines)."""
    h = hashlib.sha256()
    for pkg in PACKAGES:
        for path in sorted((_ROOT / pkg).rglob("*.py")):
            h.update(path.relative_to(_ROOT).as_posix().encode())
            h.update(path.read_bytes())
    return h.hexdigest()


@lru_cache(maxsize=1)
def git_commit() -> str:
    """The checkout's commit (with "+dirty" if it has changes), or "" outside git."""
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=_ROOT, capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=_ROOT,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return ""
    return commit + ("+dirty" if dirty else "")
