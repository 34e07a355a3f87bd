"""Retraining and backtests against the session's MLflow server (basic auth), with its
Model Registry: retrain registers a new version of the champion's recipe on the newest
days and never moves the alias; a backtest's nodes are keyed by the model's weights,
so a re-run is all cache hits and another version recomputes."""

from __future__ import annotations

import datetime as dt
import json
import uuid
from types import SimpleNamespace

import pytest
from mlflow.tracking import MlflowClient

from quantloop.blocks import MlflowTracking
from quantloop.flows.backtest import backtest
from quantloop.flows.promote import promote, record_decision
from quantloop.flows.research import ResearchParams, research
from quantloop.flows.retrain import retrain
from quantloop.tasks.data.landing import business_days, land_synthetic
from quantloop.tasks.data.synthetic import SyntheticConfig
from quantloop.tasks.records import runs
from quantloop.tasks.records.recipe import read_recipe, resolve_version
from quantloop.tasks.records.runs import read_artifact
from quantloop.tasks.runtime.workspace import Workspace

SYNTHETIC = {"events_per_day": 3_000, "levels": 2, "signal": 1.0}
START = dt.date(2026, 3, 2)
TINY = {
    "data": {"products": ["SYNA", "SYNB"], "n_dates": 2, "start_date": START.isoformat(),
             "synthetic": SYNTHETIC},
    "train": {"steps": 20, "batch_size": 64, "optimizations": "none"},
    "validation": {"folds": 1},  # two dates fit one walk-forward fold: train on 1, test 2
}  # fmt: skip


def promoted_before(client, run, guarded: str) -> str:
    """The run's candidate made the champion of `guarded` as the promote flow makes one
    (flows/promote.record_decision: the copy, its record, the alias), its gate values
    planted: a champion from an earlier promotion. The copy's version number."""
    gates = {"markout": {"passed": True, "p_adjusted": 0.001, "window": {}, "why": "planted"},
             "reproduction": {"passed": True, "nodes": 0, "failures": 0},
             "ladder": {"passed": True}}  # fmt: skip
    decision = {"decision": "promoted", "gates": gates, "decided_at": "2026-03-04T00:00:00+00:00",
                "promoter": "test (planted)"}  # fmt: skip
    candidate = client.get_model_version(run.registered_model, run.model_version)
    done = record_decision(client, decision, candidate=candidate, guarded=guarded,
                           alias="champion", research_ended_s=None)  # fmt: skip
    return done["champion_version"]


@pytest.fixture(scope="module")
def champion(prefect_api, mlflow_uri, tmp_path_factory):
    """A research run's model as the champion of a registered model of its own (the
    session's server is shared), and two newer days landed after it; the run's own
    version is a candidate in `<name>-candidates`, the champion its copy in `<name>`.
    Shared by the module's two tests, which only add to it: neither moves the alias, and
    the retrains each asks to be new are on days the other does not retrain on."""
    name = f"retrain-test-{uuid.uuid4().hex[:8]}"
    home = tmp_path_factory.mktemp("retrain") / "home"
    workspace = Workspace(home=str(home), n_workers=1, tracking=MlflowTracking(
        tracking_uri=mlflow_uri, experiment=name, registered_model=name))  # fmt: skip
    run = research(ResearchParams.model_validate({**TINY, "workspace": workspace}))
    assert run.registered_model == f"{name}-candidates"
    client = MlflowClient(mlflow_uri)
    copied = promoted_before(client, run, name)
    newer = business_days(START, 4)[2:]
    land_synthetic(workspace.catalog(), workspace.resolve_site().root, ["SYNA", "SYNB"], newer,
                   SyntheticConfig(**SYNTHETIC))  # fmt: skip
    return workspace, name, SimpleNamespace(run=run, model_version=copied), newer


