"""A sweep's child runs in MLflow: `tracking.child_runs` (every child made, filled and ended
on the background senders, side by side) against the same records sent one run at a time
(what `tracking.run()` blocks in turn would do), on `mlflow server` behind basic auth
(`quantloop serve`'s settings).

    python bench/child_runs.py [--children 16,32] [--out bench/results]

Each child is what flows/sweep.py records for a (setting, fold): 22 params, 11 tags, 12
metrics and a 30-point loss curve. Prints a table; writes <out>/child-runs.json and .md
(machine, date, commit). Both peers run on the same server, alternately, three times each;
the median is reported.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.checkout import use_checkout  # noqa: E402

use_checkout()

from bench.report import RESULTS, markdown_table, stamp, stamp_line, write  # noqa: E402

USER, PASSWORD = "quantloop-bench", "bench-password-" + os.urandom(6).hex()
REPEATS = 3


def children(n: int):
    from quantloop.tasks.records.tracking import ChildRun

    curve = [1.0 / (i + 1) for i in range(30)]
    return [
        ChildRun(
            name=f"s{i // 2}-fold{i % 2}", stage="trial",
            tags={f"tag{j}": f"value-{i}-{j}" for j in range(11)},
            params={f"train.p{j}": j * 0.1 for j in range(22)},
            metrics={f"m{j}": i + j * 0.5 for j in range(12)},
            series={"loss": (curve, [(k + 1) * 10 for k in range(30)])},
        )
        for i in range(n)
    ]  # fmt: skip


def one_at_a_time(client, experiment: str, parent: str, runs) -> None:
    """The same records, each run made, filled and ended before the next."""
    from quantloop.tasks.records import tracking

    for child in runs:
        for future in tracking.child_runs(client, experiment, parent, [child]):
            future.result()


def side_by_side(client, experiment: str, parent: str, runs) -> None:
    from quantloop.tasks.records import tracking

    for future in tracking.child_runs(client, experiment, parent, runs):
        future.result()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--children", default="16,32")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    from mlflow.tracking import MlflowClient

    from quantloop.tasks.records.tracking import SENDERS
    from tests.servers import MlflowServer

    rows, result = [], {"children": {}, "senders": SENDERS}
    with tempfile.TemporaryDirectory(prefix="quantloop-child-runs-") as tmp:
        server = MlflowServer(Path(tmp), credentials=(USER, PASSWORD))
        try:
            uri = server.ready(timeout=300)
            os.environ.update(MLFLOW_TRACKING_USERNAME=USER, MLFLOW_TRACKING_PASSWORD=PASSWORD)
            client = MlflowClient(uri)
            experiment = client.create_experiment(f"child-runs-{uuid.uuid4().hex[:8]}")
            parent = client.create_run(experiment).info.run_id
            for n in [int(x) for x in args.children.split(",")]:
                runs = children(n)
                times = {"one at a time": [], "side by side": []}
                for _ in range(REPEATS):
                    for name, fn in (("one at a time", one_at_a_time),
                                     ("side by side", side_by_side)):  # fmt: skip
                        t0 = time.perf_counter()
                        fn(client, experiment, parent, runs)
                        times[name].append(time.perf_counter() - t0)
                serial = statistics.median(times["one at a time"])
                parallel = statistics.median(times["side by side"])
                result["children"][n] = {"one_at_a_time_s": times["one at a time"],
                                         "side_by_side_s": times["side by side"]}  # fmt: skip
                rows.append([n, f"{serial:.2f}", f"{serial / n * 1e3:.0f}", f"{parallel:.2f}",
                             f"{parallel / n * 1e3:.0f}", f"{serial / parallel:.2f}x"])  # fmt: skip
        finally:
            server.stop()
    columns = ["children", "one at a time s", "ms a child", "side by side s", "ms a child",
               "speed-up"]  # fmt: skip
    table = markdown_table(columns, rows)
    s = stamp()
    result.update(s)
    print(table)
    print(stamp_line(s))
    markdown = (
        f"# A sweep's child runs in MLflow\n\n{stamp_line(s)}\n\n`mlflow server` with basic "
        f"auth on loopback (one worker, SQLite); 3 calls a child (create, log_batch, end); "
        f"{SENDERS} sender threads; median of {REPEATS}.\n\n{table}\n"
    )
    write("child-runs", result, markdown, args.out)


if __name__ == "__main__":
    main()
