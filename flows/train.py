"""The training stage: fit the order-book model on the training split's features."""

from __future__ import annotations

import datetime as dt
import json
import os
import tempfile
from dataclasses import asdict

from prefect import flow, get_run_logger
from pydantic import BaseModel

from quantloop.flows.features import feature_outputs
from quantloop.models import orderbook
from quantloop.tasks import plots, storage, tracking, training
from quantloop.tasks.features import FeatureParams, feature_set
from quantloop.tasks.nodes import code_fingerprint, sha256_json
from quantloop.tasks.simulation import split_train_test
from quantloop.tasks.training import TrainConfig, load_model, resolve_device, save_model
from quantloop.tasks.training import train as fit
from quantloop.tasks.workspace import Selection, Workspace


class TrainSummary(BaseModel):
    model_url: str
    model_key: str
    model_digest: str
    cache_hit: bool
    loss_curve: list[float]
    samples: int
    samples_per_s: float
    duration_s: float
    device: str
    mlflow_run_id: str | None = None


def model_url(root: str, key: str) -> str:
    """Models are stored under their key, like nodes; the file records its weights' digest."""
    return storage.join(root, "models", f"{key}.pt")


def model_key(config: TrainConfig, feature_keys: list[str], holdout_fraction: float) -> str:
    """What decides the weights: training code, config, device type, features, the split."""
    return sha256_json(
        {
            "kind": "model",
            "code": code_fingerprint(training, orderbook),
            "config": asdict(config),
            "device": resolve_device(config.device).type,
            "features": sorted(feature_keys),
            "holdout_fraction": holdout_fraction,
        }
    )


def fetch_model(url: str, device: str = "cpu"):
    """Load a stored model from a local path or an object store URL."""
    fs, path = storage.filesystem(url)
    if storage.is_local(fs):
        return load_model(path, device=device)
    with tempfile.TemporaryDirectory() as tmp:
        local = os.path.join(tmp, "model.pt")
        fs.get_file(path, local)
        return load_model(local, device=device)


@flow(name="train")
def train(
    workspace: Workspace = Workspace(),
    selection: Selection = Selection(),
    features: FeatureParams = FeatureParams(),
    product_features: dict[str, dict] | None = None,
    config: TrainConfig = TrainConfig(),
    holdout_fraction: float = 0.3,
    parent_run_id: str | None = None,
) -> TrainSummary:
    """Train on every selected partition's training part (the held-out part is not read)."""
    logger = get_run_logger()
    outputs = feature_outputs(workspace, selection, features, product_features)
    site = workspace.resolve_site()
    key = model_key(config, [o.key for o in outputs.values()], holdout_fraction)
    url = model_url(site.root, key)
    if storage.exists(url):
        # The file is written atomically, so existing means complete; load checks the digest.
        result = fetch_model(url)
        logger.info(
            "model %s is cached (weights %s): not retrained", key[:12], result.model_digest[:12]
        )
        return _summary(result, url, key, cache_hit=True, run_id=_record(
            workspace, parent_run_id, config, features, holdout_fraction, len(outputs),
            result, key, site.name, cache_hit=True, local=None,
        ))  # fmt: skip
    tables = {p: o.read() for p, o in outputs.items()}
    train_parts, _ = split_train_test(tables, holdout_fraction)
    layout = feature_set(features)
    result = fit(list(train_parts.values()), layout.inputs, layout.labels, config)
    logger.info(
        "trained on %d windows (%d seen) in %.1f s on %s: %.0f samples/s, final loss %.4f",
        result.samples,
        result.samples_seen,
        result.duration_s,
        result.device,
        result.samples_per_s,
        result.loss_curve[-1] if result.loss_curve else float("nan"),
    )
    with tempfile.TemporaryDirectory() as tmp:
        local = os.path.join(tmp, f"{key}.pt")
        save_model(result, local)
        with open(local, "rb") as f:
            storage.write_bytes_atomic(url, f.read())
        record_lineage(site.root, key, result.model_digest, outputs, config, holdout_fraction)
        run_id = _record(
            workspace, parent_run_id, config, features, holdout_fraction, len(outputs),
            result, key, site.name, cache_hit=False, local=local,
        )  # fmt: skip
    return _summary(result, url, key, cache_hit=False, run_id=run_id)


def record_lineage(
    root: str,
    key: str,
    digest: str,
    outputs: dict,
    config: TrainConfig,
    holdout_fraction: float,
) -> None:
    """Which feature nodes a model was trained from, so lineage runs both ways."""
    record = {
        "model_key": key,
        "model_digest": digest,
        "feature_keys": sorted(o.key for o in outputs.values()),
        "partitions": sorted(str(p) for p in outputs),
        "config": asdict(config),
        "holdout_fraction": holdout_fraction,
        "created_at": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
    }
    url = storage.join(root, "lineage", "models", f"{key}.json")
    storage.write_bytes_atomic(url, json.dumps(record, indent=1).encode())


def _summary(result, url: str, key: str, *, cache_hit: bool, run_id: str | None) -> TrainSummary:
    return TrainSummary(
        model_url=url,
        model_key=key,
        model_digest=result.model_digest,
        cache_hit=cache_hit,
        loss_curve=result.loss_curve,
        samples=result.samples,
        samples_per_s=result.samples_per_s,
        duration_s=result.duration_s,
        device=result.device,
        mlflow_run_id=run_id,
    )


def _record(
    workspace: Workspace,
    parent_run_id: str | None,
    config: TrainConfig,
    features: FeatureParams,
    holdout_fraction: float,
    partitions: int,
    result,
    key: str,
    site: str,
    *,
    cache_hit: bool,
    local: str | None,
) -> str | None:
    """The "train" MLflow child run; the model file is attached when it was trained now."""
    if parent_run_id is None:
        return None
    client, experiment = tracking.client_for(workspace.resolve_tracking())
    with tracking.run(client, experiment, "train", parent=parent_run_id) as run:
        run.params({f"train.{k}": v for k, v in asdict(config).items()})
        run.params(
            {
                "features_hash": sha256_json(features.canonical()),
                "holdout_fraction": holdout_fraction,
                "partitions": partitions,
            }
        )
        run.tags(
            {
                "model_key": key,
                "model_digest": result.model_digest,
                "site": site,
                "cache_hit": cache_hit,
            }
        )
        run.metrics(
            {
                "samples": result.samples,
                "samples_per_s": result.samples_per_s,
                "duration_s": result.duration_s,
                "final_loss": result.loss_curve[-1],
                "cache_hit": float(cache_hit),
            }
        )
        steps = [(i + 1) * config.log_every for i in range(len(result.loss_curve))]
        run.series("loss", result.loss_curve, steps)
        run.flush()
        run.figure(plots.loss_curve(result.loss_curve, config.log_every), "loss_curve.png")
        if local is not None:
            run.artifact(local, "model")
        return run.run_id
