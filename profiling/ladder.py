"""Run the rungs cumulatively on one workload and measure each against the baseline.

Every rung trains a fresh OrderBookNet from the same seed on the same batches in the same
order for `cfg.steps` steps, then predicts the held-out day and replays it. Rung k turns
on the switches of rungs 1..k (those a CPU cannot run are skipped with their reason and
left off the later rungs too).
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import math
import os
import platform
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields

import numpy as np
import torch
import torch.nn.functional as F

from quantloop.models.orderbook import ModelConfig, OrderBookNet
from quantloop.profiling import kernels, measure
from quantloop.profiling.compile import apply_compile
from quantloop.profiling.config import LadderConfig, Tolerance
from quantloop.profiling.cudagraph import apply_cudagraph
from quantloop.profiling.equivalence import Equivalence, compare, interval_means, step0_deviation
from quantloop.profiling.metrics import DeviceLogger, HostLogger
from quantloop.profiling.packing import apply_packing
from quantloop.profiling.precision import apply_precision, autocast
from quantloop.profiling.streams import Layout, Prefetcher, SyncLoader
from quantloop.profiling.workload import (
    Windows,
    Workload,
    build_workload,
    packed_batch,
    packed_spec,
    padded_batch,
    padded_index,
    padded_spec,
)
from quantloop.tasks.simulation import SimConfig, markout, simulate, summarize, thresholds_from
from quantloop.tasks.training import torch_threads

TRACE_PATH = "{out}/trace-rung{number}-{name}.json"


@dataclass(kw_only=True, slots=True, frozen=True)
class Rung:
    number: int
    name: str
    switch: str  # the Switches field this rung turns on ("" for the baseline)
    cuda_only: str  # why a CPU cannot run it ("" = runs anywhere)
    predicted: str  # the gain expected before measuring, and why


RUNGS: tuple[Rung, ...] = (
    Rung(
        number=1,
        name="baseline",
        switch="",
        cuda_only="",
        predicted="reference: eager fp32 on padded [256, 256] windows; ~40 .item() syncs "
        "and 3 blocking pageable copies per step",
    ),
    Rung(
        number=2,
        name="compile",
        switch="compile",
        cuda_only="",
        predicted="1.2x: Inductor fuses LayerNorm/GELU/residual/mask elementwise work "
        "(~15% of an fp32 step); the fp32 matmuls and attention stay as they are",
    ),
    Rung(
        number=3,
        name="bf16_tf32",
        switch="bf16",
        cuda_only="",
        predicted="3x: matmuls and attention move from fp32 CUDA cores to bf16 tensor "
        "cores (~10x on that part); the host gather, copies and syncs then dominate",
    ),
    Rung(
        number=4,
        name="device_metrics",
        switch="device_metrics",
        cuda_only="",
        predicted="1.3x: ~38 of ~41 host syncs per step go (loss, 3 accuracies, 34 norms); "
        "the 3 blocking copies still sync",
    ),
    Rung(
        number=5,
        name="fused_kernel",
        switch="fused_kernel",
        cuda_only="the fused AdamW + norm kernel is Triton, which needs a CUDA GPU",
        predicted="1.05x: one pass over 0.8M parameters instead of ~15 foreach kernels "
        "and a norm pass; small next to the model",
    ),
    Rung(
        number=6,
        name="streams",
        switch="streams",
        cuda_only="pinned memory and a copy stream need a CUDA GPU",
        predicted="1.7x: the host gather (~1 ms) and the 3.7 MB copy leave the critical path; "
        "the last per-step syncs go",
    ),
    Rung(
        number=7,
        name="cuda_graph",
        switch="cudagraph",
        cuda_only="CUDA graphs need a CUDA GPU",
        predicted="1.3x: ~400 kernel launches per step become one replay; matters once the "
        "GPU step is a few ms",
    ),
    Rung(
        number=8,
        name="no_padding",
        switch="packing",
        cuda_only="",
        predicted="2.7x: 74 packed rows instead of 256 padded windows (3.5x fewer positions "
        "and attention FLOPs), less the packing slack",
    ),
)


@dataclass(kw_only=True, slots=True, frozen=True)
class Switches:
    compile: bool = False
    bf16: bool = False
    device_metrics: bool = False
    fused_kernel: bool = False
    streams: bool = False
    cudagraph: bool = False
    packing: bool = False

    @classmethod
    def upto(cls, number: int, available: set[str]) -> Switches:
        """Rungs 1..number cumulatively, leaving out switches this machine cannot run."""
        on = {r.switch for r in RUNGS if r.number <= number and r.switch in available}
        return cls(**{f.name: f.name in on for f in fields(cls)})


def skip_reason(rung: Rung, device: torch.device) -> str | None:
    if rung.cuda_only and device.type != "cuda":
        return f"skipped: no CUDA device ({rung.cuda_only})"
    if rung.switch == "fused_kernel" and kernels.triton is None:
        return "skipped: triton is not installed"
    return None


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def model_config(cfg: LadderConfig, work: Workload) -> ModelConfig:
    return ModelConfig(
        n_features=work.n_features,
        n_outputs=len(work.label_names),
        d_model=cfg.d_model,
        n_layers=cfg.n_layers,
        n_heads=cfg.n_heads,
        ff_mult=cfg.ff_mult,
        max_len=cfg.max_len,
    )


# ---------------------------------------------------------------- one rung


@dataclass(kw_only=True, slots=True)
class RungRun:
    loss: np.ndarray  # [steps]
    accuracy: np.ndarray  # [steps, L]
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
    with torch.random.fork_rng(devices=[device.index or 0] if cuda else []):
        torch.manual_seed(cfg.seed)
        model = OrderBookNet(model_config(cfg, work)).to(device)
        if perturb:
            gen = torch.Generator().manual_seed(cfg.seed + 1)
            with torch.no_grad():
                for p in model.parameters():
                    sign = torch.randint(0, 2, p.shape, generator=gen).mul(2).sub(1)
                    p.mul_(1 + perturb * sign.to(p.device, p.dtype))
    n_out = len(work.label_names)

    if sw.fused_kernel:
        opt = kernels.FusedAdamW(model, lr=cfg.lr, weight_decay=cfg.weight_decay)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    if sw.device_metrics:
        chunk_owner = opt.chunk_owner if sw.fused_kernel else None
        logger = DeviceLogger(model, n_out, cfg.log_every, device, chunk_owner=chunk_owner)
        if sw.fused_kernel:
            opt.log_into(logger.ring, logger.slot, logger.norm_col)
    else:
        logger = HostLogger(model, n_out)
    net = apply_packing(model) if sw.packing else model
    if sw.compile:
        net = apply_compile(net, cfg=cfg)
    inputs = ("x", "pos", "seg", "last", "count") if sw.packing else ("x", "mask")

    def step_fn(batch: dict[str, torch.Tensor]) -> None:
        with autocast(device, sw.bf16):
            pred = net(*(batch[k] for k in inputs))
        pred = pred.float()
        loss = F.mse_loss(pred, batch["y"])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        logger.record(loss, pred, batch["y"])
        opt.step()
        logger.advance()

    make = packed_batch if sw.packing else padded_batch
    layout = Layout((packed_spec if sw.packing else padded_spec)(work, cfg.batch_size))
    if sw.streams:
        loader = Prefetcher(
            lambda step, views: make(work, step, out=views), layout, cfg.steps, device,
            cfg.prefetch_depth,
        )  # fmt: skip
    else:
        loader = SyncLoader(lambda step: make(work, step), device)
    graphed = (
        apply_cudagraph(step_fn, layout, device=device, eager_steps=cfg.warmup_steps - 1)
        if sw.cudagraph
        else None
    )

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
                    flat, batch = loader.get(step)
                    if graphed is not None:
                        graphed(flat)
                    else:
                        step_fn(batch)
                    loader.release()
                    logger.end_step(step, cfg.steps - 1)
            measure.sync(device)
            if prof is not None:
                prof.__exit__(None, None, None)
    finally:
        loader.close()
    counts = None
    if prof is not None:
        prof.export_chrome_trace(trace)
        counts = measure.count_trace(trace, P)
    loss, acc, norms = logger.series()
    pred_test = predict(model, work, work.test, cfg.predict_batch, device)
    pred_thr = predict(model, work, work.threshold, cfg.predict_batch, device)
    return RungRun(
        loss=loss, accuracy=acc, grad_norm=norms, pred_test=pred_test, pred_threshold=pred_thr,
        warmup_s=warmup_s, timed_s=timed, timed_wall_s=wall, gpu_util=sampler.mean,
        peak_mem_gb=peak, counts=counts, trace=trace, batch_bytes=layout.nbytes,
    )  # fmt: skip


# ---------------------------------------------------------------- evaluation


def markout_summary(work: Workload, run: RungRun, product: str) -> dict:
    sim = SimConfig()
    threshold = thresholds_from(run.pred_threshold, sim)
    trades = simulate(work.test_table, run.pred_test, threshold, sim)
    marked = markout(trades, work.test_table, sim)
    total = summarize({product: marked})["total"]
    # standard error of the mean mark-out per horizon: the scale a difference is judged on
    se = {}
    for key in sim.horizon_keys():
        v = marked.column(f"markout_{key}").to_numpy(zero_copy_only=False).astype(np.float64)
        v = v[np.isfinite(v)]
        se[key] = float(v.std(ddof=1) / math.sqrt(len(v))) if len(v) > 1 else math.nan
    return {**total, "se_bps": se}


def heldout_fit(work: Workload, pred: np.ndarray) -> dict:
    """How well predictions fit the held-out day's labels: the mean squared error in
    standardized label units (1.0 = no better than predicting the mean) and the
    correlation per label. Evidence that the model learned something to be equivalent on."""
    y = work.test_labels
    ok = np.isfinite(y).all(axis=1)
    z = work.normalizer.scale_labels(y[ok]).astype(np.float64)
    zp = work.normalizer.scale_labels(pred[ok]).astype(np.float64)
    corr = [float(np.corrcoef(zp[:, j], z[:, j])[0, 1]) for j in range(z.shape[1])]
    return {"heldout_loss": float(np.mean((zp - z) ** 2)), "heldout_corr": corr}


# Relative size of a rounding error: the unit roundoff of each precision (half an ulp).
UNIT_ROUNDOFF = {"fp32": 2.0**-24, "bf16": 2.0**-9}


CONTROLS = ("fp32", "bf16", "other_seed")


def run_controls(
    work: Workload,
    cfg: LadderConfig,
    device: torch.device,
    base: dict,
    log,
    names: tuple[str, ...] = CONTROLS,
) -> dict:
    """The baseline again with its initial weights perturbed by one rounding error of each
    precision, and once with another seed: how far rounding alone, and a genuinely
    different model, move the three equivalence figures on this workload."""
    controls = {}
    runs = [(k, {"perturb": u}, cfg) for k, u in UNIT_ROUNDOFF.items()]
    runs.append(("other_seed", {}, dataclasses.replace(cfg, seed=cfg.seed + 1)))
    for name, kwargs, c in runs:
        if name not in names:
            continue
        run = train_rung(RUNGS[0], Switches(), work, c, device, None, **kwargs)
        eq, _, _ = check_rung(work, run, base, cfg, cfg.fp32_tolerance, step0=False)
        eq_bf16, _, _ = check_rung(work, run, base, cfg, cfg.bf16_tolerance, step0=False)
        controls[name] = {
            "perturb": kwargs.get("perturb", 0.0),
            "loss_max_rel_dev": eq.loss_max_rel_dev,
            "pred_rel_l2": eq.pred_rel_l2,
            "markout_delta_bps": eq.markout_delta_bps,
            **heldout_fit(work, run.pred_test),
            # what the stated checks say about this control: a rounding control should pass
            # both, another seed (a different model) should fail both
            "fails_fp32": list(eq.failures),
            "fails_bf16": list(eq_bf16.failures),
        }
        log(f"control {name}: {controls[name]}")
    return controls


def control_floor(control: dict) -> dict:
    """CONTROL_FACTOR x what one rounding error of the rung's precision does to the
    baseline: below this no check can hold a rung. Reported next to the stated tolerance,
    never used to widen it: a rung over its stated tolerance fails even when the floor is
    higher (the row then says the tolerance is below the floor)."""
    return {k: CONTROL_FACTOR * v for k, v in control.items()}


CONTROL_FACTOR = 2.0


def reference(work: Workload, run: RungRun, cfg: LadderConfig) -> dict:
    """What every rung is compared with: the baseline run's figures."""
    return {
        "curve": interval_means(run.loss, cfg.log_every),
        "pred": run.pred_test,
        "markout": markout_summary(work, run, cfg.product),
        "loss0": float(run.loss[0]),
        "norms0": np.array([v[0] for v in run.grad_norm.values()]),
    }


