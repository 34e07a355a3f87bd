"""tasks/research/bartlett.py against arch, the estimator it replaces: the same bits on
every series (stored statistics are reproduced exactly), and a run's statistics without
arch's or scipy.stats' imports."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
from arch.covariance.kernel import Bartlett
from scipy import stats
from scipy.signal import lfilter

from quantloop.tasks.research import bartlett
from quantloop.tasks.research.uncertainty import long_run_variance, t_sf


def _series() -> list[np.ndarray]:
    rng = np.random.default_rng(20261206)
    out = [np.array([1.0, -1.0]), np.array([0.0, 0.0, 3.0]), np.array([2.0, 0.0, 0.0, 0.0])]
    for n in (2, 3, 5, 9, 31, 50, 101, 400, 2_000, 10_007):
        out.append(rng.normal(size=n))
        out.append(lfilter([1.0], [1.0, -0.8], rng.normal(size=n)))  # AR(1), phi 0.8
        out.append(lfilter([1.0], [1.0, 0.6], rng.standard_t(3, size=n)))  # negative, heavy
        sparse = rng.normal(size=n) * (rng.random(n) < 0.05)  # mostly empty windows
        out.append(sparse * 1e-7)
    return out


@pytest.mark.parametrize("i", range(len(_series())))
def test_bandwidth_and_long_run_are_archs_to_the_bit(i):
    z = _series()[i]
    try:
        want = float(Bartlett(z, center=False).bandwidth)
    except ZeroDivisionError:
        with pytest.raises(ZeroDivisionError):
            bartlett.automatic_bandwidth(z)
        want = None
    if want is not None:
        assert bartlett.automatic_bandwidth(z) == want
    for bw in {0.0, 1.0, 4.0, 2.5, min(want or 0.0, len(z) - 1.0), len(z) - 1.0}:
        ref = float(np.asarray(Bartlett(z, bandwidth=bw, center=False).cov.long_run).item())
        assert bartlett.long_run(z, bw) == ref, (len(z), bw)


def test_the_pilot_spectrum_at_zero_raises_as_archs_does():
    z = np.array([1.0, -1.0])  # sig_0 = 1, sig_1 = -1/2: f_0 = 1 + 2 (-1/2) = 0
    with pytest.raises(ZeroDivisionError):
        _ = Bartlett(z, center=False).bandwidth
    with pytest.raises(ZeroDivisionError):
        bartlett.automatic_bandwidth(z)
    # the floor of 4 windows cut at n - 1: 2 (1 + 2 (1/2) (-1/2)) = 1 against lag-1 truncation 0
    assert long_run_variance(z) == (1.0, 1.0)
    one = np.zeros(40)
    one[7] = 1.0  # one window traded: no autocovariance, alpha 0, bandwidth 0
    assert bartlett.automatic_bandwidth(one) == float(Bartlett(one, center=False).bandwidth) == 0.0
    with pytest.raises(ValueError, match="bandwidth"):
        bartlett.long_run(one, float("nan"))


def test_t_sf_is_scipy_stats_t_sf():
    for t in (0.0, 0.3, 1.96, -2.5, 7.0, 40.0):
        for df in (1, 2, 9, 29, 48.5, 1_000, 1e7):
            assert t_sf(t, df) == float(stats.t.sf(t, df)), (t, df)


def test_a_runs_statistics_import_neither_arch_nor_scipy_stats():
    code = (
        "import sys, numpy as np\n"
        "from quantloop.tasks.research import uncertainty\n"
        "uncertainty.warm()\n"
        "rng = np.random.default_rng(1)\n"
        "s = uncertainty.Sample(rng.normal(size=500), np.sort(rng.uniform(0, 3600, 500)),\n"
        "                       np.repeat(np.array(['2024-01-02']), 500))\n"
        "e = uncertainty.mean(s, 10.0)\n"
        "assert e.tested and 0 < e.p_value < 1, e\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('arch', 'pandas')\n"
        "             or m.startswith('scipy.stats')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout
    # and the same estimate as with arch's Bartlett, in this process
    z = _series()[13]
    var, bw = long_run_variance(z)
    arch_lr = len(z) * float(
        np.asarray(Bartlett(z, bandwidth=bw, center=False).cov.long_run).item()
    )
    assert var == max(arch_lr, float(np.sum(z * z) + 2 * np.sum(z[1:] * z[:-1])))
