"""A sweep's best setting on noise: is the '*' on the chosen one calibrated?

    .venv/bin/python bench/selection.py                    # 300 replications, K = 1, 4, 16
    .venv/bin/python bench/selection.py --replications 40  # quicker

A sweep (tasks/research/sweep.py) ranks its settings by the paired difference of each
setting's model and a reference on the same held-out days at `rank_horizon` (5 s), and
reports the best with its p-value adjusted over the horizons (Holm) and then over the
settings, each a trial on those data (Sidak: 1 - (1 - p)^K). Sidak's adjustment is exact
for K independent tests and conservative for positively correlated ones, which a sweep's
models (variants of one model on the same data) are; this measures it rather than assuming.

Each replication is one synthetic product with no edge (`synthetic.signal` 0), three
days: the first sets each strategy's trading threshold, the other two are replayed
(bench/validity.py's set-up and tasks/research/simulation.py's rules). The settings are
K no-edge strategies, AR(0.999) noise per event (a smoothed model output's persistence),
each sqrt(rho) of one shared AR(0.999) path plus sqrt(1 - rho) of its own (rho 0:
independent settings; rho 0.8: variants of one model), and the reference is an
independent AR(0.999) strategy of the same kind, so H0 (no difference) holds for every
setting by construction. The statistics are the research run's own
(tasks/research/simulation.paired_difference with trials=K, then sweep.rank).

Per K and rho, over the replications:
- how often the best setting is called significant at the rank horizon: with the raw
  p-value, after Holm over the horizons only, and after Holm and Sidak over K (what the
  summary's '*' shows; nominal 5%), and at any horizon after both;
- the best setting's difference in its own standard errors, averaged (the winner's
  curse: the chosen setting's reported figure is the best of K draws, biased upward);
- how often the setting with the highest mean had too few trades for a standard error:
  the ranking's pick before it put such settings after the tested ones (sweep.rank).

Writes bench/results/selection.json and .md (machine, date, commit).
"""

from __future__ import annotations

import argparse
import datetime as dt
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

import pyarrow as pa  # noqa: E402
import pyarrow.compute as pc  # noqa: E402
from scipy.signal import lfilter  # noqa: E402

from quantloop.tasks.data.landing import business_days  # noqa: E402
from quantloop.tasks.data.synthetic import SyntheticConfig, generate_day  # noqa: E402
from quantloop.tasks.research.features import FeatureParams, compute_features  # noqa: E402
from quantloop.tasks.research.simulation import (  # noqa: E402
    SimConfig,
    markout,
    paired_difference,
    simulate,
    thresholds_from,
)
from quantloop.tasks.research.sweep import held_out, rank  # noqa: E402

CONFIG = SimConfig()
HORIZONS = CONFIG.horizon_keys()
RANK_HORIZON = "5s"  # Sweep.rank_horizon's default
PHI = 0.999
ALPHA = 0.05
COLUMNS = ["rho", "K", "raw", "Holm", "Holm + Sidak (the '*')", "'*' at any horizon",
           "mean t of the best", "mean diff bps", "best tested",
           "highest mean untested (the old rule's pick)", "held out: '*' on the last day",
           "held out: mean t"]  # fmt: skip
DAYS = business_days(dt.date(2024, 1, 2), 3)  # one sets thresholds, two are replayed


def ar(rng: np.random.Generator, n: int) -> np.ndarray:
    """AR(1) noise at PHI with a stationary start, unit variance."""
    e = rng.standard_normal(n) * math.sqrt(1 - PHI**2)
    e[0] /= math.sqrt(1 - PHI**2)
    return lfilter([1.0], [1.0, -PHI], e)


def settings_signals(rng: np.random.Generator, n: int, k: int, rho: float) -> list[np.ndarray]:
    """K AR(PHI) signals, each correlated rho with the others through a shared path."""
    shared = ar(rng, n)
    return [math.sqrt(rho) * shared + math.sqrt(1 - rho) * ar(rng, n) for _ in range(k)]


