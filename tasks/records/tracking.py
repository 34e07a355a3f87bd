"""MLflow recording in batches: one HTTP call carries up to 1,000 metrics.

A tracking-server round trip costs ~66 ms here, so nothing in quantloop logs a
metric at a time; stages collect values and send them with `RunLog.flush()`.
"""

from __future__ import annotations

import contextlib
import fcntl
import getpass
import json
import os
import socket
import tempfile
import time
import warnings
from collections.abc import Iterator, Mapping
from typing import Any

import psutil
import pyarrow as pa
from mlflow.data.dataset_source_registry import resolve_dataset_source
from mlflow.data.meta_dataset import MetaDataset
from mlflow.entities import DatasetInput, InputTag, Metric, Param, RunTag
from mlflow.tracking import MlflowClient

from quantloop.blocks.tracking import MlflowTracking
from quantloop.tasks.engine import storage
from quantloop.tasks.records.provenance import git_commit

_MAX_METRICS, _MAX_PARAMS, _MAX_TAGS = 1000, 100, 100
_MAX_PARAM_CHARS = 6000  # MLflow's cap on a parameter value
# The experiment opens in the UI's model-training view, not its GenAI view.
EXPERIMENT_KIND = ("mlflow.experimentKind", "custom_model_development")
PARENT_TAG = "mlflow.parentRunId"


def client_for(tracking: MlflowTracking) -> tuple[MlflowClient, str]:
    """A client and the experiment id, creating the experiment if needed."""
    uri = tracking.resolved_uri()
    if tracking.username and tracking.password:
        # MLflow's REST client reads credentials from these, per request; a block's
        # credentials win over the environment's.
        os.environ["MLFLOW_TRACKING_USERNAME"] = tracking.username
        os.environ["MLFLOW_TRACKING_PASSWORD"] = tracking.password.get_secret_value()
    with _store_lock(uri):
        # Opening a SQLite store creates its tables (the client's constructor opens the
        # tracking store, the first registry call the registry's): two first runs at
        # once raced in the migration ("alembic_version ... 0 found", then "duplicate
        # column name: step" in CI), so both are opened under the lock.
        client = MlflowClient(tracking_uri=uri)
        if uri.startswith("sqlite:///"):
            client.search_registered_models(max_results=1)
        exp = client.get_experiment_by_name(tracking.experiment)
    if exp is not None:
        if exp.tags.get(EXPERIMENT_KIND[0]) is None:  # made before quantloop set it
            client.set_experiment_tag(exp.experiment_id, *EXPERIMENT_KIND)
        return client, exp.experiment_id
    try:
        return client, client.create_experiment(
            tracking.experiment,
            artifact_location=tracking.resolved_artifact_location(),
            tags=dict([EXPERIMENT_KIND]),
        )
    except Exception:
        # Another process created it between our get and create.
        exp = client.get_experiment_by_name(tracking.experiment)
        if exp is None:
            raise
        return client, exp.experiment_id


