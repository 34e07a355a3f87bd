"""What code produced a result: the git commit when there is one, and a source digest."""

from __future__ import annotations

import hashlib
import importlib
import os
import subprocess
from functools import lru_cache
from pathlib import Path

# quantloop's packages. Each is found where Python imports it from (a checkout's
# top-level folder in an editable install, site-packages/quantloop/... from a wheel),
# and named by its import path, so both give the same digest and nothing beside
# quantloop (another project's `models/`, say) ever enters it.
PACKAGES = (
    "quantloop",
    "quantloop.flows",
    "quantloop.tasks",
    "quantloop.blocks",
    "quantloop.models",
    "quantloop.profiling",
)


def package_files(name: str) -> list[tuple[str, Path]]:
    """(import-path-like name, file) of a package's own Python sources, sorted; the
    subpackages listed in PACKAGES are left to their own entry."""
    folder = Path(importlib.import_module(name).__file__).parent
    prefix = name.replace(".", "/")
    nested = {p.rsplit(".", 1)[1] for p in PACKAGES if p.startswith(name + ".")}
    out = []
    for path in folder.rglob("*.py"):
        rel = path.relative_to(folder)
        if rel.parts[0] in nested or "__pycache__" in rel.parts:
            continue
        out.append((f"{prefix}/{rel.as_posix()}", path))
    return sorted(out)


@lru_cache(maxsize=1)
def code_digest() -> str:
    """sha256 over quantloop's Python sources, by import path (stable across machines
    and across editable and wheel installs)."""
    h = hashlib.sha256()
    for pkg in PACKAGES:
        for name, path in package_files(pkg):
            h.update(name.encode())
            h.update(path.read_bytes())
    return h.hexdigest()


@lru_cache(maxsize=1)
def git_commit(short: bool = False) -> str:
    """The checkout's commit (with "+dirty" if it has changes), or "" outside git
    (a wheel install); QUANTLOOP_GIT_COMMIT names it where there is no git (the GPU
    machine runs a wheel built from a commit)."""
    if named := os.environ.get("QUANTLOOP_GIT_COMMIT"):
        return named
    root = Path(importlib.import_module("quantloop.flows").__file__).parents[1]
    if not (root / "pyproject.toml").is_file():
        return ""  # installed from a wheel: site-packages, whatever repository holds it
    try:
        commit = subprocess.run(
            ["git", "rev-parse", *(["--short"] if short else []), "HEAD"],
            cwd=root, capture_output=True, text=True, check=True,
        ).stdout.strip()  # fmt: skip
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=root, capture_output=True, text=True, check=True,
        ).stdout.strip()  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        return ""
    return commit + ("+dirty" if dirty else "")
