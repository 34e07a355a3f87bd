"""Is a rung's answer the baseline's? Three figures against the fixed-seed baseline:

- the first step (same weights, same batch): loss and per-parameter gradient norms,
  the sharp test of the rung's arithmetic;
- the loss curve (mean training loss per logging interval): largest relative deviation;
- the held-out predictions (bps, every event of the held-out day): relative L2 error;
- the out-of-sample mark-out: largest |difference| of the mean mark-out over horizons, bps.

Each is checked against the rung's tolerance (profiling.config: fp32 tight, bf16 looser).
A rung over any tolerance is reported as failing, with the figure that failed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from quantloop.profiling.config import Tolerance


def interval_means(per_step: np.ndarray, every: int) -> np.ndarray:
    starts = np.arange(0, len(per_step), every)
    return np.add.reduceat(np.asarray(per_step, np.float64), starts) / np.diff(
        np.append(starts, len(per_step))
    )


def max_rel_dev(curve: np.ndarray, base: np.ndarray) -> float:
    curve, base = np.asarray(curve, np.float64), np.asarray(base, np.float64)
    if curve.shape != base.shape:
        raise ValueError(f"curves differ in length: {curve.shape} vs {base.shape}")
    if not np.isfinite(curve).all():
        return math.inf
    return float(np.max(np.abs(curve - base) / np.maximum(np.abs(base), 1e-12)))


def rel_l2(pred: np.ndarray, base: np.ndarray) -> float:
    pred, base = np.asarray(pred, np.float64), np.asarray(base, np.float64)
    if not np.isfinite(pred).all():
        return math.inf
    return float(np.linalg.norm(pred - base) / max(np.linalg.norm(base), 1e-300))


def markout_delta(mean_bps: dict[str, float], base_bps: dict[str, float]) -> float:
    """max over horizons of |mean - base| (bps); a horizon NaN in both is skipped."""
    worst = 0.0
    for key, b in base_bps.items():
        a = mean_bps.get(key, math.nan)
        if math.isnan(a) and math.isnan(b):
            continue
        if math.isnan(a) or math.isnan(b):
            return math.inf
        worst = max(worst, abs(a - b))
    return worst


@dataclass(kw_only=True, slots=True, frozen=True)
class Equivalence:
    step0_rel: float
    loss_max_rel_dev: float
    pred_rel_l2: float
    markout_delta_bps: float
    tolerance: Tolerance
    failures: tuple[str, ...]

    @property
    def equivalent(self) -> bool:
        return not self.failures


def step0_deviation(
    loss0: float, base_loss0: float, norms0: np.ndarray, base_norms0: np.ndarray
) -> float:
    """max(|loss0 - base| / |base|, ||norms0 - base|| / ||base||) at the first step."""
    loss = abs(loss0 - base_loss0) / max(abs(base_loss0), 1e-12)
    return max(loss, rel_l2(norms0, base_norms0)) if np.isfinite(loss) else math.inf


def compare(
    *,
    step0: float = 0.0,
    loss_curve: np.ndarray,
    base_loss_curve: np.ndarray,
    pred: np.ndarray,
    base_pred: np.ndarray,
    markout_bps: dict[str, float],
    base_markout_bps: dict[str, float],
    tolerance: Tolerance,
) -> Equivalence:
    loss = max_rel_dev(loss_curve, base_loss_curve)
    l2 = rel_l2(pred, base_pred)
    mo = markout_delta(markout_bps, base_markout_bps)
    failures = tuple(
        f"{name} {value:.3g} > {limit:.3g}"
        for name, value, limit in (
            ("step0_rel", step0, tolerance.step0_rel),
            ("loss_max_rel_dev", loss, tolerance.loss_rel),
            ("pred_rel_l2", l2, tolerance.pred_rel_l2),
            ("markout_delta_bps", mo, tolerance.markout_bps),
        )
        if not value <= limit  # NaN fails too
    )
    return Equivalence(
        step0_rel=step0,
        loss_max_rel_dev=loss,
        pred_rel_l2=l2,
        markout_delta_bps=mo,
        tolerance=tolerance,
        failures=failures,
    )
