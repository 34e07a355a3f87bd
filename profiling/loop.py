"""One rung's training run: a fresh OrderBookNet from the ladder's seed, trained on the
same batches in the same order for `cfg.steps` steps with the rung's switches on, timed
and traced; then its predictions on the held-out day (padded, eager, float32).

The schedule is warm-up (compile, capture) | timed | profiled, all of them training steps:
the clock reads only the timed ones, the profiler only the last `profiled_steps`.

`Training` is the step with its switches on (optimizer, metric logger, forward module,
loader, graph): the ladder's runs and a research run's trainer (profiling.trainer) both
step through it, so a research run applies exactly the pieces the ladder measured.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from quantloop.models.orderbook import ModelConfig, OrderBookNet
from quantloop.profiling import kernels, measure
from quantloop.profiling.compile import apply_compile, compile_each
from quantloop.profiling.config import LadderConfig
from quantloop.profiling.cudagraph import apply_cudagraph
from quantloop.profiling.metrics import DeviceLogger, HostLogger
from quantloop.profiling.packing import FlexMask, apply_packing, flex_layout
from quantloop.profiling.precision import apply_precision, autocast
from quantloop.profiling.rungs import Rung, Switches
from quantloop.profiling.streams import Layout, Prefetcher, SyncLoader
from quantloop.profiling.workload import (
    TrainingSet,
    Windows,
    Workload,
    packed_batch,
    packed_spec,
    padded_batch,
    padded_index,
    padded_spec,
)
from quantloop.tasks.research.training import torch_threads

TRACE_PATH = "{out}/trace-rung{number}-{name}.json"


def model_config(cfg: LadderConfig, work: Workload) -> ModelConfig:
    """The OrderBookNet every rung trains: the ladder's sizes, the workload's widths."""
    return ModelConfig(
        n_features=work.n_features,
        n_outputs=len(work.label_names),
        d_model=cfg.d_model,
        n_layers=cfg.n_layers,
        n_heads=cfg.n_heads,
        ff_mult=cfg.ff_mult,
        max_len=cfg.max_len,
    )


@dataclass(kw_only=True, slots=True)
class RungRun:
    """What one training run leaves: its series, held-out predictions, clocks and counts."""

    loss: np.ndarray  # [steps]
    grad_norm: dict[str, np.ndarray]
    pred_test: np.ndarray  # [test rows, L] bps
    pred_threshold: np.ndarray  # [threshold rows, L] bps
    warmup_s: float
    timed_s: float  # device timeline of the timed steps
    timed_wall_s: float
    gpu_util: float | None
    peak_mem_gb: float | None
    counts: measure.TraceCounts | None
    trace: str | None
    batch_bytes: int


@dataclass(kw_only=True, slots=True, frozen=True)
class StepSettings:
    """What the step needs from a run's config: the ladder's (LadderConfig) or a research
    run's (tasks.training.TrainConfig, through profiling.trainer)."""

    batch_size: int
    steps: int
    lr: float
    weight_decay: float
    log_every: int
    eager_steps: int  # steps run before a CUDA graph is captured (>= 3)
    compile_backend: str
    prefetch_depth: int = 3
    # compile each transformer block on its own instead of the whole forward module:
    # gradients then become ready block by block (profiling.distributed overlaps their
    # all-reduce with the backward of the blocks below)
    compile_per_block: bool = False

    @classmethod
    def of_ladder(cls, cfg: LadderConfig) -> StepSettings:
        return cls(
            batch_size=cfg.batch_size, steps=cfg.steps, lr=cfg.lr,
            weight_decay=cfg.weight_decay, log_every=cfg.log_every,
            eager_steps=cfg.warmup_steps - 1, compile_backend=cfg.compile_backend,
            prefetch_depth=cfg.prefetch_depth,
        )  # fmt: skip


class LossLogger:
    """The loss only, kept on the device and read once at the end: how tasks.training's
    plain loop records it. A research run's trainer uses it when device_metrics is off."""

    def __init__(self, steps: int, device: torch.device) -> None:
        self.losses = torch.zeros(steps, device=device)
        self.step = 0

    def record(self, loss: torch.Tensor, pred: torch.Tensor, y: torch.Tensor) -> None:
        self.losses[self.step] = loss.detach()

    def advance(self) -> None:
        self.step += 1

    def end_step(self, step: int, last_step: int) -> None:
        pass

    def series(self) -> tuple[np.ndarray, np.ndarray, dict[str, np.ndarray]]:
        return self.losses.cpu().numpy().astype(np.float64), np.zeros((0, 0)), {}


