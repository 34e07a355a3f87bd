"""The training stage: fit the order-book model on the training split's features."""

from __future__ import annotations

import datetime as dt
import json
from dataclasses import asdict

from prefect import flow, get_run_logger
from pydantic import BaseModel

from quantloop.models import orderbook
from quantloop.tasks import plots, progress, storage, tracking, training
from quantloop.tasks.features import feature_set
from quantloop.tasks.form import TrainForm
from quantloop.tasks.nodes import code_fingerprint, sha256_json
from quantloop.tasks.simulation import split_train_test
from quantloop.tasks.stage import (
    FeatureOutput,
    StageParams,
    feature_outputs,
    keyed_output,
    output_key,
)
from quantloop.tasks.training import (
    TrainConfig,
    TrainResult,
    load_model,
    resolve_device,
    save_model,
)
from quantloop.tasks.training import train as fit


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


def model_key(config: TrainConfig, feature_keys: list[str], holdout_fraction: float) -> str:
    """What decides the weights: training code, config, device type, features, the split."""
    return output_key(
        "model",
        code=code_fingerprint(training, orderbook),
        config=asdict(config),
        device=resolve_device(config.device).type,
        features=sorted(feature_keys),
        holdout_fraction=holdout_fraction,
    )


@flow(name="train")
def train(
    stage: StageParams = StageParams(),
    config: TrainForm = TrainConfig(),
    parent_run_id: str | None = None,
) -> TrainSummary:
    """Train on every selected partition's training part (the held-out part is not read).

    Args:
        stage: The workspace, the partitions and the feature parameters their features
            were computed with (run the features flow on them first).
        config: How the model is trained.
        parent_run_id: An MLflow run to record under as a child run "train"; empty:
            nothing is recorded.
    """
    logger = get_run_logger()
    outputs = feature_outputs(stage)
    site = stage.workspace.resolve_site()
    key = model_key(config, [o.key for o in outputs.values()], stage.holdout_fraction)

    def fit_now() -> TrainResult:
        tables = {p: o.read() for p, o in outputs.items()}
        train_parts, _ = split_train_test(tables, stage.holdout_fraction)
        layout = feature_set(stage.features)
        return fit(list(train_parts.values()), layout.inputs, layout.labels, config)

    # load checks the weights against their stored digest
    model = keyed_output(site.root, "model", key, ".pt", load=load_model, compute=fit_now,
                         save=lambda url, result: save_model(result, url))  # fmt: skip
    result = model.value
    if model.cache_hit:
        message = f"model {key[:12]} is cached (weights {result.model_digest[:12]}): not retrained"
    else:
        record_lineage(site.root, key, result.model_digest, outputs, config, stage.holdout_fraction)
        message = (
            f"trained on {result.samples:,} windows ({result.samples_seen:,} seen) in "
            f"{result.duration_s:.1f} s on {result.device}: {result.samples_per_s:,.0f} samples/s, "
            f"final loss {result.loss_curve[-1]:.4f}"
        )
    logger.info(message)
    progress.note("train", message)
    run_id = None
    if parent_run_id is not None:
        run_id = _record(stage, parent_run_id, config, len(outputs), model, site.name)
    return TrainSummary(
        model_url=model.url,
        model_key=key,
        model_digest=result.model_digest,
        cache_hit=model.cache_hit,
        loss_curve=result.loss_curve,
        samples=result.samples,
        samples_per_s=result.samples_per_s,
        duration_s=result.duration_s,
        device=result.device,
        mlflow_run_id=run_id,
    )


def record_lineage(
    root: str,
    key: str,
    digest: str,
    outputs: dict[object, FeatureOutput],
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


def _record(
    stage: StageParams,
    parent_run_id: str,
    config: TrainConfig,
    partitions: int,
    model,
    site: str,
) -> str:
    """The "train" MLflow child run; the model file is attached when it was trained now."""
    result: TrainResult = model.value
    client, experiment = tracking.client_for(stage.workspace.resolve_tracking())
    with tracking.run(client, experiment, "train", parent=parent_run_id) as run:
        run.params({f"train.{k}": v for k, v in asdict(config).items()})
        run.params(
            {
                "features_hash": sha256_json(stage.features.canonical()),
                "holdout_fraction": stage.holdout_fraction,
                "partitions": partitions,
            }
        )
        run.tags(
            {
                "model_key": model.key,
                "model_digest": result.model_digest,
                "site": site,
                "cache_hit": model.cache_hit,
            }
        )
        run.metrics(
            {
                "samples": result.samples,
                "samples_per_s": result.samples_per_s,
                "duration_s": result.duration_s,
                "final_loss": result.loss_curve[-1],
                "cache_hit": float(model.cache_hit),
            }
        )
        steps = [(i + 1) * config.log_every for i in range(len(result.loss_curve))]
        run.series("loss", result.loss_curve, steps)
        run.flush()
        run.figure(plots.loss_curve(result.loss_curve, config.log_every), "loss_curve.png")
        if not model.cache_hit:
            run.file(storage.read_bytes(model.url), f"{model.key}.pt", "model")
        return run.run_id
