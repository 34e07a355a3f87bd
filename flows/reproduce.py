"""The `reproduce` flow: re-run a research run's results from their recorded inputs,
parameters and code, compare, and record the reproduction failure rate on the run.

What is re-run: a sample of its feature nodes (or all), each walk-forward fold's model
(one check each; same seed, data and rungs: the same weights digest on the same device
class) and the simulation with the recorded models, each fold's on its own test window,
pooled (mark-outs within MARKOUT_TOLERANCE_BPS). Nothing is read from or written to the
cache: outputs are computed in this process and compared by digest.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

import torch
from prefect import flow, get_run_logger
from pydantic import TypeAdapter

from quantloop.flows.simulate import pooled
from quantloop.flows.sweep import refit_stacked
from quantloop.profiling import inference, trainer
from quantloop.profiling.proof import plan_rungs
from quantloop.tasks.data.catalog import Catalog
from quantloop.tasks.engine import storage
from quantloop.tasks.records import runs, tracking
from quantloop.tasks.records.reproduce import (
    Check,
    Report,
    check_nodes,
    check_value,
    manifest_rows,
    markout_fingerprint,
    sample_rows,
)
from quantloop.tasks.research.folds import Fold
from quantloop.tasks.research.planning import feature_kind
from quantloop.tasks.research.simulation import SimConfig, replay_all, summarize
from quantloop.tasks.research.stage import (
    StageParams,
    feature_outputs,
    fold_of,
    fold_part,
    plan_folds,
    training_part,
)
from quantloop.tasks.research.train_config import TrainConfig
from quantloop.tasks.research.training import load_model, resolve_device
from quantloop.tasks.runtime import progress
from quantloop.tasks.runtime.workspace import Workspace


@flow(name="reproduce")
def reproduce(
    run: str,
    sample: int | None = 20,
    models: bool = True,
    workspace: Workspace = Workspace(),
) -> dict:
    """Reproduce research run `run` (its MLflow run id or Prefect flow run id): `sample`
    feature nodes (all: None), and with `models` the model and the simulation. Returns
    {nodes, failures, failure_rate, checks, seconds}; the same goes to the run's MLflow
    record as metrics and a reproduction.json artifact."""
    t0 = time.perf_counter()
    logger = get_run_logger()
    client, _ = tracking.client_for(workspace.resolve_tracking())
    research = runs.find_research_run(client, run)
    tags = research.data.tags
    stages = runs.stage_runs(client, research)
    root, catalog = tags[tracking.STORE_TAG], Catalog(tags[tracking.CATALOG_TAG])
    logger.info("reproducing research run %s (store %s)", research.info.run_id, root)

    rows = manifest_rows(runs.manifest_tables(client, stages["features"].info.run_id))
    kind = feature_kind()
    checks: list[Check] = check_nodes(sample_rows(rows, sample), root=root, catalog=catalog,
                                      kinds={kind.name: kind})  # fmt: skip
    if models:
        checks += _models(client, research, stages)
    report = Report(checks)
    summary = {**report.summary(), "run": research.info.run_id,
               "seconds": time.perf_counter() - t0}  # fmt: skip
    log = tracking.RunLog(client, research.info.run_id)
    log.metrics({"reproduction.nodes": report.nodes, "reproduction.failures": report.failures,
                 "reproduction.failure_rate": report.failure_rate})  # fmt: skip
    log.flush()
    log.json(summary, "reproduction.json", "reproduction")
    line = (f"{report.nodes} results re-run, {report.failures} did not reproduce "
            f"(failure rate {report.failure_rate:.3f})")  # fmt: skip
    logger.info(line)
    progress.note("reproduce", line)
    for c in checks:
        if not c.reproduced:
            logger.warning("%s %s %s: %s", c.what, c.label, c.key[:12], c.reason)
    return summary


def _models(client, research, stages) -> list[Check]:
    """Every fold's model trained again, and the simulation replayed with the recorded
    models, each fold's on its own test window, pooled as the run pooled them."""
    resolved = json.loads(runs.read_artifact(client, research.info.run_id,
                                             "params/resolved_params.json"))  # fmt: skip
    params = resolved["params"]
    workspace = json.loads(research.data.tags[tracking.WORKSPACE_TAG])
    stage = StageParams.model_validate({
        "workspace": Workspace.model_validate(workspace),
        "selection": resolved["selection"], "features": params["features"],
        "product_features": params["product_features"],
        # a run from before the folds has holdout_fraction (the single split) instead
        **{k: params[k] for k in ("validation", "holdout_fraction") if k in params},
    })  # fmt: skip
    config = TypeAdapter(TrainConfig).validate_python(params["train"])
    models = recorded_folds(client, stages, stage)
    try:
        outputs = feature_outputs(stage)
    except LookupError as exc:
        return [Check("model", m.key, f"model fold {m.fold.index}", False, f"input gone: {exc}",
                      m.digest, "") for m in models]  # fmt: skip
    root = research.data.tags[tracking.STORE_TAG]
    train_run = stages["train"].data
    rungs = [r for r in train_run.tags.get("rungs", "none").split(",")
             if r and r not in ("none", "stacked")]  # fmt: skip
    device = resolve_device(config.device)
    trained_on = train_run.params.get("train.device", "auto")
    plan = plan_rungs(tuple(rungs) if rungs else "none", device, head_dim=config.head_dim)
    checks = []
    stacks: dict[tuple[str, ...], dict[str, str]] = {}  # a stack trained again once
    for m in models:
        parts = training_part(outputs, m.fold)
        label = f"model fold {m.fold.index}"
        lineage = json.loads(
            storage.read_bytes(storage.join(root, "lineage", "models", f"{m.key}.json"))
        )
        if sorted(o.key for o in parts.values()) != lineage["feature_keys"]:
            checks.append(Check("model", m.key, label, False, "inputs changed since (other "
                                "feature nodes in the catalog's current versions)", m.digest,
                                ""))  # fmt: skip
            continue
        # the model's own config and rungs as its train run recorded them (a sweep's
        # settings differ); a run from before that record: the run's
        cfg = config if m.train is None else TypeAdapter(TrainConfig).validate_python(m.train)
        own = (
            plan
            if m.rungs is None
            else plan_rungs(
                tuple(r for r in m.rungs if r != "stacked") or "none", device, head_dim=cfg.head_dim
            )
        )

        def weights(parts=parts, fold=m.fold, cfg=cfg, own=own, lineage=lineage, key=m.key) -> str:
            if "stack" in lineage:  # trained in a stack (flows/sweep.py): that stack again
                members = tuple(s["model_key"] for s in lineage["stack"]["members"])
                if members not in stacks:
                    stacks[members] = refit_stacked(stage, lineage, outputs)
                return stacks[members][key]
            tables = {p: o.read() for p, o in parts.items()}
            return trainer.train_on_features(tables, stage.features, fold, cfg,
                                             own).model_digest  # fmt: skip

        check = check_value("model", m.key, f"{label} on {device.type}", m.digest, weights)
        recorded_device = torch.device(load_model(m.url).device).type
        if not check.reproduced and recorded_device != device.type:
            check = Check("model", m.key, check.label, True,
                          f"trained on {recorded_device}, re-run on {device.type} ({trained_on}): "
                          "weights not compared bit for bit; the simulation below is",
                          m.digest, check.now)  # fmt: skip
        checks.append(check)

    sim_run = stages["simulate"]
    sim_config = TypeAdapter(SimConfig).validate_python(params["simulation"])
    recorded = {h: sim_run.data.metrics[f"model.total.markout_bps.{h}"]
                for h in sim_config.horizon_keys()}  # fmt: skip

    def markouts() -> str:
        replayed = []
        for m in models:
            model = load_model(m.url, device=str(resolve_device("auto")))
            tables = {p: o.read() for p, o in fold_part(outputs, m.fold).items()}
            replayed.append(replay_all(inference.Predictor(model), tables, sim_config, m.fold))
        merged = pooled(replayed)
        return markout_fingerprint(summarize(merged["model"])["total"]["mean_bps"])

    checks.append(check_value("simulation", sim_run.data.tags.get("simulation_key", ""),
                              "simulation (model mark-out)", markout_fingerprint(recorded),
                              markouts))  # fmt: skip
    return checks


