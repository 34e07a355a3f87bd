"""Run the rungs cumulatively on one workload and measure each against the baseline.

Every rung trains a fresh OrderBookNet from the same seed on the same batches in the same
order (profiling.loop), then predicts the held-out day and replays it
(profiling.evaluation). Rung k turns on the switches of rungs 1..k (profiling.rungs); those
this machine cannot run are skipped with their reason and left off the later rungs too.
"""

from __future__ import annotations

import datetime as dt
import os
import platform
from collections.abc import Callable
from dataclasses import asdict

import numpy as np
import torch

from quantloop.models.orderbook import OrderBookNet
from quantloop.profiling import kernels, measure
from quantloop.profiling.config import LadderConfig
from quantloop.profiling.evaluation import (
    CONTROLS,
    check_rung,
    control_floor,
    heldout_fit,
    reference,
    run_controls,
)
from quantloop.profiling.loop import RungRun, model_config, train_rung
from quantloop.profiling.proof import device_class
from quantloop.profiling.results import RungResult
from quantloop.profiling.rungs import RUNGS, Rung, Switches, runnable, skip_reason
from quantloop.profiling.workload import Workload, build_workload
from quantloop.tasks.research.training import resolve_device


def _params(work: Workload, cfg: LadderConfig) -> int:
    return sum(p.numel() for p in OrderBookNet(model_config(cfg, work)).parameters())


def work_figures(work: Workload, cfg: LadderConfig) -> tuple[int, float, float]:
    """Parameters, and the timed steps' mean padding-free matmul FLOPs and positions."""
    lengths = work.train.lengths[work.order]  # [steps, B]
    timed = slice(cfg.warmup_steps, cfg.warmup_steps + cfg.timed_steps)
    useful_flops = float(np.mean([
        measure.model_flops(list(map(int, row)), seq=0, n_seq=0, d=cfg.d_model,
                            layers=cfg.n_layers, ff=cfg.ff_mult, n_in=work.n_features,
                            n_out=len(work.label_names), batch=cfg.batch_size)
        for row in lengths[timed]
    ]))  # fmt: skip
    return _params(work, cfg), useful_flops, float(lengths[timed].sum(1).mean())


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
    n_params, useful_flops, useful_positions = work_figures(work, cfg)

    available = runnable(device)
    base: dict | None = None
    control_names, controls = controls, {}
    rows: list[RungResult] = []
    wanted = set(rungs or [r.number for r in RUNGS]) | {1}
    for rung in RUNGS:
        if rung.number not in wanted:
            continue
        reason = skip_reason(rung, device, available)
        if reason is None:
            sw = Switches.upto(rung.number, available)
            log(f"rung {rung.number} {rung.name}: {asdict(sw)}")
            try:
                run = train_rung(rung, sw, work, cfg, device, out)
                if base is None:
                    base = reference(work, run, cfg)
                    controls = run_controls(work, cfg, device, base, log, control_names)
                row = rung_row(
                    rung, sw, run, work=work, cfg=cfg, base=base, controls=controls,
                    ceilings=ceilings, useful_flops=useful_flops,
                    useful_positions=useful_positions, n_params=n_params,
                    baseline_samples_per_s=rows[0].samples_per_s if rows else None,
                )  # fmt: skip
            except Exception as exc:  # noqa: BLE001 - a rung that breaks here is reported
                if rung.number == 1:
                    raise  # the reference: nothing can be judged without it
                first = (str(exc).strip().splitlines() or [""])[0][:300]
                reason = f"failed: {type(exc).__name__}: {first}"
            finally:
                run = None
                if cuda:
                    torch.cuda.empty_cache()
        if reason is not None:
            # left off the later rungs too, like a switch this machine cannot run
            log(f"rung {rung.number} {rung.name}: {reason}")
            available.discard(rung.switch)
            rows.append(RungResult(number=rung.number, name=rung.name,
                                   predicted=rung.predicted, skipped=reason))  # fmt: skip
            continue
        eq = row
        log(
            f"  {row.samples_per_s:,.0f} samples/s, {row.step_ms:.2f} ms/step "
            f"({row.speedup_vs_baseline:.2f}x), warm-up {row.warmup_s:.1f} s, "
            f"launches {row.kernels_per_step}, syncs {row.syncs_per_step}; "
            f"step0 {eq.step0_rel:.2e}, loss dev {eq.loss_max_rel_dev:.2e}, "
            f"pred L2 {eq.pred_rel_l2:.2e}, "
            f"mark-out {eq.markout_delta_bps:.3f} bp; held-out loss {row.heldout_loss:.3f} "
            f"corr {np.round(row.heldout_corr, 3).tolist()} -> "
            f"{'equivalent' if eq.equivalent else 'NOT equivalent: ' + '; '.join(eq.failures)}"
        )
        rows.append(row)
    return {
        "gpu": torch.cuda.get_device_name(device) if cuda else platform.processor() or "cpu",
        "device": str(device),
        "device_class": device_class(device),
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
        "rungs": [row.to_dict() for row in rows],
    }


def rung_row(
    rung: Rung,
    sw: Switches,
    run: RungRun,
    *,
    work: Workload,
    cfg: LadderConfig,
    base: dict,
    controls: dict,
    ceilings: dict,
    useful_flops: float,
    useful_positions: float,
    n_params: int,
    baseline_samples_per_s: float | None,
) -> RungResult:
    """One trained rung's row: speed, trace counts, work and roofline, equivalence to the
    baseline `base` under its precision's tolerance, held-out fit and mark-out."""
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
    roofline = {}
    if ceilings:
        t_flops = useful_flops / (ceilings["bf16_matmul_tflops"] * 1e12)
        t_bytes = min_bytes / (ceilings["copy_gbps"] * 1e9)
        roofline = dict(
            floor_ms=max(t_flops, t_bytes) * 1e3,
            roofline_fraction=max(t_flops, t_bytes) / step_s,
            bound="bf16 matmul" if t_flops >= t_bytes else "memory bandwidth",
        )
    samples_per_s = cfg.batch_size / step_s
    limits = (
        ("loss_max_rel_dev", tol.loss_rel),
        ("pred_rel_l2", tol.pred_rel_l2),
        ("markout_delta_bps", tol.markout_bps),
    )
    row = RungResult(
        number=rung.number,
        name=rung.name,
        predicted=rung.predicted,
        switches=asdict(sw),
        samples_per_s=samples_per_s,
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
        tolerance=eq.tolerance,
        control_floor=floor,
        tolerance_below_floor=[k for k, t in limits if floor[k] > t],
        tolerance_not_below_other_seed=[
            k for k, t in limits if "other_seed" in controls and controls["other_seed"][k] <= t
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
        **roofline,
        speedup_vs_baseline=samples_per_s / (baseline_samples_per_s or samples_per_s),
    )
    return row
