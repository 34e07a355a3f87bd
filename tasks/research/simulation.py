"""Replay a signal over a feature table, trade at the touch after a latency, and mark the
trades out net of a fee.

All vectorized: trades come from an exact greedy cool-down computed by pointer doubling
(O(n log n), no loop per event or per trade), fills and mark-outs from np.searchsorted on
time. The decision is taken at the trigger event; the order meets the book `latency_s`
seconds and at least `latency_events` events later (`fill_at`), at the touch there.
A mark-out is D * (M - P) / P * 1e4 bps: D = +1 buy at the ask / -1 sell at the bid,
P = the fill price, M = the mid a clock or event horizon after the fill; NaN past the
day's end. Net of the fee it is that minus `fee_bps` (one fee per trade: the mark-out
marks to the mid, there is no exit fill). `daily_pnl` sums one horizon's net mark-outs
per day.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from quantloop.tasks.data.schema import Partition
from quantloop.tasks.research import uncertainty
from quantloop.tasks.research.folds import Fold, WalkForward, folds, split_fold

_LABEL_RE = re.compile(r"^label_(\d+)$")


# ---------------------------------------------------------------- train / test split


def split_train_test(
    tables: Mapping[Partition, pa.Table], holdout_fraction: float = 0.3
) -> tuple[dict[Partition, pa.Table], dict[Partition, pa.Table]]:
    """Hold out the last dates, or, with one date, the end of each day.

    Several dates: the last ceil(holdout_fraction * n_dates) dates (at least one, and at
    least one left for training) are test for every product. One date: each day is cut by
    row at floor((1 - holdout_fraction) * rows); in the training part, label_h at rows whose
    horizon reaches the cut (row + h >= cut) is set to NaN so no test mid leaks into training.
    Both dicts keep the original Partition keys.
    """
    if not 0.0 < holdout_fraction < 1.0:
        raise ValueError(f"holdout_fraction must be in (0, 1), got {holdout_fraction}")
    dates = sorted({p.date for p in tables})
    if len(dates) > 1:
        n_test = min(max(1, math.ceil(holdout_fraction * len(dates))), len(dates) - 1)
        test_dates = set(dates[-n_test:])
        train = {p: t for p, t in tables.items() if p.date not in test_dates}
        test = {p: t for p, t in tables.items() if p.date in test_dates}
        return train, test
    train, test = {}, {}
    for p, table in tables.items():
        cut = int(math.floor((1.0 - holdout_fraction) * table.num_rows))
        head = table.slice(0, cut)
        rows = np.arange(cut)
        for i, name in enumerate(head.column_names):
            match = _LABEL_RE.match(name)
            if match is None:
                continue
            values = head.column(i).to_numpy(zero_copy_only=False).astype(np.float64)
            values[rows + int(match.group(1)) >= cut] = np.nan
            head = head.set_column(i, head.field(i), pa.array(values, head.field(i).type))
        train[p], test[p] = head, table.slice(cut)
    return train, test


# ---------------------------------------------------------------- signal -> trades


# A fee beyond these is a typo (bps for a fraction, or a percent): exchange taker fees are
# well under 10 bps and maker rebates a few tenths of one.
FEE_BPS_MIN, FEE_BPS_MAX = -10.0, 100.0


@dataclass(kw_only=True, slots=True, frozen=True)
class SimConfig:
    signal_horizon: int = 0  # which model output (label index) is the trading signal
    trade_quantile: float = 0.95  # trade when |signal| exceeds this quantile of training |signal|
    markout_horizons_s: tuple[float, ...] = (1, 5, 30, 60, 300)
    markout_horizons_events: tuple[int, ...] = (10, 100)
    min_gap_events: int = 10  # a new trade needs at least this many events since the last one
    latency_s: float = 0.0  # decision-to-fill delay in seconds (>= 0); see fill_at
    latency_events: int = 0  # decision-to-fill delay in order-book events (>= 0); see fill_at
    fee_bps: float = 0.0  # fee per fill, bps of the fill price; negative = a rebate
    pnl_horizon: str = ""  # horizon key whose net mark-out is the daily P&L; "" = last clock one

    def __post_init__(self) -> None:
        if not isinstance(self.signal_horizon, int) or self.signal_horizon < 0:
            raise ValueError(f"signal_horizon must be an integer >= 0, got {self.signal_horizon}")
        if not 0.0 <= self.trade_quantile < 1.0:
            raise ValueError(f"trade_quantile must be in [0, 1), got {self.trade_quantile}")
        # finite too: an infinite horizon reads no mid and made a column of NaN ("infs")
        if any(not 0 < h < math.inf for h in self.markout_horizons_s):
            raise ValueError(
                f"markout_horizons_s must be finite and > 0, got {self.markout_horizons_s}"
            )
        if any(int(h) != h or h < 1 for h in self.markout_horizons_events):
            raise ValueError(
                f"markout_horizons_events must be integers >= 1, got {self.markout_horizons_events}"
            )
        if not isinstance(self.min_gap_events, int) or self.min_gap_events < 1:
            raise ValueError(f"min_gap_events must be an integer >= 1, got {self.min_gap_events}")
        if not (isinstance(self.latency_s, int | float) and 0.0 <= self.latency_s < math.inf):
            raise ValueError(f"latency_s must be a finite number >= 0, got {self.latency_s!r}")
        if (
            not isinstance(self.latency_events, int)
            or isinstance(self.latency_events, bool)
            or self.latency_events < 0
        ):
            raise ValueError(f"latency_events must be an integer >= 0, got {self.latency_events!r}")
        if not (
            isinstance(self.fee_bps, int | float) and FEE_BPS_MIN <= self.fee_bps <= FEE_BPS_MAX
        ):
            raise ValueError(
                f"fee_bps must be in [{FEE_BPS_MIN:g}, {FEE_BPS_MAX:g}] bps, got {self.fee_bps!r}"
            )
        object.__setattr__(
            self, "markout_horizons_s", tuple(float(h) for h in self.markout_horizons_s)
        )
        object.__setattr__(
            self, "markout_horizons_events", tuple(int(h) for h in self.markout_horizons_events)
        )
        object.__setattr__(self, "latency_s", float(self.latency_s))
        object.__setattr__(self, "fee_bps", float(self.fee_bps))
        keys = self.horizon_keys()  # after the conversions: keys are spelled from floats
        if self.pnl_horizon and self.pnl_horizon not in keys:
            raise ValueError(f"pnl_horizon must be one of {keys} or '', got {self.pnl_horizon!r}")
        if not self.pnl_horizon and not self.markout_horizons_s:
            raise ValueError(
                f"pnl_horizon '' means the last clock horizon, and markout_horizons_s is "
                f"empty; name one of {keys}"
            )

    def horizon_keys(self) -> list[str]:
        """'1s', '5s', ..., '10ev', '100ev': the summary's horizon keys, in column order."""
        return [f"{h:g}s" for h in self.markout_horizons_s] + [
            f"{h}ev" for h in self.markout_horizons_events
        ]

    def pnl_key(self) -> str:
        """The horizon key of the daily P&L: `pnl_horizon`, or the last clock horizon's."""
        return self.pnl_horizon or f"{self.markout_horizons_s[-1]:g}s"


