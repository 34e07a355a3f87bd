"""Replay a signal over a feature table, trade at the touch, and mark the trades out.

All vectorized: trades come from an exact greedy cool-down computed by pointer doubling
(O(n log n), no loop per event or per trade), mark-outs from np.searchsorted on time.
A mark-out is D * (M - P) / P * 1e4 bps: D = +1 buy at the ask / -1 sell at the bid,
P = the trade price, M = the mid a clock or event horizon later; NaN past the day's end.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from quantloop.tasks.schema import Partition

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


@dataclass(kw_only=True, slots=True, frozen=True)
class SimConfig:
    signal_horizon: int = 0  # which model output (label index) is the trading signal
    trade_quantile: float = 0.95  # trade when |signal| exceeds this quantile of training |signal|
    markout_horizons_s: tuple[float, ...] = (1, 5, 30, 60, 300)
    markout_horizons_events: tuple[int, ...] = (10, 100)
    min_gap_events: int = 10  # a new trade needs at least this many events since the last one

    def __post_init__(self) -> None:
        if not isinstance(self.signal_horizon, int) or self.signal_horizon < 0:
            raise ValueError(f"signal_horizon must be an integer >= 0, got {self.signal_horizon}")
        if not 0.0 <= self.trade_quantile < 1.0:
            raise ValueError(f"trade_quantile must be in [0, 1), got {self.trade_quantile}")
        if any(not h > 0 for h in self.markout_horizons_s):
            raise ValueError(f"markout_horizons_s must be > 0, got {self.markout_horizons_s}")
        if any(int(h) != h or h < 1 for h in self.markout_horizons_events):
            raise ValueError(
                f"markout_horizons_events must be integers >= 1, got {self.markout_horizons_events}"
            )
        if not isinstance(self.min_gap_events, int) or self.min_gap_events < 1:
            raise ValueError(f"min_gap_events must be an integer >= 1, got {self.min_gap_events}")
        object.__setattr__(
            self, "markout_horizons_s", tuple(float(h) for h in self.markout_horizons_s)
        )
        object.__setattr__(
            self, "markout_horizons_events", tuple(int(h) for h in self.markout_horizons_events)
        )

    def horizon_keys(self) -> list[str]:
        """'1s', '5s', ..., '10ev', '100ev': the summary's horizon keys, in column order."""
        return [f"{h:g}s" for h in self.markout_horizons_s] + [
            f"{h}ev" for h in self.markout_horizons_events
        ]


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


def simulate(features: pa.Table, signal: np.ndarray, threshold: float, cfg: SimConfig) -> pa.Table:
    """Trades of one day: at event t, signal > threshold buys at the ask, < -threshold sells
    at the bid. Rule: a trigger trades unless it comes fewer than `min_gap_events` events
    after the previous trade (greedy cool-down; buys and sells share it).

    Columns: row (event index in `features`), time, side (+1/-1), price, mid, signal.
    """
    s = signal_column(signal, cfg)
    if len(s) != features.num_rows:
        raise ValueError(f"signal has {len(s)} rows, features {features.num_rows}")
    triggers = np.flatnonzero(np.abs(np.nan_to_num(s, nan=0.0)) > threshold)
    rows = greedy_cooldown(triggers, cfg.min_gap_events)
    side = np.sign(s[rows]).astype(np.int8)
    ask, bid = _column(features, "ask")[rows], _column(features, "bid")[rows]
    return pa.table(
        {
            "row": rows.astype(np.int64),
            "time": _column(features, "time")[rows],
            "side": side,
            "price": np.where(side > 0, ask, bid),
            "mid": _column(features, "mid")[rows],
            "signal": s[rows],
        }
    )


# ---------------------------------------------------------------- mark-out and summary


def _column(table: pa.Table, name: str) -> np.ndarray:
    return table.column(name).to_numpy(zero_copy_only=False).astype(np.float64)


def markout(trades: pa.Table, features: pa.Table, cfg: SimConfig) -> pa.Table:
    """trades + one `markout_{key}` column (bps) per horizon key ('1s', ..., '10ev').

    Clock horizon h: M = mid at the last event with time <= t + h; NaN when t + h is after
    the day's last event. Event horizon k: M = mid k events later; NaN past the last event.
    """
    time, mid = _column(features, "time"), _column(features, "mid")
    n = len(time)
    rows = trades.column("row").to_numpy(zero_copy_only=False).astype(np.int64)
    t = _column(trades, "time")
    d = _column(trades, "side")
    p = _column(trades, "price")
    end = time[-1] if n else -np.inf  # no events: every mark-out is NaN (and no trades)
    last = max(n - 1, 0)
    out = trades
    # per horizon: target event j [trades] and whether it exists ok [trades]
    targets = [
        (np.searchsorted(time, t + h, side="right") - 1, t + h <= end)
        for h in cfg.markout_horizons_s
    ] + [(rows + k, rows + k < n) for k in cfg.markout_horizons_events]
    for key, (j, ok) in zip(cfg.horizon_keys(), targets, strict=True):
        m = mid[np.clip(j, 0, last)] if n else np.full(len(t), np.nan)
        bps = np.where(ok, d * (m - p) / p * 1e4, np.nan)
        out = out.append_column(f"markout_{key}", pa.array(bps, pa.float64()))
    return out


