"""The hit rate's standard error on noise: is it calibrated?

    .venv/bin/python bench/hit_rate.py                    # 300 replications
    .venv/bin/python bench/hit_rate.py --replications 40  # quicker
    .venv/bin/python bench/hit_rate.py --days 13 --replications 150  # 12 days replayed

A research run reports each signal's hit rate per horizon (the share of trades with a
positive mark-out; README's `hit 1s`) with a standard error (`hit_rate_se` in the
summary and MLflow): the same HAC estimator as the mean mark-out's
(tasks/research/uncertainty.py), applied to the 0/1 indicators. Same-side runs of trades
and overlapping horizons make those indicators as dependent as the mark-outs, so an iid
binomial SE would be too small; this measures whether the reported one holds.

Each replication is bench/validity.py's: one synthetic product with no edge, three days,
the first setting each strategy's threshold, two replayed; the strategies are the
baseline (top-of-book imbalance) and no-edge noise of several persistences. The market's
law is the same in every replication, so each strategy's hit rate has one true value and
its spread over replications is the SE a calibrated estimator reports on average. Per
strategy and horizon: that spread / the root mean square reported SE (1 = calibrated),
the same for the iid binomial SE, the share of replications with an SE, and the mean hit
rate.

Writes bench/results/hit-rate.json and .md (machine, date, commit).
"""

from __future__ import annotations

import argparse
import math
import multiprocessing
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.checkout import use_checkout  # noqa: E402
from bench.report import markdown_table, stamp, stamp_line, write  # noqa: E402

use_checkout()

from bench.validity import HORIZONS, NULL_STRATEGIES, replay  # noqa: E402
from quantloop.tasks.research import uncertainty  # noqa: E402
from quantloop.tasks.research.uncertainty import Sample  # noqa: E402

STRATEGIES = ["baseline", *NULL_STRATEGIES]


def measure(seed: int, days: int = 3) -> dict:
    """Per strategy and horizon: the hit rate, its reported SE and the iid binomial SE;
    the mean mark-out and its SE beside them (bench/validity.py measures those)."""
    tables = replay(seed, 0.0, days)
    out = {}
    for name in STRATEGIES:
        t = tables[name]
        for key in HORIZONS:
            column = f"markout_{key}"
            width = uncertainty.window_seconds(key, [t])
            est = uncertainty.mean(Sample.of([t], column, hits=True), width)
            mark = uncertainty.mean(Sample.of([t], column), width)
            n = int(np.isfinite(t[column].to_numpy(zero_copy_only=False)).sum())
            p = est.estimate
            iid = math.sqrt(p * (1 - p) / n) if n > 1 and math.isfinite(p) else math.nan
            out[f"{name}|{key}"] = {"est": p, "se": est.se, "se_iid": iid, "n": n,
                                    "mark": mark.estimate, "mark_se": mark.se}  # fmt: skip
    return out


def ratio(estimates: list[float], ses: list[float]) -> float:
    """The estimate's spread over replications / the root mean square SE (bench/validity.py)."""
    e = np.asarray(estimates, np.float64)
    s = np.asarray(ses, np.float64)
    ok = np.isfinite(e) & np.isfinite(s) & (s > 0)
    if ok.sum() < 10:
        return math.nan
    return float(e[ok].std(ddof=1) / math.sqrt(np.mean(s[ok] ** 2)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--replications", type=int, default=300)
    ap.add_argument("--days", type=int, default=3, help="the first sets thresholds")
    ap.add_argument("--processes", type=int, default=os.cpu_count() or 1)
    args = ap.parse_args()
    t0 = time.perf_counter()
    with multiprocessing.get_context("spawn").Pool(args.processes) as pool:
        recs = pool.starmap(measure, [(r, args.days) for r in range(args.replications)], 2)
    cases, table = [], []
    for name in STRATEGIES:
        for key in HORIZONS:
            rows = [r[f"{name}|{key}"] for r in recs]
            tested = [r for r in rows if r["se"] is not None and r["se"] > 0]
            case = {
                "strategy": name, "horizon": key,
                "se_ratio": ratio([r["est"] for r in tested], [r["se"] for r in tested]),
                "se_ratio_iid": ratio([r["est"] for r in tested], [r["se_iid"] for r in tested]),
                "markout_se_ratio": ratio([r["mark"] for r in rows], [r["mark_se"] for r in rows]),
                "tested": len(tested) / len(rows),
                "mean_hit_rate": float(np.nanmean([r["est"] for r in rows])),
                "mean_trades": float(np.mean([r["n"] for r in rows])),
            }  # fmt: skip
            cases.append(case)
            table.append((name, key, f"{case['se_ratio']:.2f}", f"{case['se_ratio_iid']:.2f}",
                          f"{case['markout_se_ratio']:.2f}",
                          f"{case['tested']:.0%}", f"{case['mean_hit_rate']:.1%}",
                          f"{case['mean_trades']:,.0f}"))  # fmt: skip
    s = stamp()
    result = {**s, "replications": args.replications, "days": args.days, "cases": cases,
              "seconds": time.perf_counter() - t0}  # fmt: skip
    md = (
        "# The hit rate's standard error on noise (bench/hit_rate.py)\n\n"
        f"{stamp_line(s)} {args.replications} replications, {result['seconds']:.0f} s.\n\n"
        f"Each strategy on {args.days - 1} replayed synthetic days with no edge "
        "(bench/validity.py's set-up; the market's law is the same in every replication). "
        "SE ratio: the hit rate's spread over the replications with an SE / the RMS SE "
        "(1 = calibrated; above 1, the SE is too small): the reported HAC SE, and the iid "
        "binomial SE for comparison, over the same replications, and the mean mark-out's "
        "reported SE (its own calibration: bench/results/validity.md). Tested: the share of "
        "replications with a hit rate SE.\n\n"
        + markdown_table(
            [
                "strategy",
                "horizon",
                "SE ratio (reported)",
                "SE ratio (iid)",
                "mark-out SE ratio",
                "tested",
                "mean hit rate",
                "mean trades",
            ],
            table,
            [False, False, True, True, True, True, True, True],
        )  # fmt: skip
        + "\n"
    )
    write("hit-rate" if args.days == 3 else f"hit-rate-{args.days}d", result, md)
    print(md)


if __name__ == "__main__":
    main()
