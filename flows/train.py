"""The training stage: one order-book model per walk-forward fold, each fitted on its
fold's training part and keyed by its training window, so folds cache like features."""

from __future__ import annotations

import contextlib
import contextvars
import datetime as dt
import importlib
import json
import os
import sys
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict

import torch
from mlflow.entities.model_registry import ModelVersion
from prefect import flow, get_run_logger
from pydantic import BaseModel

from quantloop.models import orderbook
from quantloop.profiling import trainer
from quantloop.profiling.proof import Plan, plan_rungs
from quantloop.tasks.data.schema import Partition
from quantloop.tasks.engine import NoWorkers, code_fingerprint, sha256_json, storage
from quantloop.tasks.records import plots, registry, tracking
from quantloop.tasks.records.provenance import code_digest
from quantloop.tasks.research import folds, training
from quantloop.tasks.research.folds import Fold
from quantloop.tasks.research.form import TrainForm
from quantloop.tasks.research.sited import SiteOutputs, at_front, device_type
from quantloop.tasks.research.stage import (
    FeatureOutput,
    Keyed,
    StageParams,
    describe,
    feature_outputs,
    output_key,
    plan_features,
    plan_folds,
    training_part,
)
from quantloop.tasks.research.training import (
    TrainConfig,
    TrainResult,
    load_model,
    open_cuda_context,
    resolve_device,
    save_model,
    start_cuda_driver,
)
from quantloop.tasks.runtime import overlap, progress, timeline
from quantloop.tasks.runtime.sites import stage_site


class FoldModel(BaseModel):
    """One fold's model: the window it was trained for and where it is."""

    index: int  # the fold's place on the walk-forward grid (tasks/research/folds.Fold.index)
    window: dict  # Fold.window(): its train, embargo and test dates (and intraday cut)
    model_url: str
    model_key: str
    model_digest: str
    cache_hit: bool
    final_loss: float
    samples: int  # training windows
    duration_s: float  # the training loop's seconds when it was trained
    partitions: int  # feature outputs it trained on
    bytes_across: int = 0  # feature output bytes copied to its training site for it


class TrainSummary(BaseModel):
    """The train stage's result. The top-level model fields are the last fold's model
    (trained on the most recent data: the one registered in MLflow); every fold's is in
    `folds`, oldest first."""

    folds: list[FoldModel] = []
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
    # feature output bytes copied to the training site from others for it (all sites)
    bytes_across: int = 0
    # the same by the site they were copied to: the site above, and a GPU site that lost
    # its workers after copies were made there (the stage was then placed again)
    bytes_across_at: dict[str, int] = {}


def model_key(
    config: TrainConfig,
    feature_keys: list[str],
    window: dict,
    rungs: tuple[str, ...] = (),
    device: str | None = None,
) -> str:
    """What decides the weights: training code (the split's too), config, device type,
    the training partitions' feature keys, the fold's training window
    (Fold.training_window(): its dates and intraday cut, not its test dates, so two folds
    that train on the same dates share a model, and adding a date keeps every earlier
    fold's key), and the rungs applied (not how they were asked for: "auto" and the same
    list named explicitly train the same model). device: the device type where training
    runs, when that is not this process (a GPU site's worker)."""
    code = code_fingerprint(training, orderbook, folds)
    if rungs:
        code += code_fingerprint(*trainer.RUNG_CODE)
    config_values = {k: v for k, v in asdict(config).items() if k != "optimizations"}
    return output_key(
        "model",
        code=code,
        config=config_values,
        device=device or resolve_device(config.device).type,
        features=sorted(feature_keys),
        window=window,
        rungs=list(rungs),
    )


def ladder_results(stage: StageParams) -> list[str]:
    """The workspace's own ladder result, if `quantloop ladder` ran there (flows/ladder.py
    writes it): `auto` weighs it with the committed ones."""
    return [os.path.join(stage.workspace.home_abs, "ladder", "ladder.json")]


def plan_for(stage: StageParams, config: TrainConfig, device: str | None = None) -> Plan:
    where = torch.device(device) if device else resolve_device(config.device)
    return plan_rungs(config.optimizations, where, ladder_results(stage), head_dim=config.head_dim)


