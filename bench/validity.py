"""Calibration of the mark-out statistics: null rejection rates, SE ratios, power, the gate.

    .venv/bin/python bench/validity.py --out bench/results            # 500 null replications
    .venv/bin/python bench/validity.py --replications 100 --power-replications 40  # quicker

Each replication is one synthetic product on three days (seed = the replication): the
first day sets each signal's trading threshold (the `trade_quantile` of its |signal|, as
the simulation stage does on its training part), the other two are replayed with
tasks/simulation.py's rules (fills at the touch, the greedy cool-down, mark-out at clock
and event horizons). No flow, no model: the statistics are what is measured.

- Null (`synthetic.signal` 0: nothing predicts the mid): the baseline (top-of-book
  imbalance) and no-edge strategies of several persistences: random sign each event, and
  AR(1) noise at phi 0.99, 0.999, 0.9999 per event (how a smoothed model output behaves:
  long same-side runs of trades). Per strategy and horizon: the rejection rate of the
  nominal-5% two-sided paired test against the baseline, and the ratio of the true spread
  of the estimate over replications to the mean reported SE, for the old statistics
  (iid SE; pairs of 5-minute buckets) and the new (tasks/uncertainty.py) side by side.
  "Insufficient data" counts as no rejection; its complement is `tested_fraction`.
- Power (`synthetic.signal` 0.25, 0.5, 1.0: the imbalance foreshadows the next move):
  the rejection rate of the one-sided paired test "imbalance beats AR(0.99) noise".
- Gate (tasks/gate.py, the promote flow's test): null pairs, two independent AR(0.999)
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
import platform
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.checkout import use_checkout  # noqa: E402

use_checkout()

import pyarrow as pa  # noqa: E402
from scipy.signal import lfilter  # noqa: E402

from quantloop.tasks import uncertainty  # noqa: E402
from quantloop.tasks.features import FeatureParams, compute_features  # noqa: E402
from quantloop.tasks.gate import GateConfig, paired_gate  # noqa: E402
from quantloop.tasks.landing import business_days  # noqa: E402
from quantloop.tasks.provenance import git_commit  # noqa: E402
from quantloop.tasks.simulation import (  # noqa: E402
    SimConfig,
    baseline_signal,
    markout,
    simulate,
    thresholds_from,
)
from quantloop.tasks.synthetic import SyntheticConfig, generate_day  # noqa: E402
from quantloop.tasks.uncertainty import Sample  # noqa: E402

CONFIG = SimConfig()
HORIZONS = CONFIG.horizon_keys()
NULL_STRATEGIES = ["random_sign", "ar_0.99", "ar_0.999", "ar_0.9999"]
SIGNALS = (0.25, 0.5, 1.0)
DAYS = business_days(dt.date(2024, 1, 2), 3)  # one to set thresholds, two replayed
GATE = GateConfig()
Z = 1.959963984540054  # the old statistics' two-sided 5% test used the normal


# ---------------------------------------------------------------- the old statistics


def old_se(v: np.ndarray) -> float:
    """Before tasks/uncertainty.py: std / sqrt(n) (tasks/simulation.py's `_stats`)."""
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
    n = features.num_rows
    signals = {"baseline": baseline_signal(features), "random_sign": rng.standard_normal(n)}
    for phi in (0.99, 0.999, 0.9999):
        signals[f"ar_{phi:g}"] = ar_noise(rng, n, phi)
    signals["champion_noise"] = ar_noise(rng, n, 0.999)  # the gate's null pair
    return signals


def replay(seed: int, signal: float) -> dict[str, pa.Table]:
    """Mark-out tables by strategy over the two replayed days."""
    rng = np.random.default_rng([seed, int(signal * 1000), 7])
    cfg = SyntheticConfig(seed=seed, signal=signal, levels=5)
    days = [compute_features(generate_day("SYN", d, cfg), FeatureParams()) for d in DAYS]
    per_day = [strategy_signals(rng, f) for f in days]
    out = {}
    for name in per_day[0]:
        threshold = thresholds_from(per_day[0][name], CONFIG)
        parts = []
        for date, f, sigs in zip(DAYS[1:], days[1:], per_day[1:], strict=True):
            marked = markout(simulate(f, sigs[name], threshold, CONFIG), f, CONFIG)
            day = pa.array([date.isoformat()] * marked.num_rows, pa.string())
            parts.append(marked.append_column("day", day))
        out[name] = pa.concat_tables(parts)
    return out


def measure(seed: int, signal: float) -> dict:
    """Per strategy and horizon: old and new estimates of the mean and of the paired
    difference against the baseline; the gate's decisions."""
    tables = replay(seed, signal)
    rec: dict = {"seed": seed, "signal": signal, "mean": {}, "paired": {}, "gate": {}}
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
                "new_se": new.se, "tested": new.tested, "windows": new.windows,
            }  # fmt: skip
            if name == "baseline":
                continue
            om, ose = old_paired(t, base, key)
            d = uncertainty.difference(Sample.of([t], col), Sample.of([base], col), width)
            rec["paired"][f"{name}|{key}"] = {
                "old_est": om, "old_se": ose, "new_est": d.estimate, "new_se": d.se,
                "tested": d.tested, "p": d.p_value, "p_greater": d.p_greater(),
                "windows": d.windows, "n_eff": d.n_eff,
            }  # fmt: skip
    for key in HORIZONS:
        col = f"markout_{key}"
        width = uncertainty.window_seconds(key, [tables["ar_0.999"], tables["champion_noise"]])
        for pair, (cand, champ) in {
            "null": ("ar_0.999", "champion_noise"),
            "planted": ("baseline", "champion_noise"),
        }.items():
            g = paired_gate(Sample.of([tables[cand]], col), Sample.of([tables[champ]], col),
                            width, GateConfig(horizon=key))  # fmt: skip
            rec["gate"][f"{pair}|{key}"] = {"passed": g.passed, "windows": g.windows}
    return rec


