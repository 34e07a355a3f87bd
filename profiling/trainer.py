"""A research run's training with the ladder's optimizations applied.

tasks.training prepares the data (windows, normalization, the seeded batch order) and
trains in its plain loop; this trains the same model from the same seed on the same
batches in the same order, stepping through profiling.loop.Training: the pieces the
ladder measured (compile, bf16, on-device metrics, the fused optimizer kernel, the copy
stream, the whole-step CUDA graph, packed windows, FlexAttention, ...), switched on by
name. `train_applied` is what flows/train.py calls; with no rungs it is the plain loop.

The clock: the whole loop (samples_per_s, as the plain loop reports it) and, apart from
it, the steps after the warm-up (compile, capture): steady_samples_per_s and step_ms,
from CUDA events, as the ladder measures its rungs.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict
from typing import Any

import numpy as np
import pyarrow as pa
import torch

from quantloop.models import orderbook
from quantloop.models.orderbook import ModelConfig
from quantloop.profiling import (
    compile,
    cudagraph,
    kernels,
    loop,
    measure,
    metrics,
    packing,
    precision,
    streams,
    workload,
)
from quantloop.profiling.compile_cache import kept as compile_cache_kept
from quantloop.profiling.loop import StepSettings, Training, seeded_model
from quantloop.profiling.precision import apply_precision
from quantloop.profiling.proof import Plan, plan_rungs
from quantloop.profiling.rungs import Switches
from quantloop.profiling.workload import TrainingSet, Windows
from quantloop.tasks.data.schema import Partition
from quantloop.tasks.engine import storage
from quantloop.tasks.engine.keys import code_fingerprint
from quantloop.tasks.research import training as training_module
from quantloop.tasks.research.features import FeatureParams, feature_set
from quantloop.tasks.research.folds import Fold, split_fold
from quantloop.tasks.research.stage import FeatureOutput, StageParams, read_outputs
from quantloop.tasks.research.training import (
    TrainConfig,
    TrainingData,
    TrainResult,
    interval_means,
    model_bytes,
    model_digest,
    prepare,
    resolve_device,
    torch_threads,
    train_plain,
)
from quantloop.tasks.runtime import overlap, timeline
from quantloop.tasks.runtime.sites import worker_address

# The code a model trained here depends on besides tasks.training and models (model keys)
RUNG_CODE = (
    sys.modules[__name__], loop, kernels, packing, compile, cudagraph, streams, metrics,
    precision, workload,
)  # fmt: skip
MAX_WARMUP_STEPS = 25  # compile and capture happen here; the ladder warms up as long
log = logging.getLogger(__name__)


# Python's GIL switch interval while a CUDA training runs. A thread that wants the GIL
# waits up to this long for the one holding it, and a step of ~2 ms is launched by the
# main thread beside the loader thread, the flow's Prefect and Dask threads, the GPU
# sampler: at Python's 5 ms, each handover can cost more than a step. Measured on
# H200s (bench/results/research-modes-h200.json, cold research runs): 110,731 samples/s
# at 0.5 ms against 102,730 at 5 ms on one machine; 94,170 and 83,462 against 80,515 on
# another. QUANTLOOP_GIL_SWITCH_S overrides ("default": Python's own).
def _gil_switch_setting() -> float | None:
    value = os.environ.get("QUANTLOOP_GIL_SWITCH_S", "0.0005")
    if value == "default":
        return None
    try:
        seconds = float(value)
    except ValueError:
        seconds = 0.0
    if not seconds > 0:
        raise ValueError(f"QUANTLOOP_GIL_SWITCH_S={value!r}: seconds > 0, or 'default'")
    return seconds


GIL_SWITCH_S = _gil_switch_setting()


@contextlib.contextmanager
def gil_switch(seconds: float | None) -> Iterator[None]:
    """Python's GIL switch interval set to `seconds` inside the block (None: left alone)."""
    if seconds is None:
        yield
        return
    old = sys.getswitchinterval()
    sys.setswitchinterval(seconds)
    try:
        yield
    finally:
        sys.setswitchinterval(old)


def no_compile_workers() -> None:
    """Inductor without its pool of compile workers for the rest of this process. The
    compile cache was loaded, so the graphs are found, not compiled; yet the first
    compile starts the pool (one Python process a core, each importing torch: 16 on an
    H200 machine) beside the run, and the run's exit waits for it to stop. The setting
    is not part of Inductor's cache keys (config._cache_config_ignore_prefix); a graph
    that misses after all compiles in this process."""
    import torch._inductor.config

    torch._inductor.config.compile_threads = 1