# What torch._dynamo.reset() imports before a compiled training where CUDA is available
# (cudagraph_trees), and the first compile's backend (compile_fx): 3.1 s of an H200
# research run's train stage (bench/results/turnaround-h200-rows-notes.md). The warm
# process cannot import them ahead: on the H200 that import initializes CUDA, which a
# forked child cannot use; the run imports them in a thread while it lands, plans and
# reads its features (tasks/runtime/overlap.py), and the trainer waits for it.
INDUCTOR_MODULES = ("torch._inductor.cudagraph_trees", "torch._inductor.compile_fx")


def import_inductor_ahead(stage: StageParams, config: TrainConfig) -> bool:
    """Import Inductor in a thread when this process will compile a training on a GPU
    (`compiles_here`, decided in the thread too); False when overlap is off. Deciding it
    starts CUDA (the plan's device class asks torch.cuda for the GPU's name), so the
    thread runs even where the warm process imported Inductor already: skipped there
    (488b06b), the train stage's plan paid that start on the path, 0.13-0.21 s in every
    run of an A/B on one H100 (call 15 of bench/results/turnaround-h200-ahead-notes.md)
    against 0.01-0.02 s with the thread. The driver and the device's context are started
    through the driver's API (`start_cuda_driver`, `open_cuda_context`), which lets go of
    the interpreter's lock: from torch, the driver's start held the main thread 0.24 s
    (H100, call 18) and a `torch.zeros(1)` on the device held the main thread's MLflow
    calls or the train stage's plan for 0.35-0.9 s (H200, call 12)."""

    def work() -> None:
        if config.device != "cpu":
            start_cuda_driver()  # the lock let go meanwhile (compiles_here asks torch.cuda)
        if compiles_here(stage, config):
            open_cuda_context(resolve_device(config.device))  # the model's set-up's, ahead
            for module in INDUCTOR_MODULES:
                if module not in sys.modules:
                    importlib.import_module(module)

    return overlap.ahead("inductor", work)


def compiles_here(stage: StageParams, config: TrainConfig) -> bool:
    """Whether the train stage will compile a training in this process on a GPU: no site
    has Dask workers that could take it, the device is CUDA, the plan compiles, and a
    fold's model is missing from the store (`models_missing`)."""
    if any(s.gpus and s.scheduler_address for s in stage.workspace.resolve_sites()):
        return False
    if resolve_device(config.device).type != "cuda":
        return False
    plan = plan_for(stage, config)
    return "compile" in plan.rungs and models_missing(stage, config, plan)


def models_missing(stage: StageParams, config: TrainConfig, plan: Plan) -> bool:
    """Whether a fold's model is not stored under the key the train stage will look
    for, known before the features stage runs: the keys of the planned feature nodes
    are the keys their outputs are stored under."""
    planned = plan_features(stage).nodes
    keys = {
        Partition.trusted(product, dt.date.fromisoformat(date)): key
        for key, product, date in zip(
            *(planned[c].to_pylist() for c in ("key", "product", "date")), strict=True
        )
    }
    sited = SiteOutputs(stage.workspace)  # stored at any site (the catalog's copies)
    for fold in plan_folds(stage):
        key = model_key(config, list(training_part(keys, fold).values()),
                        fold.training_window(), plan.rungs)  # fmt: skip
        if not sited.find("model", key, ".pt"):
            return True
    return False


@flow(name="train")
def train(
    stage: StageParams = StageParams(),
    config: TrainForm = TrainConfig(),
    parent_run_id: str | None = None,
) -> TrainSummary:
    """Train one model per fold of the stage's validation, each on its fold's training
    part (nothing of its test window or embargo is read).

    Args:
        stage: The workspace, the partitions, the feature parameters their features
            were computed with (run the features flow on them first) and the folds.
        config: How the models are trained.
        parent_run_id: An MLflow run to record under as a child run "train"; empty:
            nothing is recorded.
    """
    logger = get_run_logger()
    site = stage.workspace.resolve_site()
    down: set[str] = set()  # GPU sites that lost every worker during this stage
    spent: dict[str, int] = {}  # bytes copied to each site for training, whatever happens
    while True:
        with contextlib.ExitStack() as stack:
            try:
                return _train(stage, config, parent_run_id, site, stack, logger, down, spent)
            except NoWorkers as exc:
                # Past the site's no_workers_timeout_s: fail naming it, or (replica) train
                # at the next GPU site, else here; models stored meanwhile stay cached.
                if stage.workspace.on_unreachable != "replica" or exc.site is None:
                    raise
                down.add(exc.site)
                logger.warning("%s: training is placed again", exc)


