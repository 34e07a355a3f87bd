"""The simulate stage's compute, wherever it runs: the flow's process, or a worker of a
site whose workers declare a GPU (flows/simulate.py sends it there, as flows/train.py
sends training)."""

from __future__ import annotations

from collections.abc import Mapping

import pyarrow as pa

from quantloop.profiling.inference import InferenceStats, Predictor, forward_rungs, mode_name
from quantloop.tasks.data.schema import Partition
from quantloop.tasks.engine import storage
from quantloop.tasks.research.folds import Fold
from quantloop.tasks.research.predictions import PredictionStore
from quantloop.tasks.research.simulation import SimConfig, replay_all, stack_markouts
from quantloop.tasks.research.sited import save_checked
from quantloop.tasks.research.stage import FeatureOutput, StageParams, read_outputs
from quantloop.tasks.research.training import load_model, resolve_device, stored_model
from quantloop.tasks.runtime import timeline
from quantloop.tasks.runtime.sites import worker_address


def predictor_for(model_url: str, root: str | None = None) -> Predictor:
    """The stored model on this process's best device, on the fast path where it applies;
    with a storage `root`, it reads and keeps its predictions in that root's
    PredictionStore (tasks/research/predictions)."""
    store = PredictionStore(root) if root is not None else None
    return Predictor(load_model(model_url, device=str(resolve_device("auto"))), store=store)


def inference_mode(model_url: str) -> tuple[str, str]:
    """How the model predicts where this runs ("eager" or the rungs applied: part of the
    simulation's key), and the model's weight digest as stored: read without building the
    model (the replay loads it and checks its weights against that digest; building it
    here too was 0.9-1.1 s of an H200 research run's simulate stage)."""
    stored = stored_model(model_url)
    rungs = forward_rungs(stored.get("rungs", ()), resolve_device("auto"))
    return mode_name(rungs), stored["model_digest"]


def replay_stage(
    model_url: str,
    stage: StageParams,
    config: SimConfig,
    outputs: Mapping[Partition, FeatureOutput],
    fold: Fold,
    root: str | None = None,
) -> tuple[dict[str, dict[str, pa.Table]], InferenceStats, str]:
    """Replay the fold's test part with the fold's model and the baseline (`outputs`:
    the fold's partitions, its training part giving the thresholds). Returns the
    mark-outs, the prediction's counts and where it ran (a Dask worker's address, or ""
    in the flow's process). `root`: the site's storage, whose PredictionStore keeps the
    model's predictions (a promotion's gate replays the same days with them)."""
    with timeline.phase("simulate: load model"):
        predictor = predictor_for(model_url, root)
    with timeline.phase("simulate: read features"):
        tables = read_outputs(stage, outputs)
    with timeline.phase("simulate: predict and mark out"):
        merged = replay_all(predictor, tables, config, fold)
    return merged, predictor.stats, worker_address()


def replay_and_store(model_url: str, stage, config, parts, fold, url: str,
                     root: str | None = None) -> tuple:  # fmt: skip
    """Replay a fold (replay_stage, its predictions kept under `root`) and store its
    mark-outs at `url`, at the site where this runs (tasks/research/sited). Returns the
    mark-outs, the prediction's counts, the worker, and the stored file's sha256 and
    size."""
    merged, stats, worker = replay_stage(model_url, stage, config, parts, fold, root)
    digest, length = save_checked(url, storage.parquet_bytes(stack_markouts(merged)))
    return merged, stats, worker, digest, length