def check_rung(
    work: Workload,
    run: RungRun,
    base: dict,
    cfg: LadderConfig,
    tolerance: Tolerance,
    *,
    step0: bool = True,
) -> tuple[Equivalence, dict, np.ndarray]:
    """The rung's equivalence to the baseline `base` (reference()) under `tolerance`;
    also returns its mark-out summary and loss curve. step0=False leaves the first-step
    figure out (0): the controls change the initial weights or the seed on purpose."""
    summary = markout_summary(work, run, cfg.product)
    curve = interval_means(run.loss, cfg.log_every)
    norms0 = np.array([v[0] for v in run.grad_norm.values()])
    dev0 = step0_deviation(float(run.loss[0]), base["loss0"], norms0, base["norms0"])
    eq = compare(
        step0=dev0 if step0 else 0.0,
        loss_curve=curve, base_loss_curve=base["curve"], pred=run.pred_test,
        base_pred=base["pred"], markout_bps=summary["mean_bps"],
        base_markout_bps=base["markout"]["mean_bps"], tolerance=tolerance,
    )  # fmt: skip
    return eq, summary, curve


def _params(work: Workload, cfg: LadderConfig) -> int:
    return sum(p.numel() for p in OrderBookNet(model_config(cfg, work)).parameters())


def run_ladder(
    cfg: LadderConfig,
    out: str,
    *,
    rungs: tuple[int, ...] | None = None,
    controls: tuple[str, ...] = CONTROLS,
    log: Callable[[str], None] = print,
) -> dict:
    """All rungs (or those numbered in `rungs`; 1 always runs: it is the reference).

    Writes traces under `out`; returns the JSON-able results (see bench/results)."""
    os.makedirs(out, exist_ok=True)
    device = resolve_device(cfg.device)
    cuda = device.type == "cuda"
    log(f"ladder on {device}: building the workload")
    work = build_workload(cfg, os.path.join(out, "store"))
    lengths = work.train.lengths[work.order]  # [steps, B]
    log(
        f"{len(work.train)} training windows, mean {work.train.lengths.mean():.1f} events "
        f"(max {work.train.lengths.max()}) of max_len {cfg.max_len}; packed rows {work.pack_rows}"
    )
    ceilings = measure.measure_ceilings(device)
    if cuda:
        torch.cuda.empty_cache()
    kernel_err = kernels.check_kernel(device) if cuda and kernels.triton is not None else None
    if ceilings:
        log(f"ceilings: {ceilings}; fused-kernel check max rel err {kernel_err}")
    n_params = _params(work, cfg)
    timed = slice(cfg.warmup_steps, cfg.warmup_steps + cfg.timed_steps)
    useful_flops = float(np.mean([
        measure.model_flops(list(map(int, row)), seq=0, n_seq=0, d=cfg.d_model,
                            layers=cfg.n_layers, ff=cfg.ff_mult, n_in=work.n_features,
                            n_out=len(work.label_names), batch=cfg.batch_size)
        for row in lengths[timed]
    ]))  # fmt: skip
    useful_positions = float(lengths[timed].sum(1).mean())

    available = {r.switch for r in RUNGS if skip_reason(r, device) is None}
    base: dict | None = None
    control_names, controls = controls, {}
    rows = []
    wanted = set(rungs or [r.number for r in RUNGS]) | {1}
    for rung in RUNGS:
        if rung.number not in wanted:
            continue
        row: dict = {"number": rung.number, "name": rung.name, "predicted": rung.predicted}
        reason = skip_reason(rung, device)
        if reason:
            log(f"rung {rung.number} {rung.name}: {reason}")
            rows.append({**row, "skipped": reason, "equivalent": None})
            continue
        sw = Switches.upto(rung.number, available)
        log(f"rung {rung.number} {rung.name}: {asdict(sw)}")
        run = train_rung(rung, sw, work, cfg, device, out)
        if base is None:
            base = reference(work, run, cfg)
            controls = run_controls(work, cfg, device, base, log, control_names)
        precision = "bf16" if sw.bf16 else "fp32"
        # a bf16 rung also reorders float32 sums: its floor is the larger of the two controls
        own = [p for p in (["fp32", "bf16"] if sw.bf16 else ["fp32"]) if p in controls]
        floor = control_floor({
            k: max((controls[p][k] for p in own), default=0.0)
            for k in ("loss_max_rel_dev", "pred_rel_l2", "markout_delta_bps")
        })  # fmt: skip
        tol = cfg.bf16_tolerance if sw.bf16 else cfg.fp32_tolerance
        eq, summary, curve = check_rung(work, run, base, cfg, tol)
        step_s = run.timed_s / cfg.timed_steps
        positions = (work.pack_rows if sw.packing else cfg.batch_size) * cfg.max_len
        flops = measure.model_flops(
            None, seq=cfg.max_len, n_seq=positions // cfg.max_len, d=cfg.d_model,
            layers=cfg.n_layers, ff=cfg.ff_mult, n_in=work.n_features,
            n_out=len(work.label_names), batch=cfg.batch_size,
        )  # fmt: skip
        nbytes = measure.step_bytes(
            positions=positions, d=cfg.d_model, layers=cfg.n_layers, ff=cfg.ff_mult,
            n_params=n_params, act_bytes=2 if sw.bf16 else 4, batch_bytes=run.batch_bytes,
        )  # fmt: skip
        min_bytes = measure.step_bytes(
            positions=int(useful_positions), d=cfg.d_model, layers=cfg.n_layers,
            ff=cfg.ff_mult, n_params=n_params, act_bytes=2, batch_bytes=0,
        )  # fmt: skip
        c = run.counts
        row.update(
            skipped=None,
            switches=asdict(sw),
            samples_per_s=cfg.batch_size / step_s,
            step_ms=step_s * 1e3,
            host_step_ms=run.timed_wall_s / cfg.timed_steps * 1e3,
            warmup_s=run.warmup_s,
            kernels_per_step=c.launches if c else None,
            gpu_kernels_per_step=c.gpu_kernels if c else None,
            syncs_per_step=c.syncs if c else None,
            memcpys_per_step=c.memcpys if c else None,
            gpu_util=run.gpu_util,
            gpu_busy=c.gpu_busy if c else None,
            peak_mem_gb=run.peak_mem_gb,
            flops_per_step=flops,
            useful_flops_per_step=useful_flops,
            bytes_per_step=nbytes,
            achieved_tflops=flops / step_s / 1e12,
            useful_tflops=useful_flops / step_s / 1e12,
            step0_rel=eq.step0_rel,
            loss_max_rel_dev=eq.loss_max_rel_dev,
            pred_rel_l2=eq.pred_rel_l2,
            markout_delta_bps=eq.markout_delta_bps,
            precision=precision,
            tolerance=asdict(eq.tolerance),
            control_floor=floor,
            tolerance_below_floor=[
                k
                for k, t in (
                    ("loss_max_rel_dev", tol.loss_rel),
                    ("pred_rel_l2", tol.pred_rel_l2),
                    ("markout_delta_bps", tol.markout_bps),
                )
                if floor[k] > t
            ],  # fmt: skip
            # limits that another seed (a different model) would pass: such a check has no power
            tolerance_not_below_other_seed=[
                k
                for k, t in (
                    ("loss_max_rel_dev", tol.loss_rel),
                    ("pred_rel_l2", tol.pred_rel_l2),
                    ("markout_delta_bps", tol.markout_bps),
                )
                if "other_seed" in controls and controls["other_seed"][k] <= t
            ],  # fmt: skip
            equivalent=eq.equivalent,
            failures=list(eq.failures),
            final_loss=float(curve[-1]),
            **heldout_fit(work, run.pred_test),
            loss_curve=curve.tolist(),
            trades=summary["count"],
            markout_bps=summary["mean_bps"],
            markout_se_bps=summary["se_bps"],
            trace=os.path.basename(run.trace) if run.trace else None,
        )
        if ceilings:
            t_flops = useful_flops / (ceilings["bf16_matmul_tflops"] * 1e12)
            t_bytes = min_bytes / (ceilings["copy_gbps"] * 1e9)
            row.update(
                floor_ms=max(t_flops, t_bytes) * 1e3,
                roofline_fraction=max(t_flops, t_bytes) / step_s,
                bound="bf16 matmul" if t_flops >= t_bytes else "memory bandwidth",
            )
        else:
            row.update(floor_ms=None, roofline_fraction=None, bound=None)
        base_sps = rows[0]["samples_per_s"] if rows else row["samples_per_s"]
        row["speedup_vs_baseline"] = row["samples_per_s"] / base_sps
        log(
            f"  {row['samples_per_s']:,.0f} samples/s, {row['step_ms']:.2f} ms/step "
            f"({row['speedup_vs_baseline']:.2f}x), warm-up {row['warmup_s']:.1f} s, "
            f"launches {row['kernels_per_step']}, syncs {row['syncs_per_step']}; "
            f"step0 {eq.step0_rel:.2e}, loss dev {eq.loss_max_rel_dev:.2e}, "
            f"pred L2 {eq.pred_rel_l2:.2e}, "
            f"mark-out {eq.markout_delta_bps:.3f} bp; held-out loss {row['heldout_loss']:.3f} "
            f"corr {np.round(row['heldout_corr'], 3).tolist()} -> "
            f"{'equivalent' if eq.equivalent else 'NOT equivalent: ' + '; '.join(eq.failures)}"
        )
        rows.append(row)
        del run
        if cuda:
            torch.cuda.empty_cache()
    return {
        "gpu": torch.cuda.get_device_name(device) if cuda else platform.processor() or "cpu",
        "device": str(device),
        "torch": torch.__version__,
        "triton": getattr(kernels.triton, "__version__", None),
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "batch_size": cfg.batch_size,
        "config": cfg.to_dict(),
        "ceilings": ceilings,
        "fused_kernel_max_rel_err": kernel_err,
        "workload": {
            "train_windows": len(work.train),
            "mean_window": float(work.train.lengths.mean()),
            "max_window": int(work.train.lengths.max()),
            "real_position_share_padded": useful_positions / (cfg.batch_size * cfg.max_len),
            "pack_rows": work.pack_rows,
            "real_position_share_packed": useful_positions / (work.pack_rows * cfg.max_len),
            "n_params": n_params,
            "test_events": len(work.test),
        },
        "baseline_markout_se_bps": base["markout"]["se_bps"] if base else None,
        "controls": controls,
        "rungs": rows,
    }


