"""Calibration of the mark-out statistics: null rejection rates, SE ratios, power, the gate.

    .venv/bin/python bench/validity.py --out bench/results            # 500 null replications
    .venv/bin/python bench/validity.py --replications 100 --power-replications 40  # quicker

Each replication is one synthetic product on three days (seed = the replication): the
first day sets each signal's trading threshold (the `trade_quantile` of its |signal|, as
the simulation stage does on its training part), the other two are replayed with
tasks/research/simulation.py's rules (fills at the touch, the greedy cool-down, mark-out at clock
and event horizons). No flow, no model: the statistics are what is measured.

- Null (`synthetic.signal` 0: nothing predicts the mid): the baseline (top-of-book
  imbalance) and no-edge strategies of several persistences: random sign each event, and
  AR(1) noise at phi 0.99, 0.999, 0.9999 per event (how a smoothed model output behaves:
  long same-side runs of trades). Per strategy and horizon: the rejection rate of the
  nominal-5% two-sided paired test against the baseline, and the ratio of the true spread
  of the estimate over replications to the mean reported SE, for the old statistics
  (iid SE; pairs of 5-minute buckets) and the new (tasks/research/uncertainty.py) side by side.
  "Insufficient data" counts as no rejection; its complement is `tested_fraction`.
- Power (`synthetic.signal` 0.25, 0.5, 1.0: the imbalance foreshadows the next move):
  the rejection rate of the one-sided paired test "imbalance beats AR(0.99) noise".
- Gate (tasks/research/gate.py, the promote flow's test): null pairs, two independent AR(0.999)
  noise strategies as champion and candidate on the same days: the false-promotion rate;
  and imbalance (planted edge) against noise: the promotion rate.

Writes <out>/validity.json and validity.md (machine, date, commit).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import multiprocessing
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.checkout import use_checkout  # noqa: E402
from bench.report import stamp  # noqa: E402

use_checkout()

import pyarrow as pa  # noqa: E402
import pyarrow.compute as pc  # noqa: E402
from scipy.signal import lfilter  # noqa: E402

from quantloop.tasks.data.landing import business_days  # noqa: E402
from quantloop.tasks.data.synthetic import SyntheticConfig, generate_day  # noqa: E402
from quantloop.tasks.research import uncertainty  # noqa: E402
from quantloop.tasks.research.features import FeatureParams, compute_features  # noqa: E402
from quantloop.tasks.research.gate import GateConfig, paired_gate  # noqa: E402
from quantloop.tasks.research.simulation import (  # noqa: E402
    SimConfig,
    baseline_signal,
    markout,
    simulate,
    thresholds_from,
)
from quantloop.tasks.research.uncertainty import Sample  # noqa: E402

CONFIG = SimConfig()
HORIZONS = CONFIG.horizon_keys()
NULL_STRATEGIES = ["random_sign", "ar_0.99", "ar_0.999", "ar_0.9999"]
SIGNALS = (0.25, 0.5, 1.0)
DAYS = business_days(dt.date(2024, 1, 2), 3)  # one to set thresholds, two replayed
GATE = GateConfig()
Z = 1.959963984540054  # the old statistics' two-sided 5% test used the normal


# ---------------------------------------------------------------- the old statistics


def old_se(v: np.ndarray) -> float:
    """Before tasks/research/uncertainty.py: std / sqrt(n) (tasks/research/simulation.py's
    `_stats`)."""
    return float(v.std(ddof=1) / math.sqrt(len(v))) if len(v) > 1 else math.nan


def old_paired(model: pa.Table, baseline: pa.Table, key: str) -> tuple[float, float]:
    """Before: the mean over (day, 5-minute bucket) of the two signals' mean difference in
    buckets where both traded, with the iid SE of those differences."""

    def buckets(table: pa.Table) -> dict[tuple, float]:
        v = table[f"markout_{key}"].to_numpy(zero_copy_only=False).astype(np.float64)
        ok = np.isfinite(v)
        b = np.floor(table["time"].to_numpy(zero_copy_only=False) / 300.0)
        days = table["day"].to_numpy(zero_copy_only=False)
        sums: dict[tuple, list[float]] = {}
        for day, bucket, x in zip(days[ok], b[ok], v[ok], strict=True):
            sums.setdefault((day, bucket), []).append(x)
        return {k: float(np.mean(xs)) for k, xs in sums.items()}

    m, b = buckets(model), buckets(baseline)
    d = np.asarray([m[k] - b[k] for k in m.keys() & b.keys()])
    if len(d) < 2:
        return math.nan, math.nan
    return float(d.mean()), float(d.std(ddof=1) / math.sqrt(len(d)))


# ---------------------------------------------------------------- one replication


def ar_noise(rng: np.random.Generator, n: int, phi: float) -> np.ndarray:
    """AR(1) noise with a stationary start: x_t = phi x_{t-1} + e_t."""
    e = rng.standard_normal(n)
    e[0] /= math.sqrt(1 - phi**2)
    return lfilter([1.0], [1.0, -phi], e)


def strategy_signals(rng: np.random.Generator, features: pa.Table) -> dict[str, np.ndarray]:
    """The baseline, and each no-edge strategy twice, independently ("<name>" and
    "<name>/b"): the second is the first's null partner."""
    n = features.num_rows
    signals = {"baseline": baseline_signal(features)}
    for copy in ("", "/b"):
        signals["random_sign" + copy] = rng.standard_normal(n)
        for phi in (0.99, 0.999, 0.9999):
            signals[f"ar_{phi:g}{copy}"] = ar_noise(rng, n, phi)
    return signals