def replay(tables: list[pa.Table], signals: list[np.ndarray]) -> dict[str, pa.Table]:
    """One strategy's mark-outs on the replayed days, its threshold from the first day."""
    threshold = thresholds_from(signals[0], CONFIG)
    parts = []
    for date, features, signal in zip(DAYS[1:], tables[1:], signals[1:], strict=True):
        marked = markout(simulate(features, signal, threshold, CONFIG), features, CONFIG)
        day = pa.array([date.isoformat()] * marked.num_rows, pa.string())
        parts.append(marked.append_column("day", day))
    return {"SYN": pa.concat_tables(parts)}


def on_day(replayed: dict[str, pa.Table], day: dt.date) -> dict[str, pa.Table]:
    """The strategy's mark-outs on one replayed day (a fold's test window, for held_out)."""
    return {p: t.filter(pc.equal(t["day"], day.isoformat())) for p, t in replayed.items()}


def measure(seed: int, ks: list[int], rhos: list[float]) -> dict:
    """Per (rho, K): the best of the first K settings against the reference."""
    rng = np.random.default_rng([seed, 23])
    cfg = SyntheticConfig(seed=seed, signal=0.0, levels=5)
    tables = [compute_features(generate_day("SYN", d, cfg), FeatureParams()) for d in DAYS]
    reference = replay(tables, [ar(rng, t.num_rows) for t in tables])
    out: dict = {}
    for rho in rhos:
        per_day = [settings_signals(rng, t.num_rows, max(ks), rho) for t in tables]
        replayed = [replay(tables, [day[i] for day in per_day]) for i in range(max(ks))]
        for k in ks:
            rows = [{"setting": i, "paired": paired_difference(replayed[i], reference, HORIZONS,
                                                                 alpha=ALPHA, trials=k)}
                    for i in range(k)]  # fmt: skip
            best = rank(rows, RANK_HORIZON)[0]
            at = best["paired"][RANK_HORIZON]
            # the rule before 2026-12-07: the highest mean, tested or not
            means = [r["paired"][RANK_HORIZON]["mean_bps"] for r in rows]
            top = rows[int(np.nanargmax(means))]["paired"][RANK_HORIZON] if np.isfinite(
                means).any() else at  # fmt: skip
            t = at["mean_bps"] / at["se_bps"] if at["se_bps"] else math.nan
            # the sweep's held-out test (two folds): chosen on the first replayed day alone,
            # judged on the second, each day a fold's test window
            first, last = DAYS[1], DAYS[2]
            held = held_out(
                [paired_difference(on_day(replayed[i], first), on_day(reference, first),
                                   HORIZONS, alpha=ALPHA) for i in range(k)],
                [paired_difference(on_day(replayed[i], last), on_day(reference, last),
                                   HORIZONS, alpha=ALPHA) for i in range(k)],
                [str(i) for i in range(k)], RANK_HORIZON, trials=k, settings=k, alpha=ALPHA,
            )  # fmt: skip
            # no pick where no setting could be judged on the first day (held["setting"] None)
            held_se = held.get("diff_se_bps")
            out[f"{rho:g}|{k}"] = {
                "held_tested": bool(held_se is not None and held_se > 0),
                "held_significant": held.get("significant", False),
                "held_t": held["diff_bps"] / held_se if held_se and held_se > 0 else math.nan,
                "tested": at["insufficient"] in ("", None) and math.isfinite(at["p_value"]),
                "p_raw": at["p_value"], "p_holm": at["p_holm"], "p_adjusted": at["p_adjusted"],
                "significant": bool(best["significant"]),
                "any_horizon": any(v["significant"] for v in best["paired"].values()),
                "diff_bps": at["mean_bps"], "se_bps": at["se_bps"], "t": t,
                "highest_mean_untested": not top["se_bps"] > 0,
            }  # fmt: skip
    return out


def _job(args: tuple[int, list[int], list[float]]) -> dict:
    return measure(*args)


