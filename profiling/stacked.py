"""K models of one shape trained as one: a sweep's settings or walk-forward folds in a
single kernel stream.

A desk's models are small (about 1 MB of weights each at the research shape) and many.
Trained one after another, each step of each model launches the same ~hundreds of small
kernels, and on an H200 one model at batch 256 keeps the GPU 15% busy
(bench/results/ladder-h200.md). Here the K models' parameters are stacked along a leading
model dimension (`torch.func.stack_module_state`) and the forward is the model's, written
over them (models/stacked.py: batched matmuls, one attention over K * B windows), so one
step is one stream of batched kernels ([K, B, T, D] activations) whatever K is.

What each model keeps of its own, so it is the model it would be trained alone
(tasks/research/training.py `train_plain`):
- its initial weights: built from its seed by the same constructor, then stacked;
- its data and order: each member names its TrainingData (a fold's windows and
  normalization) and its seeded batch order; distinct data are concatenated once on the
  device and each member's batch is a gather at its own offsets;
- its hyperparameters: learning rate and weight decay are [K] tensors broadcast against
  each stacked parameter in the AdamW update, not a Python loop over models;
- its loss: the K per-model losses are summed, and since no parameter is shared, each
  model's gradient is its own loss's gradient.

The update is AdamW's (Loshchilov & Hutter 2019, as torch.optim.AdamW computes it):
decoupled decay p *= 1 - lr * wd, then p -= lr / bc1 * m / (sqrt(v) / sqrt(bc2) + eps).

Switches (a visible flag each, as the ladder's rungs): `compile` wraps the vmapped loss
and the update in torch.compile; `bf16` runs the forward under bfloat16 autocast. The
equivalence of each member with its solo run is checked by tests/test_stacked.py (CPU,
fp32) and bench/sweep.py (the H200, with the rungs on).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch.func import stack_module_state

from quantloop.models import stacked as stacked_model
from quantloop.models.orderbook import ModelConfig, OrderBookNet
from quantloop.profiling import measure
from quantloop.tasks.research.train_config import TrainConfig
from quantloop.tasks.research.training import (
    TrainingData,
    TrainResult,
    interval_means,
    model_digest,
    resolve_device,
    sample_order,
    torch_threads,
)

# What members of one stack must share: the model's shape and the step's shape. Seed,
# learning rate, weight decay and data may differ.
SHARED = ("window", "batch_size", "steps", "log_every", "d_model", "n_layers", "n_heads",
          "ff_mult", "device")  # fmt: skip
BETAS = (0.9, 0.999)  # torch.optim.AdamW's defaults, as the plain loop uses them
EPS = 1e-8


@dataclass(kw_only=True, slots=True, frozen=True)
class StackConfig:
    """How a stack is trained: which of the ladder's switches apply."""

    compile: bool = False  # torch.compile the vmapped loss and the update
    bf16: bool = False  # bfloat16 autocast in the forward (CUDA)
    warmup_steps: int = 3  # steps before the steady clock starts (compile happens here)
    # Inductor on a GPU; the CPU tests use "aot_eager" (Dynamo and AOTAutograd without
    # Inductor's C++ build), as tests/test_train_rungs.py does for the ladder's rungs
    compile_backend: str = "inductor"
    sample_gpu: bool = True  # NVML's busy fraction over the steady steps (CUDA)

    def __post_init__(self) -> None:
        if not isinstance(self.warmup_steps, int) or self.warmup_steps < 0:
            raise ValueError(f"warmup_steps must be an integer >= 0, got {self.warmup_steps!r}")


@dataclass(kw_only=True, slots=True)
class Member:
    """One model of a stack: its prepared data (shared with others by identity) and its
    training config (seed, lr, weight decay are its own)."""

    data: TrainingData
    config: TrainConfig


@dataclass(kw_only=True, slots=True)
class StackTiming:
    """The stack's clock: the whole loop and its steps after the warm-up."""

    k: int
    duration_s: float
    warmup_s: float
    step_ms: float  # per step after the warm-up (all K models)
    samples_per_s: float  # K * batch per step, over the steady steps
    peak_mem_gb: float | None
    gpu_util: float | None  # mean NVML busy fraction over the steady steps


def reseeded(data: TrainingData, cfg: TrainConfig) -> TrainingData:
    """`data` with the batch order `cfg.seed` gives (sample_order), its arrays shared: the
    settings of a sweep over one fold differ in seed without preparing the fold again."""
    return dataclasses.replace(data, order=sample_order(len(data.windows), cfg))