def signal_column(signal: np.ndarray, cfg: SimConfig) -> np.ndarray:
    """[rows] float64: a 1-d signal as is, or column `signal_horizon` of [rows, outputs]."""
    signal = np.asarray(signal, np.float64)
    if signal.ndim == 2:
        if cfg.signal_horizon >= signal.shape[1]:
            raise ValueError(
                f"signal_horizon {cfg.signal_horizon} out of range for {signal.shape[1]} outputs"
            )
        return signal[:, cfg.signal_horizon]
    if signal.ndim != 1:
        raise ValueError(f"signal must be [rows] or [rows, outputs], got shape {signal.shape}")
    return signal


def thresholds_from(signal_train: np.ndarray, cfg: SimConfig) -> float:
    """|signal| quantile on the training period: model and baseline trade at the same rate."""
    s = np.abs(signal_column(signal_train, cfg))
    s = s[np.isfinite(s)]
    if len(s) == 0:
        raise ValueError("signal_train has no finite values")
    return float(np.quantile(s, cfg.trade_quantile))


def greedy_cooldown(events: np.ndarray, gap: int) -> np.ndarray:
    """Subset of sorted event indices taken greedily: the first, then each next one at least
    `gap` after the last taken. Exact, vectorized by pointer doubling over the trigger list.

    nxt[k] = first trigger >= events[k] + gap; the taken set is {nxt^m(0)}; m-th element for
    all m at once by applying nxt^(2^j) where bit j of m is set (log2(n) array passes).
    """
    n = len(events)
    if n == 0:
        return events
    jump = np.append(np.searchsorted(events, events + gap, side="left"), n)  # n = past the end
    m = np.arange(n)
    pos = np.zeros(n, np.int64)
    bit = 0
    while (1 << bit) < n:
        pos = np.where((m >> bit) & 1, jump[pos], pos)
        jump = jump[jump]
        bit += 1
    return events[np.unique(pos[pos < n])]


