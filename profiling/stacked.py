"""K models of one shape trained as one: a sweep's settings or walk-forward folds in a
single kernel stream.

A desk's models are small (about 3 MB of float32 weights each at the research shape) and
many. Trained one after another, each step of each model launches the same few hundred
small kernels, and on an H200 one model at batch 256 keeps the GPU about half busy
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
- its hyperparameters: learning rate and weight decay are [K] tensors in the AdamW update,
  not a Python loop over models;
- its loss: the K per-model losses are summed, and since no parameter is shared, each
  model's gradient is its own loss's gradient.

The update is AdamW's (Loshchilov & Hutter 2019, as torch.optim.AdamW computes it):
decoupled decay p *= 1 - lr * wd, then p -= lr / bc1 * m / (sqrt(v) / sqrt(bc2) + eps).

Switches (a visible flag each, named as the ladder's rungs, profiling/rungs.py):
`compile` (torch.compile of the stacked loss and of the update), `bf16` (bfloat16 autocast
in the forward, TF32 for float32 matmuls), `packing` (every member's windows packed into
rows, planned before the loop and kept on the device: rung 8), `flex_attention` (one
FlexAttention block mask over the K x rows: rung 9), `flex_blocks` (its 64-event blocks
and tiles where profiling/packing.flex_layout allows: rung 13), and the top rung's step:
`fused_kernel` (every model's parameters, gradients and moments in flat buffers, one
AdamW pass over all of them with each element's model's lr and decay: rung 5),
`flat_grads` (backward hands its gradients over and one multi-tensor copy puts them in
the flat buffer: rung 10) and `cudagraph` (the whole step, batch gather included, one
CUDA graph replayed each step: rung 7; the step index lives on the device).

The equivalence of each member with its solo run is checked by tests/test_stacked.py (CPU,
fp32) and bench/sweep.py (the H200, with the rungs on).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass

import numpy as np
import torch
from torch.func import stack_module_state
from torch.nn.attention.flex_attention import flex_attention

from quantloop.models import orderbook
from quantloop.models import stacked as stacked_model
from quantloop.models.orderbook import ModelConfig
from quantloop.profiling import cudagraph, measure
from quantloop.profiling.compile import inductor_options
from quantloop.profiling.compile_cache import kept as compile_cache_kept
from quantloop.profiling.loop import seeded_model
from quantloop.profiling.packing import FlexMask, flex_layout
from quantloop.profiling.precision import apply_precision, autocast
from quantloop.profiling.trainer import training_set
from quantloop.profiling.workload import pack_fields
from quantloop.tasks.engine.keys import code_fingerprint
from quantloop.tasks.research import training as training_module
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
ALIGN = 16  # elements: each parameter of the flat buffer starts on a 64-byte boundary
# The switches a stack has, by the ladder's names (StackConfig's fields), and what each
# needs besides itself.
SWITCHES = ("compile", "bf16", "packing", "flex_attention", "flex_blocks", "fused_kernel",
            "flat_grads", "cudagraph", "combo_kernels", "gemm_bias_grad")  # fmt: skip
REQUIRES = {
    "flex_attention": ("packing",),
    "flex_blocks": ("flex_attention",),
    "flat_grads": ("fused_kernel",),
    "cudagraph": ("fused_kernel",),
    "combo_kernels": ("compile",),
}


# Compiled losses and FlexAttention masks kept between stacks of one shape when a caller
# asks (train_stacked reuse_compiled): Dynamo guards on the loss's closure and on the block
# mask's mask function, so a new closure or mask for each stack would compile again (and
# past Dynamo's recompile limit run eagerly without a word). Cleared with Dynamo's state.
_COMPILED: dict[tuple, Callable] = {}
_FLEX_MASKS: dict[tuple, FlexMask] = {}


class CompiledLater:
    """torch.compile(fn, **options), wrapped at the first call rather than when made: torch
    looks a function's Dynamo package up when it wraps it (compile_cache.kept's
    precompile), and a stack's store is loaded after its step is built."""

    __slots__ = ("fn", "options", "compiled")

    def __init__(self, fn: Callable, **options) -> None:
        self.fn, self.options, self.compiled = fn, options, None

    def __call__(self, *args, **kwargs):
        if self.compiled is None:
            self.compiled = torch.compile(self.fn, **self.options)
        return self.compiled(*args, **kwargs)


def forget_compiled() -> None:
    """A fresh Dynamo state: the kept losses and masks dropped, torch._dynamo.reset()."""
    _COMPILED.clear()
    _FLEX_MASKS.clear()
    torch._dynamo.reset()