def group_key(cfg: TrainConfig, data: TrainingData) -> tuple:
    """Members with equal keys can be trained in one stack."""
    return (
        *(getattr(cfg, name) for name in SHARED),
        data.model_config,
        data.windows.index.shape[1],
    )


def check_members(members: Sequence[Member]) -> None:
    if not members:
        raise ValueError("a stack needs at least one member")
    first = group_key(members[0].config, members[0].data)
    for i, m in enumerate(members[1:], 1):
        key = group_key(m.config, m.data)
        if key != first:
            names = (*SHARED, "model_config", "window_len")
            diff = [n for n, a, b in zip(names, first, key, strict=True) if a != b]
            raise ValueError(
                f"member {i} differs from member 0 in {', '.join(diff)}: "
                "members of a stack share the model's and the step's shape"
            )


class StackedAdamW:
    """AdamW over stacked parameters [K, ...] with a learning rate and weight decay per
    model ([K] tensors), computed as torch.optim.AdamW does. The step count lives on the
    device (as AdamW's `capturable` path keeps it), so a compiled update sees tensors
    only and compiles once, not once per step for each new bias correction."""

    def __init__(self, params: Sequence[torch.Tensor], lr: torch.Tensor,
                 weight_decay: torch.Tensor, *, backend: str | None = None) -> None:  # fmt: skip
        self.params = list(params)
        self.exp_avg = [torch.zeros_like(p) for p in self.params]
        self.exp_avg_sq = [torch.zeros_like(p) for p in self.params]
        # [K, 1, ...] per parameter rank, so each model's value broadcasts over its slice
        self.lr = [lr.view(-1, *[1] * (p.dim() - 1)) for p in self.params]
        self.decay = [1 - (lr * weight_decay).view(-1, *[1] * (p.dim() - 1)) for p in self.params]
        self.t = torch.zeros((), dtype=torch.float32, device=lr.device)
        self.update = torch.compile(update, backend=backend, dynamic=False) if backend else update

    @torch.no_grad()
    def step(self) -> None:
        self.update(self.params, self.exp_avg, self.exp_avg_sq, self.lr, self.decay, self.t)

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None


def update(params, exp_avgs, exp_avg_sqs, lrs, decays, t: torch.Tensor) -> None:
    """One AdamW update of every stacked parameter (a function, so torch.compile can fuse
    it into a few kernels); `t` is the step count, advanced here."""
    b1, b2 = BETAS
    t.add_(1)
    bc1 = 1 - b1**t
    bc2_sqrt = (1 - b2**t).sqrt()
    for p, m, v, lr, decay in zip(params, exp_avgs, exp_avg_sqs, lrs, decays, strict=True):
        g = p.grad
        p.mul_(decay)
        m.lerp_(g, 1 - b1)
        v.mul_(b2).addcmul_(g, g, value=1 - b2)
        denom = (v.sqrt() / bc2_sqrt).add_(EPS)
        p.sub_(lr / bc1 * m / denom)


def stacked_loss_fn(cfg: ModelConfig, bf16: bool, device_type: str):
    """[K] losses of K models on their own batches: each model's MSE of standardized
    labels (F.mse_loss's mean over its batch and outputs), as the plain loop's."""

    def losses(params, x, mask, y):
        # x: [K, B, T, F]; mask: [K, B, T]; y: [K, B, L]
        with torch.autocast(device_type, dtype=torch.bfloat16, enabled=bf16):
            pred = stacked_model.forward(params, cfg, x, mask)
        return (pred.float() - y).square().mean(dim=(1, 2))

    return losses


