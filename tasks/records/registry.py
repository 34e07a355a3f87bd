"""Trained models in MLflow's Model Registry: logged as MLflow models (signature, input
example, pinned requirements; `mlflow.pytorch.load_model` gives them back), each a
version of one registered model, tagged with the digests of what made it.

A model is keyed like a node (flows/train.py); its registered version carries that key,
so a cached model finds its version again instead of registering a copy.

Registration writes the model with `mlflow.pytorch.save_model` (torch.export's format,
MLflow's default: loading it needs no pickle, which MLflow 3 refuses unless told
otherwise) and sends it with the client's own calls, not `mlflow.pytorch.log_model`,
which loads the saved model back to validate the input example as a serving request
(~1 s; on the H200 it warned that CPU-exported weights do not load on CUDA) and reads
every metric's history of the run back (a call a metric) to link the metrics to the
model. The version is made with its tags (not a set-tag call per tag, two requests each
with MLflow 3's prompt check), the run's step-0 metrics are linked as they are sent
(`RunLog.link_model`), and the model's files go up side by side. Measured against a
tracking server with basic auth: 69 requests and ~3.0 s before, 12 and ~1.1 s after.

Importing this module imports neither torch nor MLflow: `register` does.
"""

from __future__ import annotations

import contextlib
import copy
import importlib.metadata
import logging
import os
import tempfile
import time
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from quantloop.tasks.records import tracking
from quantloop.tasks.runtime import overlap, timeline

if TYPE_CHECKING:
    import pyarrow as pa
    from mlflow.entities.model_registry import ModelVersion
    from mlflow.tracking import MlflowClient

    from quantloop.models.predictor import Predictor
    from quantloop.tasks.research.training import TrainResult

_logger = logging.getLogger(__name__)

MODEL_KEY_TAG = "model_key"
EXAMPLE_WINDOWS = 4
READY_WITHIN_S = 300  # MLflow's own wait for a version a registry makes asynchronously


@contextlib.contextmanager
def tracking_uri(uri: str) -> Iterator[None]:
    """MLflow's fluent API (`mlflow.pytorch.load_model`, say) pointed at `uri` inside the
    block; quantloop's own calls use explicit clients."""
    import mlflow

    before = mlflow.get_tracking_uri()
    mlflow.set_tracking_uri(uri)
    try:
        yield
    finally:
        mlflow.set_tracking_uri(before)


def predictor(result: TrainResult) -> Predictor:
    """The trained network with its normalization inside, on the CPU, in eval mode."""
    import torch

    from quantloop.models.predictor import Predictor
    from quantloop.tasks.research.training import INPUT_CLIP

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
    from quantloop.tasks.research.training import column_matrix

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
    torch_version = importlib.metadata.version("torch").split("+", 1)[0]
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
    log: tracking.RunLog | None = None,
    source: Mapping[str, str] | None = None,
    model_url: str | None = None,
) -> ModelVersion:
    """Log the model to the run as an MLflow model and register it as a version of
    `name`, its version tagged with `tags` (digests of its data, code and parameters).

    A model already registered under `model_key` is found (one search), not logged
    again. `log`: the run's log, whose buffered step-0 metrics become the logged model's
    metrics too when it sends them (MLflow's log_model links the run's metrics so).
    `uri`: the client's tracking URI (the client's own is what is used). `source`: the
    logged model's source tags (tracking.source_tags()), taken by the caller where it
    runs in another thread than its flow's (no flow run context there). `model_url`: where
    the model is stored (save_model), so a warm process's child can export it (`export`)."""
    found = find_version(client, name, model_key)
    if found is not None:
        return found
    with timeline.timed("registration"):
        return _register(client, experiment_id, run_id, result, example_table, name=name,
                         model_key=model_key, tags=tags, log=log,
                         source=tracking.source_tags() if source is None else source,
                         model_url=model_url)  # fmt: skip


