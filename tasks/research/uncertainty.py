"""Standard errors of mean mark-outs that hold when trades overlap.

Trades a few events apart share most of their mark-out horizon and, for a persistent
signal, their side: their mark-outs are strongly correlated, and the iid standard error
`std / sqrt(n)` understates the true spread of the mean (measured on the synthetic
generator with a persistent no-edge signal: 1.5x at 1 s, 5.7x at 300 s; the paired test
then called noise significant in 12-25% of replications at a nominal 5%).

Method: a HAC (heteroskedasticity and autocorrelation consistent) variance of the mean
on a clock-time grid. Each day is cut into windows at least one horizon long (and at
least MIN_WINDOW_S); the mean's influence function, (x_i - mean) / n, is summed per
window, which gives a regular time series z_c (zero where no trade fell), and the
variance of the mean is a long-run variance of that series (`long_run_variance`): the
larger of the truncated kernel at lag 1 (Hansen and Hodrick, 1980), exact for
dependence that stops at the overlap, and Bartlett's kernel (Newey and West, 1987,
"A simple, positive semi-definite, heteroskedasticity and autocorrelation consistent
covariance matrix", Econometrica 55) with Newey and West's (1994) automatic bandwidth
("Automatic lag selection in covariance matrix estimation", RES 61), as Kevin Sheppard's
`arch.covariance.kernel.Bartlett` computes it, for slower dependence (the spread paid).
With MIN_DAYS days or more, the cluster-by-day variance is taken where it is larger: a
level that moves from day to day is invisible within days.

Why a grid in clock time rather than a lag in trades: trades are irregular, and what
correlates two mark-outs is how much of their horizon they share in time; under no edge
the mid is a martingale, so mark-outs of windows more than a horizon apart are
uncorrelated whatever the signal's persistence. The paired model-minus-baseline
difference uses one grid for both signals, so the market moves they share cancel
window by window (a paired test), with no matching of trades.

Effective sample: `windows` is the number of non-overlapping horizon windows the trades
fill, weighted by how evenly (Kish's effective number, (sum n_c)^2 / sum n_c^2); a
horizon whose trades fill fewer than MIN_WINDOWS is reported as insufficient data, with
no standard error: a HAC variance from a handful of windows looks precise and is not.
`n_eff` is the design-effect sample, n * (iid SE / HAC SE)^2: how many independent
trades the mark-outs are worth. Tests use Student's t with windows - 1 degrees of
freedom (days - 1 where the day clusters gave the SE). The calibration of all this is
measured, not assumed: bench/validity.py, bench/results/validity.md.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass

import numpy as np
import pyarrow as pa

from quantloop.tasks.research import bartlett

MIN_WINDOWS = 30  # fewer effective horizon windows than this: "insufficient data"
MIN_BANDWIDTH = 4  # Bartlett bandwidth floor, in windows (lag 1 keeps weight 3/4)
MIN_WINDOW_S = 10.0  # no window shorter than this: the spread's own persistence
MIN_DAYS = 10  # from this many days on, the SE also holds a day-to-day level shift
EVENT_SPAN_QUANTILE = 0.9  # an event horizon's window: this quantile of its elapsed seconds


@dataclass(frozen=True, slots=True, kw_only=True)
class Estimate:
    """A mean (or a difference of means) with what a reader needs to judge it."""

    estimate: float  # the mean (bps, or a fraction for a hit rate)
    se: float  # HAC standard error; NaN when insufficient
    se_iid: float  # the iid standard error, std / sqrt(n), for comparison
    n: int  # observations (trades; for a difference, both signals' together)
    n_eff: float  # n * (se_iid / se)^2: independent trades the sample is worth
    windows: float  # effective non-overlapping horizon windows (Kish)
    days: int  # days the sample spans (>= MIN_DAYS: day-to-day variation is in the SE)
    bandwidth: float  # Bartlett bandwidth, in windows
    width_s: float  # window length, seconds
    statistic: float  # estimate / se (t); NaN when insufficient
    df: float  # degrees of freedom of the t test: windows - 1
    p_value: float  # two-sided, H0: the mean is 0
    insufficient: str = ""  # why no test was made ("" when it was)

    @property
    def tested(self) -> bool:
        return not self.insufficient

    def p_greater(self, margin: float = 0.0) -> float:
        """One-sided p-value of H0: mean <= margin against H1: mean > margin."""
        if not self.tested:
            return math.nan
        return t_sf((self.estimate - margin) / self.se, self.df)

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True, slots=True)
class Sample:
    """One signal's observations at one horizon: values and when (day, fill time in
    seconds) each trade was made. Non-finite values are dropped."""

    values: np.ndarray  # [n] float64
    times: np.ndarray  # [n] float64 seconds
    days: np.ndarray  # [n] day labels (str or int)

    def __post_init__(self) -> None:
        v = np.asarray(self.values, np.float64)
        t = np.asarray(self.times, np.float64)
        d = np.asarray(self.days)
        if not (len(v) == len(t) == len(d)):
            raise ValueError(f"values, times, days differ in length: {len(v)}, {len(t)}, {len(d)}")
        ok = np.isfinite(v) & np.isfinite(t)
        object.__setattr__(self, "values", v[ok])
        object.__setattr__(self, "times", t[ok])
        object.__setattr__(self, "days", d[ok])

    @staticmethod
    def of(tables: Sequence[pa.Table], column: str, *, hits: bool = False) -> Sample:
        """The `column` (e.g. markout_5s) of mark-out tables with `day` and `time` (or
        `fill_time`) columns; hits: the indicator value > 0 instead (a hit rate)."""
        parts = [t for t in tables if column in t.column_names and t.num_rows]
        if not parts:
            return Sample(np.zeros(0), np.zeros(0), np.zeros(0, dtype=object))

        def col(t: pa.Table, name: str) -> np.ndarray:
            return t.column(name).to_numpy(zero_copy_only=False)

        v = np.concatenate([col(t, column).astype(np.float64) for t in parts])
        if hits:
            v = np.where(np.isfinite(v), (v > 0).astype(np.float64), np.nan)
        # without times every trade is in one window: no standard error, insufficient data
        when = [col(t, "fill_time") if "fill_time" in t.column_names else
                col(t, "time") if "time" in t.column_names else np.zeros(t.num_rows)
                for t in parts]  # fmt: skip
        days = [col(t, "day") if "day" in t.column_names else np.zeros(t.num_rows) for t in parts]
        return Sample(v, np.concatenate(when).astype(np.float64), np.concatenate(days))

    def __len__(self) -> int:
        return len(self.values)


def window_seconds(key: str, tables: Sequence[pa.Table] = ()) -> float:
    """A horizon's window length: the horizon itself for a clock horizon ('5s'); for an
    event horizon ('100ev'), EVENT_SPAN_QUANTILE of the seconds its mark-outs spanned
    (the `elapsed_<key>` column); never under MIN_WINDOW_S."""
    if key.endswith("s") and not key.endswith("ev"):
        return max(float(key[:-1]), MIN_WINDOW_S)
    spans = [
        t.column(f"elapsed_{key}").to_numpy(zero_copy_only=False).astype(np.float64)
        for t in tables
        if f"elapsed_{key}" in t.column_names
    ]
    s = np.concatenate(spans) if spans else np.zeros(0)
    s = s[np.isfinite(s)]
    span = float(np.quantile(s, EVENT_SPAN_QUANTILE)) if len(s) else 0.0
    return max(span, MIN_WINDOW_S)


def long_run_variance(z: np.ndarray, min_bandwidth: float = MIN_BANDWIDTH) -> tuple[float, float]:
    """Variance of sum(z) for a series z of window sums with mean zero: the larger of

    - the truncated kernel at lag 1, sum z_c^2 + 2 sum z_c z_{c+1} (Hansen and Hodrick,
      1980, "Forward exchange rates as optimal predictors of future spot rates", JPE 88:
      overlapping forecast errors). Exact when the dependence stops at the overlap, which
      it does for the price move under no edge: windows are at least one horizon long, so
      a mark-out reaches the next window at most. Bartlett weights would shrink that lag
      (and its small-sample bias: 12-14% of the variance with ~50 windows, in a scratch
      simulation of same-side runs on a Brownian mid, not committed);
    - Bartlett's kernel with Newey and West's (1994) automatic bandwidth, at least
      min_bandwidth (tasks/research/bartlett.py: arch's arithmetic): slower dependence than
      the overlap, such as the spread paid, which at a 1 s horizon outlives the 10 s
      windows.

    Returns (variance of the sum, the Bartlett bandwidth)."""
    z = np.asarray(z, np.float64)
    if len(z) < 2 or not np.any(z):
        return float(np.sum(z * z)), 0.0
    try:
        automatic = bartlett.automatic_bandwidth(z)
    except ZeroDivisionError:  # the plug-in's pilot spectrum at 0 is 0: one window traded
        automatic = 0.0
    bandwidth = max(automatic if math.isfinite(automatic) else 0.0, float(min_bandwidth))
    bandwidth = min(bandwidth, float(len(z) - 1))
    long_run = len(z) * bartlett.long_run(z, bandwidth)
    truncated = float(np.sum(z * z) + 2 * np.sum(z[1:] * z[:-1]))
    return max(long_run, truncated), bandwidth


def t_sf(t: float, df: float) -> float:
    """Student's t survival function, P(T > t): scipy.stats.t.sf's own function
    (`scipy.special.stdtr(df, -t)`, the same bits), without importing scipy.stats
    (~420 modules, 0.3-0.7 s) into every run."""
    from scipy.special import stdtr

    return float(stdtr(df, -t))


def warm() -> None:
    """Make the first estimate's imports (scipy.special's Student t) before a run needs
    them: the warm process calls this once, so its children start with them
    (quantloop/forkserver.py WARM_CALLS). Where arch's numba kernel was used, this was
    its compile (2.1 s on the H200 image; bench/results/turnaround-h200-ahead-notes.md,
    call 10)."""
    long_run_variance(np.array([1.0, -0.5, 0.25, -1.0, 0.5, 0.75]))
    t_sf(1.0, 5.0)


def _cells(samples: Sequence[Sample], width: float) -> tuple[list[np.ndarray], int, np.ndarray]:
    """Each sample's index into one dense grid of windows of `width` seconds: per day,
    every window from the first trade's to the last one's (empty ones too); days one
    after another. Also each window's day (0, 1, ...)."""
    days = np.unique(np.concatenate([s.days.astype(str) for s in samples]))
    codes = [np.searchsorted(days, s.days.astype(str)) for s in samples]
    cells = [np.floor(s.times / width).astype(np.int64) for s in samples]
    lo = np.full(len(days), np.iinfo(np.int64).max)
    hi = np.full(len(days), np.iinfo(np.int64).min)
    for d, c in zip(codes, cells, strict=True):
        np.minimum.at(lo, d, c)
        np.maximum.at(hi, d, c)
    size = np.where(hi >= lo, hi - lo + 1, 0)
    start = np.concatenate([[0], np.cumsum(size)[:-1]])
    index = [start[d] + c - lo[d] for d, c in zip(codes, cells, strict=True)]
    return index, int(size.sum()), np.repeat(np.arange(len(days)), size)