@pytest.mark.slow
@pytest.mark.server
def test_retrain_registers_a_new_version_of_the_champions_recipe(champion, mlflow_uri):
    workspace, name, first, newer = champion
    client = MlflowClient(mlflow_uri)
    candidates = f"{name}-candidates"

    def versions(model: str) -> int:
        return len(client.search_model_versions(f"name = '{model}'"))

    # the research run's candidate, and the backtest test's retrain if it ran first
    registered = versions(candidates)
    summary = retrain(workspace=workspace)

    assert summary.from_version == first.model_version
    assert summary.new_version is not None and summary.new_version != first.model_version
    assert (summary.start, summary.end) == (newer[0], newer[-1])  # the newest days only
    # the alias stays: promotion is promote's
    assert client.get_model_version_by_alias(name, "champion").version == first.model_version
    old = client.get_model_version(name, first.model_version)
    new = client.get_model_version(candidates, summary.new_version)  # a candidate
    assert new.tags["train_config"] == old.tags["train_config"]
    assert new.tags["retrained_from"] == f"{name}/{first.model_version}"
    assert new.tags["data_digest"] != old.tags["data_digest"]
    catalog = workspace.catalog()
    assert (read_recipe(client, new, catalog).digest_fields()
            == read_recipe(client, old, catalog).digest_fields())  # fmt: skip
    # its run is shaped like a research run: features, train and simulate under it
    stages = runs.stage_runs(client, client.get_run(summary.mlflow_run_id))
    assert set(stages) == {"features", "train", "simulate"}
    # so promote gates the new version as it gates a research run's.
    # Champion and candidate replay the one day neither trained on: the retrain's held-out
    # day (the champion trained on the first day and held out the second). Margin 5 bps:
    # a retrain of the same recipe does not beat its source by that (here: within 1 bp).
    decision = promote(summary.mlflow_run_id, reproduce_sample=2, min_improvement_bps=5.0,
                       workspace=workspace)  # fmt: skip
    gate = decision["gates"]["markout"]
    assert decision["version"] == summary.new_version
    assert (gate["against"], gate["champion"]) == ("champion", first.model_version)
    assert gate["window"]["days"] == [newer[-1].isoformat()] and gate["window"]["excluded"] == {}
    assert gate["window"]["events"] == 2 * SYNTHETIC["events_per_day"]
    assert gate["trials"] == 1  # the retrain is the only run on its pinned days
    assert gate["candidate_trades"] > 0 and gate["incumbent_trades"] > 0
    assert abs(gate["difference_bps"]) < 5.0 and gate["p_value"] > 0.05
    assert decision["decision"] == "refused" and ">= alpha 0.05" in gate["why"]
    assert client.get_model_version_by_alias(name, "champion").version == first.model_version
    tags = client.get_model_version(candidates, summary.new_version).tags
    assert tags["promotion.markout.min_improvement_bps"] == "5.0"
    assert tags["promotion.markout.why"] == gate["why"]
    # refused on the mark-out gate: the reproduction was not run (it would take minutes)
    assert decision["gates"]["reproduction"]["skipped"], decision["gates"]
    assert "promotion.time_s" not in tags

    # Nothing new landed: the same key, the same version; no copy is registered. (A
    # candidate's recipe, by its number in the candidates model: no promotion needed.)
    again = retrain(workspace=workspace, model=candidates, alias=summary.new_version)
    assert again.new_version is None and again.model_cached
    assert again.version == summary.new_version
    assert versions(candidates) == registered + 1  # the first retrain's version only
    assert versions(name) == 1  # the champion only

    # One day of data: the retrain holds out the end of the day (an intraday fold). The
    # window is those rows; the champion never saw the day.
    one_day = retrain(workspace=workspace, days=1)
    assert (one_day.start, one_day.end) == (newer[-1], newer[-1])
    decision = promote(one_day.mlflow_run_id, reproduce_sample=2, min_improvement_bps=5.0,
                       workspace=workspace)  # fmt: skip
    window = decision["gates"]["markout"]["window"]
    cut = int(0.7 * SYNTHETIC["events_per_day"])  # floor((1 - 0.3) x rows)
    assert window["from_row"] == {f"{p}/{newer[-1]}": cut for p in ("SYNA", "SYNB")}
    assert window["events"] == 2 * (SYNTHETIC["events_per_day"] - cut)
    assert decision["decision"] == "refused"