# ---------------------------------------------------------------- the table


def _fmt(v, spec: str) -> str:
    if v is None:
        return "-"
    if isinstance(v, float) and math.isnan(v):
        return "nan"
    return format(v, spec)


TABLE_COLUMNS = (
    ("rung", None), ("samples/s", ",.0f"), ("step ms", ".2f"), ("speedup", ".2f"),
    ("launches/step", ".1f"), ("syncs/step", ".2f"), ("GPU util", ".0%"), ("peak GB", ".2f"),
    ("TFLOP/s", ".1f"), ("roofline", ".1%"), ("step-0 dev", ".1e"), ("loss dev", ".1e"),
    ("pred L2", ".1e"), ("mark-out Δ bp", ".3f"), ("held-out loss", ".3f"), ("equivalent", None),
)  # fmt: skip
_KEYS = (None, "samples_per_s", "step_ms", "speedup_vs_baseline", "kernels_per_step",
         "syncs_per_step", "gpu_util", "peak_mem_gb", "achieved_tflops", "roofline_fraction",
         "step0_rel", "loss_max_rel_dev", "pred_rel_l2", "markout_delta_bps", "heldout_loss",
         None)  # fmt: skip


def controls_markdown(result: dict) -> str:
    """The controls: how far rounding alone and another seed move the baseline's answer."""
    lines = [
        "| control | loss dev | pred L2 | mark-out Δ bp | held-out loss | fp32 check "
        "| bf16 check |",
        "|---|---:|---:|---:|---:|---|---|",
    ]
    for name, c in (result.get("controls") or {}).items():
        verdict = [
            "fails: " + "; ".join(c[k]) if c.get(k) else "passes"
            for k in ("fails_fp32", "fails_bf16")
        ]
        lines.append(
            f"| {name} | {c['loss_max_rel_dev']:.1e} | {c['pred_rel_l2']:.1e} | "
            f"{c['markout_delta_bps']:.3f} | {c['heldout_loss']:.3f} | {verdict[0]} | "
            f"{verdict[1]} |"
        )
    return "\n".join(lines)


def table_markdown(result: dict) -> str:
    head = "| " + " | ".join(name for name, _ in TABLE_COLUMNS) + " |"
    rule = "|---|" + "---:|" * (len(TABLE_COLUMNS) - 2) + "---|"
    lines = [head, rule]
    for row in result["rungs"]:
        label = f"{row['number']}. {row['name']}"
        if row.get("skipped"):
            lines.append(f"| {label} | {row['skipped']} |" + " |" * (len(TABLE_COLUMNS) - 2))
            continue
        cells = [
            _fmt(row.get(key), spec)
            for (_, spec), key in zip(TABLE_COLUMNS[1:-1], _KEYS[1:-1], strict=True)
        ]
        eq = "yes" if row["equivalent"] else "**NO**: " + "; ".join(row["failures"])
        lines.append(f"| {label} | " + " | ".join(cells) + f" | {eq} |")
    return "\n".join(lines)