def _variance(z: np.ndarray, cell_day: np.ndarray) -> tuple[float, float, int, bool]:
    """The variance of sum(z): the HAC over the windows, or, with MIN_DAYS days or more,
    the larger of it and the cluster-by-day variance G / (G - 1) * sum_d z_d^2 (Liang and
    Zeger, 1986), which also holds what the HAC cannot see: a level that moves from day to
    day (measured on the generator: the baseline's spread paid varies by day, and with
    two days its 1 s SE was half the truth). Returns (variance, bandwidth, days, whether
    the day clusters gave it: then the t test has days - 1 degrees of freedom)."""
    var_sum, bandwidth = long_run_variance(z)
    days = int(cell_day.max()) + 1 if len(cell_day) else 0
    if days >= MIN_DAYS:
        per_day = np.bincount(cell_day, weights=z, minlength=days)
        by_day = days / (days - 1) * float(np.sum(per_day**2))
        if by_day > var_sum:
            return by_day, bandwidth, days, True
    return var_sum, bandwidth, days, False


def _kish(index: np.ndarray, length: int) -> float:
    counts = np.bincount(index, minlength=length).astype(np.float64)
    total = counts.sum()
    return float(total**2 / (counts**2).sum()) if total else 0.0


def _result(
    estimate: float, var_sum: float, bandwidth: float, se_iid: float, n: int, n_iid: float,
    windows: float, width: float, days: int = 0, by_day: bool = False,
) -> Estimate:  # fmt: skip
    common = dict(estimate=estimate, se_iid=se_iid, n=n, windows=windows, width_s=width,
                  bandwidth=bandwidth, days=days)  # fmt: skip
    if windows < MIN_WINDOWS:
        why = f"insufficient data: {windows:.1f} effective {width:g} s windows < {MIN_WINDOWS}"
        return Estimate(se=math.nan, n_eff=math.nan, statistic=math.nan, df=math.nan,
                        p_value=math.nan, insufficient=why, **common)  # fmt: skip
    # small-sample factor as a cluster SE's G / (G - 1), with G the effective windows
    se = math.sqrt(max(var_sum, 0.0) * windows / (windows - 1))
    df = days - 1 if by_day else windows - 1
    # zero up to rounding: the two signals' mark-outs cancel in every window
    if se <= 1e-9 * max(abs(estimate), se_iid if se_iid == se_iid else 0.0, 1e-300):
        return Estimate(se=0.0, n_eff=math.inf, statistic=math.nan, df=df, p_value=math.nan,
                        insufficient="no variation: the same in every window, up to a "
                        "constant", **common)  # fmt: skip
    t = estimate / se
    return Estimate(se=se, n_eff=n_iid * (se_iid / se) ** 2 if se_iid == se_iid else math.nan,
                    statistic=t, df=df, p_value=2 * t_sf(abs(t), df),
                    **common)  # fmt: skip


