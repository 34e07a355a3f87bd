"""How many MLflow calls a research run's records cost, counted at a real (locked) MLflow
server's door; that the run's timeline counts the same calls; that the registered model
still loads and predicts; that a record that fails to send fails its run.

Measured here (tests/test_research.py's TINY run, MLflow 3.17, basic auth), HTTP requests
to the server: a first run 112 before this module's bounds were set, 42 after; a no-op
re-run (every node a cache hit, the model and simulation found by key) 41, then 28.
"""

from __future__ import annotations

import dataclasses
import signal
import threading
from pathlib import Path

import numpy as np
import pytest
import requests
from mlflow.entities import LoggedModelStatus
from mlflow.tracking import MlflowClient
from prefect.exceptions import TerminationSignal

from quantloop.blocks import MlflowTracking
from quantloop.tasks.records import tracking
from quantloop.tasks.runtime import timeline

# Bounds on the HTTP requests of one TINY research run's records (measured: 42 on a new
# server, 39 where the experiment and registered model exist; 28 for the re-run).
FIRST_RUN_CALLS = 45
NO_OP_RERUN_CALLS = 30
SERVER_INFO = "/api/3.0/mlflow/server-info"


class Requests:
    """Every HTTP request this process sends to `uri` (MLflow's client uses requests;
    Prefect's httpx is not counted), from any thread."""

    def __init__(self, uri: str):
        self.uri, self.sent, self._lock = uri, [], threading.Lock()
        self.outside: list[str] = []  # sent outside every call the timeline counts

    def install(self, monkeypatch) -> Requests:
        send = requests.Session.send

        def counted(session, request, **kwargs):
            if request.url.startswith(self.uri):
                with self._lock:
                    path = request.url[len(self.uri) :].split("?")[0]
                    self.sent.append(f"{request.method} {path}")
                    if not getattr(tracking._calls, "depth", 0):  # this thread's call depth
                        self.outside.append(self.sent[-1])
            return send(session, request, **kwargs)

        monkeypatch.setattr(requests.Session, "send", counted)
        return self

    def since(self, start: int) -> list[str]:
        with self._lock:
            return self.sent[start:]


def timeline_calls() -> int:
    totals = timeline.report()["totals"]
    return sum(totals.get(k, {}).get("count", 0) for k in ("mlflow", tracking.BACKGROUND_TOTAL))