def _job(args: tuple[int, float]) -> dict:
    return measure(*args)


# ---------------------------------------------------------------- aggregation


def _ratio(estimates: list[float], ses: list[float]) -> float:
    e = np.asarray(estimates, np.float64)
    s = np.asarray(ses, np.float64)
    ok = np.isfinite(e) & np.isfinite(s)
    if ok.sum() < 10:
        return math.nan
    return float(e[ok].std(ddof=1) / s[ok].mean())


def aggregate_null(recs: list[dict]) -> dict:
    out: dict = {"paired": {}, "mean": {}}
    for name in NULL_STRATEGIES:
        for key in HORIZONS:
            rows = [r["paired"][f"{name}|{key}"] for r in recs]
            old_ok = [r for r in rows if math.isfinite(r["old_se"]) and r["old_se"] > 0]
            new_est = [r["new_est"] for r in rows if r["tested"]]
            new_se = [r["new_se"] for r in rows if r["tested"]]
            diffs = np.asarray([r["new_est"] for r in rows], np.float64)
            diffs = diffs[np.isfinite(diffs)]
            out["paired"][f"{name}|{key}"] = {
                "strategy": name, "horizon": key,
                "reject_rate_old": float(np.mean([abs(r["old_est"] / r["old_se"]) > Z
                                                  for r in old_ok])) if old_ok else math.nan,
                "reject_rate_new": float(np.mean([r["tested"] and r["p"] < 0.05
                                                  for r in rows])),
                "se_ratio_old": _ratio([r["old_est"] for r in old_ok],
                                       [r["old_se"] for r in old_ok]),
                "se_ratio_new": _ratio(new_est, new_se),
                "tested_fraction": float(np.mean([r["tested"] for r in rows])),
                "mean_windows": float(np.nanmean([r["windows"] for r in rows])),
                # is the null exactly true? the Monte Carlo mean of the difference
                "mc_mean_diff_bps": float(diffs.mean()) if len(diffs) else math.nan,
                "mc_se_diff_bps": float(diffs.std(ddof=1) / math.sqrt(len(diffs)))
                if len(diffs) > 1 else math.nan,
            }  # fmt: skip
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
    return {
        key: float(np.mean([r["paired"][f"{key}"]["tested"]
                            and r["paired"][f"{key}"]["p_greater"] < 0.05 for r in recs]))
        for key in [f"ar_0.99|{h}" for h in HORIZONS]
    }  # fmt: skip