def _register(
    client: MlflowClient,
    experiment_id: str,
    run_id: str,
    result: TrainResult,
    example_table: pa.Table,
    *,
    name: str,
    model_key: str,
    tags: Mapping[str, Any],
    log: tracking.RunLog | None,
    source: Mapping[str, str],
    model_url: str | None = None,
) -> ModelVersion:
    from mlflow.entities import LoggedModelOutput, LoggedModelStatus

    anchors = np.linspace(0, example_table.num_rows - 1, EXAMPLE_WINDOWS).astype(np.int64)
    example = windows(result, example_table, anchors)
    version_tags = {MODEL_KEY_TAG: model_key, **{k: str(v) for k, v in tags.items()}}
    # Made in the run's experiment, as the run's output (the experiment's and the run's
    # pages list it), with the tags MLflow's own logging gives a model.
    logged = client.create_logged_model(
        experiment_id, name=name, source_run_id=run_id,
        tags={**source, **version_tags},
    )  # fmt: skip
    try:
        with tempfile.TemporaryDirectory(prefix="quantloop-model-") as tmp:
            local = os.path.join(tmp, "model")
            meta = {"artifact_path": logged.artifact_location, "model_uuid": logged.model_id,
                    "run_id": run_id, "model_id": logged.model_id}  # fmt: skip
            export(result, example, local, meta, model_url)
            _upload_folder(client, logged.artifact_location, local)
        client.log_outputs(run_id, [LoggedModelOutput(logged.model_id, step=0)])
        client.finalize_logged_model(logged.model_id, LoggedModelStatus.READY)
    except BaseException:
        with contextlib.suppress(Exception):
            client.finalize_logged_model(logged.model_id, LoggedModelStatus.FAILED)
        raise
    if log is not None:
        log.link_model(logged.model_id)
    version = _create_version(client, name, logged.model_id, run_id, version_tags)
    _logger.info("registered %s version %s (logged model %s)", name, version.version,
                 logged.model_id)  # fmt: skip
    return version


def export(
    result: TrainResult,
    example: np.ndarray,
    local: str,
    meta: Mapping[str, str],
    model_url: str | None = None,
) -> None:
    """The model as an MLflow model folder at `local` (torch.export's format, its
    signature and input example from `example`; `meta`: the logged model's ids and
    artifact location). Where the command runs in a warm process's child and the model
    is stored at `model_url`, a fresh child of that process exports it from the store
    (tasks/runtime/overlap.call): torch.export's seconds of tracing then run on another
    core instead of beside the simulation in this interpreter (on an H200 they slowed
    its replay by ~2 s). Elsewhere, where no such child can be had, and where the child
    fails (a warning with its traceback), it is exported here from the trained model."""
    if model_url is not None and overlap.available():
        example_path = os.path.join(os.path.dirname(local), "example.npy")
        np.save(example_path, example)
        try:
            with timeline.timed("registration: export in a warm child"):
                overlap.call(f"{__name__}:export_stored", {
                    "model_url": model_url, "example": example_path, "local": local,
                    "meta": dict(meta),
                })  # fmt: skip
            return
        except overlap.Unavailable as exc:
            _logger.info("the model is exported here: %s", exc)
        except overlap.CallFailed as exc:  # the export here is the reference: the run goes on
            _logger.warning("the model's export in a warm process's child failed; exported "
                            "here instead: %s", exc)  # fmt: skip
    save_exported(predictor(result), example, local, meta)


def export_stored(model_url: str, example: str, local: str, meta: dict[str, str]) -> dict:
    """`export` in a warm process's child (forkserver.CALLS): the stored model, its
    weights checked against their digest (load_model), exported as `export` would
    export the trained one."""
    from quantloop.tasks.research.training import load_model

    save_exported(predictor(load_model(model_url, "cpu")), np.load(example), local, meta)
    return {"files": sorted(os.listdir(local))}