def save_timed(url: str, result: TrainResult) -> None:
    """Store a model (flows/sweep.py stores its models with this, at the default site)."""
    with timeline.phase("train: save model"):
        save_model(result, url)


def _train(stage, config, parent_run_id, site, stack, logger, down, spent) -> TrainSummary:
    # Training goes to a site whose Dask workers declare a GPU, when there is one;
    # otherwise it runs here, in the flow's process (the default site). It reads the
    # feature outputs there: those stored only elsewhere are copied there first (counted).
    with timeline.phase("train: plan"):
        where = stage_site(stage.workspace.resolve_sites(), stack, down=down, log=logger,
                           on_unreachable=stage.workspace.on_unreachable)  # fmt: skip
        at = where.site
        sited = SiteOutputs(stage.workspace)
        outputs = feature_outputs(stage, prefer=at.name)
        planned = plan_folds(stage)
        device = where.run(device_type, config.device) if where.remote else None
        plan = plan_for(stage, config, device)
    logger.info("training optimizations: %s", plan.record())
    ran_at = {"site": at.name, "worker": ""}
    trained: list[tuple[Fold, Keyed[TrainResult], dict[Partition, FeatureOutput], int]] = []
    for fold in planned:
        parts = training_part(outputs, fold)
        key = model_key(config, [o.key for o in parts.values()], fold.training_window(),
                        plan.rungs, device)  # fmt: skip
        copied = [0]

        def fit_now(url: str, parts=parts, fold=fold, copied=copied):
            if where.remote:
                logger.info("training on site %s (a worker with the GPU resource)", at.name)
            local, copied[0] = sited.bring_features_for("train", parts, at, where.run, spent)
            outputs.update(local)  # later folds read the copies
            # stored at `url`, at the site that trains it
            result, worker, digest, length = where.run(trainer.fit_and_store, at_front(stage, at),
                                                       config, plan, local, fold, url)  # fmt: skip
            ran_at["worker"] = worker
            return result, digest, length

        # load checks the weights against their stored digest
        model = sited.keyed(at, "model", key, ".pt", load=load_model, compute=fit_now)
        result = model.value
        across = copied[0]
        where_fold = f"fold {fold.index} ({describe(fold)})"
        if model.cache_hit:
            message = (f"{where_fold}: model {key[:12]} is cached at site {model.site} (weights "
                       f"{result.model_digest[:12]}): not retrained")  # fmt: skip
        else:
            with timeline.phase("train: lineage"):
                # beside the model, at the site that trained it
                record_lineage(at.root, key, result.model_digest, parts, config, fold)
            steady = result.steady_samples_per_s
            message = (
                f"{where_fold}: trained on {result.samples:,} windows "
                f"({result.samples_seen:,} seen) "
                f"in {result.duration_s:.1f} s on {result.device}: "
                f"{result.samples_per_s:,.0f} samples/s"
                + (f" ({steady:,.0f} after a {result.warmup_s:.1f} s warm-up)" if steady else "")
                + f", final loss {result.loss_curve[-1]:.4f}; "
                + f"optimizations: {', '.join(result.rungs) or 'none'}"
            )
        logger.info(message)
        progress.note("train", message)
        trained.append((fold, model, parts, across))
    run_id = version = None
    if parent_run_id is not None:
        with timeline.phase("train: record"):
            run_id, version = _record(stage, parent_run_id, config, outputs, trained,
                                      ran_at["site"], plan)  # fmt: skip
        if isinstance(version, Future):  # registered in the background: the caller joins it
            version = None
    return train_summary(trained, ran_at, run_id, version, spent)