def train_stacked(
    members: Sequence[Member], stack: StackConfig = StackConfig()
) -> tuple[list[TrainResult], StackTiming]:  # noqa: E501
    """Train the members together; each member's TrainResult as its solo run would give
    it (curve, weights, digest), and the stack's timing."""
    check_members(members)
    cfg0 = members[0].config
    device = resolve_device(cfg0.device)
    k, steps, batch = len(members), cfg0.steps, cfg0.batch_size

    # Distinct data once on the device, concatenated; each member reads at its offsets.
    # Members reseeded from one prepared fold (`reseeded`) share its arrays: one copy.
    datas: list[TrainingData] = []
    for m in members:
        if not any(m.data.windows is d.windows for d in datas):
            datas.append(m.data)
    feats, index, mask, labels, window_offset = [], [], [], [], {}
    rows = windows = 0
    for d in datas:
        feats.append(d.features)
        index.append(d.windows.index + rows)  # the data's own padding row moves with it
        mask.append(d.windows.mask)
        labels.append(d.labels)
        window_offset[id(d.windows)] = windows
        rows += len(d.features)
        windows += len(d.windows)
    feats_t = torch.from_numpy(np.concatenate(feats)).to(device)  # [rows, F]
    index_t = torch.from_numpy(np.concatenate(index)).to(device)  # [N, T]
    mask_t = torch.from_numpy(np.concatenate(mask)).to(device)  # [N, T]
    labels_t = torch.from_numpy(np.concatenate(labels)).to(device)  # [N, L]
    # [K, steps, B]: each member's own batch order, at its data's offset
    order = np.stack([m.data.order + window_offset[id(m.data.windows)] for m in members])
    order_t = torch.from_numpy(order).to(device)

    rng_devices = [device.index or 0] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=rng_devices), torch_threads(cfg0.num_threads):
        models = []
        for m in members:  # each model's initial weights from its own seed, as alone
            torch.manual_seed(m.config.seed)
            models.append(OrderBookNet(m.data.model_config).to(device))
        params, _ = stack_module_state(models)  # {name: [K, ...]}, leaves with grad
        names = list(params)
        lr = torch.tensor([m.config.lr for m in members], dtype=torch.float32, device=device)
        wd = torch.tensor([m.config.weight_decay for m in members], dtype=torch.float32,
                          device=device)  # fmt: skip
        optimizer = StackedAdamW(
            [params[n] for n in names],
            lr,
            wd,
            backend=stack.compile_backend if stack.compile else None,
        )
        loss_fn = stacked_loss_fn(members[0].data.model_config, stack.bf16, device.type)
        if stack.compile:
            # static shapes: each K is its own graph (a second K would otherwise make
            # Dynamo compile a dynamic-shape graph for every K after it)
            loss_fn = torch.compile(loss_fn, backend=stack.compile_backend, dynamic=False)
        losses = torch.zeros(steps, k, device=device)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
        start = time.perf_counter()
        steady = start
        sampler = measure.UtilSampler(device if stack.sample_gpu else torch.device("cpu"))
        sampling = contextlib.ExitStack()
        for step in range(steps):
            if step == stack.warmup_steps:
                sync()
                steady = time.perf_counter()
                sampling.enter_context(sampler)
            b = order_t[:, step]  # [K, B]
            loss = loss_fn(params, feats_t[index_t[b]], mask_t[b], labels_t[b])  # [K]
            optimizer.zero_grad()
            loss.sum().backward()
            optimizer.step()
            losses[step] = loss.detach()
        curves = losses.cpu().numpy().astype(np.float64)  # the one host sync
        end = time.perf_counter()
        sampling.close()
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    duration = end - start
    steady_steps = steps - min(stack.warmup_steps, steps)
    steady_s = end - steady if steady_steps else duration
    timing = StackTiming(
        k=k, duration_s=duration, warmup_s=steady - start,
        step_ms=steady_s / max(steady_steps, 1) * 1e3,
        samples_per_s=k * batch * max(steady_steps, 1) / steady_s if steady_s > 0 else math.inf,
        peak_mem_gb=peak, gpu_util=sampler.mean,
    )  # fmt: skip
    results = []
    for i, (m, model) in enumerate(zip(members, models, strict=True)):
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.copy_(params[name][i])
        model.eval()
        seen = steps * batch
        results.append(
            TrainResult(
                model=model, model_config=m.data.model_config, train_config=m.config,
                normalizer=m.data.normalizer, inputs=m.data.inputs, labels=m.data.label_names,
                loss_curve=interval_means(curves[:, i], m.config.log_every),
                model_digest=model_digest(model), samples=len(m.data.windows),
                samples_seen=seen, duration_s=duration,
                samples_per_s=seen / duration if duration > 0 else math.inf,
                device=str(device),
                rungs=("stacked", *(("compile",) if stack.compile else ()),
                       *(("bf16",) if stack.bf16 else ())),
                steady_samples_per_s=timing.samples_per_s / k, step_ms=timing.step_ms,
                warmup_s=timing.warmup_s, peak_mem_gb=peak, gpu_util=timing.gpu_util,
            )
        )  # fmt: skip
    return results, timing