@dataclass(kw_only=True, slots=True, frozen=True)
class StackConfig:
    """How a stack is trained: which of the ladder's switches apply."""

    compile: bool = False  # torch.compile the stacked loss and the update
    bf16: bool = False  # bfloat16 autocast in the forward (CUDA)
    warmup_steps: int = 3  # steps before the steady clock starts (compile, capture here)
    # Inductor on a GPU; the CPU tests use "aot_eager" (Dynamo and AOTAutograd without
    # Inductor's C++ build), as tests/test_train_rungs.py does for the ladder's rungs
    compile_backend: str = "inductor"
    sample_gpu: bool = True  # NVML's busy fraction over the steady steps (CUDA)
    packing: bool = False  # windows packed into rows, no padding (the ladder's rung 8)
    flex_attention: bool = False  # with packing: FlexAttention's block mask (rung 9)
    flex_blocks: bool = False  # FlexAttention's 64-event blocks and tiles (rung 13)
    fused_kernel: bool = False  # flat buffers, one AdamW pass over every model (rung 5)
    flat_grads: bool = False  # gradients handed to the flat buffer in one copy (rung 10)
    cudagraph: bool = False  # the whole step one CUDA graph (rung 7); CUDA only
    combo_kernels: bool = False  # Inductor's combo kernels for the loss (rung 11)
    # the wide Linears' bias gradients summed by a GEMM (models/stacked.linear), not by
    # Inductor's reduction kernels: an A/B switch (bench/sweep.py --stack-set), on in no
    # stack: with bf16 Linears it measured no gain (sweep-h200-notes.md, call 5), and it is
    # no rung of the ladder, so a research run's stacks (flows/sweep.stack_setup) lack it
    gemm_bias_grad: bool = False
    # with a compile-cache store: Dynamo's packages kept in it too, so a process that
    # loads it installs the compiled loss and update without tracing them (compile_cache
    # .kept's precompile; torch's experimental caching_precompile). Not a rung: the same
    # kernels, from the store instead of a trace. Off until a GPU has run it (FlexAttention
    # and the CUDA graph are not on a CPU): bench/sweep.py --stack-set precompile=1.
    precompile: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.warmup_steps, int) or self.warmup_steps < 0:
            raise ValueError(f"warmup_steps must be an integer >= 0, got {self.warmup_steps!r}")
        for name, needs in REQUIRES.items():
            lacking = [n for n in needs if getattr(self, name) and not getattr(self, n)]
            if lacking:
                raise ValueError(f"{name} needs {', '.join(lacking)}")
        if self.cudagraph and self.warmup_steps < 4:
            raise ValueError("cudagraph needs warmup_steps >= 4: 3 eager steps, then the capture")

    @classmethod
    def top(cls, device: torch.device, head_dim: int, **changes) -> StackConfig:
        """Every switch that runs on `device` (the ladder's top rung for a stack): on a CPU,
        packing and the flat-buffer step only (FlexAttention has no backward there, torch
        2.13; no CUDA graph); FlexAttention only for heads it supports."""
        cuda = device.type == "cuda"
        flex = cuda and head_dim >= 16
        # not gemm_bias_grad: with the Linears in bf16 (07df07c) it gains nothing, K = 16
        # on an H100 20.59 ms a step with it, 20.58 without (sweep-h200-notes.md, call 5;
        # 22.80 -> 21.44 in call 4 was on float32 Linear outputs)
        on = dict(compile=cuda, bf16=cuda, packing=True, flex_attention=flex,
                  flex_blocks=flex, fused_kernel=True, flat_grads=True, cudagraph=cuda)  # fmt: skip
        return cls(**{**on, "warmup_steps": 10 if cuda else 3, **changes})

    def switches(self) -> tuple[str, ...]:
        """The switches on, by the ladder's names (a stacked model's rungs)."""
        return tuple(name for name in SWITCHES if getattr(self, name))


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
    warmup_s: float  # the warm-up steps (compile or compile-cache load, capture)
    step_ms: float  # per step after the warm-up (all K models)
    samples_per_s: float  # K * batch per step, over the steady steps
    peak_mem_gb: float | None
    gpu_util: float | None  # mean NVML busy fraction over the steady steps
    setup_s: float = 0.0  # before the first step: data and packing plan on the device, models
    compile_cache: str = "off"  # the workspace store's compiled kernels: off, loaded, missing
    rows: int = 0  # packed rows per model and step (0: padded)
    # each warm-up step's seconds, the device synchronized after it (on CUDA with the
    # graph: the compile or cache load, the eager steps, the capture and first replay)
    warmup_steps_s: tuple[float, ...] = ()
    cache_load_s: float = 0.0  # the store's compiled kernels read and loaded, before step 0


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


