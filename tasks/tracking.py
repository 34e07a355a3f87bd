"""MLflow recording in batches: one HTTP call carries up to 1,000 metrics.

A tracking-server round trip costs ~66 ms here, so nothing in quantloop logs a
metric at a time; stages collect values and send them with `RunLog.flush()`.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import time
from collections.abc import Iterator, Mapping
from typing import Any

import pyarrow as pa
from mlflow.entities import Metric, Param, RunTag
from mlflow.tracking import MlflowClient

from quantloop.blocks.tracking import MlflowTracking
from quantloop.tasks import storage

_MAX_METRICS, _MAX_PARAMS, _MAX_TAGS = 1000, 100, 100
PARENT_TAG = "mlflow.parentRunId"


def client_for(tracking: MlflowTracking) -> tuple[MlflowClient, str]:
    """A client and the experiment id, creating the experiment if needed."""
    client = MlflowClient(tracking_uri=tracking.resolved_uri())
    exp = client.get_experiment_by_name(tracking.experiment)
    if exp is not None:
        return client, exp.experiment_id
    try:
        return client, client.create_experiment(
            tracking.experiment, artifact_location=tracking.resolved_artifact_location()
        )
    except Exception:
        # Another process created it between our get and create.
        exp = client.get_experiment_by_name(tracking.experiment)
        if exp is None:
            raise
        return client, exp.experiment_id


class RunLog:
    """Buffers params, tags and metrics of one MLflow run and sends them in batches."""

    def __init__(self, client: MlflowClient, run_id: str):
        self.client = client
        self.run_id = run_id
        self._metrics: list[Metric] = []
        self._params: list[Param] = []
        self._tags: list[RunTag] = []

    def params(self, values: Mapping[str, Any]) -> None:
        # MLflow caps a param value at 6,000 characters.
        self._params += [Param(k, str(v)[:6000]) for k, v in values.items()]

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


def _prefect_tags() -> dict[str, str]:
    """The Prefect flow run this MLflow run belongs to, when there is one."""
    from prefect.runtime import flow_run

    run_id = flow_run.id
    return {"prefect_flow_run_id": run_id, "prefect_flow": flow_run.flow_name} if run_id else {}


@contextlib.contextmanager
def run(
    client: MlflowClient,
    experiment_id: str,
    name: str,
    *,
    parent: str | None = None,
    tags: Mapping[str, Any] | None = None,
) -> Iterator[RunLog]:
    """An MLflow run that ends FINISHED, or FAILED if the block raises; flushed on exit."""
    all_tags = {"mlflow.runName": name, **_prefect_tags(), **(tags or {})}
    if parent:
        all_tags[PARENT_TAG] = parent
    created = client.create_run(
        experiment_id, run_name=name, tags={k: str(v) for k, v in all_tags.items()}
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