def gate_rate(recs: list[dict], pair: str) -> dict[str, float]:
    return {h: float(np.mean([r["gate"][f"{pair}|{h}"]["passed"] for r in recs]))
            for h in HORIZONS}  # fmt: skip


# ---------------------------------------------------------------- report


def machine() -> str:
    return f"{platform.node()} {platform.machine()}, {os.cpu_count()} CPUs, " + (
        f"Python {platform.python_version()}"
    )


def markdown(result: dict) -> str:
    lines = [
        "# Mark-out statistics: calibration (bench/validity.py)",
        "",
        f"Machine: {result['machine']}; {result['date']}; commit {result['commit']}; "
        f"{result['replications']} null replications, {result['power_replications']} per "
        f"signal strength; {result['seconds']:.0f} s.",
        "",
        "## Null: paired test against the baseline, nominal 5% (`synthetic.signal` 0)",
        "",
        "| strategy | horizon | reject old | reject new | SE ratio old | SE ratio new "
        "| tested | windows | MC mean diff (bps) |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in result["null"]["paired"].values():
        lines.append(
            f"| {r['strategy']} | {r['horizon']} | {r['reject_rate_old']:.1%} | "
            f"{r['reject_rate_new']:.1%} | {r['se_ratio_old']:.2f} | {r['se_ratio_new']:.2f} | "
            f"{r['tested_fraction']:.0%} | {r['mean_windows']:.0f} | "
            f"{r['mc_mean_diff_bps']:+.3f} ± {r['mc_se_diff_bps']:.3f} |"
        )
    lines += ["", "## Null: SE ratio of one signal's mean mark-out (true spread / mean SE)", "",
              "| strategy | " + " | ".join(HORIZONS) + " |",
              "|---|" + "---:|" * len(HORIZONS)]  # fmt: skip
    for name in ["baseline", *NULL_STRATEGIES]:
        cells = []
        for h in HORIZONS:
            r = result["null"]["mean"][f"{name}|{h}"]
            cells.append(f"{r['se_ratio_old']:.2f} → {r['se_ratio_new']:.2f}")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += ["", "## Power: one-sided paired test, imbalance beats AR(0.99) noise, 5%", "",
              "| signal | " + " | ".join(HORIZONS) + " |", "|---|" + "---:|" * len(HORIZONS)]
    for s, row in result["power"].items():
        lines.append(f"| {s} | " + " | ".join(f"{row[f'ar_0.99|{h}']:.0%}" for h in HORIZONS)
                     + " |")  # fmt: skip
    lines += ["", f"## Gate (one-sided, alpha {GATE.alpha}, min improvement "
              f"{GATE.min_improvement_bps} bps)", "",
              "| pairs | " + " | ".join(HORIZONS) + " |", "|---|" + "---:|" * len(HORIZONS),
              "| null: false promotion | " + " | ".join(
                  f"{result['false_promotion_rate'][h]:.1%}" for h in HORIZONS) + " |"]
    for s, row in result["gate_planted"].items():
        lines.append(f"| planted edge {s}: promotion | "
                     + " | ".join(f"{row[h]:.0%}" for h in HORIZONS) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replications", type=int, default=500)
    parser.add_argument("--power-replications", type=int, default=200)
    parser.add_argument("--processes", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    t0 = time.perf_counter()
    jobs = [(s, 0.0) for s in range(args.replications)] + [
        (10_000 + s, signal) for signal in SIGNALS for s in range(args.power_replications)
    ]
    with multiprocessing.get_context("spawn").Pool(args.processes) as pool:
        recs = pool.map(_job, jobs, chunksize=4)
    null = [r for r in recs if r["signal"] == 0.0]
    result = {
        "machine": machine(),
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "commit": git_commit(short=True),
        "replications": len(null),
        "power_replications": args.power_replications,
        "method": uncertainty.__doc__.split("\n\n")[2].replace("\n", " "),
        "settings": {"min_windows": uncertainty.MIN_WINDOWS,
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