@dataclass(frozen=True, slots=True)
class RecordedFold:
    fold: Fold
    key: str  # its model's key
    digest: str  # its model's weights digest
    url: str  # its stored model
    train: dict | None = None  # its TrainConfig as trained (None: recorded before, the run's)
    rungs: list[str] | None = None  # the rungs it was trained with (None: the train run's)


def recorded_folds(client, stages, stage: StageParams) -> list[RecordedFold]:
    """The folds a run trained, as its train run recorded them (folds/folds.json: each
    fold's window, model key, digest and URL). A run from before the folds recorded one
    model (tags) for the single split its stage's validation is."""
    train_run = stages["train"]
    try:
        recorded = json.loads(runs.read_artifact(client, train_run.info.run_id, "folds/folds.json"))
    except Exception:  # noqa: BLE001 - no such artifact: a run from before the folds
        (fold,) = plan_folds(stage)
        tags = train_run.data.tags
        return [RecordedFold(fold, tags["model_key"], tags["model_digest"],
                             stages["simulate"].data.params["model_url"])]  # fmt: skip
    return [RecordedFold(fold_of(r["window"], r["index"]), r["model_key"], r["model_digest"],
                         r["model_url"], r.get("train"), r.get("rungs"))
            for r in recorded]  # fmt: skip