def mean(sample: Sample, width_s: float) -> Estimate:
    """The sample's mean with its HAC standard error over windows of width_s seconds."""
    n = len(sample)
    if n == 0:
        return _result(math.nan, math.nan, 0.0, math.nan, 0, 0, 0.0, width_s)
    mu = float(sample.values.mean())
    se_iid = float(sample.values.std(ddof=1) / math.sqrt(n)) if n > 1 else math.nan
    (index,), length, cell_day = _cells([sample], width_s)
    z = np.bincount(index, weights=(sample.values - mu) / n, minlength=length)
    var_sum, bandwidth, days, by_day = _variance(z, cell_day)
    return _result(mu, var_sum, bandwidth, se_iid, n, n, _kish(index, length), width_s, days,
                   by_day)  # fmt: skip


def difference(a: Sample, b: Sample, width_s: float) -> Estimate:
    """mean(a) - mean(b), both signals' influence summed on one grid of windows, so what
    the market did in a window cancels between them (a paired test without matching
    trades). The effective windows are the fewer of the two signals'."""
    na, nb = len(a), len(b)
    if na == 0 or nb == 0:
        return _result(math.nan, math.nan, 0.0, math.nan, na + nb, 0, 0.0, width_s)
    ma, mb = float(a.values.mean()), float(b.values.mean())
    var_iid = (a.values.var(ddof=1) / na if na > 1 else math.nan) + (
        b.values.var(ddof=1) / nb if nb > 1 else math.nan
    )
    (ia, ib), length, cell_day = _cells([a, b], width_s)
    z = np.bincount(ia, weights=(a.values - ma) / na, minlength=length) - np.bincount(
        ib, weights=(b.values - mb) / nb, minlength=length
    )
    var_sum, bandwidth, days, by_day = _variance(z, cell_day)
    windows = min(_kish(ia, length), _kish(ib, length))
    n_iid = 2.0 / (1.0 / na + 1.0 / nb)  # n_eff is reported on the harmonic-mean scale
    return _result(ma - mb, var_sum, bandwidth, math.sqrt(var_iid), na + nb, n_iid, windows,
                   width_s, days, by_day)  # fmt: skip