def fill_at(
    time: np.ndarray, rows: np.ndarray, cfg: SimConfig
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Where decisions at event `rows` fill: (fill_row, fill_time, filled), the first two
    for the filled decisions only, `filled` a mask over `rows`.

    The order reaches the book latency_s seconds after the decision at t = time[row] and no
    sooner than latency_events events after it: fill_row j = max(row + latency_events, the
    last event with time <= t + latency_s), i.e. the book in force when the order arrives
    (the mark-outs read the mid by the same rule). fill_time = max(t + latency_s, time[j]):
    the arrival instant, or the fill row's own time when the event count is what holds the
    order back. With latency_s = 0 the clock part is row itself: later events stamped with
    the same time as the decision do not count as passed, so both latencies 0 fill at the
    decision row, at the decision time. A decision whose fill would come after the day's
    last event (row + latency_events past the last row, or t + latency_s after its time)
    is dropped: there is no book to fill against.
    """
    n = len(time)
    t = time[rows]
    j = rows + cfg.latency_events
    if cfg.latency_s > 0:
        j = np.maximum(j, np.searchsorted(time, t + cfg.latency_s, side="right") - 1)
    end = time[-1] if n else -np.inf
    filled = (j < n) & (t + cfg.latency_s <= end)
    j = j[filled]
    return j, np.maximum(t[filled] + cfg.latency_s, time[j]), filled


def simulate(features: pa.Table, signal: np.ndarray, threshold: float, cfg: SimConfig) -> pa.Table:
    """Trades of one day: at event t, signal > threshold decides to buy at the ask, <
    -threshold to sell at the bid. Rule: a trigger trades unless it comes fewer than
    `min_gap_events` events after the previous trade's decision (greedy cool-down on the
    trigger rows; buys and sells share it). The fill comes after the latency (`fill_at`),
    at the touch of the fill row; a decision with no fill before the day's end is dropped.

    Columns: row (decision event index in `features`), time (decision time), side (+1/-1),
    price (fill price), mid (mid at the decision), signal, fill_row, fill_time.
    """
    s = signal_column(signal, cfg)
    if len(s) != features.num_rows:
        raise ValueError(f"signal has {len(s)} rows, features {features.num_rows}")
    time = _column(features, "time")
    triggers = np.flatnonzero(np.abs(np.nan_to_num(s, nan=0.0)) > threshold)
    # The cool-down runs on decisions, before any drop: dropped ones are the day's last
    # (the fill rule is monotone in the row), so they block no decision that could fill.
    rows = greedy_cooldown(triggers, cfg.min_gap_events)
    fill_row, fill_time, filled = fill_at(time, rows, cfg)
    rows = rows[filled]
    side = np.sign(s[rows]).astype(np.int8)
    ask, bid = _column(features, "ask")[fill_row], _column(features, "bid")[fill_row]
    return pa.table(
        {
            "row": rows.astype(np.int64),
            "time": time[rows],
            "side": side,
            "price": np.where(side > 0, ask, bid),
            "mid": _column(features, "mid")[rows],
            "signal": s[rows],
            "fill_row": fill_row.astype(np.int64),
            "fill_time": fill_time.astype(np.float64),
        }
    )


# ---------------------------------------------------------------- mark-out and summary


def _column(table: pa.Table, name: str) -> np.ndarray:
    return table.column(name).to_numpy(zero_copy_only=False).astype(np.float64)


def markout(trades: pa.Table, features: pa.Table, cfg: SimConfig) -> pa.Table:
    """trades + per horizon key ('1s', ..., '10ev'): `markout_{key}` (gross bps),
    `net_{key}` (markout_{key} - fee_bps) and `elapsed_{key}` (seconds from the fill to
    the event the mark-out reads), all NaN where the mark-out is.

    Horizons start at the fill (fill_row, fill_time) and are marked against the fill price.
    Clock horizon h: M = mid at the last event with time <= fill_time + h; NaN when that is
    after the day's last event; elapsed = that event's time - fill_time, clipped to [0, h]
    (the event read precedes the fill instant when none comes within h of it: the fill
    row itself; it passes h only by the rounding of fill_time + h). Event horizon k: M = mid at
    fill_row + k; NaN past the last event; elapsed = time[fill_row + k] - fill_time.
    Tables from before fills had their own columns (no fill_row / fill_time) are marked
    from row / time, which is where they filled.
    """
    time, mid = _column(features, "time"), _column(features, "mid")
    n = len(time)
    names = trades.column_names
    from_row = "fill_row" if "fill_row" in names else "row"
    rows = trades.column(from_row).to_numpy(zero_copy_only=False).astype(np.int64)
    t = _column(trades, "fill_time" if "fill_time" in names else "time")
    d = _column(trades, "side")
    p = _column(trades, "price")
    end = time[-1] if n else -np.inf  # no events: every mark-out is NaN (and no trades)
    last = max(n - 1, 0)
    # per horizon: target event j [trades], whether it exists ok [trades], and the most
    # seconds the mark-out may span (inf: an event horizon has no clock bound)
    targets = [
        (np.searchsorted(time, t + h, side="right") - 1, t + h <= end, h)
        for h in cfg.markout_horizons_s
    ] + [(rows + k, rows + k < n, np.inf) for k in cfg.markout_horizons_events]
    gross, net, elapsed = {}, {}, {}
    for key, (j, ok, span) in zip(cfg.horizon_keys(), targets, strict=True):
        at = np.clip(j, 0, last)
        m = mid[at] if n else np.full(len(t), np.nan)
        bps = np.where(ok, d * (m - p) / p * 1e4, np.nan)
        gross[key], net[key] = bps, bps - cfg.fee_bps
        seconds = np.clip(time[at] - t, 0.0, span) if n else np.full(len(t), np.nan)
        elapsed[key] = np.where(ok, seconds, np.nan)
    out = trades
    for prefix, columns in (("markout", gross), ("net", net), ("elapsed", elapsed)):
        for key, values in columns.items():
            out = out.append_column(f"{prefix}_{key}", pa.array(values, pa.float64()))
    return out


def daily_pnl(markouts: pa.Table, cfg: SimConfig) -> pa.Table:
    """One row per day of `markouts` (which needs a `day` column, as replay_all adds), in
    day order: day, trades, pnl_bps, gross_bps, fees_bps.

    Over the day's trades whose mark-out at `cfg.pnl_key()` exists (a trade whose horizon
    runs past the close is in none of the sums, nor in `trades`): pnl_bps = sum of
    net_{key}, gross_bps = sum of markout_{key}, fees_bps = the fees those trades paid,
    read from the table (gross - net), so the P&L is in bps of one unit of notional per
    trade. A day with trades but none marked has zeros; a day without trades has no row.
    """
    key = cfg.pnl_key()
    missing = [c for c in ("day", f"markout_{key}", f"net_{key}") if c not in markouts.column_names]
    if missing:
        raise ValueError(f"daily_pnl needs columns {missing} (pnl horizon {key!r})")
    gross, net = _column(markouts, f"markout_{key}"), _column(markouts, f"net_{key}")
    day = markouts.column("day")
    days, group = np.unique(day.to_numpy(zero_copy_only=False), return_inverse=True)
    ok = np.isfinite(net)

    def per_day(values: np.ndarray) -> np.ndarray:
        return np.bincount(group, weights=np.where(ok, values, 0.0), minlength=len(days))

    return pa.table(
        {
            "day": pa.array(days, day.type),
            "trades": per_day(np.ones(len(net))).astype(np.int64),
            "pnl_bps": per_day(net),
            "gross_bps": per_day(gross),
            "fees_bps": per_day(gross - net),
        }
    )


def _keys(tables: Iterable[pa.Table]) -> list[str]:
    keys: list[str] = []
    for table in tables:
        for name in table.column_names:
            if name.startswith("markout_") and name[len("markout_") :] not in keys:
                keys.append(name[len("markout_") :])
    return keys


def _stats(tables: list[pa.Table], keys: list[str], fee_bps: float = 0.0) -> dict:
    """A signal's mark-out per horizon with standard errors that hold under overlapping
    horizons and same-side runs (tasks/research/uncertainty.py: HAC over horizon windows)."""
    count = sum(t.num_rows for t in tables)
    out: dict = {"count": int(count)}
    fields = ("mean_bps", "se_bps", "se_iid_bps", "net_bps", "hit_rate", "hit_rate_se",
              "windows", "n_eff", "insufficient")  # fmt: skip
    for f in fields:
        out[f] = {}
    for key in keys:
        column = f"markout_{key}"
        width = uncertainty.window_seconds(key, tables)
        est = uncertainty.mean(uncertainty.Sample.of(tables, column), width)
        hits = uncertainty.mean(uncertainty.Sample.of(tables, column, hits=True), width)
        out["mean_bps"][key] = est.estimate
        out["se_bps"][key] = est.se
        out["se_iid_bps"][key] = est.se_iid
        out["net_bps"][key] = est.estimate - fee_bps
        out["hit_rate"][key] = hits.estimate
        out["hit_rate_se"][key] = hits.se
        out["windows"][key] = est.windows
        out["n_eff"][key] = est.n_eff
        out["insufficient"][key] = est.insufficient
    return out


def paired_difference(
    model: Mapping[str, pa.Table],
    baseline: Mapping[str, pa.Table],
    keys: list[str],
    *,
    alpha: float = 0.05,
    trials: int = 1,
) -> dict[str, dict]:
    """Model minus baseline mean mark-out per horizon on the same held-out data, with the
    paired HAC standard error (tasks/research/uncertainty.difference: both signals on one grid of
    horizon windows, products pooled by time, so the market's moves cancel), its two-sided
    p-value, the p-value adjusted over the horizons (Holm) and then for the trials made on
    the same data (Sidak), and whether the difference survives both at `alpha`.
    "insufficient" says why a horizon was not tested. Tables need `day` columns."""
    m_tables = [model[p] for p in sorted(model)]
    b_tables = [baseline[p] for p in sorted(baseline)]
    out: dict[str, dict] = {}
    for key in keys:
        column = f"markout_{key}"
        width = uncertainty.window_seconds(key, m_tables + b_tables)
        est = uncertainty.difference(
            uncertainty.Sample.of(m_tables, column), uncertainty.Sample.of(b_tables, column), width
        )
        out[key] = {
            "mean_bps": est.estimate, "se_bps": est.se, "se_iid_bps": est.se_iid,
            "statistic": est.statistic, "p_value": est.p_value, "windows": est.windows,
            "n_eff": est.n_eff, "width_s": est.width_s, "insufficient": est.insufficient,
        }  # fmt: skip
    holm = uncertainty.holm({k: v["p_value"] for k, v in out.items()})
    for key, row in out.items():
        row["p_holm"] = holm[key]
        row["p_adjusted"] = uncertainty.trials_adjusted(holm[key], trials)
        row["trials"] = trials
        row["significant"] = bool(row["p_adjusted"] < alpha)  # NaN compares False
    return out


def last_fold_split(
    earlier: Mapping[str, Mapping[str, pa.Table]],
    last: Mapping[str, Mapping[str, pa.Table]],
    keys: list[str],
) -> dict[str, dict[str, dict]]:
    """The paired difference (model - baseline) on the folds before the last, pooled, and
    on the last fold alone, each `{"model": {product: table}, "baseline": ...}`: what a
    choice made on the earlier folds and tested on the last one needs (a sweep's held-out
    test of its pick, flows/sweep.py). Unadjusted for trials (Holm over the horizons
    only): the caller knows how many choices the test stands for."""
    return {
        "earlier": paired_difference(earlier["model"], earlier["baseline"], keys),
        "last": paired_difference(last["model"], last["baseline"], keys),
    }


def equal_counts(
    model: Mapping[str, pa.Table], baseline: Mapping[str, pa.Table]
) -> tuple[dict[str, pa.Table], dict[str, pa.Table]]:
    """Both signals at the same out-of-sample trade count, per product: the more active
    one keeps only its strongest trades (largest |signal|), as many as the other made.
    Thresholds come from the training period, so out of sample the two rates drift apart;
    compared as traded, a signal that trades less is judged on its more selective trades."""
    m_out, b_out = {}, {}
    for product in sorted(set(model) | set(baseline)):
        m, b = model.get(product), baseline.get(product)
        if m is None or b is None:
            continue
        k = min(m.num_rows, b.num_rows)

        def strongest(t: pa.Table, k: int = k) -> pa.Table:
            if t.num_rows == k:
                return t
            order = np.argsort(-np.abs(_column(t, "signal")), kind="stable")[:k]
            return t.take(pa.array(np.sort(order)))

        m_out[product], b_out[product] = strongest(m), strongest(b)
    return m_out, b_out


def summarize(markouts_by_product: Mapping[str, pa.Table], fee_bps: float = 0.0) -> dict:
    """{product: {...}, "total": {...}}: each {"count", and per horizon key: "mean_bps",
    "se_bps" (HAC, NaN when insufficient), "se_iid_bps", "net_bps" (after the fee),
    "hit_rate" (fraction of trades with a positive mark-out) and "hit_rate_se",
    "windows" (effective horizon windows), "n_eff", "insufficient" (why no SE, or "")};
    over trades whose mark-out exists at that horizon (NaN when none)."""
    keys = _keys(markouts_by_product.values())
    summary = {p: _stats([t], keys, fee_bps) for p, t in markouts_by_product.items()}
    summary["total"] = _stats(list(markouts_by_product.values()), keys, fee_bps)
    return summary


def pnl(markouts_by_product: Mapping[str, pa.Table], cfg: SimConfig) -> dict:
    """The signal's daily P&L (bps of one unit of notional per trade, net of fees) at
    `cfg.pnl_key()` over all products, its total and the total's HAC standard error."""
    tables = [t for t in markouts_by_product.values() if t.num_rows]
    key = cfg.pnl_key()
    if not tables or f"net_{key}" not in tables[0].column_names:
        return {"horizon": key, "days": {}, "total_bps": 0.0, "se_bps": math.nan}
    daily = daily_pnl(pa.concat_tables(tables), cfg)
    est = uncertainty.mean(
        uncertainty.Sample.of(tables, f"net_{key}"), uncertainty.window_seconds(key, tables)
    )
    n = len(uncertainty.Sample.of(tables, f"net_{key}"))
    return {
        "horizon": key,
        "days": dict(zip(daily["day"].to_pylist(), daily["pnl_bps"].to_pylist(), strict=True)),
        "total_bps": float(pc.sum(daily["pnl_bps"]).as_py() or 0.0),
        "se_bps": n * est.se,  # the total is n times the mean
        "insufficient": est.insufficient,
    }


BASELINE_SCALE_BPS = 10.0  # a typical half-spread: turns imbalance in [-1, 1] into bps


def baseline_signal(features: pa.Table) -> np.ndarray:
    """Top-of-book imbalance, imbalance_1 * BASELINE_SCALE_BPS: [rows] bps-like.

    Only its sign and rank matter under the quantile threshold rule.
    """
    return _column(features, "imbalance_1") * BASELINE_SCALE_BPS


# ---------------------------------------------------------------- replay of held-out data


def replay_all(
    predict: Callable[[pa.Table], np.ndarray],
    tables: Mapping[Partition, pa.Table],
    config: SimConfig,
    fold: Fold | float,
) -> dict[str, dict[str, pa.Table]]:
    """Mark-outs by signal ("model", "baseline") and product over one fold's test part
    (tasks/research/folds.split_fold: its test dates, or the end of each day for an intraday
    fold), each signal trading at a threshold from the fold's training part; a `fold`
    column holds the fold's index, a `day` column the date. The model's predictions (bps,
    [rows, labels]) come from `predict` (profiling.inference: the fast path on a GPU for
    a model trained with packing, tasks.training.predict otherwise), a model that must
    not have trained on the test part. A float `fold` is the single split of that
    held-out share (split_train_test's)."""
    if not isinstance(fold, Fold):
        (fold,) = folds({p.date for p in tables}, WalkForward(holdout_fraction=fold))
    train_parts, test_parts = split_fold(tables, fold)
    marks: dict[str, dict[str, list[pa.Table]]] = {"model": {}, "baseline": {}}
    for product in sorted({p.product for p in test_parts}):
        train_tables = [t for p, t in train_parts.items() if p.product == product]
        test = [(p, t) for p, t in sorted(test_parts.items()) if p.product == product]
        signals = {
            "model": lambda t: signal_column(predict(t), config),
            "baseline": baseline_signal,
        }
        for name, signal_of in signals.items():
            # Each product's threshold comes from its own training days: trading rates match.
            threshold = thresholds_from(
                np.concatenate([signal_of(t) for t in train_tables]), config
            )
            for part, table in test:
                trades = simulate(table, signal_of(table), threshold, config)
                marked = markout(trades, table, config)
                n = marked.num_rows
                day = pa.array([part.date.isoformat()] * n, pa.string())
                marked = marked.append_column("day", day)
                marked = marked.append_column("fold", pa.array([fold.index] * n, pa.int64()))
                marks[name].setdefault(product, []).append(marked)
    return {
        name: {p: pa.concat_tables(ts) for p, ts in by_product.items()}
        for name, by_product in marks.items()
    }


def stack_markouts(merged: dict[str, dict[str, pa.Table]]) -> pa.Table:
    """One table of every mark-out, with `signal` and `product` columns."""
    parts = []
    for name, by_product in merged.items():
        for product, t in by_product.items():
            n = t.num_rows
            t = t.append_column("signal_name", pa.array([name] * n, pa.string()))
            parts.append(t.append_column("product", pa.array([product] * n, pa.string())))
    return pa.concat_tables(parts)


def split_markouts(table: pa.Table) -> dict[str, dict[str, pa.Table]]:
    out: dict[str, dict[str, pa.Table]] = {}
    for name in ("model", "baseline"):
        rows = table.filter(pc.equal(table["signal_name"], name))
        out[name] = {
            p: rows.filter(pc.equal(rows["product"], p)).drop_columns(["signal_name", "product"])
            for p in sorted(set(rows["product"].to_pylist()))
        }
    return out