@contextlib.contextmanager
def _store_lock(uri: str) -> Iterator[None]:
    """An exclusive lock beside a local SQLite store while it may be created; nothing
    for a tracking server, which serializes its own writes."""
    if not uri.startswith("sqlite:///"):
        yield
        return
    path = uri[len("sqlite:///") :]
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(f"{path}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


# Who made a run: a later run on the same host can tell a run whose process died
# (SIGKILL, power loss) from one still going, and mark it KILLED.
HOST_TAG, PID_TAG, PID_START_TAG = "quantloop.host", "quantloop.pid", "quantloop.pid_start"
# Where a research run's records live (its site's storage root, its catalog file, its
# workspace as JSON): what finds them from the run alone.
STORE_TAG, CATALOG_TAG, WORKSPACE_TAG = (
    "quantloop.store",
    "quantloop.catalog",
    "quantloop.workspace",
)
MANIFEST_TAG = "quantloop.manifest"  # a features run's manifest folder


def _owner_tags() -> dict[str, str]:
    me = psutil.Process()
    return {HOST_TAG: socket.gethostname(), PID_TAG: str(me.pid),
            PID_START_TAG: repr(me.create_time())}  # fmt: skip


def _process_alive(pid: int, started: str) -> bool:
    try:
        return repr(psutil.Process(pid).create_time()) == started
    except psutil.Error:
        return False


def close_dead_runs(client: MlflowClient, experiment_id: str) -> list[str]:
    """Mark KILLED the RUNNING runs this host's processes made and left behind when they
    died; returns their ids. Runs of other hosts are left alone (their liveness is not
    visible from here)."""
    host = socket.gethostname()
    found = client.search_runs(
        [experiment_id],
        filter_string=f"attributes.status = 'RUNNING' and tags.`{HOST_TAG}` = '{host}'",
        max_results=1000,
    )
    closed = []
    for r in found:
        tags = r.data.tags
        if PID_TAG in tags and not _process_alive(int(tags[PID_TAG]), tags.get(PID_START_TAG, "")):
            client.set_tag(r.info.run_id, "quantloop.closed", "its process died; marked KILLED")
            client.set_terminated(r.info.run_id, "KILLED")
            closed.append(r.info.run_id)
    return closed


class RunLog:
    """Buffers params, tags and metrics of one MLflow run and sends them in batches."""

    def __init__(self, client: MlflowClient, run_id: str):
        self.client = client
        self.run_id = run_id
        self._metrics: list[Metric] = []
        self._params: list[Param] = []
        self._tags: list[RunTag] = []

    def params(self, values: Mapping[str, Any]) -> None:
        """Parameters, each value written one way: lists and tuples as JSON lists
        ([1, 10, 100], never (1, 10, 100)), mappings as JSON, the rest as str()."""
        self._params += [Param(k, param_value(v)) for k, v in values.items()]

    def tags(self, values: Mapping[str, Any]) -> None:
        self._tags += [RunTag(k, str(v)) for k, v in values.items()]

    def metrics(self, values: Mapping[str, float], step: int = 0) -> None:
        ts = int(time.time() * 1000)
        self._metrics += [Metric(k, float(v), ts, step) for k, v in values.items() if v is not None]

    def series(self, name: str, values: list[float], steps: list[int] | None = None) -> None:
        ts = int(time.time() * 1000)
        steps = steps if steps is not None else list(range(len(values)))
        self._metrics += [Metric(name, float(v), ts, s) for s, v in zip(steps, values, strict=True)]

    def flush(self) -> None:
        """Send everything buffered: ceil(n / 1000) calls, not one per value."""
        while self._metrics or self._params or self._tags:
            metrics, self._metrics = self._metrics[:_MAX_METRICS], self._metrics[_MAX_METRICS:]
            params, self._params = self._params[:_MAX_PARAMS], self._params[_MAX_PARAMS:]
            tags, self._tags = self._tags[:_MAX_TAGS], self._tags[_MAX_TAGS:]
            self.client.log_batch(self.run_id, metrics=metrics, params=params, tags=tags)

    def artifact(self, path: str, artifact_path: str | None = None) -> None:
        self.client.log_artifact(self.run_id, path, artifact_path)

    def table(self, table: pa.Table, name: str, artifact_path: str | None = None) -> None:
        """Log an Arrow table as a Parquet artifact."""
        self.file(storage.parquet_bytes(table), name, artifact_path)

    def file(self, data: bytes, name: str, artifact_path: str | None = None) -> None:
        """Log bytes as an artifact file called `name`."""
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, name)
            with open(path, "wb") as f:
                f.write(data)
            self.artifact(path, artifact_path)

    def figure(self, fig: Any, name: str) -> None:
        self.client.log_figure(self.run_id, fig, name)

    def json(self, value: Any, name: str, artifact_path: str | None = None) -> None:
        """Log a JSON-able value as a .json artifact (the UI shows it)."""
        self.file(json.dumps(value, indent=2, sort_keys=True, default=str).encode(), name,
                  artifact_path)  # fmt: skip

    def dataset(self, *, name: str, source: str, digest: str, context: str, rows: int) -> None:
        """An input dataset of the run (the UI's Datasets column): which catalog dataset,
        where it lives, and the digest of exactly the partition versions read."""
        with warnings.catch_warnings():
            # a local path matches two registered local sources, both the same class
            warnings.simplefilter("ignore", UserWarning)
            resolved = resolve_dataset_source(source)
        ds = MetaDataset(
            resolved, name=name,
            digest=digest[:32],  # MLflow keeps 36 characters; the full digest is a tag
        )  # fmt: skip
        tags = [InputTag("mlflow.data.context", context), InputTag("quantloop.digest", digest),
                InputTag("quantloop.partitions", str(rows))]  # fmt: skip
        self.client.log_inputs(self.run_id, [DatasetInput(ds._to_mlflow_entity(), tags)])


def param_value(value: Any) -> str:
    if isinstance(value, tuple | list):
        value = json.dumps(list(value), default=str)
    elif isinstance(value, Mapping):
        value = json.dumps(value, sort_keys=True, default=str)
    return str(value)[:_MAX_PARAM_CHARS]


def _prefect_tags() -> dict[str, str]:
    """The Prefect flow run this MLflow run belongs to, when there is one."""
    from prefect.runtime import flow_run

    run_id = flow_run.id
    if not run_id:
        return {}
    return {"prefect_flow_run_id": run_id, "prefect_flow": flow_run.flow_name,
            "prefect_flow_run_name": flow_run.name}  # fmt: skip


def _source_tags(prefect: Mapping[str, str]) -> dict[str, str]:
    """What the UI's Source and User columns show: the flow (or command) and commit."""
    flow = prefect.get("prefect_flow")
    source = f"quantloop.flows.{flow}" if flow else "quantloop"
    tags = {"mlflow.source.name": source, "mlflow.source.type": "JOB",
            "mlflow.user": getpass.getuser()}  # fmt: skip
    if commit := git_commit():
        tags["mlflow.source.git.commit"] = commit.removesuffix("+dirty")
    return tags


@contextlib.contextmanager
def run(
    client: MlflowClient,
    experiment_id: str,
    name: str,
    *,
    parent: str | None = None,
    tags: Mapping[str, Any] | None = None,
) -> Iterator[RunLog]:
    """An MLflow run that ends FINISHED, or FAILED if the block raises; flushed on exit.

    Its name carries the Prefect flow run's ("research-clever-fox"), its
    `quantloop.stage` tag the bare `name` ("research")."""
    prefect = _prefect_tags()
    run_name = f"{name}-{prefect['prefect_flow_run_name']}" if prefect else name
    all_tags = {"mlflow.runName": run_name, "quantloop.stage": name, **_owner_tags(),
                **_source_tags(prefect), **prefect, **(tags or {})}  # fmt: skip
    if parent:
        all_tags[PARENT_TAG] = parent
    created = client.create_run(
        experiment_id, run_name=run_name, tags={k: str(v) for k, v in all_tags.items()}
    )
    log = RunLog(client, created.info.run_id)
    try:
        yield log
    except BaseException:
        with contextlib.suppress(Exception):
            log.flush()
        client.set_terminated(log.run_id, "FAILED")
        raise
    log.flush()
    client.set_terminated(log.run_id, "FINISHED")