class Training:
    """One training run's step with switches `sw` on, over the batches of `work`.

    model: a fresh OrderBookNet on `device` (its parameters become views of the fused
    optimizer's flat buffer with fused_kernel). plain_logger: the logger without
    device_metrics: "host" (rung 1's per-step .item() syncs) or "loss" (LossLogger).
    step(i) runs training step i: the batch from the loader, then the step eagerly or as
    the graph's replay. after_backward runs between backward and the optimizer step
    (profiling.distributed waits there for the gradient all-reduce).
    """

    def __init__(
        self,
        model: OrderBookNet,
        sw: Switches,
        work: TrainingSet,
        s: StepSettings,
        device: torch.device,
        *,
        plain_logger: str = "host",
        after_backward: Callable[[], None] | None = None,
    ) -> None:
        self.model, self.sw, self.steps = model, sw, s.steps
        n_out = work.labels.shape[1]
        if sw.fused_kernel:
            opt = kernels.FusedAdamW(
                model, lr=s.lr, weight_decay=s.weight_decay, handoff=sw.flat_grads
            )
        else:
            opt = torch.optim.AdamW(model.parameters(), lr=s.lr, weight_decay=s.weight_decay)
        if sw.device_metrics:
            chunk_owner = opt.chunk_owner if sw.fused_kernel else None
            logger = DeviceLogger(model, n_out, s.log_every, device, chunk_owner=chunk_owner)
            if sw.fused_kernel:
                opt.log_into(logger.ring, logger.slot, logger.norm_col)
        elif plain_logger == "loss":
            logger = LossLogger(s.steps, device)
        else:
            logger = HostLogger(model)
        self.opt, self.logger = opt, logger
        block, tiles = flex_layout(work.max_len, model.cfg.head_dim, tuned=sw.flex_blocks)
        net = apply_packing(model, flex=sw.flex_attention, tiles=tiles) if sw.packing else model
        how = {"backend": s.compile_backend, "autotune": sw.autotune, "combo": sw.combo_kernels}
        if sw.compile and s.compile_per_block:
            compile_each(net.layers if sw.packing else model.blocks, **how)
        elif sw.compile:
            net = apply_compile(net, **how)
        self.net = net
        self.flex = None
        if sw.flex_attention:
            self.flex = FlexMask(work.pack_rows, work.max_len, device, block=block)
        inputs = ("x", "pos", "seg", "last", "count") if sw.packing else ("x", "mask")
        flex = self.flex
        # rung 12: the loader lists the mask's blocks (else FlexMask makes them each step)
        mask_block = flex.block if flex is not None and sw.loader_mask else 0
        lists = ("kv_num", "kv_idx") if mask_block else ()

        def step_fn(batch: dict[str, torch.Tensor]) -> None:
            extra = {}
            if flex is not None:
                extra["block_mask"] = flex.update(batch["seg"], *(batch[k] for k in lists))
            with autocast(device, sw.bf16):
                pred = net(*(batch[k] for k in inputs), **extra)
            pred = pred.float()
            loss = F.mse_loss(pred, batch["y"])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            if after_backward is not None:
                after_backward()
            logger.record(loss, pred, batch["y"])
            opt.step()
            logger.advance()

        self.step_fn = step_fn
        if sw.packing:
            spec = packed_spec(work, s.batch_size, mask_block)
            make = functools.partial(packed_batch, mask_block=mask_block)
        else:
            spec, make = padded_spec(work, s.batch_size), padded_batch
        self.layout = Layout(spec)
        if sw.streams:
            self.loader = Prefetcher(
                lambda step, views: make(work, step, out=views), self.layout, s.steps, device,
                s.prefetch_depth,
            )  # fmt: skip
        else:
            self.loader = SyncLoader(lambda step: make(work, step), device)
        self.graphed = (
            apply_cudagraph(step_fn, self.layout, device=device, eager_steps=s.eager_steps)
            if sw.cudagraph
            else None
        )

    def step(self, step: int) -> None:
        flat, batch = self.loader.get(step)
        if self.graphed is not None:
            self.graphed(flat)
        else:
            self.step_fn(batch)
        self.loader.release()
        self.logger.end_step(step, self.steps - 1)

    def close(self) -> None:
        self.loader.close()


