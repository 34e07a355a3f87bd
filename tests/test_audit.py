"""Auditing a result: reproduce it, query its nodes from its run id, promote it.

A real `mlflow server` (the session's, with basic auth) holds the runs; reproduction
re-runs nodes, the model and the simulation without the cache; promotion moves the
champion alias only when the gates pass, and records every decision on the version.
"""

from __future__ import annotations

import datetime as dt
import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from mlflow.tracking import MlflowClient
from typer.testing import CliRunner

from quantloop.cli import app
from quantloop.flows.research import ResearchParams, research
from quantloop.tasks import storage
from quantloop.tasks.catalog import Catalog
from quantloop.tasks.engine import NodeStore, plan_nodes, run_nodes, sha256_json
from quantloop.tasks.features import FeatureParams
from quantloop.tasks.landing import land_synthetic
from quantloop.tasks.planning import feature_kind
from quantloop.tasks.reproduce import Report, check_nodes, manifest_rows
from quantloop.tasks.synthetic import SyntheticConfig


def test_a_planted_nondeterministic_node_is_the_one_that_fails_to_reproduce(tmp_path):
    root = str(tmp_path / "store")
    catalog = Catalog(tmp_path / "catalog.sqlite")
    days = [dt.date(2026, 3, 2), dt.date(2026, 3, 3)]
    land_synthetic(catalog, root, ["SYNA", "SYNB"], days,
                   SyntheticConfig(events_per_day=800, levels=2))  # fmt: skip
    inputs = catalog.table("synthetic")
    params = FeatureParams().canonical()
    digest = sha256_json(params)
    storage.write_bytes_atomic(storage.join(root, "params", f"{digest}.json"),
                               json.dumps(params).encode())  # fmt: skip
    features = feature_kind()
    rng = np.random.default_rng()

    def noisy(table: pa.Table, p) -> pa.Table:  # the planted nondeterminism
        out = features.compute(table, p)
        return out.set_column(0, out.column_names[0], pa.array(
            out.column(0).to_numpy() + rng.normal(size=out.num_rows)))  # fmt: skip

    planted = replace(features, name="noisy", compute=noisy, compute_many=None)
    store = NodeStore(root)
    good = run_nodes(features, {digest: params}, plan_nodes(features, inputs.slice(1),
                                                            {"SYNA": digest, "SYNB": digest}),
                     store)  # fmt: skip
    bad = run_nodes(planted, {digest: params}, plan_nodes(planted, inputs.slice(0, 1),
                                                          {"SYNA": digest}), store)  # fmt: skip
    rows = manifest_rows([good.manifest, bad.manifest])
    report = Report(check_nodes(rows, root=root, catalog=catalog,
                                kinds={"features": features, "noisy": planted}))  # fmt: skip
    assert report.nodes == 4 and report.failures == 1
    [failed] = [c for c in report.checks if not c.reproduced]
    assert (failed.what, failed.label, failed.reason) == ("noisy", "SYNA/2026-03-02",
                                                          "output differs")  # fmt: skip
    # The same records with today's code changed, and with an input gone.
    changed = Report(check_nodes(rows, root=root, catalog=catalog, kinds={
        "features": replace(features, code="0" * 64), "noisy": planted}))  # fmt: skip
    assert {c.reason for c in changed.checks if c.what == "features"} == {"code changed"}
    for url in {e.location for e in catalog.entries("synthetic")}:
        Path(url).unlink()
    gone = Report(check_nodes(rows, root=root, catalog=catalog,
                              kinds={"features": features, "noisy": planted}))  # fmt: skip
    assert gone.failures == 4 and all(c.reason.startswith("input gone") for c in gone.checks)


TINY = {
    "data": {"products": ["SYNA", "SYNB"], "n_dates": 3,
             "synthetic": {"events_per_day": 6_000, "levels": 3, "signal": 1.0}},
}  # fmt: skip
# A model that has barely moved from its initial weights, and one trained: the second
# trades on the book's signal, the first on noise (measured here: see the test).
UNTRAINED = {"steps": 1, "lr": 1e-6, "batch_size": 64, "optimizations": "none"}
TRAINED = {"steps": 150, "batch_size": 64, "optimizations": "none"}