def holm(p_values: Mapping[str, float]) -> dict[str, float]:
    """Holm's step-down adjustment (Holm, 1979, "A simple sequentially rejective multiple
    test procedure", Scand. J. Statist. 6) over the tested entries; NaN stays NaN.

    The i-th smallest of m p-values becomes max over j <= i of min(1, (m - j + 1) p_(j)).
    Written out rather than taken from statsmodels' multipletests, whose Holm branch
    runs gc.collect() on every call: 1.3 s of a research run's statistics in a process
    holding torch, Prefect and MLflow (tests/test_uncertainty.py checks the two agree)."""
    keys = sorted((k for k, p in p_values.items() if p == p), key=lambda k: p_values[k])
    out = {k: math.nan for k in p_values}
    running, m = 0.0, len(keys)
    for i, key in enumerate(keys):
        running = max(running, min(1.0, (m - i) * p_values[key]))
        out[key] = running
    return out


def trials_adjusted(p: float, trials: int) -> float:
    """A p-value after `trials` tries on the same data: Sidak's 1 - (1 - p)^k, the chance
    that the best of k independent null trials looks at least this good (Sidak, 1967;
    conservative when the trials are positively correlated, as variants of one model are)."""
    if p != p:
        return math.nan
    k = max(int(trials), 1)
    return float(-math.expm1(k * math.log1p(-min(p, 1.0)))) if p < 1 else 1.0