@pytest.mark.slow
@pytest.mark.server
def test_a_research_runs_records_cost_few_calls_and_a_rerun_fewer(
    prefect_api, mlflow_uri, tmp_path, monkeypatch
):
    from quantloop.flows.research import research
    from tests.test_research import tiny_params

    sent = Requests(mlflow_uri).install(monkeypatch)
    params = tiny_params(tmp_path / "home", mlflow_uri)
    # A seed of its own: tests/test_research.py registers the same tiny model on the same
    # session server, and a first run that finds its version there makes no registration
    # calls (in the whole suite this first run then counted 28, as many as the re-run).
    params = params.model_copy(update={"train": dataclasses.replace(params.train, seed=4242)})

    counted = timeline_calls()
    first = research(params)
    calls = sent.since(0)
    assert not first.model_cached
    assert len(calls) <= FIRST_RUN_CALLS, "\n".join(sorted(calls))
    # One experiment lookup for the run and its three stages; every version tag in the
    # call that makes the version; no run read back to find where its files go.
    assert calls.count("GET /api/2.0/mlflow/experiments/get-by-name") == 1
    assert not [c for c in calls if "model-versions/set-tag" in c or "metrics/get-history" in c]
    assert "GET /api/2.0/mlflow/runs/get" not in calls
    # --profile's totals count every one of them: each request is sent inside a call the
    # timeline counts, one count a request, but for MLflow's own probe of the server's
    # artifact capabilities (GET server-info, once an artifact repository, since MLflow
    # 3.18), which its upload makes inside that upload's call: its time is in that call's.
    assert not sent.outside, sent.outside
    probes = [c for c in calls if c == f"GET {SERVER_INFO}"]
    assert len(probes) <= 1, probes
    assert timeline_calls() - counted == len(calls) - len(probes)

    again = research(params)
    rerun = sent.since(len(calls))
    assert again.model_cached and again.simulation_cached and again.computed == 0
    assert len(rerun) <= NO_OP_RERUN_CALLS, "\n".join(sorted(rerun))
    assert len(rerun) < len(calls)
    assert not [c for c in rerun if "logged-models" in c or "registered-models" in c]

    # What the cheaper records still say: the parent's tags (given at creation), the
    # stages' metrics and files, the version's tags, the logged model's metrics.
    client = MlflowClient(mlflow_uri)
    parent = client.get_run(again.mlflow_run_id)
    assert parent.data.tags["params_hash"] == again.params_hash
    assert parent.data.tags["model_version"] == first.model_version
    assert parent.data.params["features.return_lags"] == "[1, 10, 100]"
    assert [d.dataset.name for d in parent.inputs.dataset_inputs] == ["synthetic"]
    assert {a.path for a in client.list_artifacts(parent.info.run_id, "params")} == {
        "params/resolved_params.json"}  # fmt: skip
    train = client.get_run(first.mlflow_stage_runs["train"])
    assert train.info.status == "FINISHED" and "final_loss" in train.data.metrics
    train_files = {a.path for a in client.list_artifacts(train.info.run_id)}
    assert {"folds", "loss_curve.png"} <= train_files
    assert [m.step for m in client.get_metric_history(train.info.run_id, "loss")] == [
        5, 10, 15, 20, 25, 30]  # fmt: skip
    version = client.get_model_version(first.registered_model, first.model_version)
    for tag in ("model_key", "model_digest", "data_digest", "train_run_id", "research_run_id",
                "train_config", "fold_window", "rungs", "ladder_result"):  # fmt: skip
        assert version.tags.get(tag), tag
    assert version.run_id == train.info.run_id
    [output] = train.outputs.model_outputs
    logged = client.get_logged_model(output.model_id)
    assert logged.status == LoggedModelStatus.READY
    assert {m.key for m in logged.metrics or []} >= {"final_loss", "samples"}
    assert version.source == f"models:/{output.model_id}"
    sim = client.get_run(first.mlflow_stage_runs["simulate"])
    assert {"markout_curve.png", "markouts", "folds", "validation"} <= {
        a.path for a in client.list_artifacts(sim.info.run_id)}  # fmt: skip

    _loads_and_predicts(mlflow_uri, first, tmp_path)


def _loads_and_predicts(mlflow_uri: str, summary, tmp_path: Path) -> None:
    """The registered version, loaded by its models:/ URI, takes raw feature windows and
    predicts what the trained model predicts."""
    import mlflow.pytorch
    import torch

    from quantloop.tasks.records import registry
    from quantloop.tasks.research.stage import StageParams, feature_outputs
    from quantloop.tasks.research.training import load_model, predict
    from quantloop.tasks.runtime.workspace import Workspace

    with registry.tracking_uri(mlflow_uri):
        served = mlflow.pytorch.load_model(
            f"models:/{summary.registered_model}/{summary.model_version}"
        )
    trained = load_model(summary.model_url)
    [table, *_] = [o.read() for _, o in sorted(feature_outputs(StageParams(
        workspace=Workspace(home=str(tmp_path / "home")))).items())]  # fmt: skip
    anchors = np.arange(0, table.num_rows, 97)
    with torch.no_grad():
        got = served(torch.from_numpy(registry.windows(trained, table, anchors))).numpy()
    assert np.allclose(got, predict(trained, table)[anchors], rtol=1e-4, atol=1e-4)


# ---------------------------------------------------------------- no server: a local store


def _local(tmp_path: Path) -> tuple[MlflowClient, str]:
    return tracking.client_for(MlflowTracking(tracking_uri=f"sqlite:///{tmp_path}/mlflow.db"))


def test_a_file_that_fails_to_send_fails_its_run(tmp_path):
    """Files go up in the background; one that fails makes the run's end raise and the
    run end FAILED: never a finished run with a record missing."""
    client, experiment = _local(tmp_path)
    with pytest.raises(FileNotFoundError):
        with tracking.run(client, experiment, "broken") as run:
            run.metrics({"x": 1.0})
            run.artifact(str(tmp_path / "not-there.txt"))
    recorded = client.get_run(run.run_id)
    assert recorded.info.status == "FAILED"
    assert recorded.data.metrics["x"] == 1.0  # what could be sent, was


