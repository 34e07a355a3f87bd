"""What every benchmark records and prints: the machine, the date and the commit a result
was measured on, a Markdown table, and the JSON + Markdown pair under bench/results/."""

from __future__ import annotations

import datetime as dt
import json
import os
import platform
import subprocess
from collections.abc import Iterable, Sequence
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def machine() -> str:
    """ "host x86_64, 2 CPUs, 24 GiB, Python 3.11.7" (and the GPU where there is one)."""
    try:
        import psutil

        memory = f", {psutil.virtual_memory().total / 2**30:.0f} GiB"
    except ImportError:
        memory = ""
    gpu = ""
    try:
        names = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.split("\n")
        if names and names[0].strip():
            gpu = f", {len([n for n in names if n.strip()])} x {names[0].strip()}"
    except (OSError, subprocess.SubprocessError):
        pass
    return (
        f"{platform.node()} {platform.machine()}, {os.cpu_count()} CPUs{memory}{gpu}, "
        f"Python {platform.python_version()}"
    )


def commit() -> str:
    """The checkout's short commit, "+dirty" when it has changes (QUANTLOOP_GIT_COMMIT
    where there is no git: the GPU machine runs a wheel built from a commit)."""
    if named := os.environ.get("QUANTLOOP_GIT_COMMIT"):
        return named
    root = Path(__file__).resolve().parents[1]
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=root,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=root,
            capture_output=True,
            text=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return ""
    return head + ("+dirty" if dirty else "")


def stamp() -> dict[str, str]:
    """{"machine", "date" (UTC, seconds), "commit", "load"}: what a result was measured on."""
    load = ""
    if hasattr(os, "getloadavg"):
        load = "{:.2f} {:.2f} {:.2f}".format(*os.getloadavg())
    return {
        "machine": machine(),
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "commit": commit(),
        "load": load,
    }


def stamp_line(s: dict) -> str:
    line = f"Machine: {s['machine']}; {s['date']}; commit {s['commit']}"
    return line + (f"; load average at the end {s['load']}." if s.get("load") else ".")


def markdown_table(
    columns: Sequence[str], rows: Iterable[Sequence[object]], numeric: Sequence[bool] | None = None
) -> str:
    """A GitHub table; numeric columns right-aligned (by default every column but the first)."""
    numeric = numeric or [i > 0 for i in range(len(columns))]
    lines = [
        "| " + " | ".join(columns) + " |",
        "|" + "|".join("---:" if n else "---" for n in numeric) + "|",
    ]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def write(name: str, result: dict, markdown: str, folder: Path = RESULTS) -> tuple[Path, Path]:
    """bench/results/<name>.json and .md, each written whole or not at all."""
    folder.mkdir(parents=True, exist_ok=True)
    paths = folder / f"{name}.json", folder / f"{name}.md"
    for path, text in zip(
        paths, (json.dumps(result, indent=1, default=str) + "\n", markdown), strict=True
    ):
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        tmp.write_text(text)
        os.replace(tmp, path)
    return paths
