"""The HAC standard errors against cases with a known answer (tasks/research/uncertainty.py)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy.signal import lfilter

from quantloop.tasks.research import uncertainty
from quantloop.tasks.research.uncertainty import Sample, difference, holm, mean, trials_adjusted


def regular(values: np.ndarray, step_s: float = 1.0, day: str = "d") -> Sample:
    return Sample(values, np.arange(len(values)) * step_s, np.full(len(values), day))


def ar1(rng: np.random.Generator, n: int, phi: float) -> np.ndarray:
    e = rng.standard_normal(n)
    e[0] /= math.sqrt(1 - phi**2)
    return lfilter([1.0], [1.0, -phi], e)


def test_ar1_mean_has_its_long_run_variance():
    """AR(1) with unit innovations: the long-run variance is 1 / (1 - phi)^2, so the SE of
    the mean of n is 1 / ((1 - phi) sqrt(n)), while the iid SE is sqrt(1 / (1 - phi^2) / n)."""
    rng = np.random.default_rng(0)
    n, phi = 40_000, 0.6
    est = mean(regular(ar1(rng, n, phi)), 1.0)
    truth = 1 / ((1 - phi) * math.sqrt(n))
    assert est.se == pytest.approx(truth, rel=0.12)
    assert est.se_iid == pytest.approx(math.sqrt(1 / (1 - phi**2) / n), rel=0.05)
    assert est.n_eff == pytest.approx(n * (1 - phi) ** 2 / (1 - phi**2), rel=0.25)


def test_overlapping_window_sums_over_many_replications():
    """x_i = the sum of the next k iid moves (a k-event mark-out of every event): the
    variance of the mean is k^2 / n. Over replications the SE's calibration is measured:
    the true spread of the mean over the mean SE is near 1; the iid SE's is near sqrt(k)."""
    rng = np.random.default_rng(1)
    n, k = 4_000, 10
    means, ses, iid = [], [], []
    for _ in range(200):
        c = np.concatenate([[0.0], np.cumsum(rng.standard_normal(n + k))])
        est = mean(regular(c[k : k + n] - c[:n]), float(k))
        means.append(est.estimate)
        ses.append(est.se)
        iid.append(est.se_iid)
    spread = np.std(means, ddof=1)
    assert spread == pytest.approx(math.sqrt(k * k / n), rel=0.15)
    assert 0.9 < spread / np.mean(ses) < 1.15
    assert spread / np.mean(iid) > 0.8 * math.sqrt(k)


def test_iid_data_keeps_the_iid_standard_error():
    rng = np.random.default_rng(2)
    est = mean(regular(rng.standard_normal(10_000), 12.0), 10.0)
    assert est.se == pytest.approx(est.se_iid, rel=0.1)


def test_few_windows_are_insufficient_data():
    """500 trades in 20 windows of 10 s are 20 independent observations at most."""
    t = np.repeat(np.arange(20) * 10.0, 25)
    est = mean(Sample(np.random.default_rng(3).standard_normal(500), t, np.zeros(500)), 10.0)
    assert not est.tested and math.isnan(est.se) and math.isnan(est.p_value)
    assert est.windows == pytest.approx(20.0)
    assert est.insufficient == (
        f"insufficient data: 20.0 effective 10 s windows < {uncertainty.MIN_WINDOWS}"
    )


def test_days_are_separate_grids():
    """Two days' trades at the same clock times are different windows."""
    t = np.arange(40) * 10.0
    one = Sample(np.ones(80), np.concatenate([t, t]), np.repeat(["a", "b"], 40))
    assert mean(one, 10.0).windows == pytest.approx(80.0)


def test_difference_of_a_shifted_copy():
    rng = np.random.default_rng(4)
    base = rng.standard_normal(5_000)
    t = np.arange(5_000) * 15.0
    a = Sample(base + 0.25, t, np.zeros(5_000))
    b = Sample(base, t + 1.0, np.zeros(5_000))
    d = difference(a, b, 10.0)
    assert d.estimate == pytest.approx(0.25) and d.insufficient.startswith("no variation")


def test_window_seconds():
    assert uncertainty.window_seconds("300s") == 300.0
    assert uncertainty.window_seconds("1s") == uncertainty.MIN_WINDOW_S


def test_holm_and_sidak():
    adjusted = holm({"a": 0.01, "b": 0.04, "c": 0.03, "d": math.nan})
    assert adjusted["a"] == pytest.approx(0.03)  # smallest of 3 tested: times 3
    assert adjusted["c"] == pytest.approx(0.06) and adjusted["b"] == pytest.approx(0.06)
    assert math.isnan(adjusted["d"])
    # the same as statsmodels' multipletests, ties and p-values near 1 included
    from statsmodels.stats.multitest import multipletests

    rng = np.random.default_rng(3)
    for m in (1, 2, 5, 17):
        p = np.concatenate([rng.uniform(0, 1, m), [0.02, 0.02, 0.9]])
        ours = holm({str(i): float(x) for i, x in enumerate(p)})
        theirs = multipletests(p, method="holm")[1]
        assert [ours[str(i)] for i in range(len(p))] == pytest.approx(theirs.tolist(), abs=1e-15)
    assert trials_adjusted(0.01, 1) == pytest.approx(0.01)
    assert trials_adjusted(0.01, 5) == pytest.approx(1 - 0.99**5)
    assert math.isnan(trials_adjusted(math.nan, 3))
