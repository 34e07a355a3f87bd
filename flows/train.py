"""The training stage: fit the order-book model on the training split's features."""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import os
from dataclasses import asdict

import torch
from mlflow.entities.model_registry import ModelVersion
from prefect import flow, get_run_logger
from pydantic import BaseModel

from quantloop.models import orderbook
from quantloop.profiling import trainer
from quantloop.profiling.proof import Plan, plan_rungs
from quantloop.tasks import plots, progress, registry, storage, tracking, training
from quantloop.tasks.engine import code_fingerprint, sha256_json
from quantloop.tasks.form import TrainForm
from quantloop.tasks.provenance import code_digest
from quantloop.tasks.schema import Partition
from quantloop.tasks.sites import GPU, gpu_client
from quantloop.tasks.stage import (
    FeatureOutput,
    Keyed,
    StageParams,
    feature_outputs,
    keyed_output,
    output_key,
    plan_features,
)
from quantloop.tasks.training import (
    TrainConfig,
    TrainResult,
    load_model,
    resolve_device,
    save_model,
)


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
    registered_model: str | None = None  # the MLflow registered model and its version
    model_version: str | None = None
    rungs: list[str] = []  # the ladder's optimizations applied ([]: the plain loop)
    steady_samples_per_s: float | None = None  # after the warm-up (compile, capture)
    step_ms: float | None = None
    warmup_s: float | None = None
    gpu_util: float | None = None
    peak_mem_gb: float | None = None
    ladder_result: dict | None = None  # the ladder result the rungs relied on
    site: str = ""  # the site training ran at (a cached model: where this run found it)
    worker: str = ""  # the Dask worker that trained it ("": the flow's process, or cached)
    bytes_across: int = 0  # feature output bytes training read from another site


def model_key(
    config: TrainConfig,
    feature_keys: list[str],
    holdout_fraction: float,
    rungs: tuple[str, ...] = (),
    device: str | None = None,
) -> str:
    """What decides the weights: training code, config, device type, features, the split,
    and the rungs applied (not how they were asked for: "auto" and the same list named
    explicitly train the same model). device: the device type where training runs, when
    that is not this process (a GPU site's worker)."""
    code = code_fingerprint(training, orderbook)
    if rungs:
        code += code_fingerprint(*trainer.RUNG_CODE)
    config_values = {k: v for k, v in asdict(config).items() if k != "optimizations"}
    return output_key(
        "model",
        code=code,
        config=config_values,
        device=device or resolve_device(config.device).type,
        features=sorted(feature_keys),
        holdout_fraction=holdout_fraction,
        rungs=list(rungs),
    )


def ladder_results(stage: StageParams) -> list[str]:
    """The workspace's own ladder result, if `quantloop ladder` ran there (flows/ladder.py
    writes it): `auto` weighs it with the committed ones."""
    return [os.path.join(stage.workspace.home_abs, "ladder", "ladder.json")]


def plan_for(stage: StageParams, config: TrainConfig, device: str | None = None) -> Plan:
    where = torch.device(device) if device else resolve_device(config.device)
    return plan_rungs(config.optimizations, where, ladder_results(stage), head_dim=config.head_dim)


def device_type(name: str) -> str:
    """The device type `name` resolves to where this runs (on a GPU site's worker)."""
    return resolve_device(name).type


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
    site = stage.workspace.resolve_site()
    with contextlib.ExitStack() as stack:
        return _train(stage, config, parent_run_id, site, stack, logger)


