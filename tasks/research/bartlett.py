"""Bartlett's kernel long-run variance with Newey and West's automatic bandwidth, for one
series of window sums (Newey and West, 1987, "A simple, positive semi-definite,
heteroskedasticity and autocorrelation consistent covariance matrix", Econometrica 55;
the bandwidth: Newey and West, 1994, "Automatic lag selection in covariance matrix
estimation", Review of Economic Studies 61).

The arithmetic is arch's (`arch.covariance.kernel.Bartlett` with `center=False`, version 7
and 8), operation for operation on the same (n, 1) arrays, so the numbers are the same to
the last bit (tests/test_bartlett.py compares them on many series): statistics stored by
earlier runs are reproduced exactly. Written out because `import arch` brings scipy.stats,
pandas, statsmodels and matplotlib along (~800 modules, 1.2-2.5 s), which every run's first
statistics paid for three arithmetic loops."""

from __future__ import annotations

import math

import numpy as np

KERNEL_CONST = 1.1447  # Bartlett's c_k in Newey and West's (1994) optimal bandwidth (arch's too)
RATE = 2 / 9  # the pilot's lag count grows as n^(2/9) (Newey and West, 1994, section 3)


def _column(z: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(np.asarray(z, np.float64).reshape(-1, 1))


def automatic_bandwidth(z: np.ndarray) -> float:
    """Newey and West's (1994) plug-in bandwidth for Bartlett's kernel (q = 1):
    1.1447 (alpha n)^(1/3), alpha = (f1 / f0)^2 from autocovariances up to lag
    ceil(4 (n/100)^(2/9)); at most n - 1. Raises ZeroDivisionError where the pilot
    spectrum at 0 is 0, as arch does."""
    v = _column(z) @ np.ones((1, 1))  # arch weights the columns: one column, weight 1
    nobs = v.shape[0]
    n = int(np.ceil(4 * ((nobs / 100) ** RATE)))
    f_0s = 0.0
    f_qs = 0.0
    for j in range(n + 1):
        sig_j = float(np.squeeze(v[j:].T @ v[: (nobs - j)])) / nobs
        scale = 1 + (j != 0)
        f_0s += scale * sig_j
        f_qs += scale * j**1.0 * sig_j
    alpha_q = (f_qs / f_0s) ** 2
    bw = KERNEL_CONST * (alpha_q * nobs) ** (1 / (2 * 1.0 + 1))
    return min(bw, nobs - 1.0)


def long_run(z: np.ndarray, bandwidth: float) -> float:
    """Bartlett's long-run variance of z's mean (weights 1 - h/(b+1), h = 0..b),
    uncentred, divided by n: multiply by n for the variance of the sum."""
    if not (bandwidth >= 0.0 and math.isfinite(bandwidth)):
        raise ValueError(f"bandwidth must be a finite non-negative number, got {bandwidth!r}")
    x = _column(z)
    df = x.shape[0]
    sr = x.T @ x / df
    w = ((bandwidth + 1 - np.arange(int(bandwidth + 1), dtype="double")) / (bandwidth + 1)).astype(
        float
    )
    oss = np.zeros((1, 1))
    for i in range(1, w.shape[0]):
        oss += w[i] * (x[i:].T @ x[:-i]) / df
    return float((sr + oss + oss.T).item())