# ---------------------------------------------------------------- optimizers


class StackedAdamW:
    """AdamW over stacked parameters [K, ...] with a learning rate and weight decay per
    model ([K] tensors), computed as torch.optim.AdamW does, one parameter at a time (the
    first version; `FlatAdamW` is the fused one). The step count lives on the device (as
    AdamW's `capturable` path keeps it), so a compiled update sees tensors only and
    compiles once, not once per step for each new bias correction."""

    def __init__(self, params: Sequence[torch.Tensor], lr: torch.Tensor,
                 weight_decay: torch.Tensor, *, backend: str | None = None) -> None:  # fmt: skip
        self.params = list(params)
        self.exp_avg = [torch.zeros_like(p) for p in self.params]
        self.exp_avg_sq = [torch.zeros_like(p) for p in self.params]
        # [K, 1, ...] per parameter rank, so each model's value broadcasts over its slice
        self.lr = [lr.view(-1, *[1] * (p.dim() - 1)) for p in self.params]
        self.decay = [1 - (lr * weight_decay).view(-1, *[1] * (p.dim() - 1)) for p in self.params]
        self.t = torch.zeros((), dtype=torch.float32, device=lr.device)
        self.update = CompiledLater(update, backend=backend, dynamic=False) if backend else update

    @torch.no_grad()
    def step(self) -> None:
        self.update(self.params, self.exp_avg, self.exp_avg_sq, self.lr, self.decay, self.t)

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None


def update(params, exp_avgs, exp_avg_sqs, lrs, decays, t: torch.Tensor) -> None:
    """One AdamW update of every stacked parameter (a function, so torch.compile can fuse
    it); `t` is the step count, advanced here."""
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


def flat_update(p, g, m, v, owner, step_size, decay, bc2_sqrt) -> None:
    """AdamW over flat buffers of every model's parameters: element i belongs to model
    owner[i], whose step size (lr / bc1) and decay (1 - lr * wd) are gathered from [K]
    tensors. torch.optim.AdamW's operations in its order; compiled, one pointwise kernel."""
    b1, b2 = BETAS
    p.mul_(decay[owner])
    m.lerp_(g, 1 - b1)
    v.mul_(b2).addcmul_(g, g, value=1 - b2)
    denom = (v.sqrt() / bc2_sqrt).add_(EPS)
    p.sub_(step_size[owner] * (m / denom))