def _train(stage, config, parent_run_id, site, stack, logger) -> TrainSummary:
    # Training goes to a site whose Dask workers declare a GPU, when there is one;
    # otherwise it runs here, in the flow's process. It reads the outputs stored there.
    gpu = gpu_client(stage.workspace.resolve_sites(), stack)
    outputs = feature_outputs(stage, prefer=(gpu[0] if gpu else site).name)
    device = gpu[1].submit(device_type, config.device, resources={GPU: 1},
                           pure=False).result() if gpu else None  # fmt: skip
    plan = plan_for(stage, config, device)
    key = model_key(config, [o.key for o in outputs.values()], stage.holdout_fraction, plan.rungs,
                    device)  # fmt: skip
    logger.info("training optimizations: %s", plan.record())
    ran_at = {"site": gpu[0].name if gpu else site.name, "worker": ""}

    def fit_now() -> TrainResult:
        if gpu is not None:
            logger.info("training on site %s (a worker with the GPU resource)", gpu[0].name)
            done = gpu[1].submit(trainer.fit_stage, stage, config, plan, outputs,
                                 resources={GPU: 1}, pure=False)  # fmt: skip
            result, ran_at["worker"] = done.result()
        else:
            result, _ = trainer.fit_stage(stage, config, plan, outputs)
        return result

    # load checks the weights against their stored digest
    model = keyed_output(site.root, "model", key, ".pt", load=load_model, compute=fit_now,
                         save=lambda url, result: save_model(result, url))  # fmt: skip
    result = model.value
    at = gpu[0] if gpu else site
    across = (
        0
        if model.cache_hit
        else sum(o.blob.length for o in outputs.values() if not at.holds(o.blob.url))
    )
    if model.cache_hit:
        message = f"model {key[:12]} is cached (weights {result.model_digest[:12]}): not retrained"
    else:
        record_lineage(site.root, key, result.model_digest, outputs, config, stage.holdout_fraction)
        steady = result.steady_samples_per_s
        message = (
            f"trained on {result.samples:,} windows ({result.samples_seen:,} seen) in "
            f"{result.duration_s:.1f} s on {result.device}: {result.samples_per_s:,.0f} samples/s"
            + (f" ({steady:,.0f} after a {result.warmup_s:.1f} s warm-up)" if steady else "")
            + f", final loss {result.loss_curve[-1]:.4f}; "
            + f"optimizations: {', '.join(result.rungs) or 'none'}"
        )
    logger.info(message)
    progress.note("train", message)
    run_id = version = None
    if parent_run_id is not None:
        run_id, version = _record(stage, parent_run_id, config, outputs, model, ran_at["site"],
                                  plan, across)  # fmt: skip
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
        registered_model=version.name if version else None,
        model_version=str(version.version) if version else None,
        rungs=list(result.rungs),
        steady_samples_per_s=result.steady_samples_per_s,
        step_ms=result.step_ms,
        warmup_s=result.warmup_s,
        gpu_util=result.gpu_util,
        peak_mem_gb=result.peak_mem_gb,
        ladder_result=result.ladder_result,
        site=ran_at["site"],
        worker=ran_at["worker"],
        bytes_across=across,
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
    outputs: dict[Partition, FeatureOutput],
    model: Keyed[TrainResult],
    site: str,
    plan: Plan,
    bytes_across: int,
) -> tuple[str, ModelVersion]:
    """The "train" MLflow child run, and the model as a version in the Model Registry
    (the version of a cached model is found by its key, not registered again).

    The rungs applied and the ladder result they relied on (file, commit, date) are the
    model's (a cached model keeps those it was trained with); the plan is this run's."""
    result = model.value
    tracking_block = stage.workspace.resolve_tracking()
    client, experiment = tracking.client_for(tracking_block)
    digests = {
        "data_digest": plan_features(stage).data_digest(),
        "features_digest": sha256_json(sorted(o.key for o in outputs.values())),
        "code_digest": code_digest(),
        "params_hash": sha256_json({
            "features": stage.features.canonical(), "product_features": stage.product_features,
            "train": asdict(config), "holdout_fraction": stage.holdout_fraction,
        }),
        "model_digest": result.model_digest,
    }  # fmt: skip
    with tracking.run(client, experiment, "train", parent=parent_run_id) as run:
        run.params({f"train.{k}": v for k, v in asdict(config).items()})
        run.params({f"plan.{k}": v for k, v in plan.record().items()})
        proof = result.ladder_result or {}
        run.params({f"ladder.{k}": v for k, v in proof.items()})
        run.params(
            {
                "features_hash": sha256_json(stage.features.canonical()),
                "holdout_fraction": stage.holdout_fraction,
                "partitions": len(outputs),
            }
        )
        run.tags({"model_key": model.key, "site": site, "cache_hit": model.cache_hit,
                  "rungs": ",".join(result.rungs) or "none", **digests})  # fmt: skip
        measured = {
            "steady_samples_per_s": result.steady_samples_per_s,
            "step_ms": result.step_ms,
            "warmup_s": result.warmup_s,
            "gpu_util": result.gpu_util,
            "peak_mem_gb": result.peak_mem_gb,
        }
        run.metrics(
            {
                "samples": result.samples,
                "samples_per_s": result.samples_per_s,
                "duration_s": result.duration_s,
                "final_loss": result.loss_curve[-1],
                "cache_hit": float(model.cache_hit),
                "rungs_applied": float(len(result.rungs)),
                "bytes_across_sites": float(bytes_across),
                **{k: v for k, v in measured.items() if v is not None},
            }
        )
        steps = [(i + 1) * config.log_every for i in range(len(result.loss_curve))]
        run.series("loss", result.loss_curve, steps)
        run.flush()
        run.figure(plots.loss_curve(result.loss_curve, config.log_every), "loss_curve.png")
        version = registry.register(
            client, tracking_block.resolved_uri(), experiment, run.run_id, result,
            outputs[min(outputs)].read(), name=tracking_block.registered_model,
            model_key=model.key, tags={**digests, "train_run_id": run.run_id,
                                       "research_run_id": parent_run_id,
                                       "train_config": json.dumps(asdict(config)),
                                       "rungs": ",".join(result.rungs) or "none",
                                       "ladder_result": json.dumps(result.ladder_result)},
        )  # fmt: skip
        run.tags({"registered_model": version.name, "model_version": version.version})
        run.dataset(name=stage.selection.dataset, digest=digests["data_digest"],
                    context="training", rows=len(outputs),
                    source=storage.join(stage.workspace.resolve_site().root, "datasets",
                                        stage.selection.dataset))  # fmt: skip
        return run.run_id, version