def rate(flags: list[bool]) -> tuple[float, float]:
    """A rate and its binomial standard error."""
    n = len(flags)
    p = float(np.mean(flags)) if n else math.nan
    return p, math.sqrt(p * (1 - p) / n) if n else math.nan


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--replications", type=int, default=300)
    ap.add_argument("--ks", default="1,4,16")
    ap.add_argument("--rhos", default="0,0.8")
    ap.add_argument("--processes", type=int, default=os.cpu_count() or 1)
    args = ap.parse_args()
    ks = [int(k) for k in args.ks.split(",")]
    rhos = [float(r) for r in args.rhos.split(",")]
    t0 = time.perf_counter()
    with multiprocessing.get_context("spawn").Pool(args.processes) as pool:
        recs = pool.map(_job, [(s, ks, rhos) for s in range(args.replications)], chunksize=2)
    cases, table = [], []
    for rho in rhos:
        for k in ks:
            rows = [r[f"{rho:g}|{k}"] for r in recs]
            ts = np.asarray([r["t"] for r in rows], np.float64)
            case = {"rho": rho, "k": k, "tested": float(np.mean([r["tested"] for r in rows]))}
            for name, flag in (("raw", lambda r: r["p_raw"] < ALPHA),
                               ("holm", lambda r: r["p_holm"] < ALPHA),
                               ("holm_sidak", lambda r: r["significant"]),
                               ("any_horizon", lambda r: r["any_horizon"])):  # fmt: skip
                case[name], case[f"{name}_se"] = rate([bool(r["tested"] and flag(r))
                                                       for r in rows])  # fmt: skip
            case["held_significant"], case["held_significant_se"] = rate(
                [r["held_tested"] and r["held_significant"] for r in rows])  # fmt: skip
            case["held_mean_t"] = float(np.nanmean([r["held_t"] for r in rows]))
            case["highest_mean_untested"] = float(np.mean([r["highest_mean_untested"]
                                                           for r in rows]))  # fmt: skip
            case["mean_t"] = float(np.nanmean(ts))
            case["mean_diff_bps"] = float(np.nanmean([r["diff_bps"] for r in rows]))
            cases.append(case)
            table.append((f"{rho:g}", k, f"{case['raw']:.1%} ± {case['raw_se']:.1%}",
                          f"{case['holm']:.1%} ± {case['holm_se']:.1%}",
                          f"{case['holm_sidak']:.1%} ± {case['holm_sidak_se']:.1%}",
                          f"{case['any_horizon']:.1%} ± {case['any_horizon_se']:.1%}",
                          f"{case['mean_t']:+.2f}", f"{case['mean_diff_bps']:+.3f}",
                          f"{case['tested']:.0%}",
                          f"{case['highest_mean_untested']:.0%}",
                          f"{case['held_significant']:.1%} ± {case['held_significant_se']:.1%}",
                          f"{case['held_mean_t']:+.2f}"))  # fmt: skip
    s = stamp()
    result = {**s, "replications": args.replications, "ks": ks, "rhos": rhos,
              "rank_horizon": RANK_HORIZON, "alpha": ALPHA, "phi": PHI, "cases": cases,
              "seconds": time.perf_counter() - t0}  # fmt: skip
    md = (
        "# A sweep's best setting on noise (bench/selection.py)\n\n"
        f"{stamp_line(s)} {args.replications} replications, {result['seconds']:.0f} s.\n\n"
        f"K no-edge settings (AR({PHI:g}) noise, pairwise correlation rho) against an "
        "independent no-edge reference on the same two held-out days, ranked as a sweep "
        f"ranks them (paired difference at {RANK_HORIZON}); the best one's claim. H0 holds "
        "for every setting, so each rate is a false-positive rate (nominal "
        f"{ALPHA:.0%}; ± its binomial SE). Columns: the best's p < {ALPHA:g} raw, after "
        f"Holm over the {len(HORIZONS)} horizons, after Holm and Sidak over K (the "
        "summary's '*'), and '*' at any horizon; its difference over its SE, and in bps, "
        "averaged (0 for an unselected null); how often the best had a tested difference "
        "(a standard error); and how often the setting with the highest mean, which the "
        "ranking chose before it put untested settings last, had none. Held out (the "
        "sweep's `sweep_holdout` with two folds, each replayed day a fold's test window): "
        "the setting chosen on the first day alone, its '*' on the second day (Holm over the "
        "horizons; nominal 5%) and its difference over its SE there, averaged.\n\n"
        + markdown_table(COLUMNS, table)
        + "\n"
    )
    write("selection", result, md)
    print(md)


if __name__ == "__main__":
    main()
