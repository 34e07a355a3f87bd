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
from torch.nn.attention.flex_attention import flex_attention

from quantloop.models import stacked as stacked_model
from quantloop.models.orderbook import ModelConfig, OrderBookNet
from quantloop.profiling import measure
from quantloop.profiling.packing import FlexMask
from quantloop.profiling.trainer import training_set
from quantloop.profiling.workload import pack_fields
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
    packing: bool = False  # windows packed into rows, no padding (the ladder's rung 8)
    flex_attention: bool = False  # with packing: FlexAttention's block mask (rung 9)

    def __post_init__(self) -> None:
        if not isinstance(self.warmup_steps, int) or self.warmup_steps < 0:
            raise ValueError(f"warmup_steps must be an integer >= 0, got {self.warmup_steps!r}")
        if self.flex_attention and not self.packing:
            raise ValueError("flex_attention needs packing: it attends within packed windows")


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
        data.windows.window,
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
    """[K] losses of K models on their own padded batches: each model's MSE of standardized
    labels (F.mse_loss's mean over its batch and outputs), as the plain loop's."""

    def losses(params, x, mask, y):
        # x: [K, B, T, F]; mask: [K, B, T]; y: [K, B, L]
        with torch.autocast(device_type, dtype=torch.bfloat16, enabled=bf16):
            pred = stacked_model.forward(params, cfg, x, mask)
        return (pred.float() - y).square().mean(dim=(1, 2))

    return losses


def packed_loss_fn(cfg: ModelConfig, bf16: bool, device_type: str):
    """The same losses on packed batches; `block_mask` (FlexAttention's, over the K * R rows)
    or, without it, a dense block-diagonal mask made from `seg`."""

    def losses(params, x, pos, seg, last, count, y, block_mask=None):
        if block_mask is None:
            attend = stacked_model.dense_window_attention(seg)
        else:

            def attend(q, k, v):
                return flex_attention(q, k, v, block_mask=block_mask)

        with torch.autocast(device_type, dtype=torch.bfloat16, enabled=bf16):
            pred = stacked_model.forward_packed(params, cfg, x, pos, seg, last, count, attend)
        return (pred.float() - y).square().mean(dim=(1, 2))

    return losses


@dataclasses.dataclass(kw_only=True)
class Device:
    """The members' distinct data, concatenated on the device once; each member reads at
    its offsets. Members reseeded from one prepared fold (`reseeded`) share its arrays."""

    features: torch.Tensor  # [rows, F]
    index: torch.Tensor  # [N, T] feature row of each window position (padded layout)
    mask: torch.Tensor  # [N, T]
    labels: torch.Tensor  # [N, L]
    order: torch.Tensor  # [K, steps, B] global window index
    row_offset: dict[int, int]  # id(windows) -> first feature row of that data
    window_offset: dict[int, int]  # id(windows) -> first window of that data


def on_device(members: Sequence[Member], device: torch.device) -> Device:
    datas: list[TrainingData] = []
    for m in members:
        if not any(m.data.windows is d.windows for d in datas):
            datas.append(m.data)
    feats, index, mask, labels, row_offset, window_offset = [], [], [], [], {}, {}
    rows = windows = 0
    for d in datas:
        feats.append(d.features)
        index.append(d.windows.index + rows)  # the data's own padding row moves with it
        mask.append(d.windows.mask)
        labels.append(d.labels)
        row_offset[id(d.windows)], window_offset[id(d.windows)] = rows, windows
        rows += len(d.features)
        windows += len(d.windows)
    order = np.stack([m.data.order + window_offset[id(m.data.windows)] for m in members])
    return Device(
        features=torch.from_numpy(np.concatenate(feats)).to(device),
        index=torch.from_numpy(np.concatenate(index)).to(device),
        mask=torch.from_numpy(np.concatenate(mask)).to(device),
        labels=torch.from_numpy(np.concatenate(labels)).to(device),
        order=torch.from_numpy(order).to(device),
        row_offset=row_offset,
        window_offset=window_offset,
    )


class PaddedBatches:
    """Each step's batch of every member, padded to the window length: one gather."""

    def __init__(self, dev: Device) -> None:
        self.dev = dev

    def __call__(self, step: int) -> tuple:
        d = self.dev
        b = d.order[:, step]  # [K, B]
        return d.features[d.index[b]], d.mask[b], d.labels[b]


class PackedBatches:
    """Each step's batch of every member packed into R rows of T events (profiling/
    packing.py's layout, first-fit decreasing per member and step, R the most any member's
    step needs). Every step's packing is planned before the loop and kept on the device
    as int32 (src, seg, pos: ~10 bytes a position), so a step is gathers on the device and
    no host work: the top rung's loader thread does the same work beside the steps."""

    def __init__(self, members: Sequence[Member], dev: Device, flex: bool) -> None:
        works = [training_set(m.data, packing=True) for m in members]
        T = works[0].max_len
        R = max(w.pack_rows for w in works)
        steps, K = members[0].config.steps, len(members)
        src = np.empty((steps, K, R * T), np.int32)
        seg = np.empty((steps, K, R, T), np.int32)
        pos = np.empty((steps, K, R, T), np.int32)
        last = np.empty((steps, K, members[0].config.batch_size), np.int64)
        count = np.empty(last.shape, np.float32)
        for k, (m, w) in enumerate(zip(members, works, strict=True)):
            offset = dev.row_offset[id(m.data.windows)]
            for step in range(steps):
                which = w.order[step]
                f = pack_fields(w.train.start[which], w.train.lengths[which], w.pack_row[step],
                                w.pack_off[step], T, R, w.pad_row)  # fmt: skip
                src[step, k] = f["src"] + offset
                seg[step, k], pos[step, k] = f["seg"], f["pos"]
                last[step, k], count[step, k] = f["last"], f["count"]
        device = dev.features.device
        self.dev, self.R, self.T = dev, R, T
        self.src, self.seg, self.pos, self.last, self.count = (
            torch.from_numpy(a).to(device) for a in (src, seg, pos, last, count)
        )
        self.mask = FlexMask(K * R, T, device) if flex else None

    def __call__(self, step: int) -> tuple:
        d = self.dev
        K = d.order.shape[0]
        x = d.features[self.src[step]].view(K, self.R, self.T, -1)
        seg = self.seg[step].long()
        y = d.labels[d.order[:, step]]
        block_mask = None if self.mask is None else self.mask.update(seg.view(-1, self.T))
        return x, self.pos[step].long(), seg, self.last[step], self.count[step], y, block_mask


def train_stacked(
    members: Sequence[Member], stack: StackConfig = StackConfig()
) -> tuple[list[TrainResult], StackTiming]:
    """Train the members together; each member's TrainResult as its solo run would give
    it (curve, weights, digest), and the stack's timing."""
    check_members(members)
    cfg0 = members[0].config
    device = resolve_device(cfg0.device)
    k, steps, batch = len(members), cfg0.steps, cfg0.batch_size
    dev = on_device(members, device)
    if stack.packing:
        batches = PackedBatches(members, dev, flex=stack.flex_attention)
        make_loss = packed_loss_fn
    else:
        batches = PaddedBatches(dev)
        make_loss = stacked_loss_fn

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
        loss_fn = make_loss(members[0].data.model_config, stack.bf16, device.type)
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
            loss = loss_fn(params, *batches(step))  # [K]
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
