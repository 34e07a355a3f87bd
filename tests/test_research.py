"""The research flow end to end: real Prefect API, real Dask cluster, real MLflow server."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
from mlflow.tracking import MlflowClient
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import (
    ArtifactFilter,
    ArtifactFilterKey,
    ArtifactFilterType,
    FlowRunFilter,
    FlowRunFilterId,
)
from typer.testing import CliRunner

from quantloop.cli import app
from quantloop.flows.research import ResearchParams, research
from quantloop.tasks.data.catalog import Catalog
from quantloop.tasks.data.ingest import DataValidationError
from quantloop.tasks.data.landing import land_lobster

TINY = {
    "data": {
        "products": ["SYNA", "SYNB"],
        "n_dates": 3,
        "synthetic": {"events_per_day": 4_000, "levels": 3},
    },
    "train": {"steps": 30, "batch_size": 64, "log_every": 5},
}


def tiny_params(home: Path, mlflow_uri: str, **extra) -> ResearchParams:
    values = {**TINY, "workspace": {"home": str(home), "tracking_uri": mlflow_uri}, **extra}
    return ResearchParams.model_validate(values)


def children(client: MlflowClient, run_id: str) -> dict:
    run = client.get_run(run_id)
    found = client.search_runs(
        [run.info.experiment_id], filter_string=f"tags.mlflow.parentRunId = '{run_id}'"
    )
    return {r.data.tags["quantloop.stage"]: r for r in found}


@pytest.mark.slow
def test_research_records_everything_and_reruns_from_cache(
    prefect_api, mlflow_uri, tmp_path, monkeypatch
):
    # On the LocalCluster, as the module says: these 6 small first nodes would otherwise
    # run in the flow's process (flows/features.py, QUANTLOOP_INLINE_BELOW_S)
    monkeypatch.setenv("QUANTLOOP_INLINE_BELOW_S", "0")
    params = tiny_params(tmp_path / "home", mlflow_uri)
    first = research(params)

    assert first.nodes == 6 and first.computed == 6 and first.cache_hits == 0
    # The default validation: two walk-forward folds, each testing one date on a model
    # trained on every date before it; the run's mark-out pools their test windows.
    assert first.folds == 2 and [r["index"] for r in first.per_fold] == [0, 1]
    assert [(r["train"]["dates"], r["test"]["first"]) for r in first.per_fold] == [
        (1, "2026-03-03"), (2, "2026-03-04")]  # fmt: skip
    assert sum(r["trades"] for r in first.per_fold) == first.trades
    assert set(first.markout_bps) == {"1s", "5s", "30s", "60s", "300s", "10ev", "100ev"}
    assert first.trades > 0 and first.baseline_trades > 0
    assert first.tracking_uri == mlflow_uri

    client = MlflowClient(mlflow_uri)
    parent = client.get_run(first.mlflow_run_id)
    tags = parent.data.tags
    for tag in ("code_digest", "data_digest", "params_hash", "model_digest"):
        assert len(tags[tag]) == 64, tag
    assert tags["prefect_flow_run_id"] == first.prefect_flow_run_id != ""
    assert tags["site"] == "local"
    assert parent.data.metrics["nodes"] == 6
    # An ML experiment in the UI (not the GenAI view); Source, User and run name filled in.
    experiment = client.get_experiment(parent.info.experiment_id)
    assert experiment.tags["mlflow.experimentKind"] == "custom_model_development"
    assert tags["mlflow.source.name"] == "quantloop.flows.research" and tags["mlflow.user"]
    assert parent.info.run_name == f"research-{tags['prefect_flow_run_name']}"
    # Every input: the resolved parameters, each product's effective features, the data.
    [dataset] = parent.inputs.dataset_inputs
    assert dataset.dataset.name == "synthetic"
    assert {t.key: t.value for t in dataset.tags}["quantloop.digest"] == first.data_digest
    assert dataset.dataset.digest == first.data_digest[:32]
    assert parent.data.params["features.return_lags"] == "[1, 10, 100]"  # lists one way
    assert parent.data.metrics["markout_bps.5s"] == pytest.approx(first.markout_bps["5s"])
    assert "baseline_markout_bps.5s" in parent.data.metrics

    stages = children(client, parent.info.run_id)
    assert set(stages) == {"features", "train", "simulate"}
    assert {r.data.tags["prefect_flow_run_id"] for r in stages.values()} != {""}
    assert first.mlflow_stage_runs == {n: r.info.run_id for n, r in stages.items()}

    # The Prefect UI's summary: a markdown artifact of the flow run, linking every MLflow run.
    with get_client(sync_client=True) as prefect:
        artifacts = prefect.read_artifacts(
            artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=["research-summary"])),
            flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[first.prefect_flow_run_id])),
        )
    [artifact] = artifacts
    assert "Mark-out" in artifact.data and all(r.info.run_id in artifact.data
                                               for r in stages.values())  # fmt: skip
    features = stages["features"]
    assert features.data.metrics["cache_hits"] == 0 and features.data.metrics["computed"] == 6
    # Shard progress in the Prefect UI: a progress artifact per shard, at 100% when done.
    with get_client(sync_client=True) as prefect:
        progress = prefect.read_artifacts(
            artifact_filter=ArtifactFilter(type=ArtifactFilterType(any_=["progress"])),
            flow_run_filter=FlowRunFilter(
                id=FlowRunFilterId(any_=[features.data.tags["prefect_flow_run_id"]])
            ),
        )
    assert [a.data for a in progress] == [100.0]
    assert len(features.data.params["code_fingerprint"]) == 64
    # The manifest's parts (one per shard), as the run folder beside the outputs holds them.
    manifest = pq.read_table(
        client.download_artifacts(
            features.info.run_id, "manifest/features_manifest", str(tmp_path / "first")
        )
    )
    assert manifest.num_rows == 6
    assert set(manifest["status"].to_pylist()) == {"ok"}
    assert all(len(d) == 64 for d in manifest["output_digest"].to_pylist())

    # The model is in the Model Registry, tagged with what made it, and the registered
    # version predicts what the trained model predicts.
    version = client.get_model_version(first.registered_model, first.model_version)
    for tag in ("data_digest", "code_digest", "model_params_hash", "model_key", "model_digest"):
        assert len(version.tags[tag]) == 64, tag
    assert version.tags["model_digest"] == first.model_digest
    assert version.tags["data_digest"] == first.data_digest
    assert version.run_id == stages["train"].info.run_id
    import mlflow.pytorch
    import torch

    from quantloop.tasks.records import registry
    from quantloop.tasks.research.stage import StageParams, feature_outputs
    from quantloop.tasks.research.training import load_model, predict
    from quantloop.tasks.runtime.workspace import Workspace

    with registry.tracking_uri(mlflow_uri):
        registered = mlflow.pytorch.load_model(f"models:/{version.name}/{version.version}")
    trained = load_model(first.model_url)
    [table, *_] = [o.read() for _, o in sorted(feature_outputs(StageParams(
        workspace=Workspace(home=str(tmp_path / "home")))).items())]  # fmt: skip
    anchors = np.arange(0, table.num_rows, 97)
    with torch.no_grad():
        served = registered(torch.from_numpy(registry.windows(trained, table, anchors))).numpy()
    assert np.allclose(served, predict(trained, table)[anchors], rtol=1e-4, atol=1e-4)
    assert len(client.search_logged_models([parent.info.experiment_id])) >= 1

    loss = client.get_metric_history(stages["train"].info.run_id, "loss")
    assert [m.step for m in loss] == [5, 10, 15, 20, 25, 30]
    train_run = stages["train"].data
    assert train_run.tags["model_digest"] == first.model_digest
    # auto on a CPU: no ladder result for it, so the plain loop, and it says so
    assert first.train_rungs == [] and train_run.tags["rungs"] == "none"
    assert train_run.params["plan.optimizations"] == "auto"
    assert train_run.params["plan.rungs"] == "none" and "step_ms" in train_run.metrics
    artifacts = {a.path for a in client.list_artifacts(stages["simulate"].info.run_id)}
    assert {"markout_curve.png", "markouts"} <= artifacts
    assert "model.total.markout_bps.5s" in stages["simulate"].data.metrics

    again = research(params)
    assert again.cache_hits == again.nodes == 6 and again.computed == 0
    assert again.model_cached and again.simulation_cached
    assert again.model_digest == first.model_digest
    assert (again.registered_model, again.model_version) == (first.registered_model,
                                                             first.model_version)  # fmt: skip
    assert again.markout_bps == first.markout_bps
    # the re-run names the first run of its configuration, so later runs count its trial
    # without reading it (tasks/records/runs.trials_on); the first names none
    from quantloop.tasks.records.runs import REPEAT_TAG

    assert client.get_run(again.mlflow_run_id).data.tags[REPEAT_TAG] == first.mlflow_run_id
    assert REPEAT_TAG not in tags
    # Whether a run will train is known before its features stage: the train stage's
    # keys from the planned feature nodes (a GPU run imports Inductor ahead only then)
    import dataclasses

    from quantloop.flows.train import models_missing, plan_for
    from quantloop.tasks.runtime.workspace import Selection

    selection = Selection(dataset="synthetic", pin=first.data_digest)
    stage = params.stage(selection)
    assert not models_missing(stage, params.train, plan_for(stage, params.train))
    reseeded = dataclasses.replace(params.train, seed=params.train.seed + 1)
    assert models_missing(stage, reseeded, plan_for(stage, reseeded))
    other = tiny_params(tmp_path / "home", mlflow_uri,
                        product_features={"SYNB": {"ofi_window": 20}}).stage(selection)  # fmt: skip
    assert models_missing(other, params.train, plan_for(other, params.train))

    changed = research(
        tiny_params(tmp_path / "home", mlflow_uri, product_features={"SYNB": {"ofi_window": 20}})
    )
    assert changed.computed == 3 and changed.cache_hits == 3
    assert not changed.model_cached  # SYNB's features changed, so the model must too
    stages = children(client, changed.mlflow_run_id)
    manifest = pq.read_table(
        client.download_artifacts(
            stages["features"].info.run_id, "manifest/features_manifest", str(tmp_path / "changed")
        )
    )
    assert stages["features"].data.metrics["recomputed.params"] == 3
    by_product = Path(client.download_artifacts(
        stages["features"].info.run_id, "manifest/nodes_by_product.csv", str(tmp_path)
    )).read_text().splitlines()  # fmt: skip
    assert by_product[0].startswith('"product","nodes","computed","cache_hits","failed",')
    assert by_product[1].startswith('"SYNA",3,0,3,0,""')
    assert by_product[2].startswith('"SYNB",3,3,0,0,"params 3"')
    # The override is visible in MLflow: as a param, and in the resolved parameters.
    changed_parent = client.get_run(changed.mlflow_run_id)
    assert changed_parent.data.params["product_features.SYNB.ofi_window"] == "20"
    resolved = json.loads(
        Path(
            client.download_artifacts(
                changed.mlflow_run_id, "params/resolved_params.json", str(tmp_path)
            )
        ).read_text()
    )
    assert resolved["effective_features"]["SYNB"]["ofi_window"] == 20
    assert resolved["effective_features"]["SYNA"]["ofi_window"] == 50
    ran = manifest.filter(pc.invert(manifest["cache_hit"]))
    assert set(ran["product"].to_pylist()) == {"SYNB"}
    assert set(ran["reason"].to_pylist()) == {"params"}

    # The same records from the command line, and one node's lineage both ways.
    home = str(tmp_path / "home")
    runner = CliRunner(env={"COLUMNS": "400"})
    out = runner.invoke(app, ["nodes", "--home", home, "--computed", "--json"])
    assert out.exit_code == 0, out.output
    rows = sorted(json.loads(out.output), key=lambda r: r["date"])
    assert {r["product"] for r in rows} == {"SYNB"} and len(rows) == 3
    # Two walk-forward folds on three dates: the first date trains both folds' models, the
    # second the last fold's (the registered one), the third is only tested on.
    first_fold, last_fold = changed.per_fold
    used_by = []
    for row in rows:
        out = runner.invoke(app, ["nodes", "--home", home, "--lineage", row["key"][:20]])
        assert out.exit_code == 0, out.output
        lineage = json.loads(out.output)
        assert lineage["params"]["ofi_window"] == 20
        assert lineage["inputs"][0]["dataset"] == "synthetic"
        used_by.append(sorted(m["model_digest"] for m in lineage["used_by_models"]))
    assert used_by == [sorted([first_fold["model_digest"], changed.model_digest]),
                       [changed.model_digest], []]  # fmt: skip
    assert last_fold["model_digest"] == changed.model_digest
    out = runner.invoke(app, ["nodes", "--home", home, "--product", "SYNA", "--all-runs"])
    assert out.exit_code == 0 and "9 of 18 nodes match" in out.output

    # The ladder's rungs a CPU runs, asked for by name: another model key, trained through
    # profiling.trainer and recorded; "none" is the plain loop, the first run's model.
    train = {**TINY["train"], "optimizations": ["device_metrics", "packing"]}
    packed = research(tiny_params(tmp_path / "home", mlflow_uri, train=train))
    assert not packed.model_cached and packed.model_digest != first.model_digest
    assert packed.train_rungs == ["device_metrics", "packing"] and packed.train_samples_per_s > 0
    packed_train = children(client, packed.mlflow_run_id)["train"].data
    assert packed_train.tags["rungs"] == "device_metrics,packing"
    assert packed_train.params["plan.rungs_unproven"] == "device_metrics,packing"
    assert {"steady_samples_per_s", "step_ms", "warmup_s"} <= set(packed_train.metrics)
    train = {**TINY["train"], "optimizations": "none"}
    plain = research(tiny_params(tmp_path / "home", mlflow_uri, train=train))
    assert plain.model_cached and plain.model_digest == first.model_digest


@pytest.mark.slow
def test_walk_forward_reruns_from_cache_and_a_new_day_adds_one_fold(
    prefect_api, mlflow_uri, tmp_path
):
    """Every fold's model and simulation are found by key on a re-run; with as many folds
    as fit, one more day adds one fold and the earlier folds' models and simulations are
    cache hits, with the same digests and mark-outs."""

    def run(n_dates: int):
        return research(ResearchParams.model_validate({
            "workspace": {"home": str(tmp_path / "home"), "tracking_uri": mlflow_uri},
            "data": {"products": ["SYNA"], "n_dates": n_dates,
                     "synthetic": {"events_per_day": 2_000, "levels": 2}},
            "train": {"steps": 5, "batch_size": 32, "log_every": 5, "optimizations": "none"},
            "validation": {"folds": None, "test_dates": 1},
        }))  # fmt: skip

    def results(rows: list[dict]) -> list[dict]:  # what a fold gave, not whether it was cached
        return [{k: v for k, v in r.items() if not k.endswith("_cached")} for r in rows]

    first = run(3)
    assert first.folds == 2 and not first.model_cached and not first.simulation_cached
    again = run(3)
    assert again.computed == 0 and again.model_cached and again.simulation_cached
    assert all(r["model_cached"] and r["simulation_cached"] for r in again.per_fold)
    assert results(again.per_fold) == results(first.per_fold)
    assert again.markout_bps == first.markout_bps
    more = run(4)
    assert more.folds == 3 and more.computed == 1  # the new day's feature node
    old, new = more.per_fold[:2], more.per_fold[2]
    assert [(r["model_cached"], r["simulation_cached"]) for r in old] == [(True, True)] * 2
    assert results(old) == results(first.per_fold)  # the same windows, models, mark-outs
    assert (new["index"], new["test"]["first"], new["train"]["dates"]) == (2, "2026-03-05", 3)
    assert not new["model_cached"] and not new["simulation_cached"]
    assert more.model_digest == new["model_digest"] != first.model_digest
    assert sum(r["trades"] for r in more.per_fold) == more.trades

    # MLflow: per-fold figures in batches on the stage runs, the folds' window params, the
    # last fold's model as the registered version, the fold of every stored mark-out.
    client = MlflowClient(mlflow_uri)
    parent = client.get_run(more.mlflow_run_id)
    assert parent.data.params["validation.folds"] == "None"
    assert parent.data.params["validation.test_dates"] == "1" and parent.data.params["folds"] == "3"
    stages = children(client, more.mlflow_run_id)
    train = stages["train"].data
    assert [train.metrics[f"fold{k}.cache_hit"] for k in range(3)] == [1.0, 1.0, 0.0]
    assert train.metrics["fold2.final_loss"] == train.metrics["final_loss"]
    assert json.loads(train.tags["fold_window"])["test"] == ["2026-03-05", "2026-03-05", 1]
    version = client.get_model_version(more.registered_model, more.model_version)
    assert version.tags["model_digest"] == more.model_digest
    sim = stages["simulate"].data
    assert sim.metrics["fold2.trades"] == new["trades"]
    marks = pq.read_table(client.download_artifacts(
        stages["simulate"].info.run_id, "markouts/markouts.parquet", str(tmp_path)))  # fmt: skip
    assert sorted(set(marks["fold"].to_pylist())) == [0, 1, 2]
    by_fold = marks.filter(pc.equal(marks["signal_name"], "model")).group_by("fold").aggregate(
        [("fold", "count")]).to_pylist()  # fmt: skip
    assert {r["fold"]: r["fold_count"] for r in by_fold} == {
        r["index"]: r["trades"] for r in more.per_fold if r["trades"]}  # fmt: skip


@pytest.mark.slow
def test_research_on_lobster_files(prefect_api, tmp_path, lobster_dir):
    params = ResearchParams.model_validate(
        {
            "workspace": {"home": str(tmp_path / "home")},
            "data": {"lobster_dir": str(lobster_dir)},
            "train": {"steps": 20, "batch_size": 64},
        }
    )
    summary = research(params)
    # AMZN's 1-level file is superseded by its 5-level file for the same day.
    assert summary.dataset == "lobster" and summary.nodes == 2
    assert set(summary.per_product) == {"AMZN", "GOOG"}
    assert summary.trades > 0
    assert summary.tracking_uri.startswith("sqlite:///")
    # the data stage recorded what each file held (tests/test_sources.py: a next run
    # reads none of them)
    index = json.loads((tmp_path / "home" / "lobster-sources.json").read_text())
    digests = {Path(f).name: entry["digests"] for f, entry in index["sources"].items()}
    assert sorted(digests) == sorted(p.name for p in lobster_dir.glob("*.zip"))
    assert digests.pop("LOBSTER_SampleFile_AMZN_2012-06-21_1.zip") == [None]  # superseded
    assert all(len(d) == 1 and d[0] for d in digests.values())  # landed, by its digest


def test_cli_rejects_unknown_parameter_before_writing_anything(tmp_path):
    bad = tmp_path / "params.json"
    bad.write_text(json.dumps({"train": {"stepz": 3}}))
    home = tmp_path / "home"
    runner = CliRunner(env={"COLUMNS": "400"})
    result = runner.invoke(app, ["run", "--params", str(bad), "--home", str(home)])
    assert result.exit_code == 2
    assert "stepz" in result.output
    assert not home.exists()


def test_cli_rejects_missing_lobster_folder(tmp_path):
    runner = CliRunner(env={"COLUMNS": "400"})  # no wrapping inside the error box
    result = runner.invoke(app, ["run", "--lobster", str(tmp_path / "nope")])
    assert result.exit_code == 2 and "does not exist" in result.output


def test_bad_file_in_a_folder_lands_nothing(tmp_path, lobster_dir):
    """One truncated zip among good ones: a clear error, and no partition is landed."""
    folder = tmp_path / "lobster"
    folder.mkdir()
    good = lobster_dir / "LOBSTER_SampleFile_AMZN_2012-06-21_1.zip"
    shutil.copy(good, folder / good.name)
    data = good.read_bytes()
    (folder / "LOBSTER_SampleFile_MSFT_2012-06-21_1.zip").write_bytes(data[: len(data) // 3])
    catalog = Catalog(tmp_path / "catalog.sqlite")
    root = tmp_path / "store"
    with pytest.raises(DataValidationError, match="MSFT_2012-06-21_1.zip"):
        land_lobster(catalog, str(root), folder)
    assert catalog.entries("lobster") == []
    assert not root.exists()


@pytest.mark.parametrize("fault", ["wrong column count", "crossed book", "non-monotonic time"])
def test_bad_csv_day_beside_a_good_one_lands_nothing(tmp_path, fault):
    """A folder with a good day and a bad one: the error names the bad file and row,
    and no day of the folder is landed (no dataset file, no catalog row)."""
    from tests.test_ingest import BOOK, MSG, write_day

    folder = tmp_path / "lobster"
    folder.mkdir()
    write_day(folder, MSG, BOOK)  # TEST, 2024-01-02: valid
    msg, book = list(MSG), list(BOOK)
    if fault == "wrong column count":
        book[2] += ",5"
        where = r"OTHER_2024-01-03_.*orderbook_2\.csv: row 3"
    elif fault == "crossed book":
        book[1] = "999000,100,1000000,200,9999999999,0,-9999999999,0"
        where = r"OTHER_2024-01-03_.*orderbook_2\.csv: row 2"
    else:
        msg[2] = "34200.05" + msg[2][len("34200.30") :]
        where = r"OTHER_2024-01-03_.*message_2\.csv: row 3"
    stem = "OTHER_2024-01-03_34200000_57600000"
    (folder / f"{stem}_message_2.csv").write_text("\n".join(msg) + "\n")
    (folder / f"{stem}_orderbook_2.csv").write_text("\n".join(book) + "\n")
    catalog = Catalog(tmp_path / "catalog.sqlite")
    root = tmp_path / "store"
    with pytest.raises(DataValidationError, match=where):
        land_lobster(catalog, str(root), folder)
    assert catalog.entries("lobster") == []
    assert not root.exists()