def warm_export() -> None:
    """A tiny model exported as `save_exported` exports a trained one, thrown away: run
    by the warm process (quantloop/forkserver.WARM_CALLS), so that a registration's
    export in one of its children finds torch.export's ~500 modules imported and its
    first-call set-up done. On a 2-core VM the research shape's export in a forked child
    took 2.0-2.2 s without this, 0.7 s after it (1.4 s once, in the warm process); on an
    H200 the export (6.2 s) outlasted the simulation beside it and the run waited 3.4 s
    for it (bench/results/turnaround-h200-ahead-notes.md).

    The warm process must stay fit to fork, so:
    - no kernel runs for real (the export traces fake tensors; the signature's output is
      given): a parent that once entered an OpenMP parallel region (a LayerNorm of 8 rows
      did) leaves its forked children hanging in their first one (libgomp is not
      fork-safe; tests/test_forkserver.py's export hung). Nor does it touch the intra-op
      thread count: set to 1 and back here, the H200's children failed their first
      parallel op ("Invalid thread pool", ParallelOpenMP.cpp, device call 6);
    - no CUDA driver: the export's CUDA calls are FakeTensorMode's. Its
      avoid_device_init asks `torch.cuda.is_available()` (469 times), which runs cuInit
      where CUDA is built; where the answer is no, its __enter__ calls
      `torch._C._ensureCUDADeviceGuardSet()`, which initializes CUDA as well. On the H200
      each left /dev/nvidiactl open and the warm process refused to serve
      (bench/cuda_open.py --trace found both, one call each). Inside this call
      avoid_device_init answers False without asking: the path an export takes on a
      machine with a GPU, where the registration's own export runs; nothing here moves
      a tensor to a device, which is all the answer changes."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from quantloop.models.orderbook import ModelConfig, OrderBookNet
    from quantloop.models.predictor import Predictor

    cfg = ModelConfig(n_features=2, n_outputs=1, d_model=4, n_layers=1, n_heads=1,
                      ff_mult=1, max_len=4)  # fmt: skip
    one, zero = torch.ones(2), torch.zeros(2)
    model = Predictor(OrderBookNet(cfg), zero, one, zero[:1], one[:1], 5.0).eval()
    example = np.zeros((2, 4, 2), np.float32)
    asks_cuda = FakeTensorMode.avoid_device_init
    FakeTensorMode.avoid_device_init = property(lambda self: False)  # type: ignore[method-assign]
    try:
        with tempfile.TemporaryDirectory(prefix="quantloop-warm-export-") as tmp:
            save_exported(model, example, os.path.join(tmp, "model"),
                          {"artifact_path": tmp, "model_uuid": "warm", "run_id": "warm",
                           "model_id": "warm"}, out=np.zeros((2, 1), np.float32))  # fmt: skip
    finally:
        FakeTensorMode.avoid_device_init = asks_cuda  # type: ignore[method-assign]


def save_exported(
    model: Predictor,
    example: np.ndarray,
    local: str,
    meta: Mapping[str, str],
    out: np.ndarray | None = None,
) -> None:
    """`out`: the model's output on `example` (its signature's), computed here if not
    given."""
    import mlflow.pytorch
    import torch
    from mlflow.models import Model, infer_signature

    if out is None:
        with torch.no_grad():
            out = model(torch.from_numpy(example)).numpy()
    with overlap.TRACING:  # torch.export: not beside a compile in this process
        mlflow.pytorch.save_model(
            model, local, mlflow_model=Model(**meta),
            signature=infer_signature(example, out), input_example=example,
            pip_requirements=requirements(), serialization_format="pt2",
        )  # fmt: skip


def _create_version(
    client: MlflowClient, name: str, model_id: str, run_id: str, tags: dict[str, str]
) -> ModelVersion:
    """A version of `name` made with all its tags in one call; the registered model is
    made first only where there is none (one failed call, once per registry)."""
    from mlflow.exceptions import MlflowException

    def create() -> ModelVersion:
        # No waiting inside (it logs a line even when there is nothing to wait for): a
        # tracking server's version is READY as made; one that is not is polled below.
        return client.create_model_version(name, f"models:/{model_id}", run_id=run_id,
                                           tags=tags, model_id=model_id,
                                           await_creation_for=0)  # fmt: skip

    # A local (SQL) registry finds the logged model of a models:/ source through the
    # fluent API's tracking URI, not the client's: pointed at the client's store here.
    with tracking_uri(client.tracking_uri):
        try:
            version = create()
        except MlflowException as exc:
            if exc.error_code != "RESOURCE_DOES_NOT_EXIST":
                raise
            with contextlib.suppress(MlflowException):  # another process made it meanwhile
                client.create_registered_model(name)
            version = create()
    deadline = time.monotonic() + READY_WITHIN_S
    while version.status == "PENDING_REGISTRATION" and time.monotonic() < deadline:
        time.sleep(1.0)
        version = client.get_model_version(name, version.version)
    if dict(version.tags or {}) != tags:  # a store that answers without them
        version = client.get_model_version(name, version.version)
    return version


def copy_version(client: MlflowClient, name: str, version: str, to: str) -> ModelVersion:
    """Version `version` of `name` copied into registered model `to` as a new version
    (`MlflowClient.copy_model_version`: the same model files and run, the tags as they
    are now). Its source is the candidate's models:/ URI, which a local (SQL) registry
    resolves through the fluent API's tracking URI: pointed at the client's store."""
    with tracking_uri(client.tracking_uri), timeline.timed("registration"):
        copied = client.copy_model_version(f"models:/{name}/{version}", to)
    deadline = time.monotonic() + READY_WITHIN_S
    while copied.status == "PENDING_REGISTRATION" and time.monotonic() < deadline:
        time.sleep(1.0)
        copied = client.get_model_version(to, copied.version)
    _logger.info("copied %s version %s to %s version %s", name, version, to, copied.version)
    return copied


def _upload_folder(client: MlflowClient, artifact_uri: str, folder: str) -> None:
    """Every file of `folder` to `artifact_uri`, side by side (a round trip each, ~7)."""
    repo = tracking.artifact_repo(client, artifact_uri)
    files = []
    for root, _, names in os.walk(folder):
        rel = os.path.relpath(root, folder)
        files += [(os.path.join(root, n), None if rel == "." else rel) for n in names]

    def upload(path: str, artifact_path: str | None) -> None:
        with tracking.mlflow_call():
            repo.log_artifact(path, artifact_path)

    futures = [tracking.senders().submit(upload, *f) for f in files]
    failed = [exc for f in futures if (exc := f.exception()) is not None]
    if failed:
        raise failed[0]