def replay(seed: int, signal: float, n_days: int = len(DAYS)) -> dict[str, pa.Table]:
    """Mark-out tables by strategy over the replayed days (all but the first)."""
    rng = np.random.default_rng([seed, int(signal * 1000), 7])
    cfg = SyntheticConfig(seed=seed, signal=signal, levels=5)
    dates = business_days(DAYS[0], n_days)
    days = [compute_features(generate_day("SYN", d, cfg), FeatureParams()) for d in dates]
    per_day = [strategy_signals(rng, f) for f in days]
    out = {}
    for name in per_day[0]:
        threshold = thresholds_from(per_day[0][name], CONFIG)
        parts = []
        for date, f, sigs in zip(dates[1:], days[1:], per_day[1:], strict=True):
            marked = markout(simulate(f, sigs[name], threshold, CONFIG), f, CONFIG)
            day = pa.array([date.isoformat()] * marked.num_rows, pa.string())
            parts.append(marked.append_column("day", day))
        out[name] = pa.concat_tables(parts)
    return out


def measure(seed: int, signal: float) -> dict:
    """Per strategy and horizon: old and new estimates of the mean and of the paired
    difference against the baseline; the gate's decisions."""
    tables = replay(seed, signal)
    rec: dict = {"seed": seed, "signal": signal, "mean": {}, "paired": {}, "null_pair": {},
                 "gate": {}}  # fmt: skip
    base = tables["baseline"]
    for name in ["baseline", *NULL_STRATEGIES]:
        t = tables[name]
        for key in HORIZONS:
            col = f"markout_{key}"
            width = uncertainty.window_seconds(key, [t, base])
            v = t[col].to_numpy(zero_copy_only=False).astype(np.float64)
            v = v[np.isfinite(v)]
            new = uncertainty.mean(Sample.of([t], col), width)
            rec["mean"][f"{name}|{key}"] = {
                "est": float(v.mean()) if len(v) else math.nan, "old_se": old_se(v),
                "new_se": new.se, "tested": new.tested, "windows": new.windows, "df": new.df,
            }  # fmt: skip
            if name == "baseline":
                continue
            for against, other in (("baseline", base), ("copy", tables[f"{name}/b"])):
                om, ose = old_paired(t, other, key)
                d = uncertainty.difference(Sample.of([t], col), Sample.of([other], col), width)
                rec["paired" if against == "baseline" else "null_pair"][f"{name}|{key}"] = {
                    "old_est": om, "old_se": ose, "new_est": d.estimate, "new_se": d.se,
                    "tested": d.tested, "p": d.p_value,
                    # H1: the baseline beats this strategy (the power table's test)
                    "p_less": 1.0 - d.p_greater() if d.tested else math.nan,
                    "windows": d.windows, "n_eff": d.n_eff, "df": d.df,
                }  # fmt: skip
    for key in HORIZONS:
        col = f"markout_{key}"
        width = uncertainty.window_seconds(key, [tables["ar_0.999"], tables["ar_0.999/b"]])
        for pair, (cand, champ) in {
            "null": ("ar_0.999", "ar_0.999/b"),
            "planted": ("baseline", "ar_0.999/b"),
        }.items():
            g = paired_gate(Sample.of([tables[cand]], col), Sample.of([tables[champ]], col),
                            width, GateConfig(horizon=key))  # fmt: skip
            rec["gate"][f"{pair}|{key}"] = {"passed": g.passed, "windows": g.windows}
    return rec