def run_research(home: Path, mlflow_uri: str, train: dict):
    return research(ResearchParams.model_validate(
        {**TINY, "workspace": {"home": str(home), "tracking_uri": mlflow_uri}, "train": train}
    ))  # fmt: skip


def cli(*args: str):
    return CliRunner(env={"COLUMNS": "200"}).invoke(app, list(args))


@pytest.mark.slow
@pytest.mark.server
def test_reproduce_query_and_promote_runs_by_their_ids(prefect_api, mlflow_uri, tmp_path):
    home = tmp_path / "home"
    worse = run_research(home, mlflow_uri, UNTRAINED)
    better = run_research(home, mlflow_uri, TRAINED)
    client = MlflowClient(mlflow_uri)
    uri = ["--tracking-uri", mlflow_uri, "--home", str(tmp_path / "elsewhere")]

    # Reproduce, by MLflow run id: every sampled node, the model and the simulation.
    summary = tmp_path / "reproduce.json"
    out = cli("reproduce", better.mlflow_run_id, "--sample", "4", "--summary-json",
              str(summary), *uri)  # fmt: skip
    assert out.exit_code == 0, out.output
    report = json.loads(summary.read_text())
    assert (report["nodes"], report["failures"], report["failure_rate"]) == (6, 0, 0.0)
    assert {c["what"] for c in report["checks"]} == {"features", "model", "simulation"}
    recorded = client.get_run(better.mlflow_run_id).data.metrics
    assert recorded["reproduction.failure_rate"] == 0.0 and recorded["reproduction.nodes"] == 6
    # by Prefect flow run id too; an unknown run is an error, not an empty answer
    out = cli("reproduce", better.prefect_flow_run_id, "--nodes-only", "--sample", "2", *uri)
    assert out.exit_code == 0, out.output
    out = cli("reproduce", "0" * 32, *uri)
    assert out.exit_code == 2 and "no MLflow run" in out.output

    # The run's nodes, found from its id alone (the workspace given is another folder).
    out = cli("nodes", "--run", worse.mlflow_run_id, "--json", *uri)
    assert out.exit_code == 0, out.output
    assert len(json.loads(out.output)) == 6
    out = cli("nodes", "--run", worse.mlflow_run_id, "--product", "NOPE", *uri)
    assert out.exit_code == 1 and "none of the 6 recorded nodes matches" in out.output

    # Promotion: the first model is promoted (no champion yet), the better one replaces
    # it, and the worse one is refused; each decision is on its version.
    def promote(run) -> dict:
        path = tmp_path / f"promote-{run.model_version}.json"
        out = cli("promote", run.mlflow_run_id, "--sample", "2", "--summary-json", str(path),
                  *uri)  # fmt: skip
        decision = json.loads(path.read_text())
        assert out.exit_code == (0 if decision["decision"] == "promoted" else 1), out.output
        return decision

    first = promote(worse)
    assert first["decision"] == "promoted" and first["gates"]["markout"]["champion"] is None
    assert first["promotion_time_s"] > 0
    second = promote(better)
    assert second["decision"] == "promoted", second["gates"]
    gate = second["gates"]["markout"]
    assert gate["champion"] == worse.model_version
    assert gate["candidate_bps"] > gate["champion_bps"] + gate["margin_bps"]  # clearly better
    third = promote(worse)
    assert third["decision"] == "refused" and not third["gates"]["markout"]["passed"]
    assert third["gates"]["reproduction"]["passed"] and third["gates"]["ladder"]["passed"]
    name = better.registered_model
    assert client.get_model_version_by_alias(name, "champion").version == better.model_version
    refused = client.get_model_version(name, worse.model_version).tags
    assert refused["promotion.decision"] == "refused"
    assert json.loads(refused["promotion.gates"])["markout"]["passed"] is False
    accepted = client.get_model_version(name, better.model_version).tags
    assert accepted["promotion.decision"] == "promoted" and float(accepted["promotion.time_s"]) > 0