def _stats(tables: list[pa.Table], keys: list[str]) -> dict:
    count = sum(t.num_rows for t in tables)
    mean_bps, se_bps, hit_rate = {}, {}, {}
    for key in keys:
        parts = [_column(t, f"markout_{key}") for t in tables if f"markout_{key}" in t.column_names]
        v = np.concatenate(parts) if parts else np.zeros(0)
        v = v[np.isfinite(v)]
        mean_bps[key] = float(v.mean()) if len(v) else float("nan")
        # standard error of the mean: the scale a difference between signals is judged on
        se_bps[key] = float(v.std(ddof=1) / np.sqrt(len(v))) if len(v) > 1 else float("nan")
        hit_rate[key] = float((v > 0).mean()) if len(v) else float("nan")
    return {"count": int(count), "mean_bps": mean_bps, "se_bps": se_bps, "hit_rate": hit_rate}


PAIR_BUCKET_S = 300.0  # trades of both signals in the same 5 minutes of one day are a pair


def paired_difference(
    model: Mapping[str, pa.Table], baseline: Mapping[str, pa.Table], keys: list[str]
) -> dict[str, dict[str, float]]:
    """Model minus baseline mean mark-out per horizon, paired by market conditions: per
    product, day and PAIR_BUCKET_S of clock time, the difference of the two signals' mean
    mark-outs there; the mean of those differences and its standard error. Pairing takes
    the market's own moves out of the comparison (both signals trade the same minutes),
    which the two means' separate standard errors cannot. Tables need a `day` column."""

    def buckets(table: pa.Table, key: str) -> dict[tuple, float]:
        v = _column(table, f"markout_{key}")
        ok = np.isfinite(v)
        b = np.floor(_column(table, "time") / PAIR_BUCKET_S)
        days = table.column("day").to_numpy(zero_copy_only=False)
        sums: dict[tuple, list[float]] = {}
        for day, bucket, x in zip(days[ok], b[ok], v[ok], strict=True):
            sums.setdefault((day, bucket), []).append(x)
        return {k: float(np.mean(xs)) for k, xs in sums.items()}

    out = {}
    for key in keys:
        diffs = []
        for product in sorted(set(model) & set(baseline)):
            m, b = buckets(model[product], key), buckets(baseline[product], key)
            diffs += [m[k] - b[k] for k in m.keys() & b.keys()]
        d = np.asarray(diffs)
        out[key] = {
            "mean_bps": float(d.mean()) if len(d) else float("nan"),
            "se_bps": float(d.std(ddof=1) / np.sqrt(len(d))) if len(d) > 1 else float("nan"),
            "pairs": len(d),
        }
    return out


def summarize(markouts_by_product: Mapping[str, pa.Table]) -> dict:
    """{product: {...}, "total": {...}}, each {"count", "mean_bps": {key: bps}, "se_bps":
    {key: standard error of that mean}, "hit_rate": {key: fraction of trades with a
    positive mark-out}}; over trades whose mark-out exists at that horizon (NaN when
    none)."""
    keys: list[str] = []
    for table in markouts_by_product.values():
        for name in table.column_names:
            if name.startswith("markout_") and name[len("markout_") :] not in keys:
                keys.append(name[len("markout_") :])
    summary = {product: _stats([table], keys) for product, table in markouts_by_product.items()}
    summary["total"] = _stats(list(markouts_by_product.values()), keys)
    return summary


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
    holdout_fraction: float,
) -> dict[str, dict[str, pa.Table]]:
    """Mark-outs by signal ("model", "baseline") and product, over the held-out data of
    each partition's feature table; the model's predictions (bps, [rows, labels]) come
    from `predict` (profiling.inference: the fast path on a GPU for a model trained with
    packing, tasks.training.predict otherwise)."""
    train_parts, test_parts = split_train_test(tables, holdout_fraction)
    marks: dict[str, dict[str, list[pa.Table]]] = {"model": {}, "baseline": {}}
    for product in sorted({p.product for p in tables}):
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
                day = pa.array([part.date.isoformat()] * marked.num_rows, pa.string())
                marks[name].setdefault(product, []).append(marked.append_column("day", day))
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
