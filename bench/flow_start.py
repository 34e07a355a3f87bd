"""A deployment's flow run on a process worker, from the run's creation (the UI's Submit)
to its start and to its end: Prefect's default command (a workspace supervisor, then the
engine, two fresh interpreters a run) against infra/prefect.yaml's `quantloop engine`, in
its own process (QUANTLOOP_FORKSERVER=0) and in the worker's warm process.

    python bench/flow_start.py [--repeats 3] [--out bench/results]

Two flows: `where-it-ran` (tests/engine_flows.py: nothing but a file written, so the
figures are the fixed costs) and the research flow on a tiny synthetic workspace (a whole
run, MLflow on a local server). One `prefect server`, one `prefect worker` as an operator
runs it; the variants take turns, `--repeats` runs each, after one untimed run that starts
the warm process (its seconds are given: a worker's first run). Seconds from the Prefect
API's records: created -> start_time (start) and created -> end_time (total). Writes
<out>/flow-start.json and .md (machine, date, commit).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.checkout import use_checkout  # noqa: E402

use_checkout()

from bench.report import RESULTS, markdown_table, stamp, stamp_line, write  # noqa: E402

POOL = "quantloop-bench-start"
# variant -> the deployment's job variables
VARIANTS = {
    "prefect default": {},
    "quantloop engine, own process": {"command": "quantloop engine",
                                      "env": {"QUANTLOOP_FORKSERVER": "0"}},
    "quantloop engine, warm": {"command": "quantloop engine"},
}  # fmt: skip
PEER = "prefect default"


def research_params(home: Path, tracking_uri: str) -> dict:
    return {"params": {
        "workspace": {"home": str(home), "tracking_uri": tracking_uri, "n_workers": 1},
        "data": {"products": ["SYNA"], "n_dates": 2,
                 "synthetic": {"events_per_day": 3000, "levels": 2}},
        "train": {"steps": 20, "batch_size": 64},
        "validation": {"folds": 1},
    }}  # fmt: skip


def deployments(folder: Path):
    """(flow label, variant) -> (deployment name, parameters of a run)."""
    from quantloop.deploy import REPO_ROOT, Deployment, for_stack, read_deployments

    [research] = [d for d in read_deployments() if d.flow == "research"]
    trivial = Deployment(flow="where-it-ran", name="x", pool=POOL,
                         entrypoint="tests/engine_flows.py:where_it_ran")  # fmt: skip
    out, specs = {}, []
    for i, (variant, variables) in enumerate(VARIANTS.items()):
        for label, base in (("where-it-ran", trivial), ("research", research)):
            [spec] = for_stack([base], pool=POOL, checkout=REPO_ROOT, workspace={})
            spec = dataclasses.replace(spec, name=f"v{i}", job_variables=dict(variables),
                                       parameters={})  # fmt: skip
            specs.append(spec)
            out[label, variant] = f"{spec.flow}/v{i}"
    return specs, out


def one_run(name: str, parameters: dict) -> dict:
    from prefect.client.orchestration import get_client
    from prefect.deployments import run_deployment

    run = run_deployment(name, parameters=parameters, timeout=900)
    with get_client(sync_client=True) as client:
        run = client.read_flow_run(run.id)
    if not run.state.is_completed():
        raise RuntimeError(f"{name}: flow run {run.id} ended {run.state}")
    return {"start_s": (run.start_time - run.created).total_seconds(),
            "total_s": (run.end_time - run.created).total_seconds()}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()

    from prefect.settings import PREFECT_API_URL, temporary_settings

    from quantloop.deploy import apply
    from tests.servers import mlflow_server, prefect_server, prefect_worker

    with tempfile.TemporaryDirectory(prefix="flow-start-") as tmp:
        folder = Path(tmp)
        (folder / "mlflow").mkdir()
        with (prefect_server(folder / "prefect") as api, mlflow_server(folder / "mlflow") as uri,
              temporary_settings({PREFECT_API_URL: api})):  # fmt: skip
            specs, names = deployments(folder)
            apply(specs)
            count = iter(range(10**6))

            def params(label: str) -> dict:
                n = next(count)
                if label == "research":  # a fresh workspace each: a whole run, no cache
                    return research_params(folder / f"home{n}", uri)
                return {"out": str(folder / f"where{n}.json")}

            runs: dict[tuple[str, str], list[dict]] = {key: [] for key in names}
            with prefect_worker(api, POOL, folder / "worker", prewarm=False):
                t0 = time.perf_counter()
                first = one_run(names["where-it-ran", "quantloop engine, warm"],
                                params("where-it-ran"))  # fmt: skip
                print(f"first run (starts the warm process): start {first['start_s']:.1f} s, "
                      f"total {first['total_s']:.1f} s", flush=True)  # fmt: skip
                for r in range(args.repeats):
                    for variant in VARIANTS:  # the variants take turns
                        for label in ("where-it-ran", "research"):
                            runs[label, variant].append(one_run(names[label, variant],
                                                                params(label)))  # fmt: skip
                            last = runs[label, variant][-1]
                            print(f"repeat {r}: {label}, {variant}: start {last['start_s']:.1f} "
                                  f"s, total {last['total_s']:.1f} s", flush=True)  # fmt: skip
                wall = time.perf_counter() - t0
    s = stamp()
    by_name = {f"{label} | {variant}": v for (label, variant), v in runs.items()}
    result = {"stamp": s, "repeats": args.repeats, "first_run": first, "wall_s": wall,
              "runs": by_name}  # fmt: skip
    rows = []
    for label in ("where-it-ran", "research"):
        peer = statistics.median(x["total_s"] for x in runs[label, PEER])
        for variant in VARIANTS:
            xs = runs[label, variant]
            start = statistics.median(x["start_s"] for x in xs)
            total = statistics.median(x["total_s"] for x in xs)
            spread = ", ".join(f"{x['total_s']:.1f}" for x in xs)
            rows.append([label, variant, f"{start:.1f}", f"{total:.1f} ({spread})",
                         f"{peer / total:.2f}x"])  # fmt: skip
    table = markdown_table(
        ["flow", "flow-run command", "created -> started s", "created -> ended s (runs)",
         f"faster than {PEER}"], rows, [False, False, True, True, True],
    )  # fmt: skip
    md = "\n\n".join([
        "# A deployment's flow run from Submit to its end, by the flow run's command",
        stamp_line(s),
        f"One `prefect server`, one process worker polling every second (so up to 1 s of "
        f"each start is the poll); medians of {args.repeats} runs a variant, the variants in "
        f"turn. The worker's first run, which starts its warm process: start "
        f"{first['start_s']:.1f} s, total {first['total_s']:.1f} s.",
        table,
    ]) + "\n"  # fmt: skip
    print(table)
    write("flow-start", result, md, args.out)


if __name__ == "__main__":
    main()