class FlatAdamW:
    """AdamW with a learning rate and weight decay per model over one flat float32 buffer
    of every stacked parameter (rung 5's layout: parameters, gradients and both moments
    each one buffer, the stacked parameters views of it), updated in one pass.

    The stacked parameters are `leaves` ({name: [K, ...]}, autograd leaves that are views
    of the buffer). The step count and the bias corrections live on the device, computed
    in float64 as torch.optim.AdamW computes them in Python floats, so the step can be
    captured in a CUDA graph. handoff (rung 10): backward hands each gradient over as its
    own tensor and step() copies them into the flat buffer with one multi-tensor copy;
    without it backward accumulates into views of the buffer, zeroed each step."""

    def __init__(self, params: dict[str, torch.Tensor], lr: torch.Tensor,
                 weight_decay: torch.Tensor, *, handoff: bool,
                 backend: str | None = None) -> None:  # fmt: skip
        device, K = lr.device, lr.shape[0]
        sizes = [p.numel() for p in params.values()]
        spans = [-(-n // ALIGN) * ALIGN for n in sizes]
        total = sum(spans)
        self.param = torch.zeros(total, device=device)
        self.grad = torch.zeros(total, device=device)
        self.exp_avg = torch.zeros(total, device=device)
        self.exp_avg_sq = torch.zeros(total, device=device)
        owner = np.zeros(total, np.int32)  # alignment gaps: model 0, zero gradient forever
        self.leaves: dict[str, torch.Tensor] = {}
        self.grad_views: list[torch.Tensor] = []
        offset = 0
        for (name, p), n, span in zip(params.items(), sizes, spans, strict=True):
            view = self.param[offset : offset + n].view(p.shape)
            view.copy_(p.detach())
            leaf = view.detach().requires_grad_(True)  # shares the buffer's storage
            self.grad_views.append(self.grad[offset : offset + n].view(p.shape))
            if not handoff:
                leaf.grad = self.grad_views[-1]  # backward accumulates in place
            self.leaves[name] = leaf
            owner[offset : offset + n] = np.repeat(np.arange(K, dtype=np.int32), n // K)
            offset += span
        self.owner = torch.from_numpy(owner).to(device)
        self.handoff = handoff
        self.lr64 = lr.double()
        self.decay = (1 - lr.double() * weight_decay.double()).float()
        self.t = torch.zeros((), dtype=torch.float64, device=device)
        self.update = flat_update
        if backend:
            key = ("flat_update", backend)
            if key not in _COMPILED:
                _COMPILED[key] = CompiledLater(flat_update, backend=backend, dynamic=False)
            self.update = _COMPILED[key]

    def zero_grad(self) -> None:
        if self.handoff:
            for leaf in self.leaves.values():
                leaf.grad = None  # AccumulateGrad then keeps backward's tensor: no add kernel
        else:
            self.grad.zero_()

    @torch.no_grad()
    def step(self) -> None:
        if self.handoff:
            grads = [g if (g := p.grad) is not None else torch.zeros_like(p)
                     for p in self.leaves.values()]  # fmt: skip
            torch._foreach_copy_(self.grad_views, grads)
        b1, b2 = BETAS
        self.t.add_(1)
        step_size = (self.lr64 / (1 - torch.pow(b1, self.t))).float()  # [K]
        bc2_sqrt = (1 - torch.pow(b2, self.t)).sqrt().float()
        self.update(self.param, self.grad, self.exp_avg, self.exp_avg_sq, self.owner,
                    step_size, self.decay, bc2_sqrt)  # fmt: skip


# ---------------------------------------------------------------- losses


def stacked_loss_fn(cfg: ModelConfig, gemm_bias_grad: bool = False):
    """[K] losses of K models on their own padded batches: each model's MSE of standardized
    labels (F.mse_loss's mean over its batch and outputs), as the plain loop's. The caller
    enters bf16 autocast around it (StackStep.run), as the plain loop does around its net."""

    def losses(params, x, mask, y):
        # x: [K, B, T, F]; mask: [K, B, T]; y: [K, B, L]
        pred = stacked_model.forward(params, cfg, x, mask, gemm_bias_grad)
        return (pred.float() - y).square().mean(dim=(1, 2))

    return losses


def packed_loss_fn(cfg: ModelConfig, tiles: dict | None = None, gemm_bias_grad: bool = False):
    """The same losses on packed batches; `block_mask` (FlexAttention's, over the K * R rows,
    its kernels' tiles `tiles`) or, without it, a dense block-diagonal mask made from `seg`."""

    def losses(params, x, pos, seg, last, count, y, block_mask=None):
        if block_mask is None:
            attend = stacked_model.dense_window_attention(seg)
        else:

            def attend(q, k, v):
                return flex_attention(q, k, v, block_mask=block_mask, kernel_options=tiles)

        pred = stacked_model.forward_packed(params, cfg, x, pos, seg, last, count, attend,
                                            gemm_bias_grad)  # fmt: skip
        return (pred.float() - y).square().mean(dim=(1, 2))

    return losses


# ---------------------------------------------------------------- batches


@dataclasses.dataclass(kw_only=True)
class Device:
    """The members' distinct data, concatenated on the device once; each member reads at
    its offsets. Members reseeded from one prepared fold (`reseeded`) share its arrays."""

    features: torch.Tensor  # [rows, F]
    labels: torch.Tensor  # [N, L]
    order: torch.Tensor  # [K, steps, B] global window index
    row_offset: dict[int, int]  # id(windows) -> first feature row of that data
    window_offset: dict[int, int]  # id(windows) -> first window of that data
    datas: list[TrainingData]
    index: torch.Tensor | None = None  # [N, T] feature row of each position (padded layout)
    mask: torch.Tensor | None = None  # [N, T]


def on_device(members: Sequence[Member], device: torch.device, padded: bool = True) -> Device:
    datas: list[TrainingData] = []
    for m in members:
        if not any(m.data.windows is d.windows for d in datas):
            datas.append(m.data)
    feats, labels, row_offset, window_offset = [], [], {}, {}
    rows = windows = 0
    for d in datas:
        feats.append(d.features)
        labels.append(d.labels)
        row_offset[id(d.windows)], window_offset[id(d.windows)] = rows, windows
        rows += len(d.features)
        windows += len(d.windows)
    order = np.stack([m.data.order + window_offset[id(m.data.windows)] for m in members])
    dev = Device(
        features=torch.from_numpy(np.concatenate(feats)).to(device),
        labels=torch.from_numpy(np.concatenate(labels)).to(device),
        order=torch.from_numpy(order).to(device),
        row_offset=row_offset,
        window_offset=window_offset,
        datas=datas,
    )
    if padded:  # the [N, T] index and mask (the data's own padding row moves with it)
        index = [d.windows.index + row_offset[id(d.windows)] for d in datas]
        dev.index = torch.from_numpy(np.concatenate(index)).to(device)
        dev.mask = torch.from_numpy(np.concatenate([d.windows.mask for d in datas])).to(device)
    return dev


def at(t: torch.Tensor, step: torch.Tensor, dim: int = 0) -> torch.Tensor:
    """t's slice at the step held in the device tensor `step` ([1] long): a gather on the
    device (no host read), so a CUDA graph replays it for each new step."""
    return t.index_select(dim, step).squeeze(dim)


class PaddedBatches:
    """Each step's batch of every member, padded to the window length: one gather."""

    rows = 0

    def __init__(self, dev: Device) -> None:
        self.dev = dev

    def __call__(self, step: torch.Tensor) -> tuple:
        d = self.dev
        b = at(d.order, step, 1)  # [K, B]
        return d.features[d.index[b]], d.mask[b], d.labels[b]


class PackedBatches:
    """Each step's batch of every member packed into R rows of T events (profiling/
    packing.py's layout, first-fit decreasing per member and step, R the most any member's
    step needs). Every step's packing is planned before the loop and kept on the device
    as int32 (src, seg, pos: 12 bytes a position), so a step is gathers on the device and
    no host work: the top rung's loader thread does the same work beside the steps."""

    def __init__(self, members: Sequence[Member], dev: Device, flex_block: int | None) -> None:
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
        self.dev, self.rows, self.T = dev, R, T
        self.src, self.seg, self.pos, self.last, self.count = (
            torch.from_numpy(a).to(device) for a in (src, seg, pos, last, count)
        )
        self.mask = None
        if flex_block is not None:
            key = (K * R, T, flex_block, str(device))
            if key not in _FLEX_MASKS:
                _FLEX_MASKS[key] = FlexMask(K * R, T, device, block=flex_block)
            self.mask = _FLEX_MASKS[key]

    def __call__(self, step: torch.Tensor) -> tuple:
        d = self.dev
        K = d.order.shape[0]
        x = d.features[at(self.src, step)].view(K, self.rows, self.T, -1)
        seg = at(self.seg, step).long()
        y = d.labels[at(d.order, step, 1)]
        block_mask = None if self.mask is None else self.mask.update(seg.view(-1, self.T))
        return x, at(self.pos, step).long(), seg, at(self.last, step), at(self.count, step), y, \
            block_mask  # fmt: skip


# ---------------------------------------------------------------- the step


class StackStep:
    """One training step of every member, the step index on the device: the batch gather,
    the forward and backward of the K models, the update, the losses recorded. Eager, or
    (cudagraph) three eager steps on a side stream, then captured once and replayed."""

    def __init__(self, members: Sequence[Member], stack: StackConfig, device: torch.device,
                 perturb: float = 0.0) -> None:  # fmt: skip
        check_members(members)
        if stack.cudagraph and device.type != "cuda":
            raise ValueError("cudagraph needs a CUDA device")
        cfg0 = members[0].config
        model_cfg = members[0].data.model_config
        self.members, self.stack, self.device = list(members), stack, device
        self.k, self.steps = len(members), cfg0.steps
        tiles = None
        if stack.packing:
            self.dev = on_device(members, device, padded=False)
            flex_block = None
            if stack.flex_attention:
                T = members[0].data.windows.window
                flex_block, tiles = flex_layout(T, model_cfg.head_dim, tuned=stack.flex_blocks)
            self.batches: PackedBatches | PaddedBatches = PackedBatches(
                members, self.dev, flex_block
            )
            loss_fn = packed_loss_fn(model_cfg, tiles, stack.gemm_bias_grad)
        else:
            self.dev = on_device(members, device, padded=True)
            self.batches = PaddedBatches(self.dev)
            loss_fn = stacked_loss_fn(model_cfg, stack.gemm_bias_grad)
        self.tiles = tiles
        # each model's initial weights from its own seed, as alone (perturb > 0: each
        # weight times 1 +- perturb, the ladder's rounding controls)
        self.models = [seeded_model(m.data.model_config, m.config.seed, device, perturb)
                       for m in members]  # fmt: skip
        params, _ = stack_module_state(self.models)  # {name: [K, ...]}, leaves with grad
        lr = torch.tensor([m.config.lr for m in members], dtype=torch.float32, device=device)
        wd = torch.tensor([m.config.weight_decay for m in members], dtype=torch.float32,
                          device=device)  # fmt: skip
        backend = stack.compile_backend if stack.compile else None
        if stack.fused_kernel:
            self.opt: FlatAdamW | StackedAdamW = FlatAdamW(params, lr, wd,
                                                            handoff=stack.flat_grads,
                                                            backend=backend)  # fmt: skip
            self.params = self.opt.leaves
        else:
            self.params = params
            self.opt = StackedAdamW(list(params.values()), lr, wd, backend=backend)
        if stack.compile:
            # static shapes: each K is its own graph (a second K would otherwise make
            # Dynamo compile a dynamic-shape graph for every K after it)
            key = (model_cfg, stack.bf16, device.type, stack.packing, repr(tiles),
                   stack.compile_backend, stack.combo_kernels, stack.gemm_bias_grad)  # fmt: skip
            if key not in _COMPILED:
                options = inductor_options(autotune=False, combo=stack.combo_kernels)
                extra = {"options": options} if options and backend == "inductor" else {}
                _COMPILED[key] = CompiledLater(loss_fn, backend=stack.compile_backend,
                                               dynamic=False, **extra)  # fmt: skip
            loss_fn = _COMPILED[key]
        self.loss_fn = loss_fn
        self.losses = torch.zeros(self.steps, self.k, device=device)
        self.step_t = torch.zeros(1, dtype=torch.long, device=device)
        self.eager_steps = stack.warmup_steps - 1 if stack.cudagraph else None
        self.side = torch.cuda.Stream(device) if stack.cudagraph else None
        self.graph: torch.cuda.CUDAGraph | None = None
        self.calls = 0

    def run(self, phase: Callable[[str], contextlib.AbstractContextManager] | None = None):
        """The step's work (what the graph captures). `phase(name)` wraps its parts (the
        kernel breakdown's markers): "forward", "backward", "optimizer"."""
        part = phase or (lambda name: contextlib.nullcontext())
        with part("forward"):
            batch = self.batches(self.step_t)
            # bf16 autocast entered around the compiled loss, as the solo loop enters it
            # around its compiled net: entered inside, AOTAutograd's cache bypasses the
            # graph ("_enter_autocast", torch 2.13) and every process traces it again
            with autocast(self.device, self.stack.bf16):
                loss = self.loss_fn(self.params, *batch)  # [K]
        with part("backward"):
            self.opt.zero_grad()
            loss.sum().backward()
        with part("optimizer"):
            self.opt.step()
            self.losses.index_copy_(0, self.step_t, loss.detach().unsqueeze(0))
            self.step_t.add_(1)

    def __call__(self) -> None:
        if self.eager_steps is None:
            self.run()
        elif self.calls < self.eager_steps:  # compile, allocate, cuBLAS set-up off the graph
            main = torch.cuda.current_stream(self.device)
            self.side.wait_stream(main)
            with torch.cuda.stream(self.side):
                self.run()
            main.wait_stream(self.side)
        else:
            if self.graph is None:
                self.graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(self.graph, capture_error_mode=cudagraph.CAPTURE_ERROR_MODE):
                    self.run()
            self.graph.replay()
        self.calls += 1

    def results(self, curves: np.ndarray, duration: float, timing: StackTiming) -> list:
        """Each member's TrainResult from the stack's final weights and loss curves."""
        out = []
        k, batch = self.k, self.members[0].config.batch_size
        for i, (m, model) in enumerate(zip(self.members, self.models, strict=True)):
            with torch.no_grad():
                for name, p in model.named_parameters():
                    p.copy_(self.params[name][i])
            model.eval()
            seen = self.steps * batch
            out.append(
                TrainResult(
                    model=model, model_config=m.data.model_config, train_config=m.config,
                    normalizer=m.data.normalizer, inputs=m.data.inputs,
                    labels=m.data.label_names,
                    loss_curve=interval_means(curves[:, i], m.config.log_every),
                    model_digest=model_digest(model), samples=len(m.data.windows),
                    samples_seen=seen, duration_s=duration,
                    samples_per_s=seen / duration if duration > 0 else math.inf,
                    device=str(self.device), rungs=("stacked", *self.stack.switches()),
                    steady_samples_per_s=timing.samples_per_s / k, step_ms=timing.step_ms,
                    warmup_s=timing.warmup_s, peak_mem_gb=timing.peak_mem_gb,
                    gpu_util=timing.gpu_util, compile_cache=timing.compile_cache,
                )
            )  # fmt: skip
        return out


def cache_parts(step: StackStep) -> dict:
    """What decides a stack's compiled kernels besides torch and the device (profiling/
    compile_cache.py's key): the code, the model and step shapes, the switches."""
    m0 = step.members[0]
    return {
        "code": code_fingerprint(stacked_model, orderbook, training_module, sys.modules[__name__]),
        "model": asdict(m0.data.model_config), "k": step.k, "batch": m0.config.batch_size,
        "window": m0.data.windows.window, "rows": step.batches.rows,
        "stack": {n: getattr(step.stack, n) for n in (*SWITCHES, "compile_backend")},
    }  # fmt: skip


@contextlib.contextmanager
def _no_cache() -> Iterator[dict]:
    yield {"state": "off"}


@contextlib.contextmanager
def compile_workers(cache_info: dict) -> Iterator[None]:
    """With the store's artifacts loaded, Inductor compiles in this process instead of
    starting its pool of compile workers (a process a core, each importing torch, started
    by the first compile whether or not its graphs are then found in the cache). The
    setting is not part of Inductor's cache keys; a graph that misses compiles here."""
    if cache_info.get("state") != "loaded":
        yield
        return
    import torch._inductor.config as inductor_config

    with inductor_config.patch(compile_threads=1):
        yield


def train_stacked(
    members: Sequence[Member],
    stack: StackConfig = StackConfig(),
    *,
    compile_cache: str | None = None,
    perturb: float = 0.0,
    reuse_compiled: bool = False,
) -> tuple[list[TrainResult], StackTiming]:
    """Train the members together; each member's TrainResult as its solo run would give
    it (curve, weights, digest), and the stack's timing.

    compile_cache: a store root (the workspace's site) where Inductor's artifacts for this
    stack's code, shapes and switches are kept and looked for (profiling/compile_cache.py);
    None: only the machine's own Inductor cache. perturb > 0: every initial weight times
    1 +- perturb (profiling/loop.seeded_model: the rounding controls of bench/sweep.py).
    reuse_compiled: keep Dynamo's state and the compiled loss of an earlier stack of the
    same shape and switches in this process (a run of stacks of one shape: each after the
    first starts without tracing again); False (the default): a fresh Dynamo state."""
    check_members(members)
    cfg0 = members[0].config
    device = resolve_device(cfg0.device)
    cuda = device.type == "cuda"
    t0 = time.perf_counter()
    # a fresh Dynamo state per stack unless asked: compiled entries of earlier stacks
    # (other K, other masks) would otherwise pile up on the loss's code object, and past
    # Dynamo's recompile limit it runs eagerly without a word
    if not reuse_compiled:
        forget_compiled()
    with torch_threads(cfg0.num_threads):
        step = StackStep(members, stack, device, perturb)
    steps = cfg0.steps
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    sync()
    setup_s = time.perf_counter() - t0
    sampler = measure.UtilSampler(device if stack.sample_gpu else torch.device("cpu"))
    sampling = contextlib.ExitStack()
    cached = compile_cache_kept(compile_cache, device, cache_parts(step),
                                precompile=stack.precompile) \
        if stack.compile and compile_cache else _no_cache()  # fmt: skip
    with cached as cache_info, apply_precision(device, enabled=stack.bf16), \
            torch_threads(cfg0.num_threads), compile_workers(cache_info):  # fmt: skip
        start = time.perf_counter()
        steady = start
        marks = [start]
        for i in range(steps):
            if i == stack.warmup_steps:
                sync()
                steady = time.perf_counter()
                sampling.enter_context(sampler)
            step()
            if i < stack.warmup_steps:  # the warm-up's parts; a sync costs nothing there
                sync()
                marks.append(time.perf_counter())
        curves = step.losses.cpu().numpy().astype(np.float64)  # the one host sync
        end = time.perf_counter()
        sampling.close()
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if cuda else None
    duration = end - start
    steady_steps = steps - min(stack.warmup_steps, steps)
    steady_s = end - steady if steady_steps else duration
    k, batch = step.k, cfg0.batch_size
    timing = StackTiming(
        k=k, duration_s=duration, warmup_s=steady - start,
        step_ms=steady_s / max(steady_steps, 1) * 1e3,
        samples_per_s=k * batch * max(steady_steps, 1) / steady_s if steady_s > 0 else math.inf,
        peak_mem_gb=peak, gpu_util=sampler.mean, setup_s=setup_s,
        compile_cache=cache_info["state"], rows=step.batches.rows,
        warmup_steps_s=tuple(round(b - a, 4) for a, b in zip(marks, marks[1:], strict=False)),
        cache_load_s=cache_info.get("read_s", 0.0) + cache_info.get("load_s", 0.0),
    )  # fmt: skip
    return step.results(curves, duration, timing), timing


# ---------------------------------------------------------------- where the time goes

# Kernel classes of a step's GPU time, by kernel name within the forward and backward
# (cuBLAS / CUTLASS GEMMs; FlexAttention's Triton templates, the only templates Inductor
# makes without max-autotune, and SDPA's kernels; the rest: norms, elementwise, gathers,
# reductions, copies), and everything the optimizer phase runs.
GEMM_NAMES = ("gemm", "gemv", "xmma", "cutlass", "nvjet", "cublas", "bmm", "wgmma", "s16816",
              "s1688", "splitkreduce")  # fmt: skip
ATTENTION_NAMES = ("flex", "attention", "fmha", "flash", "triton_tem", "sdpa")
CLASSES = ("gemm", "attention", "norms_elementwise", "optimizer")


def kernel_class(name: str, phase: str) -> str:
    low = name.lower()
    if phase == "optimizer":
        return "optimizer"
    if any(s in low for s in GEMM_NAMES):
        return "gemm"
    if any(s in low for s in ATTENTION_NAMES):
        return "attention"
    return "norms_elementwise"


def kernel_breakdown(
    members: Sequence[Member],
    stack: StackConfig,
    *,
    steps: int = 4,
    warm: int = 3,
    reuse_compiled: bool = False,
) -> dict:
    """GPU time per step by kernel class (CLASSES) for this stack: `warm` steps, then
    `steps` profiled steps run eagerly (the graph's kernels, without the graph), the device
    synchronised between forward, backward and optimizer so each kernel falls in its
    phase. Also the phases' wall time and the kernels' count. CUDA only ({} on a CPU).
    The members' whole packing plan is made (their shapes are the training's, so a loss
    compiled for it is found: reuse_compiled, or Inductor's cache); only the first
    warm + steps steps run."""
    device = resolve_device(members[0].config.device)
    if device.type != "cuda":
        return {}
    if warm + steps > members[0].config.steps:
        raise ValueError(f"{warm + steps} steps asked of a training of {members[0].config.steps}")
    if not reuse_compiled:
        forget_compiled()
    eager = dataclasses.replace(stack, cudagraph=False, warmup_steps=0)
    step = StackStep(members, eager, device)
    spans: list[tuple[str, float, float]] = []

    @contextlib.contextmanager
    def phase(name: str) -> Iterator[None]:
        torch.cuda.synchronize(device)
        with torch.profiler.record_function(f"stack.{name}"):
            yield
            torch.cuda.synchronize(device)

    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with apply_precision(device, enabled=stack.bf16):
        for _ in range(warm):
            step.run()
        torch.cuda.synchronize(device)
        with torch.profiler.profile(activities=acts) as prof:
            for _ in range(steps):
                step.run(phase)
            torch.cuda.synchronize(device)
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        events = json.load(open(f.name)).get("traceEvents", [])
    for e in events:
        if e.get("ph") == "X" and e.get("cat") == "user_annotation" and \
                str(e.get("name", "")).startswith("stack."):  # fmt: skip
            spans.append((e["name"][6:], e["ts"], e["ts"] + e["dur"]))
    spans.sort(key=lambda s: s[1])
    ms = dict.fromkeys(CLASSES, 0.0)
    count = dict.fromkeys(CLASSES, 0)
    top: dict[str, float] = {}
    for e in events:
        if e.get("ph") != "X" or e.get("cat") not in ("kernel", "gpu_memcpy", "gpu_memset"):
            continue
        where = next((n for n, a, b in spans if a <= e["ts"] <= b), None)
        if where is None:
            continue
        cls = kernel_class(e.get("name", ""), where)
        ms[cls] += e["dur"] / 1e3 / steps
        count[cls] += 1
        top[e["name"][:240]] = top.get(e["name"][:240], 0.0) + e["dur"] / 1e3 / steps
    wall = dict.fromkeys(("forward", "backward", "optimizer"), 0.0)
    for n, a, b in spans:
        wall[n] = wall.get(n, 0.0) + (b - a) / 1e3 / steps
    return {
        "k": step.k,
        "kernel_ms": ms,
        "kernels_per_step": {c: n / steps for c, n in count.items()},
        "kernel_total_ms": sum(ms.values()),
        "phase_wall_ms": wall,
        "top_kernels_ms": dict(sorted(top.items(), key=lambda kv: -kv[1])[:15]),
    }