def train_summary(
    trained: list[tuple[Fold, Keyed[TrainResult], dict[Partition, FeatureOutput], int]],
    ran_at: dict[str, str],
    run_id: str | None = None,
    version: ModelVersion | None = None,
    spent: dict[str, int] | None = None,
) -> TrainSummary:
    """The stage's result from its folds' models (oldest first; the last is the one
    registered) and where training ran ({"site", "worker"}). spent: the bytes copied to
    each site for it (a stage placed again made copies at more than one); None: the
    folds' own counts, all at the site it ran at."""
    if spent is None:
        spent = {ran_at["site"]: sum(across for *_, across in trained)}
    fold_models = [
        FoldModel(
            index=fold.index,
            window=fold.window(),
            model_url=model.url,
            model_key=model.key,
            model_digest=model.value.model_digest,
            cache_hit=model.cache_hit,
            final_loss=model.value.loss_curve[-1],
            samples=model.value.samples,
            duration_s=model.value.duration_s,
            partitions=len(parts),
            bytes_across=across,
        )
        for fold, model, parts, across in trained
    ]
    last = trained[-1][1]  # the model of the most recent data
    result = last.value
    return TrainSummary(
        folds=fold_models,
        model_url=last.url,
        model_key=last.key,
        model_digest=result.model_digest,
        cache_hit=last.cache_hit,
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
        bytes_across=sum(spent.values()),
        bytes_across_at={name: n for name, n in spent.items() if n},
    )


def loss_curve_png(site_root: str, key: str, loss: list[float], log_every: int) -> bytes:
    """The model's loss curve as a PNG, drawn once and stored beside the model at the
    workspace's site (`site_root`; keyed by the model and the plotting code): a run that
    finds its model cached sends the stored picture instead of importing matplotlib and
    drawing it again (on the H200, a cached run's matplotlib import, font set-up and
    layout were seconds). Safe in any thread (plots.py draws no pyplot figure)."""
    url = storage.join(site_root, "models", f"{key}.loss-{code_fingerprint(plots)[:12]}.png")
    if storage.exists(url):
        return storage.read_bytes(url)
    png = plots.png(plots.loss_curve(loss, log_every))
    storage.write_bytes_atomic(url, png)
    return png


def window_tag(fold: Fold) -> str:
    """A fold's window in a few characters (a model version's tag: MLflow caps their
    length, and a window may span years of dates): its index, then first, last and count
    of each part; the dates between are the data's trading days."""

    def span(dates: tuple) -> list:
        return [dates[0].isoformat(), dates[-1].isoformat(), len(dates)] if dates else []

    return json.dumps({"fold": fold.index, "train": span(fold.train_dates),
                       "embargo": span(fold.embargoed), "test": span(fold.test_dates),
                       "holdout_fraction": fold.holdout_fraction})  # fmt: skip


def record_lineage(
    root: str,
    key: str,
    digest: str,
    outputs: dict[object, FeatureOutput],
    config: TrainConfig,
    fold: Fold,
    extra: dict | None = None,
) -> None:
    """Which feature nodes a model was trained from (its fold's training part), so
    lineage runs both ways, and the fold's window (what it was trained for and tested
    on; `holdout_fraction` is the intraday cut, None for a fold of whole dates). extra:
    more of how it was made (a stacked model's stack: flows/sweep.py)."""
    record = {
        "model_key": key,
        "model_digest": digest,
        "feature_keys": sorted(o.key for o in outputs.values()),
        "partitions": sorted(str(p) for p in outputs),
        "config": asdict(config),
        "fold": fold.index,
        "window": fold.window(),
        "holdout_fraction": fold.holdout_fraction,
        "created_at": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        **(extra or {}),
    }
    url = storage.join(root, "lineage", "models", f"{key}.json")
    storage.write_bytes_atomic(url, json.dumps(record, indent=1).encode())


