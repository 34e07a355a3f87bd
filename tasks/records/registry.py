"""Trained models in MLflow's Model Registry: logged as MLflow models (signature, input
example, pinned requirements; `mlflow.pytorch.load_model` gives them back), each a
version of one registered model, tagged with the digests of what made it.

A model is keyed like a node (flows/train.py); its registered version carries that key,
so a cached model finds its version again instead of registering a copy.
"""

from __future__ import annotations

import contextlib
import copy
import importlib.metadata
import io
import logging
from collections.abc import Iterator, Mapping
from typing import Any

import mlflow
import numpy as np
import pyarrow as pa
import torch
from mlflow.entities.model_registry import ModelVersion
from mlflow.models import infer_signature
from mlflow.tracking import MlflowClient

from quantloop.models.predictor import Predictor
from quantloop.tasks.research.training import INPUT_CLIP, TrainResult, column_matrix

_logger = logging.getLogger(__name__)

MODEL_KEY_TAG = "model_key"
EXAMPLE_WINDOWS = 4


@contextlib.contextmanager
def tracking_uri(uri: str) -> Iterator[None]:
    """MLflow's fluent API (which model logging goes through) pointed at `uri` inside
    the block; quantloop's own calls use explicit clients."""
    before = mlflow.get_tracking_uri()
    mlflow.set_tracking_uri(uri)
    try:
        yield
    finally:
        mlflow.set_tracking_uri(before)


def predictor(result: TrainResult) -> Predictor:
    """The trained network with its normalization inside, on the CPU, in eval mode."""
    n = result.normalizer
    net = copy.deepcopy(result.model).to("cpu").eval()  # the trained model stays where it is
    mean, std, label_mean, label_std = (
        torch.as_tensor(np.asarray(a), dtype=torch.float32)
        for a in (n.input_mean, n.input_std, n.label_mean, n.label_std)
    )
    return Predictor(net, mean, std, label_mean, label_std, INPUT_CLIP).eval()


def windows(result: TrainResult, table: pa.Table, anchors: np.ndarray) -> np.ndarray:
    """[len(anchors), T, F] raw feature windows ending at `anchors`, rows before the
    table's start as NaN (padding): the predictor's input."""
    x = column_matrix(table, result.inputs)
    T = result.train_config.window
    rows = anchors[:, None] + np.arange(1 - T, 1)[None, :]
    out = np.full((len(anchors), T, x.shape[1]), np.nan, np.float32)
    real = rows >= 0
    out[real] = x[rows[real]]
    return out


def requirements() -> list[str]:
    """Exact versions of what loading the model needs (torch.export's format and numpy),
    not MLflow's ~10 s inference of them."""
    torch_version = torch.__version__.split("+", 1)[0]
    return [f"torch=={torch_version}", f"numpy=={importlib.metadata.version('numpy')}"]


def find_version(client: MlflowClient, name: str, model_key: str) -> ModelVersion | None:
    """The registered version of the model with this key, if there is one."""
    with contextlib.suppress(Exception):  # no registered model of that name yet
        found = client.search_model_versions(
            f"name = '{name}' and tags.{MODEL_KEY_TAG} = '{model_key}'"
        )
        if found:
            return max(found, key=lambda v: int(v.version))
    return None


def register(
    client: MlflowClient,
    uri: str,
    experiment_id: str,
    run_id: str,
    result: TrainResult,
    example_table: pa.Table,
    *,
    name: str,
    model_key: str,
    tags: Mapping[str, Any],
) -> ModelVersion:
    """Log the model to the run as an MLflow model and register it as a version of
    `name`, its version tagged with `tags` (digests of its data, code and parameters)."""
    found = find_version(client, name, model_key)
    if found is not None:
        return found
    model = predictor(result)
    anchors = np.linspace(0, example_table.num_rows - 1, EXAMPLE_WINDOWS).astype(np.int64)
    example = windows(result, example_table, anchors)
    with torch.no_grad():
        out = model(torch.from_numpy(example)).numpy()
    with tracking_uri(uri):
        # Made first in the run's experiment: left to itself, log_model files the model
        # under the fluent API's active experiment, where the experiment's page never
        # shows it.
        logged = mlflow.initialize_logged_model(
            name=name, source_run_id=run_id, experiment_id=experiment_id,
            tags={MODEL_KEY_TAG: model_key, **{k: str(v) for k, v in tags.items()}},
        )  # fmt: skip
        # MLflow prints "Successfully registered model ..." and "Created version ..." to
        # stderr itself (not through a logger): they go to the run's log instead, so the
        # console keeps to the stage lines.
        printed = io.StringIO()
        with contextlib.redirect_stderr(printed):
            info = mlflow.pytorch.log_model(
                model, name="model", run_id=run_id, model_id=logged.model_id,
                input_example=example, signature=infer_signature(example, out),
                pip_requirements=requirements(), registered_model_name=name,
            )  # fmt: skip
        for line in printed.getvalue().splitlines():
            _logger.info("mlflow: %s", line)
    version = str(info.registered_model_version)
    for key, value in {MODEL_KEY_TAG: model_key, **tags}.items():
        client.set_model_version_tag(name, version, key, str(value))
    return client.get_model_version(name, version)