@pytest.mark.slow
@pytest.mark.server
def test_backtest_nodes_are_cached_by_the_models_weights(champion, mlflow_uri):
    workspace, name, first, newer = champion
    client = MlflowClient(mlflow_uri)
    ran = backtest(workspace=workspace)  # the champion over every landed day: 2 x 4
    assert (ran.nodes, ran.computed, ran.cache_hits, ran.failed) == (8, 8, 0, 0)
    assert ran.version == first.model_version and ran.device == "cpu"
    assert ran.total["trades"] > 0 and set(ran.products) == {"SYNA", "SYNB"}
    recorded = client.get_run(ran.mlflow_run_id).data
    assert recorded.metrics["nodes"] == 8 and recorded.tags["model_version"] == first.model_version
    assert recorded.metrics["total.trades"] == ran.total["trades"]

    again = backtest(workspace=workspace, version=first.model_version)
    assert (again.nodes, again.computed, again.cache_hits) == (8, 0, 8)
    assert again.total == ran.total

    # Another version (other weights): every node recomputes. (Its newest three days:
    # the champion's recipe on days no other retrain of the module trains on.)
    other = retrain(workspace=workspace, days=3)
    assert other.new_version is not None
    third = backtest(workspace=workspace, model=f"{name}-candidates", version=other.new_version)
    assert (third.nodes, third.computed, third.cache_hits) == (8, 8, 0)
    summary = json.loads(
        read_artifact(client, third.mlflow_run_id, "summary/backtest_summary.json")
    )
    assert summary["version"] == other.new_version


@pytest.mark.slow
@pytest.mark.server
def test_a_bad_model_or_version_is_named(prefect_api, mlflow_uri, tmp_path):
    client = MlflowClient(mlflow_uri)
    name = f"retrain-missing-{uuid.uuid4().hex[:8]}"
    with pytest.raises(LookupError, match=f"no registered model '{name}' at {mlflow_uri}"):
        resolve_version(client, name, "champion")
    client.create_registered_model(name)
    with pytest.raises(LookupError, match=f"'{name}' has no version '7'.*no versions"):
        resolve_version(client, name, "7")
    with pytest.raises(LookupError, match=f"'{name}' has no alias 'champion'"):
        resolve_version(client, name, "champion")
    workspace = Workspace(home=str(tmp_path / "home"), tracking=MlflowTracking(
        tracking_uri=mlflow_uri, experiment=name, registered_model=name))  # fmt: skip
    with pytest.raises(LookupError, match=f"'{name}' has no alias 'champion'"):
        backtest(workspace=workspace)
    with pytest.raises(LookupError, match=f"'{name}' has no alias 'champion'"):
        retrain(workspace=workspace)


def test_backtest_device_auto_is_a_gpu_when_the_site_has_one():
    import torch

    from quantloop.blocks import Site
    from quantloop.flows.backtest import resolve_backtest_device

    cluster = dict(name="gpu-site", scheduler_address="tcp://10.0.0.9:8786", storage_root="/x")
    assert resolve_backtest_device("auto", Site(**cluster, gpus=2)) == "cuda"
    assert resolve_backtest_device("auto", Site(**cluster)) == "cpu"
    assert resolve_backtest_device("cpu", Site(**cluster, gpus=2)) == "cpu"  # asked for
    local = Site(name="local", storage_root="/x")  # the embedded LocalCluster: this host's
    assert resolve_backtest_device("auto", local) == ("cuda" if torch.cuda.is_available()
                                                      else "cpu")  # fmt: skip
