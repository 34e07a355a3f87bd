"""The paired difference at an equal trade count, on noise: is its SE calibrated?

    .venv/bin/python bench/equal_count.py                    # 400 replications
    .venv/bin/python bench/equal_count.py --replications 60  # quicker

A research run reports the model's paired difference from the baseline twice: as traded,
and with both signals cut to the same out-of-sample trade count, the more active one
keeping its largest-|signal| trades (tasks/research/simulation.py `equal_counts`; README's
note under the mark-out table). Which trades are kept depends on the other signal's count
on the test days, so the second figure's SE could be off in ways the first's is not; this
measures it rather than assuming.

Each replication is one synthetic product with no edge (`synthetic.signal` 0), three days:
the first sets each strategy's trading threshold, the other two are replayed with the
simulation's rules (bench/validity.py's set-up). Two pairs of no-edge strategies, each
strategy AR(1) noise independent of the market, so H0 (no difference in mean mark-out)
holds for both by construction:
- `same`: AR(0.999) against an independent AR(0.999) (trade counts differ by chance);
- `mixed`: AR(0.99) against AR(0.9999), whose counts drift apart out of sample (a very
  persistent signal's first-day quantile says little of its next days), as a model's and
  the baseline's do.
Per pair, horizon and way (as traded, equal count), over the replications: the rejection
rate of the nominal-5% two-sided test (± its binomial SE), the SE ratio (the estimate's
spread over replications / the root mean square reported SE; 1 = calibrated), the share
tested, and '*' at any horizon (Holm over the horizons, as the summary marks it).

Writes bench/results/equal-count.json and .md (machine, date, commit).
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

from bench.selection import ALPHA, DAYS, HORIZONS, rate, replay  # noqa: E402
from bench.validity import ar_noise  # noqa: E402
from quantloop.tasks.data.synthetic import SyntheticConfig, generate_day  # noqa: E402
from quantloop.tasks.research.features import FeatureParams, compute_features  # noqa: E402
from quantloop.tasks.research.simulation import equal_counts, paired_difference  # noqa: E402

PAIRS = {"same": (0.999, 0.999), "mixed": (0.99, 0.9999)}
WAYS = ("as traded", "equal count")


def measure(seed: int) -> dict:
    """Per pair and way: the paired difference's figures at each horizon and the counts."""
    rng = np.random.default_rng([seed, 29])
    cfg = SyntheticConfig(seed=seed, signal=0.0, levels=5)
    tables = [compute_features(generate_day("SYN", d, cfg), FeatureParams()) for d in DAYS]
    out: dict = {}
    for pair, (phi_a, phi_b) in PAIRS.items():
        a = replay(tables, [ar_noise(rng, t.num_rows, phi_a) for t in tables])
        b = replay(tables, [ar_noise(rng, t.num_rows, phi_b) for t in tables])
        counts = (a["SYN"].num_rows, b["SYN"].num_rows)
        for way, (x, y) in zip(WAYS, ((a, b), equal_counts(a, b)), strict=True):
            paired = paired_difference(x, y, HORIZONS, alpha=ALPHA)
            out[f"{pair}|{way}"] = {
                "counts": counts,
                "kept": (x["SYN"].num_rows, y["SYN"].num_rows) if x and y else (0, 0),
                "any_star": any(v["significant"] for v in paired.values()),
                **{h: {"est": v["mean_bps"], "se": v["se_bps"], "p": v["p_value"]}
                   for h, v in paired.items()},
            }  # fmt: skip
    return out


def se_ratio(rows: list[dict]) -> float:
    """The estimate's spread over the tested replications / their root mean square SE."""
    ok = [r for r in rows if r["se"] is not None and r["se"] > 0 and math.isfinite(r["est"])]
    if len(ok) < 10:
        return math.nan
    e = np.asarray([r["est"] for r in ok])
    s = np.asarray([r["se"] for r in ok])
    return float(e.std(ddof=1) / math.sqrt(np.mean(s**2)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--replications", type=int, default=400)
    ap.add_argument("--processes", type=int, default=os.cpu_count() or 1)
    args = ap.parse_args()
    t0 = time.perf_counter()
    with multiprocessing.get_context("spawn").Pool(args.processes) as pool:
        recs = pool.map(measure, range(args.replications), chunksize=2)
    cases, table, stars = [], [], []
    for pair in PAIRS:
        for way in WAYS:
            runs = [r[f"{pair}|{way}"] for r in recs]
            star, star_se = rate([r["any_star"] for r in runs])
            gap = np.median([abs(math.log(max(c[0], 1) / max(c[1], 1))) for c in
                             (r["counts"] for r in runs)])  # fmt: skip
            stars.append((pair, way, f"{star:.1%} ± {star_se:.1%}", f"{math.exp(gap):.2f}x"))
            for h in HORIZONS:
                rows = [r[h] for r in runs]
                tested = [x["se"] is not None and x["se"] > 0 for x in rows]
                flags = [t and x["p"] < ALPHA for t, x in zip(tested, rows, strict=True)]
                rej, rej_se = rate(flags)
                case = {"pair": pair, "way": way, "horizon": h, "reject": rej,
                        "reject_se": rej_se, "se_ratio": se_ratio(rows),
                        "tested": float(np.mean(tested)),
                        "mean_diff_bps": float(np.nanmean([x["est"] for x in rows]))}  # fmt: skip
                cases.append(case)
                table.append((pair, way, h, f"{rej:.1%} ± {rej_se:.1%}",
                              f"{case['se_ratio']:.2f}", f"{case['tested']:.0%}",
                              f"{case['mean_diff_bps']:+.3f}"))  # fmt: skip
    s = stamp()
    result = {**s, "replications": args.replications, "alpha": ALPHA, "pairs": PAIRS,
              "cases": cases, "any_star": stars,
              "seconds": time.perf_counter() - t0}  # fmt: skip
    md = (
        "# The paired difference at an equal trade count, on noise (bench/equal_count.py)\n\n"
        f"{stamp_line(s)} {args.replications} replications, {result['seconds']:.0f} s.\n\n"
        "Two no-edge strategies on the same two held-out days (AR(1) noise independent of "
        "the market, so H0 holds): `same` AR(0.999) against an independent AR(0.999), "
        "`mixed` AR(0.99) against AR(0.9999). Each compared as traded and at an equal "
        "count (the more active one keeping its largest-|signal| trades, as the research "
        "run's `paired_equal_count_bps`). Rejection: the nominal-5% two-sided test "
        "(± binomial SE); SE ratio: the estimate's spread over replications / the RMS "
        "reported SE (1 = calibrated); tested: the share with an SE; mean diff: over "
        "replications.\n\n"
        + markdown_table(
            ["pair", "way", "horizon", "rejection", "SE ratio", "tested", "mean diff bps"],
            table,
            [False, False, False, True, True, True, True],
        )
        + "\n\n'*' at any horizon (Holm over the horizons, as the summary marks it; nominal "
        "5%), and the median ratio of the two strategies' trade counts as traded:\n\n"
        + markdown_table(
            ["pair", "way", "'*' at any horizon", "count ratio"], stars, [False, False, True, True]
        )
        + "\n"
    )
    write("equal-count", result, md)
    print(md)


if __name__ == "__main__":
    main()
