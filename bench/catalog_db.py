"""The partition catalog's own costs: landing and reading, on SQLite or PostgreSQL.

    .venv/bin/python bench/catalog_db.py [--postgres | --url postgresql://...] [--runs 3]

Per run, in a fresh temporary folder (and, with --url, on that database as given, which
should be empty; with --postgres, on a database of its own on a throwaway server on
loopback, started as the tests start theirs: tests/servers.py): `land` of 200 small
single-file partitions, `land_packed` of 10^4, `entries`, `table` (warm: land_packed
builds the snapshot on SQLite), `blobs` of every digest, `pin` and `pinned` of 10^4
entries. Prints one JSON line per run (seconds) and the median.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from quantloop.tasks.data.catalog import Catalog  # noqa: E402
from quantloop.tasks.data.schema import Partition  # noqa: E402
from tests.books import random_book  # noqa: E402


def one_run(folder: Path, url: str | None, dataset_suffix: str) -> dict[str, float]:
    catalog = Catalog(url) if url else Catalog(folder / "catalog.sqlite")
    root = str(folder / "store")
    book = random_book(100)
    days = [dt.date(2020, 1, 1) + dt.timedelta(days=i) for i in range(500)]
    out: dict[str, float] = {}
    t = time.perf_counter()
    for i in range(200):
        catalog.land(f"single{dataset_suffix}", Partition("AAA", days[i]), book, root=root)
    out["land_200"] = time.perf_counter() - t
    items = [(Partition(f"P{p:02d}", d), book.slice(0, 5)) for p in range(20) for d in days]
    t = time.perf_counter()
    catalog.land_packed(f"packed{dataset_suffix}", items, root=root)
    out["land_packed_10k"] = time.perf_counter() - t
    for name, call in [
        ("entries_10k", lambda: catalog.entries(f"packed{dataset_suffix}")),
        ("table_warm_10k", lambda: catalog.table(f"packed{dataset_suffix}")),
    ]:
        t = time.perf_counter()
        call()
        out[name] = time.perf_counter() - t
    entries = catalog.entries(f"packed{dataset_suffix}")
    t = time.perf_counter()
    catalog.blobs(e.digest for e in entries)
    out["blobs_10k"] = time.perf_counter() - t
    t = time.perf_counter()
    pin = catalog.pin(f"packed{dataset_suffix}", entries)
    catalog.pinned(pin)
    out["pin_pinned_10k"] = time.perf_counter() - t
    return {k: round(v, 4) for k, v in out.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default=None, help="a postgresql:// URL (default: SQLite)")
    parser.add_argument("--postgres", action="store_true", help="a throwaway local server")
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    with contextlib.ExitStack() as stack:
        server = None
        if args.postgres:
            from tests.servers import postgres_server

            folder = Path(tempfile.mkdtemp(prefix="quantloop-postgres-"))
            stack.callback(shutil.rmtree, folder, ignore_errors=True)
            server = stack.enter_context(postgres_server(folder))
        runs = []
        for i in range(args.runs):
            url = server.create_database(f"bench_{i}") if server else args.url
            with tempfile.TemporaryDirectory() as folder:
                runs.append(one_run(Path(folder), url, f"-{i}" if args.url else ""))
            print(json.dumps(runs[-1]), flush=True)
    print(json.dumps({"median": {k: statistics.median(r[k] for r in runs) for k in runs[0]}}))


if __name__ == "__main__":
    main()