def warmup_steps(steps: int) -> int:
    """Steps before the clock starts: up to 25, at least 4 (3 eager steps before a CUDA graph
    is captured, then the capture), and a quarter of a short run at most."""
    return max(4, min(MAX_WARMUP_STEPS, steps // 4))


def warmup_marks(warmup: int, steps: int, cudagraph: bool) -> dict[int, str]:
    """The steps where the run's timeline starts a phase of the loop: the first step
    (compiled, or its kernels loaded from the compile cache), the eager steps, the step a
    CUDA graph is captured in, the steps after the warm-up."""
    marks = {0: "train: first step", 1: "train: eager steps", warmup: "train: steady steps"}
    if cudagraph:
        marks[warmup - 1] = "train: graph capture"
    return {step: name for step, name in marks.items() if step < steps}


def training_set(data: TrainingData, packing: bool) -> TrainingSet:
    """The batch makers' view of a research run's data (windows as row ranges). Its packed
    rows are on a grid (profiling/workload.rows_grid): a research run with another seed
    trains on the same shapes, so it finds its compiled kernels in the compile cache."""
    return TrainingSet.planned(
        features=data.features,
        train=Windows(start=data.starts, end=data.ends),
        labels=data.labels,
        order=data.order,
        max_len=data.windows.window,
        packing=packing,
        rows_on_grid=True,
    )


def fit_stage(
    stage: StageParams,
    config: TrainConfig,
    plan: Plan,
    outputs: Mapping[Partition, FeatureOutput],
    fold: Fold,
) -> tuple[TrainResult, str]:
    """Read the feature outputs of the fold's training part and train the fold's model:
    the train stage's work, wherever it runs. Returns the result and where it ran: the
    Dask worker's address, or "" in the flow's process. A compile's kernels are kept in
    (and looked for in) the workspace site's store, so a fresh worker does not compile
    again (profiling/compile_cache.py)."""
    with timeline.phase("train: read features"):
        tables = read_outputs(stage, outputs)
    result = train_on_features(tables, stage.features, fold, config, plan,
                               compile_cache=stage.workspace.resolve_site().root)  # fmt: skip
    return result, worker_address()


def train_on_features(
    tables: Mapping[Partition, pa.Table],
    features: FeatureParams,
    fold: Fold,
    cfg: TrainConfig,
    plan: Plan,
    *,
    compile_cache: str | None = None,
) -> TrainResult:
    """What the train stage fits for `fold`: the fold's training part of the partitions'
    feature tables (tasks/research/folds.split_fold: its training dates, or the rows before an
    intraday cut with the labels that reach it purged; nothing of its test window or
    embargo is read), with `plan`'s rungs."""
    layout = feature_set(features)
    train_parts, _ = split_fold(tables, fold, layout.labels)
    return train_applied(list(train_parts.values()), layout.inputs, layout.labels, cfg, plan,
                         compile_cache=compile_cache)  # fmt: skip


def train_applied(
    tables: Sequence[pa.Table],
    inputs: Sequence[str],
    labels: Sequence[str],
    cfg: TrainConfig,
    plan: Plan | None = None,
    model_cfg: ModelConfig | None = None,
    *,
    compile_backend: str | None = None,
    compile_cache: str | None = None,
) -> TrainResult:
    """tasks.training.train with `plan`'s rungs (default: plan_rungs(cfg.optimizations)).

    compile_backend overrides the plan's (tests on a CPU use aot_eager: Inductor's C++
    build takes minutes there)."""
    device = resolve_device(cfg.device)
    with timeline.phase("train: windows"):
        data = prepare(tables, inputs, labels, cfg, model_cfg)
    plan = plan or plan_rungs(cfg.optimizations, device, head_dim=data.model_config.head_dim)
    if not plan.rungs:
        return train_plain(data, cfg)  # bit for bit the plain loop
    return train_prepared(data, cfg, plan, compile_backend=compile_backend,
                          compile_cache=compile_cache)  # fmt: skip


def train_prepared(
    data: TrainingData,
    cfg: TrainConfig,
    plan: Plan,
    *,
    compile_backend: str | None = None,
    compile_cache: str | None = None,
) -> TrainResult:
    """compile_cache: a store root (the workspace's site) where Inductor's artifacts for
    this training's code, shapes and rungs are kept and looked for (profiling/
    compile_cache.py); None: only the machine's own Inductor cache."""
    device = resolve_device(cfg.device)
    cuda = device.type == "cuda"
    sw = Switches.of(plan.rungs)
    with timeline.phase("train: packing plan"):
        work = training_set(data, sw.packing)
    W = warmup_steps(cfg.steps)
    settings = StepSettings(
        batch_size=cfg.batch_size, steps=cfg.steps, lr=cfg.lr, weight_decay=cfg.weight_decay,
        log_every=cfg.log_every, eager_steps=W - 1,
        compile_backend=compile_backend or plan.compile_backend,
    )  # fmt: skip
    with timeline.phase("train: dynamo reset (Inductor import)"):
        overlap.wait("inductor")  # flows/train.import_inductor_ahead, if the run started it
        torch._dynamo.reset()  # imports Inductor where CUDA is available
    with timeline.phase("train: model and step set-up"):  # the CUDA context's start here
        model = seeded_model(data.model_config, cfg.seed, device)
        training = Training(model, sw, work, settings, device, plain_logger="loss")
    timer = measure.StepTimer(device)
    sampler = measure.UtilSampler(device)
    warmup_s = timed = 0.0
    model.train()
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    start = time.perf_counter()
    cache_parts = {
        "code": code_fingerprint(*RUNG_CODE, training_module, orderbook),
        "model": asdict(data.model_config), "batch": cfg.batch_size,
        "window": work.max_len, "rungs": list(plan.rungs), "backend": settings.compile_backend,
    }  # fmt: skip
    marks = warmup_marks(W, cfg.steps, sw.cudagraph)
    steps = timeline.Chain()
    steps.switch("train: compile cache load")
    tracing = contextlib.ExitStack()  # held from the first step to the end of the warm-up
    try:
        with (
            compile_cache_kept(
                compile_cache if sw.compile else None, device, cache_parts
            ) as cached,
            apply_precision(device, enabled=sw.bf16),
            torch_threads(cfg.num_threads),
            gil_switch(GIL_SWITCH_S if cuda else None),
        ):
            if cuda and cached["state"] == "loaded" and overlap.enabled():
                no_compile_workers()
            timer.start()
            if sw.compile:  # the warm-up compiles: no torch.export beside it (overlap.TRACING)
                tracing.enter_context(overlap.TRACING)
            for step in range(cfg.steps):
                if step == W:
                    tracing.close()
                    warmup_s = timer.stop()[1]
                    sampler.__enter__()
                    timer.start()
                if step in marks:  # the warm-up's parts, each with its device work
                    measure.sync(device)
                    steps.switch(marks[step])
                training.step(step)
            tracing.close()  # a run no longer than its warm-up
            if cfg.steps > W:
                timed = timer.stop()[0]
                sampler.__exit__(None, None, None)
            measure.sync(device)
            steps.switch("train: compile cache store")  # on a miss, the block's exit
    finally:
        tracing.close()
        steps.close()
        training.close()
    loss = training.logger.series()[0]  # the loss read back: the run's last host sync
    duration = time.perf_counter() - start
    model.eval()
    with timeline.phase("train: digest"):
        digest = model_digest(model)
    log.info("compile cache %s (%s hits, %s misses, %s bytes stored); packed rows %d",
             cached["state"], cached.get("hits"), cached.get("misses"),
             cached.get("stored_bytes", 0), work.pack_rows)  # fmt: skip
    seen = cfg.steps * cfg.batch_size
    after = cfg.steps - W if cfg.steps > W else 0
    return TrainResult(
        model=model,
        model_config=data.model_config,
        train_config=cfg,
        normalizer=data.normalizer,
        inputs=data.inputs,
        labels=data.label_names,
        loss_curve=interval_means(np.asarray(loss), cfg.log_every),
        model_digest=digest,
        samples=len(data.windows),
        samples_seen=seen,
        duration_s=duration,
        samples_per_s=seen / duration if duration > 0 else float("inf"),
        device=str(device),
        rungs=plan.rungs,
        steady_samples_per_s=after * cfg.batch_size / timed if timed > 0 else None,
        step_ms=timed / after * 1e3 if timed > 0 else duration / cfg.steps * 1e3,
        warmup_s=warmup_s,
        gpu_util=sampler.mean,
        peak_mem_gb=torch.cuda.max_memory_allocated(device) / 2**30 if cuda else None,
        ladder_result=plan.proof.to_dict() if plan.proof is not None else None,
        compile_cache=cached["state"],
    )


def fit_and_store(stage, config, plan, parts, fold, url: str) -> tuple[Any, str, str, int]:
    """Train a fold's model (fit_stage) and store it at `url`, at the site where this
    runs (a GPU site's worker, or the flow's process: tasks/research/sited). Returns the
    result, the worker ("" here), sha256 and size."""
    result, worker = fit_stage(stage, config, plan, parts, fold)  # see at_front
    with timeline.phase("train: save model"):
        data = model_bytes(result)
        storage.write_bytes_atomic(url, data)
    return result, worker, storage.sha256_hex(data), len(data)