def _job(args: tuple[int, float]) -> dict:
    return measure(*args)


# ---------------------------------------------------------------- aggregation


def _ratio(estimates: list[float], ses: list[float]) -> float:
    """The true spread of the estimate over replications against the reported SE, taken
    as the root mean square SE (a calibrated SE has E[se^2] = Var(estimate); the plain
    mean of SEs that vary with each replication's trade count would understate it)."""
    e = np.asarray(estimates, np.float64)
    s = np.asarray(ses, np.float64)
    ok = np.isfinite(e) & np.isfinite(s)
    if ok.sum() < 10:
        return math.nan
    return float(e[ok].std(ddof=1) / math.sqrt(np.mean(s[ok] ** 2)))


def _pair_rows(rows: list[dict]) -> dict:
    from scipy import stats

    old_ok = [r for r in rows if math.isfinite(r["old_se"]) and r["old_se"] > 0]
    tested = [r for r in rows if r["tested"]]
    diffs = np.asarray([r["new_est"] for r in rows], np.float64)
    diffs = diffs[np.isfinite(diffs)]
    centre = float(diffs.mean()) if len(diffs) else math.nan
    return {
        # insufficient data counts as no rejection (old: fewer than two pairs)
        "reject_rate_old": float(np.mean([bool(r in old_ok and abs(r["old_est"] / r["old_se"])
                                               > Z) for r in rows])),
        "reject_rate_new": float(np.mean([r["tested"] and r["p"] < 0.05 for r in rows])),
        # against the Monte Carlo mean instead of 0: the test's size where H0 is not exact
        "reject_rate_centered_new": float(np.mean([
            r["tested"] and abs(r["new_est"] - centre) / r["new_se"]
            > stats.t.ppf(0.975, r["df"]) for r in rows])),
        "se_ratio_old": _ratio([r["old_est"] for r in old_ok], [r["old_se"] for r in old_ok]),
        "se_ratio_new": _ratio([r["new_est"] for r in tested], [r["new_se"] for r in tested]),
        "tested_fraction": len(tested) / len(rows),
        "mean_windows": float(np.nanmean([r["windows"] for r in rows])),
        "mc_mean_diff_bps": centre,
        "mc_se_diff_bps": float(diffs.std(ddof=1) / math.sqrt(len(diffs)))
        if len(diffs) > 1 else math.nan,
    }  # fmt: skip


def aggregate_null(recs: list[dict]) -> dict:
    """Per strategy and horizon. null_pair: against an independent no-edge strategy of the
    same persistence (H0 true by construction); paired: against the baseline (as traded;
    the Monte Carlo mean says whether H0 holds there); mean: one signal's mean."""
    out: dict = {"null_pair": {}, "paired": {}, "mean": {}}
    for group in ("null_pair", "paired"):
        for name in NULL_STRATEGIES:
            for key in HORIZONS:
                rows = [r[group][f"{name}|{key}"] for r in recs]
                out[group][f"{name}|{key}"] = {"strategy": name, "horizon": key,
                                               **_pair_rows(rows)}  # fmt: skip
    for name in ["baseline", *NULL_STRATEGIES]:
        for key in HORIZONS:
            rows = [r["mean"][f"{name}|{key}"] for r in recs]
            ok = [r for r in rows if math.isfinite(r["old_se"])]
            tested = [r for r in rows if r["tested"]]
            out["mean"][f"{name}|{key}"] = {
                "strategy": name, "horizon": key,
                "se_ratio_old": _ratio([r["est"] for r in ok], [r["old_se"] for r in ok]),
                "se_ratio_new": _ratio([r["est"] for r in tested],
                                       [r["new_se"] for r in tested]),
                "tested_fraction": len(tested) / len(rows),
            }  # fmt: skip
    return out


def aggregate_power(recs: list[dict]) -> dict:
    """Per horizon: how often the one-sided 5% paired test finds that the imbalance beats
    AR(0.99) noise (untested counts as not found)."""
    return {
        h: float(np.mean([r["paired"][f"ar_0.99|{h}"]["tested"]
                          and r["paired"][f"ar_0.99|{h}"]["p_less"] < 0.05 for r in recs]))
        for h in HORIZONS
    }  # fmt: skip


DAY_STRATEGIES = ("random_sign", "ar_0.99")