@pytest.mark.parametrize("stop", [KeyboardInterrupt(), TerminationSignal(signal.SIGTERM)])
def test_a_run_a_signal_stops_ends_killed(tmp_path, stop):
    """Ctrl-C, or the SIGTERM serve sends a process an earlier stack left (Prefect raises
    it as TerminationSignal), is no failure of the run's code: KILLED, as serve's own
    clean-up marks a run whose process it ended (the two race; they must agree)."""
    client, experiment = _local(tmp_path)
    with pytest.raises(type(stop)):
        with tracking.run(client, experiment, "stopped") as run:
            run.metrics({"x": 1.0})
            raise stop
    recorded = client.get_run(run.run_id)
    assert recorded.info.status == "KILLED"
    assert recorded.data.metrics["x"] == 1.0


def test_the_schema_head_is_found_once_and_an_old_store_still_refused(tmp_path):
    """The migration scripts' head is cached (tracking.cache_schema_head); the store's own
    revision is read at each opening, so a store left at an older revision is refused as
    MLflow refuses it."""
    import sqlite3

    from mlflow.exceptions import MlflowException
    from mlflow.store.db import utils
    from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore

    _local(tmp_path)
    assert utils._get_latest_schema_revision.cache_info().currsize == 1
    with sqlite3.connect(tmp_path / "mlflow.db") as db:
        db.execute("UPDATE alembic_version SET version_num = 'older'")
    with pytest.raises(MlflowException, match="out-of-date database schema"):
        # a store opened anew (MLflow's client keeps the one it opened per URI)
        SqlAlchemyStore(f"sqlite:///{tmp_path}/mlflow.db", str(tmp_path / "artifacts"))


def test_sends_in_the_background_arrive_in_order_before_the_run_ends(tmp_path):
    client, experiment = _local(tmp_path)
    with tracking.run(client, experiment, "ordered") as run:
        run.tags({"t": "first"})
        run.params({f"p{i}": i for i in range(150)})  # two batches: 100 params a call
        run.send()
        run.json({"a": 1}, "a.json", "files")
        run.file(b"bytes", "b.bin")
        run.tags({"t": "second"})  # sent after the first, so it stays
        run.series("loss", [float(i) for i in range(1500)])  # two batches: 1,000 values a call
    got = client.get_run(run.run_id)
    assert got.info.status == "FINISHED"
    assert got.data.tags["t"] == "second" and len(got.data.params) == 150
    assert len(client.get_metric_history(run.run_id, "loss")) == 1500
    assert {a.path for a in client.list_artifacts(run.run_id)} == {"files", "b.bin"}
    # Nothing waits for the senders at exit (`quantloop` joins every non-daemon thread
    # before its exit handlers: an executor's idle workers would hang it).
    senders = [t for t in threading.enumerate() if t.name.startswith("mlflow-send")]
    assert senders and all(t.daemon for t in senders)


def test_a_runs_stages_look_the_experiment_up_once(tmp_path, monkeypatch):
    block = MlflowTracking(tracking_uri=f"sqlite:///{tmp_path}/mlflow.db")
    first, experiment = tracking.client_for(block)
    looked = []
    real = tracking._client_for
    monkeypatch.setattr(tracking, "_client_for", lambda *a: looked.append(a) or real(*a))
    with tracking.shared_clients():
        assert tracking.client_for(block)[1] == experiment
        assert tracking.client_for(block)[1] == experiment
        other = block.model_copy(update={"experiment": "another"})
        assert tracking.client_for(other)[1] != experiment
    assert len(looked) == 2  # once for each experiment inside the block
    tracking.client_for(block)
    assert len(looked) == 3  # and again after it: a later run looks for itself


def test_importing_the_records_modules_imports_no_mlflow_torch_or_matplotlib():
    import subprocess
    import sys

    code = ("import sys; import quantloop.tasks.records.tracking, quantloop.tasks.records.runs, "
            "quantloop.tasks.records.recipe, quantloop.tasks.records.registry, "
            "quantloop.tasks.records.plots; "
            "print(sorted(m for m in ('mlflow', 'mlflow.models', 'mlflow.pytorch', 'torch', "
            "'matplotlib') if m in sys.modules))")  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