def seeded_model(
    config: ModelConfig, seed: int, device: torch.device, perturb: float = 0.0
) -> OrderBookNet:
    """OrderBookNet initialised from `seed` (the global RNG is left as it was); `perturb` > 0
    multiplies every initial weight by (1 +- perturb), signs from a fixed generator."""
    cuda = device.type == "cuda"
    with torch.random.fork_rng(devices=[device.index or 0] if cuda else []):
        torch.manual_seed(seed)
        model = OrderBookNet(config).to(device)
        if perturb:
            gen = torch.Generator().manual_seed(seed + 1)
            with torch.no_grad():
                for p in model.parameters():
                    sign = torch.randint(0, 2, p.shape, generator=gen).mul(2).sub(1)
                    p.mul_(1 + perturb * sign.to(p.device, p.dtype))
    return model


@torch.no_grad()
def predict(
    model: OrderBookNet, work: Workload, w: Windows, batch: int, device: torch.device
) -> np.ndarray:
    """Predictions in bps for windows `w`: padded, eager, float32 (TF32 off), eval mode."""
    model.eval()
    feats = torch.from_numpy(work.features).to(device)
    out = []
    for a in range(0, len(w), batch):  # one iteration per batch of windows
        idx, mask = padded_index(
            w, np.arange(a, min(a + batch, len(w))), work.max_len, work.pad_row
        )
        x = feats[torch.from_numpy(idx).to(device)]
        out.append(model(x, torch.from_numpy(mask).to(device)).float().cpu().numpy())
    return work.normalizer.unscale_labels(np.concatenate(out))


def train_rung(
    rung: Rung,
    sw: Switches,
    work: Workload,
    cfg: LadderConfig,
    device: torch.device,
    out: str | None,
    *,
    perturb: float = 0.0,
) -> RungRun:
    """Train one rung; `perturb` > 0 multiplies every initial weight by (1 +- perturb),
    signs from a fixed generator: the controls that measure how far rounding alone moves
    this training run's answer."""
    torch._dynamo.reset()
    cuda = device.type == "cuda"
    model = seeded_model(model_config(cfg, work), cfg.seed, device, perturb)
    training = Training(model, sw, work, StepSettings.of_ladder(cfg), device)

    W, T, P = cfg.warmup_steps, cfg.timed_steps, cfg.profiled_steps
    timer = measure.StepTimer(device)
    sampler = measure.UtilSampler(device)
    acts = [torch.profiler.ProfilerActivity.CPU] + (
        [torch.profiler.ProfilerActivity.CUDA] if cuda else []
    )
    prof = None
    trace = TRACE_PATH.format(out=out, number=rung.number, name=rung.name) if out else None
    warmup_s = timed = wall = 0.0
    peak = None
    model.train()
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    try:
        with apply_precision(device, enabled=sw.bf16), torch_threads(cfg.num_threads):
            timer.start()
            for step in range(cfg.steps):
                if step == W:
                    warmup_s = timer.stop()[1]
                    sampler.__enter__()
                    timer.start()
                elif step == W + T:
                    timed, wall = timer.stop()
                    sampler.__exit__(None, None, None)
                    if cuda:
                        peak = torch.cuda.max_memory_allocated(device) / 2**30
                    if trace:
                        prof = torch.profiler.profile(activities=acts)
                        prof.__enter__()
                with torch.profiler.record_function(measure.STEP_LABEL):
                    training.step(step)
            measure.sync(device)
            if prof is not None:
                prof.__exit__(None, None, None)
    finally:
        training.close()
    counts = None
    if prof is not None:
        prof.export_chrome_trace(trace)
        counts = measure.count_trace(trace, P)
    loss, _, norms = training.logger.series()  # the accuracies are recorded, not compared
    pred_test = predict(model, work, work.test, cfg.predict_batch, device)
    pred_thr = predict(model, work, work.threshold, cfg.predict_batch, device)
    return RungRun(
        loss=loss, grad_norm=norms, pred_test=pred_test, pred_threshold=pred_thr,
        warmup_s=warmup_s, timed_s=timed, timed_wall_s=wall, gpu_util=sampler.mean,
        peak_mem_gb=peak, counts=counts, trace=trace, batch_bytes=training.layout.nbytes,
    )  # fmt: skip
