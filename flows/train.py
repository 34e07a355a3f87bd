"""The training stage: fit the order-book model on the training split's features."""

from __future__ import annotations

import os
import tempfile
from dataclasses import asdict

from prefect import flow, get_run_logger
from pydantic import BaseModel

from flows.features import feature_outputs
from quantloop.workspace import Selection, Workspace
from tasks import plots, storage, tracking
from tasks.features import FeatureParams, feature_set
from tasks.nodes import sha256_json
from tasks.simulation import split_train_test
from tasks.training import TrainConfig, load_model, save_model
from tasks.training import train as fit


class TrainSummary(BaseModel):
    model_url: str
    model_digest: str
    loss_curve: list[float]
    samples: int
    samples_per_s: float
    duration_s: float
    device: str
    mlflow_run_id: str | None = None


def model_url(root: str, digest: str) -> str:
    """Models are stored content-addressed, like nodes."""
    return storage.join(root, "models", f"{digest}.pt")


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
    tables = {p: storage.read_parquet(url) for p, url in outputs.items()}
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
    site = workspace.resolve_site()
    url = model_url(site.root, result.model_digest)
    with tempfile.TemporaryDirectory() as tmp:
        local = os.path.join(tmp, f"{result.model_digest}.pt")
        save_model(result, local)
        with open(local, "rb") as f:
            storage.write_bytes_atomic(url, f.read())
        run_id = None
        if parent_run_id is not None:
            client, experiment = tracking.client_for(workspace.resolve_tracking())
            with tracking.run(client, experiment, "train", parent=parent_run_id) as run:
                run.params({f"train.{k}": v for k, v in asdict(config).items()})
                run.params(
                    {
                        "features_hash": sha256_json(features.canonical()),
                        "holdout_fraction": holdout_fraction,
                        "partitions": len(train_parts),
                    }
                )
                run.tags({"model_digest": result.model_digest, "site": site.name})
                run.metrics(
                    {
                        "samples": result.samples,
                        "samples_per_s": result.samples_per_s,
                        "duration_s": result.duration_s,
                        "final_loss": result.loss_curve[-1],
                    }
                )
                steps = [(i + 1) * config.log_every for i in range(len(result.loss_curve))]
                run.series("loss", result.loss_curve, steps)
                run.flush()
                run.figure(plots.loss_curve(result.loss_curve, config.log_every), "loss_curve.png")
                run.artifact(local, "model")
                run_id = run.run_id
    return TrainSummary(
        model_url=url,
        model_digest=result.model_digest,
        loss_curve=result.loss_curve,
        samples=result.samples,
        samples_per_s=result.samples_per_s,
        duration_s=result.duration_s,
        device=result.device,
        mlflow_run_id=run_id,
    )