# A research run registers the train stage's model in the background while its simulation
# runs (registry.register: torch.export and the uploads, 2 s on CPU here and 7.6 s for the
# CUDA model on an H200, bench/results/turnaround-h200.md), inside records_in_background().
# Elsewhere (the train flow alone, retrain) _record registers before it returns.
_DEFERRED: contextvars.ContextVar[list[Future] | None] = contextvars.ContextVar(
    "quantloop_train_records_in_background", default=None
)
_REGISTRATION = ThreadPoolExecutor(max_workers=1, thread_name_prefix="train-registration")


@contextlib.contextmanager
def records_in_background() -> Iterator[list[Future]]:
    """Inside this block, each train flow ends its MLflow "train" run and registers its
    model in a thread: the list gets a Future per train flow, of its ModelVersion, and its
    TrainSummary says no version (`with_version` adds it). The block's end waits for every
    one; an error of one is raised there unless another is already on its way."""
    pending: list[Future] = []
    token = _DEFERRED.set(pending)
    try:
        yield pending
    except BaseException:
        for future in pending:
            with contextlib.suppress(BaseException):
                future.result()
        raise
    finally:
        _DEFERRED.reset(token)
    for future in pending:
        future.result()


def with_version(trained: TrainSummary, version: ModelVersion) -> TrainSummary:
    """The summary of a train flow whose model was registered in the background."""
    return trained.model_copy(
        update={"registered_model": version.name, "model_version": str(version.version)}
    )


def _record(
    stage: StageParams,
    parent_run_id: str,
    config: TrainConfig,
    outputs: dict[Partition, FeatureOutput],
    trained: list[tuple[Fold, Keyed[TrainResult], dict[Partition, FeatureOutput], int]],
    site: str,
    plan: Plan,
    extra_tags: dict[str, str] | None = None,
) -> tuple[str, ModelVersion | Future]:
    """The "train" MLflow child run, with every fold's figures, and the last fold's model
    (trained on the most recent data) as a version in the Model Registry; the version of a
    cached model is found by its key, not registered again. Earlier folds' models are
    not registered: they exist to test their own windows. Inside records_in_background(),
    the registration and the run's end go to a thread: a Future of the version.

    The rungs applied and the ladder result they relied on (file, commit, date) are the
    model's (a cached model keeps those it was trained with); the plan is this run's.
    extra_tags: more tags of the run and the version (a sweep's setting, its check)."""
    last_fold, model, parts, _ = trained[-1]
    result = model.value
    tracking_block = stage.workspace.resolve_tracking()
    client, experiment = tracking.client_for(tracking_block)
    validation = asdict(stage.validation)
    digests = {
        "data_digest": plan_features(stage).data_digest(),
        "features_digest": sha256_json(sorted(o.key for o in parts.values())),
        "code_digest": code_digest(),
        # not "params_hash": that is the research form's digest (the research run's tag);
        # this one is what decides the model alone
        "model_params_hash": sha256_json({
            "features": stage.features.canonical(), "product_features": stage.product_features,
            "train": asdict(config), "validation": validation,
        }),
        "model_digest": result.model_digest,
    }  # fmt: skip
    stack = contextlib.ExitStack()
    run = stack.enter_context(tracking.run(client, experiment, "train", parent=parent_run_id))
    try:
        _record_figures(run, stage, config, outputs, trained, site, plan, digests, validation)
        run.tags(extra_tags or {})
    except BaseException:
        if not stack.__exit__(*sys.exc_info()):  # the run ends FAILED
            raise
    tags = {**digests, "train_run_id": run.run_id, "research_run_id": parent_run_id,
            "train_config": json.dumps(asdict(config)), "validation": json.dumps(validation),
            "fold_window": window_tag(last_fold), "rungs": ",".join(result.rungs) or "none",
            "ladder_result": json.dumps(result.ladder_result), **(extra_tags or {})}  # fmt: skip
    source = tracking.source_tags()  # here: the flow run's context is this thread's
    site_root = stage.workspace.resolve_site().root  # here: a block may be loaded by the API

    def register() -> ModelVersion:
        with stack:  # the run ends FINISHED, or FAILED if this raises
            # drawn and read here, beside the next stage: off the flow's path (the figure
            # alone was 0.06-0.07 s on the 2-core VM)
            png = loss_curve_png(site_root, model.key, result.loss_curve, config.log_every)
            run.file(png, "loss_curve.png")
            example = parts[min(parts)].read()
            version = registry.register(
                client, tracking_block.resolved_uri(), experiment, run.run_id, result, example,
                name=tracking_block.candidates, model_key=model.key, tags=tags,
                log=run,  # its step-0 metrics become the logged model's, sent once at the end
                source=source, model_url=model.url,
            )  # fmt: skip
            run.tags({"registered_model": version.name, "model_version": version.version})
            run.dataset(name=stage.selection.dataset, digest=digests["data_digest"],
                        context="training", rows=len(outputs),
                        source=storage.join(site_root, "datasets",
                                            stage.selection.dataset))  # fmt: skip
            return version

    pending = _DEFERRED.get()
    if pending is None:
        return run.run_id, register()
    pending.append(_REGISTRATION.submit(register))
    return run.run_id, pending[-1]


