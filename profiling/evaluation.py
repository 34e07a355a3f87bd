"""Is a rung's answer the baseline's, and how much can the check tell?

reference() takes the baseline run's figures; check_rung() compares a rung with them under
its precision's tolerance (profiling.equivalence) and also returns its out-of-sample
mark-out (tasks.simulation replays the held-out day). The controls re-train the baseline
with its initial weights moved by one rounding error of each precision, and with another
seed: how far rounding alone, and a genuinely different model, move the same figures.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import torch

from quantloop.profiling.config import LadderConfig, Tolerance
from quantloop.profiling.equivalence import Equivalence, compare, interval_means, step0_deviation
from quantloop.profiling.loop import RungRun, train_rung
from quantloop.profiling.rungs import RUNGS, Switches
from quantloop.profiling.workload import Workload
from quantloop.tasks.research.simulation import (
    SimConfig,
    markout,
    simulate,
    summarize,
    thresholds_from,
)


def markout_summary(work: Workload, run: RungRun, product: str) -> dict:
    """The run's model trading the held-out day at its own threshold: trades, mean mark-out
    per horizon (tasks.simulation.summarize's total) and its standard error (`se_bps`)."""
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


# ---------------------------------------------------------------- controls


# Relative size of a rounding error: the unit roundoff of each precision (half an ulp).
UNIT_ROUNDOFF = {"fp32": 2.0**-24, "bf16": 2.0**-9}
CONTROLS = ("fp32", "bf16", "other_seed")
CONTROL_FACTOR = 2.0  # a rung's floor: this many times its precision's rounding control


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
