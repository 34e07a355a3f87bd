"""MLflow behind basic auth: a research run's tracking calls with the credential cache on
(`quantloop serve`'s setting, quantloop.serve.MLFLOW_AUTH_INI) against MLflow's default
(off: the password hash checked on every request).

    python bench/mlflow_auth.py [--out bench/results]

Each peer: its own `mlflow server --app-name basic-auth` (one worker, SQLite), then the
same small research run (2 products x 3 synthetic days of 6,000 events, 150 training
steps) on Prefect's temporary server, every HTTP call the run's process makes timed.
Prints a table; writes <out>/mlflow-auth.json (machine, date, commit).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.report import stamp  # noqa: E402

PARAMS = {
    "data": {"products": ["SYNA", "SYNB"], "n_dates": 3,
             "synthetic": {"events_per_day": 6_000, "levels": 3, "signal": 1.0}},
    "train": {"steps": 150, "batch_size": 64, "optimizations": "none"},
}  # fmt: skip
USER, PASSWORD = "quantloop-bench", "bench-password-" + os.urandom(6).hex()


def timed_calls() -> list[tuple[str, float]]:
    """Record (method and path, seconds) of every requests call in this process."""
    import requests

    calls: list[tuple[str, float]] = []
    original = requests.Session.request

    def request(self, method, url, *args, **kwargs):
        t = time.perf_counter()
        try:
            return original(self, method, url, *args, **kwargs)
        finally:
            path = re.sub(r"^https?://[^/]+", "", str(url).split("?")[0])
            calls.append((f"{method} {re.sub(r'[0-9a-f]{32}', '<id>', path)}",
                          time.perf_counter() - t))  # fmt: skip

    requests.Session.request = request
    return calls


def run_peer(name: str, ini: str, calls: list) -> dict:
    from quantloop.flows.research import ResearchParams, research
    from tests.servers import mlflow_server

    folder = Path(tempfile.mkdtemp(prefix=f"mlflow-auth-{name}-"))
    with mlflow_server(folder, credentials=(USER, PASSWORD), auth_ini=ini) as uri:
        params = {**PARAMS, "workspace": {"home": str(folder / "home"), "tracking_uri": uri}}
        calls.clear()
        t = time.perf_counter()
        research(ResearchParams.model_validate(params))
        wall = time.perf_counter() - t
    tracking = [(k, s) for k, s in calls if "/api/" in k]
    by_kind = collections.Counter(k for k, _ in tracking)
    return {
        "wall_s": wall,
        "calls": len(tracking),
        "calls_s": sum(s for _, s in tracking),
        "ms_per_call": 1e3 * sum(s for _, s in tracking) / max(len(tracking), 1),
        "most_called": dict(by_kind.most_common(5)),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    os.environ.update(MLFLOW_TRACKING_USERNAME=USER, MLFLOW_TRACKING_PASSWORD=PASSWORD,
                      PREFECT_SERVER_ANALYTICS_ENABLED="false")  # fmt: skip
    from prefect.testing.utilities import prefect_test_harness

    from quantloop.serve import MLFLOW_AUTH_INI

    off = re.sub(r"auth_cache_ttl_seconds = \d+", "auth_cache_ttl_seconds = 0", MLFLOW_AUTH_INI)
    if off == MLFLOW_AUTH_INI:
        raise SystemExit("quantloop.serve.MLFLOW_AUTH_INI sets no auth_cache_ttl_seconds")
    calls = timed_calls()
    with prefect_test_harness():
        rows = {
            "cache off (MLflow's default)": run_peer("off", off, calls),
            "cache on (quantloop serve)": run_peer("on", MLFLOW_AUTH_INI, calls),
        }
    off_row, on_row = rows.values()
    stamped = stamp()  # machine, date, commit (bench/report.py)
    result = {
        "machine": stamped["machine"],
        "date": stamped["date"],
        "commit": stamped["commit"],
        "rows": rows,
        "run_wall_ratio": off_row["wall_s"] / on_row["wall_s"],
        "per_call_ratio": off_row["ms_per_call"] / on_row["ms_per_call"],
    }
    print(f"{'MLflow basic auth':<30} {'run s':>7} {'calls':>6} {'calls s':>8} {'ms/call':>8}")
    for name, r in rows.items():
        print(f"{name:<30} {r['wall_s']:>7.1f} {r['calls']:>6} {r['calls_s']:>8.1f} "
              f"{r['ms_per_call']:>8.1f}")  # fmt: skip
    print(
        f"off/on: run {result['run_wall_ratio']:.2f}x, per call {result['per_call_ratio']:.1f}x"
        f"; {result['machine']}; {result['date']}; commit {result['commit']}"
    )
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "mlflow-auth.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