def measure_days(seed: int, n_days: int) -> dict:
    """One market replayed on n_days - 1 days: the paired test against the baseline over
    all of them (day clusters in the SE from uncertainty.MIN_DAYS days) and over the first
    two only (the default research run's test days)."""
    tables = replay(20_000 + seed, 0.0, n_days)
    rec = {}
    for name in DAY_STRATEGIES:
        for key in HORIZONS:
            col = f"markout_{key}"
            for span, keep in (("all", None), ("two", 2)):
                pick = [tables[name], tables["baseline"]]
                if keep is not None:
                    first = sorted(set(tables["baseline"]["day"].to_pylist()))[:keep]
                    pick = [t.filter(pc.is_in(t["day"], pa.array(first))) for t in pick]
                width = uncertainty.window_seconds(key, pick)
                d = uncertainty.difference(Sample.of([pick[0]], col), Sample.of([pick[1]], col),
                                           width)  # fmt: skip
                rec[f"{name}|{key}|{span}"] = {
                    "old_est": math.nan, "old_se": math.nan, "new_est": d.estimate,
                    "new_se": d.se, "tested": d.tested, "p": d.p_value, "df": d.df,
                    "windows": d.windows,
                }  # fmt: skip
    return rec


def _days_job(args: tuple[int, int]) -> dict:
    return measure_days(*args)


def gate_rate(recs: list[dict], pair: str) -> dict[str, float]:
    return {h: float(np.mean([r["gate"][f"{pair}|{h}"]["passed"] for r in recs]))
            for h in HORIZONS}  # fmt: skip


# ---------------------------------------------------------------- report