def _record_figures(run, stage, config, outputs, trained, site, plan, digests, validation):
    """What the "train" run records before its model: parameters, tags, metrics, the loss
    curves, the folds (the loss-curve plot is drawn with the model's registration)."""
    last_fold, model, parts, _ = trained[-1]
    result = model.value
    run.params({f"train.{k}": v for k, v in asdict(config).items()})
    run.params({f"plan.{k}": v for k, v in plan.record().items()})
    proof = result.ladder_result or {}
    run.params({f"ladder.{k}": v for k, v in proof.items()})
    run.params({f"validation.{k}": v for k, v in validation.items()})
    run.params(
        {
            "features_hash": sha256_json(stage.features.canonical()),
            "partitions": len(outputs),
            "folds": len(trained),
        }
    )
    run.tags({"model_key": model.key, "site": site, "cache_hit": model.cache_hit,
              "rungs": ",".join(result.rungs) or "none", "fold_window": window_tag(last_fold),
              **digests})  # fmt: skip
    measured = {
        "steady_samples_per_s": result.steady_samples_per_s,
        "step_ms": result.step_ms,
        "warmup_s": result.warmup_s,
        "gpu_util": result.gpu_util,
        "peak_mem_gb": result.peak_mem_gb,
    }
    per_fold = {}
    for fold, m, fold_parts, across in trained:
        r, k = m.value, f"fold{fold.index}"
        per_fold |= {f"{k}.final_loss": r.loss_curve[-1], f"{k}.samples": r.samples,
                     f"{k}.cache_hit": float(m.cache_hit), f"{k}.duration_s": r.duration_s,
                     f"{k}.partitions": len(fold_parts),
                     f"{k}.bytes_across_sites": float(across)}  # fmt: skip
    run.metrics(
        {
            "samples": result.samples,
            "samples_per_s": result.samples_per_s,
            "duration_s": result.duration_s,
            "final_loss": result.loss_curve[-1],
            "cache_hit": float(model.cache_hit),
            "rungs_applied": float(len(result.rungs)),
            "bytes_across_sites": float(sum(across for *_, across in trained)),
            "folds": len(trained),
            "folds_cached": sum(m.cache_hit for _, m, _, _ in trained),
            **per_fold,
            **{k: v for k, v in measured.items() if v is not None},
        }
    )
    steps = [(i + 1) * config.log_every for i in range(len(result.loss_curve))]
    run.series("loss", result.loss_curve, steps)  # the registered (last) model's
    for fold, m, _, _ in trained[:-1]:
        curve = m.value.loss_curve
        run.series(f"fold{fold.index}.loss", curve,
                   [(i + 1) * config.log_every for i in range(len(curve))])  # fmt: skip
    # each model's own config and rungs: what `reproduce` trains it with again
    run.json([{"index": fold.index, "window": fold.window(), "model_key": m.key,
               "model_digest": m.value.model_digest, "model_url": m.url,
               "cache_hit": m.cache_hit, "feature_keys": sorted(o.key for o in p.values()),
               "train": asdict(m.value.train_config), "rungs": list(m.value.rungs)}
              for fold, m, p, _ in trained], "folds.json", "folds")  # fmt: skip
