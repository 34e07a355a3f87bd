"""A research run's trial count against a workspace's history: tasks/records/runs.trials_on,
which reads only the first run of each configuration (re-runs carry REPEAT_TAG), against
the search it replaces (every finished research run on the same data and test windows,
re-runs included), on the same MLflow SQLite store, as `quantloop run` counts them.

    python bench/trials_search.py [--runs 50,200,800] [--configs 5] [--out bench/results]

The store holds `--configs` configurations and re-runs of them up to each size, each run
with a research run's tags, ~40 parameters and ~30 metrics. Seconds per count, the median
of 5. Writes <out>/trials-search.json and .md (machine, date, commit).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.checkout import use_checkout  # noqa: E402

use_checkout()

from bench.report import RESULTS, markdown_table, stamp, stamp_line, write  # noqa: E402


def peer_count(client, experiment: str, digest: str, windows: str, own: str) -> int:
    """The search before REPEAT_TAG (c626b41's runs.research_trials): every finished run."""
    from quantloop.tasks.records.runs import TEST_WINDOWS_TAG, TRIALS_TAG, trial_ids

    where = (f"tags.data_digest = '{digest}' and tags.{TEST_WINDOWS_TAG} = '{windows}' "
             "and attributes.status = 'FINISHED'")  # fmt: skip
    seen, token = {own}, None
    while True:
        page = client.search_runs([experiment], filter_string=where, max_results=1000,
                                  page_token=token)  # fmt: skip
        for r in page:
            if r.data.tags.get("quantloop.stage") == "research" and (
                r.data.tags.get("params_hash") or r.data.tags.get(TRIALS_TAG)
            ):
                seen |= trial_ids(r)
        token = page.token
        if not token:
            return len(seen)


def median_s(fn, repeats: int = 5) -> tuple[float, object]:
    times, out = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), out


def main() -> None:
    from mlflow import MlflowClient
    from mlflow.entities import Metric, Param, RunTag

    from quantloop.tasks.records.runs import REPEAT_TAG, TEST_WINDOWS_TAG, trials_on

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", default="50,200,800")
    parser.add_argument("--configs", type=int, default=5)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    sizes = [int(n) for n in args.runs.split(",")]

    folder = Path(tempfile.mkdtemp(prefix="trials-search-"))
    client = MlflowClient(f"sqlite:///{folder / 'mlflow.db'}")
    experiment = client.create_experiment("research")
    digest, windows, own = "d" * 64, "w" * 64, "f" * 16  # own: the counting run's trial
    made, first, rows, result = 0, {}, [], {"stamp": stamp(), "sizes": []}
    for size in sizes:
        while made < size:
            config = f"{made % args.configs:04d}" + "c" * 60  # distinct in its first 16
            tags = {"quantloop.stage": "research", "params_hash": config,
                    "data_digest": digest, TEST_WINDOWS_TAG: windows}  # fmt: skip
            if config in first:
                tags[REPEAT_TAG] = first[config]
            run = client.create_run(experiment, tags=tags)
            client.log_batch(
                run.info.run_id,
                metrics=[Metric(f"m{i}", float(i), 0, 0) for i in range(30)],
                params=[Param(f"p{i}", str(i)) for i in range(40)],
                tags=[RunTag("mlflow.user", "bench")],
            )
            client.set_terminated(run.info.run_id)
            first.setdefault(config, run.info.run_id)
            made += 1
        new_s, (new_n, _) = median_s(lambda: trials_on(client, experiment, digest, windows, own))
        peer_s, peer_n = median_s(lambda: peer_count(client, experiment, digest, windows, own))
        assert new_n == peer_n == args.configs + 1, (new_n, peer_n)
        result["sizes"].append({"runs": size, "trials": new_n, "trials_on_s": new_s,
                                "peer_s": peer_s})  # fmt: skip
        rows.append([size, new_n, f"{new_s:.3f}", f"{peer_s:.3f}", f"{peer_s / new_s:.1f}x"])
        print(rows[-1], flush=True)
    md = "\n\n".join([
        "# A research run's trial count against the workspace's history",
        stamp_line(result["stamp"]),
        markdown_table(["finished research runs", "trials counted", "trials_on s",
                        "peer s (every run read)", "peer / trials_on"], rows),
        f"{args.configs} configurations and their re-runs in one MLflow SQLite store (each "
        "run: a research run's tags, 40 parameters, 30 metrics); seconds per count, the "
        "median of 5; both counts checked equal. trials_on reads the first run of each "
        "configuration (re-runs carry REPEAT_TAG, as flows/research.py tags them); the "
        "peer reads every finished run, as research_trials did before.",
    ]) + "\n"  # fmt: skip
    print(md)
    write("trials-search", result, md, args.out)


if __name__ == "__main__":
    main()