def _pair_table(rows: dict, title: str, note: str) -> list[str]:
    lines = ["", f"## {title}", "", note, "",
             "| strategy | horizon | reject old | reject new | reject new, centred | SE ratio old "
             "| SE ratio new | tested | windows | MC mean diff (bps) |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for r in rows.values():
        lines.append(
            f"| {r['strategy']} | {r['horizon']} | {r['reject_rate_old']:.1%} | "
            f"{r['reject_rate_new']:.1%} | {r['reject_rate_centered_new']:.1%} | "
            f"{r['se_ratio_old']:.2f} | {r['se_ratio_new']:.2f} | {r['tested_fraction']:.0%} | "
            f"{r['mean_windows']:.0f} | {r['mc_mean_diff_bps']:+.3f} ± {r['mc_se_diff_bps']:.3f} |"
        )
    return lines


def markdown(result: dict) -> str:
    lines = [
        "# Mark-out statistics: calibration (bench/validity.py)",
        "",
        f"Machine: {result['machine']}; {result['date']}; commit {result['commit']}; "
        f"{result['replications']} null replications, {result['power_replications']} per "
        f"signal strength, {result['days_replications']} of {result['days']} days; "
        f"{result['seconds']:.0f} s.",
        "",
        "Reject: the two-sided paired test at a nominal 5% (old: iid SE of 5-minute bucket "
        "pairs, normal; new: tasks/research/uncertainty.py, t with the effective windows); "
        "insufficient data counts as no rejection. SE ratio: the spread of the estimate over "
        "replications / the root mean square reported SE (1 = calibrated). Centred: the same "
        "test of H0: "
        "the difference equals its Monte Carlo mean, for where H0: 0 is not exactly true.",
    ]
    lines += _pair_table(result["null"]["null_pair"],
                         "Null pairs: each strategy against an independent copy of itself",
                         "`synthetic.signal` 0 and two independent no-edge signals of the same "
                         "persistence on the same days: H0 holds by construction.")  # fmt: skip
    lines += _pair_table(result["null"]["paired"],
                         "Against the baseline (top-of-book imbalance)",
                         "`synthetic.signal` 0: nothing predicts the mid, but the imbalance's "
                         "extremes come with wider spreads, so it pays more spread than a "
                         "random pick: the MC mean says where H0: 0 is false (short horizons), "
                         "and the centred column gives the test's size there.")  # fmt: skip
    lines += ["", "## One signal's mean mark-out: SE ratio, old → new", "",
              "| strategy | " + " | ".join(HORIZONS) + " |",
              "|---|" + "---:|" * len(HORIZONS)]  # fmt: skip
    for name in ["baseline", *NULL_STRATEGIES]:
        cells = []
        for h in HORIZONS:
            r = result["null"]["mean"][f"{name}|{h}"]
            cells.append(f"{r['se_ratio_old']:.2f} → {r['se_ratio_new']:.2f}")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += ["", f"## Day-to-day variation: {result['days'] - 1} replayed days against two",
              "", "The paired test against the baseline on one market's days: over all of "
              f"them (the SE takes day clusters from {uncertainty.MIN_DAYS} days) and over "
              "the first two (no day clusters).", "",
              "| strategy | horizon | SE ratio, all days | centred reject, all days "
              "| SE ratio, two days | centred reject, two days |",
              "|---|---|---:|---:|---:|---:|"]  # fmt: skip
    for r in result["days_check"].values():
        lines.append(f"| {r['strategy']} | {r['horizon']} | {r['all']['se_ratio_new']:.2f} | "
                     f"{r['all']['reject_rate_centered_new']:.1%} | "
                     f"{r['two']['se_ratio_new']:.2f} | "
                     f"{r['two']['reject_rate_centered_new']:.1%} |")  # fmt: skip
    lines += [
        "",
        "## Power: one-sided paired test, imbalance beats AR(0.99) noise, 5%",
        "",
        "| signal | " + " | ".join(HORIZONS) + " |",
        "|---|" + "---:|" * len(HORIZONS),
    ]
    for s, row in result["power"].items():
        lines.append(f"| {s} | " + " | ".join(f"{row[h]:.0%}" for h in HORIZONS) + " |")
    lines += ["", f"## Gate (tasks/research/gate.py: one-sided, alpha {GATE.alpha}, "
              f"min improvement {GATE.min_improvement_bps} bps, at each horizon)", "",
              "| pairs | " + " | ".join(HORIZONS) + " |", "|---|" + "---:|" * len(HORIZONS),
              f"| null pairs (AR 0.999 vs AR 0.999), {result['replications']}: false promotion | "
              + " | ".join(f"{result['false_promotion_rate'][h]:.1%}" for h in HORIZONS)
              + " |"]  # fmt: skip
    for s, row in result["gate_planted"].items():
        lines.append(
            f"| imbalance at signal {s} vs AR 0.999: promotion | "
            + " | ".join(f"{row[h]:.0%}" for h in HORIZONS)
            + " |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replications", type=int, default=500)
    parser.add_argument("--power-replications", type=int, default=200)
    parser.add_argument("--days-replications", type=int, default=150)
    parser.add_argument("--days", type=int, default=13, help="days of the day-to-day check")
    parser.add_argument("--processes", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    t0 = time.perf_counter()
    jobs = [(s, 0.0) for s in range(args.replications)] + [
        (10_000 + s, signal) for signal in SIGNALS for s in range(args.power_replications)
    ]
    with multiprocessing.get_context("spawn").Pool(args.processes) as pool:
        recs = pool.map(_job, jobs, chunksize=4)
        by_days = pool.map(_days_job, [(s, args.days) for s in range(args.days_replications)])
    null = [r for r in recs if r["signal"] == 0.0]
    days_check = {
        f"{name}|{h}": {"strategy": name, "horizon": h, **{
            span: _pair_rows([r[f"{name}|{h}|{span}"] for r in by_days])
            for span in ("all", "two")}}
        for name in DAY_STRATEGIES for h in HORIZONS
    } if by_days else {}  # fmt: skip
    stamped = stamp()  # machine, date, commit (bench/report.py)
    result = {
        "machine": stamped["machine"],
        "date": stamped["date"],
        "commit": stamped["commit"],
        "replications": len(null),
        "power_replications": args.power_replications,
        "days_replications": args.days_replications,
        "days": args.days,
        "days_check": days_check,
        "method": uncertainty.__doc__.split("\n\n")[2].replace("\n", " "),
        "settings": {"min_windows": uncertainty.MIN_WINDOWS, "min_days": uncertainty.MIN_DAYS,
                     "min_bandwidth": uncertainty.MIN_BANDWIDTH,
                     "min_window_s": uncertainty.MIN_WINDOW_S, "sim": str(CONFIG)},
        "null": aggregate_null(null),
        "power": {str(s): aggregate_power([r for r in recs if r["signal"] == s])
                  for s in (0.0, *SIGNALS)},
        "false_promotion_rate": gate_rate(null, "null"),
        "gate_planted": {str(s): gate_rate([r for r in recs if r["signal"] == s], "planted")
                         for s in SIGNALS},
    }  # fmt: skip
    result["seconds"] = time.perf_counter() - t0
    text = markdown(result)
    print(text)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "validity.json").write_text(json.dumps(result, indent=1, default=str))
        (args.out / "validity.md").write_text(text)


if __name__ == "__main__":
    main()
