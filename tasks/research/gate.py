"""The promotion gate's test: a candidate against the model it would replace (or, for the
first champion, against the baseline), replayed on the same held-out window, neither
trained on it.

H0: mean(candidate) - mean(incumbent) <= min_improvement_bps, against H1: it is larger,
one-sided at `alpha`, on the paired HAC standard error of tasks/research/uncertainty.py (both
signals' mark-outs on one grid of horizon windows, so the market's moves cancel). The
p-value is adjusted for the trials made on the same data (Sidak) before it is compared
with alpha. Too few effective windows is a refusal, never a pass.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from quantloop.tasks.research.uncertainty import Sample, difference, trials_adjusted


@dataclass(kw_only=True, slots=True, frozen=True)
class GateConfig:
    """How sure a promotion must be."""

    alpha: float = 0.05  # one-sided level of the paired test
    min_improvement_bps: float = 0.0  # the candidate must beat the incumbent by more
    horizon: str = "5s"  # the mark-out horizon tested

    def __post_init__(self) -> None:
        if not 0.0 < self.alpha < 0.5:
            raise ValueError(f"GateConfig.alpha must be in (0, 0.5), got {self.alpha}")
        if not self.min_improvement_bps >= 0.0:
            raise ValueError(
                f"GateConfig.min_improvement_bps must be >= 0, got {self.min_improvement_bps}"
            )
        if not (self.horizon.endswith("s") or self.horizon.endswith("ev")):
            raise ValueError(f"GateConfig.horizon must be a horizon key like '5s' or '100ev', "
                             f"got {self.horizon!r}")  # fmt: skip


@dataclass(kw_only=True, slots=True, frozen=True)
class GateResult:
    passed: bool
    test: str  # what was tested, in words
    alpha: float
    min_improvement_bps: float
    horizon: str
    difference_bps: float  # candidate minus incumbent, mean mark-out
    se_bps: float  # its HAC standard error
    statistic: float  # (difference - min_improvement) / se
    p_value: float  # one-sided, before the trials adjustment
    p_adjusted: float  # after it (Sidak over `trials`)
    trials: int
    windows: float  # effective non-overlapping horizon windows
    n_eff: float
    candidate_trades: int
    incumbent_trades: int
    why: str  # the number that decided, in words

    def as_dict(self) -> dict:
        return asdict(self)


def paired_gate(
    candidate: Sample,
    incumbent: Sample,
    width_s: float,
    cfg: GateConfig,
    *,
    against: str = "champion",
    trials: int = 1,
) -> GateResult:
    """Test the candidate's mean mark-out against the incumbent's on the same window."""
    est = difference(candidate, incumbent, width_s)
    test = (f"one-sided paired HAC t test, candidate - {against} > "
            f"{cfg.min_improvement_bps:g} bps at {cfg.horizon}")  # fmt: skip
    common = dict(test=test, alpha=cfg.alpha, min_improvement_bps=cfg.min_improvement_bps,
                  horizon=cfg.horizon, difference_bps=est.estimate, se_bps=est.se,
                  trials=trials, windows=est.windows, n_eff=est.n_eff,
                  candidate_trades=len(candidate), incumbent_trades=len(incumbent))  # fmt: skip
    if not est.tested:
        return GateResult(passed=False, statistic=float("nan"), p_value=float("nan"),
                          p_adjusted=float("nan"), why=est.insufficient, **common)  # fmt: skip
    p = est.p_greater(cfg.min_improvement_bps)
    p_adj = trials_adjusted(p, trials)
    passed = p_adj < cfg.alpha
    why = (
        f"{against} {est.estimate:+.3f} bps (se {est.se:.3f}, {est.windows:.0f} windows): "
        f"p = {p_adj:.4f}{' after ' + str(trials) + ' trials' if trials > 1 else ''} "
        f"{'<' if passed else '>='} alpha {cfg.alpha:g}"
    )
    return GateResult(passed=passed, statistic=(est.estimate - cfg.min_improvement_bps) / est.se,
                      p_value=p, p_adjusted=p_adj, why=why, **common)  # fmt: skip
