"""An auditor's two figures on LOBSTER's sample days: reproduction failure rate and the
time to promote, against a real `mlflow server` on loopback.

    .venv/bin/python bench/audit.py [--sample N] [--screenshots]

1. `quantloop run --lobster ../shared/data/lobster` (the three sample days, the
   embedded defaults otherwise) records a research run on the server;
2. `quantloop reproduce <run> --sample N` re-runs N of its feature nodes, the model and
   the simulation without the cache and compares digests;
3. `quantloop promote <run>` moves the `champion` alias if the gates pass (the first
   version: no champion to beat), and records the promotion time (end of the research
   run to the alias moving);
4. a second research run with another seed, promoted against the first: the mark-out
   gate compares it with the champion.

There is no peer to take a ratio against: before `reproduce` and `promote` both were
done by hand. With --screenshots it also takes the MLflow UI's pages of the run (docs/
mlflow-*.png) in headless Chromium. Writes bench/results/audit-lobster.json and .md with
the machine, date and commit.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from report import stamp, stamp_line  # bench/ is the script's folder, so on sys.path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # tests.servers: the launchers the tests use
LOBSTER = ROOT.parent / "shared" / "data" / "lobster"
OUT = ROOT / "bench" / "results" / "audit-lobster.json"


def cli(*args: str, env: dict, expect: tuple[int, ...] = (0,)) -> tuple[float, str]:
    exe = Path(sys.executable).with_name("quantloop")
    t = time.perf_counter()
    proc = subprocess.run([str(exe), *args], env=env, capture_output=True, text=True,
                          timeout=1800)  # fmt: skip
    wall = time.perf_counter() - t
    out = proc.stdout + proc.stderr
    assert proc.returncode in expect, f"quantloop {args[0]}: exit {proc.returncode}\n{out[-3000:]}"
    print(f"quantloop {args[0]}: {wall:.1f} s", flush=True)
    return wall, out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sample", type=int, default=50, help="feature nodes reproduced")
    parser.add_argument("--screenshots", action="store_true")
    args = parser.parse_args()
    if not LOBSTER.is_dir():
        sys.exit(f"bench/audit.py needs LOBSTER's samples at {LOBSTER}")
    from tests.servers import mlflow_server

    with (
        tempfile.TemporaryDirectory(prefix="quantloop-audit-") as tmp,
        mlflow_server(Path(tmp)) as uri,
    ):
        env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
        env["PREFECT_HOME"] = f"{tmp}/prefect"
        where = ["--home", f"{tmp}/home", "--tracking-uri", uri]
        runs = []
        for seed in (0, 1):
            params = Path(tmp) / f"params-{seed}.json"
            params.write_text(json.dumps({"train": {"seed": seed}}))
            summary = Path(tmp) / f"run-{seed}.json"
            run_s, _ = cli("run", "--lobster", str(LOBSTER), "--params", str(params),
                           "--summary-json", str(summary), *where, env=env)  # fmt: skip
            run_id = json.loads(summary.read_text())["mlflow_run_id"]
            repro = Path(tmp) / f"reproduce-{seed}.json"
            repro_s, _ = cli("reproduce", run_id, "--sample", str(args.sample),
                             "--summary-json", str(repro), *where, env=env,
                             expect=(0, 1))  # fmt: skip
            decision = Path(tmp) / f"promote-{seed}.json"
            promote_s, _ = cli("promote", run_id, "--summary-json", str(decision), *where,
                               env=env, expect=(0, 1))  # fmt: skip
            runs.append({
                "seed": seed, "mlflow_run_id": run_id, "run_s": run_s,
                "reproduce_s": repro_s, "promote_s": promote_s,
                "reproduction": json.loads(repro.read_text()),
                "promotion": json.loads(decision.read_text()),
            })  # fmt: skip
        write(args, runs)  # before the screenshots: a browser failure loses no figures
        if args.screenshots:
            screenshots(uri, runs[0]["mlflow_run_id"])


def screenshots(uri: str, run_id: str) -> None:
    """The MLflow UI's pages an auditor opens, in headless Chromium."""
    from mlflow import MlflowClient
    from playwright.sync_api import sync_playwright

    from quantloop.blocks.tracking import MODEL_TRAINING_VIEW

    client = MlflowClient(uri)
    run = client.get_run(run_id)
    experiment = run.info.experiment_id
    # The run's own version: research runs register in the candidates model
    # (quantloop-orderbook-candidates), not the guarded one, and tag the run with it.
    model, version = run.data.tags["registered_model"], run.data.tags["model_version"]
    view = MODEL_TRAINING_VIEW  # else MLflow 3.17's UI opens the experiment's GenAI view
    pages = {
        "mlflow-runs": f"{uri}/#/experiments/{experiment}/runs?{view}",
        "mlflow-run": f"{uri}/#/experiments/{experiment}/runs/{run_id}?{view}",
        "mlflow-model": f"{uri}/#/models/{model}/versions/{version}",
    }
    docs = ROOT / "docs"
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path="/usr/bin/chromium", args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1400, "height": 1100})
        for name, url in pages.items():
            # The MLflow UI polls its API, so the network never goes idle: the page is
            # taken once its data has had time to arrive and render.
            page.goto(url, wait_until="load")
            page.wait_for_timeout(10_000)
            page.screenshot(path=str(docs / f"{name}.png"))
            print(f"docs/{name}.png: {url}", flush=True)
        browser.close()


def write(args, runs: list[dict]) -> None:
    nodes = sum(r["reproduction"]["nodes"] for r in runs)
    failures = sum(r["reproduction"]["failures"] for r in runs)
    stamped = stamp()  # machine, date, commit (bench/report.py)
    result = {
        "data": "LOBSTER samples: AMZN (1 and 5 levels) and GOOG (10 levels), 2012-06-21",
        "sample": args.sample,
        "reproduction_nodes": nodes,
        "reproduction_failures": failures,
        "reproduction_failure_rate": failures / nodes if nodes else None,
        "promotion_time_s": [r["promotion"].get("promotion_time_s") for r in runs],
        "decisions": [r["promotion"]["decision"] for r in runs],
        "runs": runs,
        "machine": stamped["machine"],
        "date": stamped["date"],
        "commit": stamped["commit"],
    }
    OUT.write_text(json.dumps(result, indent=2, default=str) + "\n")
    lines = [
        stamp_line(result),
        "",
        "| run | research s | reproduce s | reproduced (nodes, model, simulation) | "
        "failure rate | promote | promotion time s |",
        "|---|---:|---:|---:|---:|---|---:|",
    ]
    for r in runs:
        rep, pro = r["reproduction"], r["promotion"]
        lines.append(
            f"| seed {r['seed']} | {r['run_s']:.1f} | {r['reproduce_s']:.1f} | "
            f"{rep['nodes'] - rep['failures']} of {rep['nodes']} | {rep['failure_rate']:.3f} | "
            f"{pro['decision']} | {pro.get('promotion_time_s') or float('nan'):.1f} |"
        )
    lines.append("")
    OUT.with_suffix(".md").write_text("\n".join(lines))
    print("\n" + "\n".join(lines))


if __name__ == "__main__":
    main()
