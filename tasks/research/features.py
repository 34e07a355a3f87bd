"""Order-book features and labels: one table per (product, date), all vectorized.

Every function here is pure NumPy over whole columns (rolling windows are
cumulative-sum differences), so a 150k-event LOBSTER day takes milliseconds and
there is no Python loop per event. The node engine fingerprints this module's
source: edit a feature and exactly the feature nodes re-run.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np
import pyarrow as pa

from quantloop.tasks.data.schema import PRICE_SCALE, levels_of


@dataclass(kw_only=True, slots=True, frozen=True)
class FeatureParams:
    """Parameters of the feature node; all event counts are in events, not seconds."""

    imbalance_levels: int = 5
    return_lags: tuple[int, ...] = (1, 10, 100)
    vol_windows: tuple[int, ...] = (50, 500)
    ofi_window: int = 50
    label_horizons: tuple[int, ...] = (10, 50, 100)

    def __post_init__(self) -> None:
        if self.imbalance_levels < 1:
            raise ValueError(f"imbalance_levels must be >= 1, got {self.imbalance_levels}")
        for name in ("return_lags", "vol_windows", "label_horizons"):
            values = getattr(self, name)
            if not values or any(int(v) != v or v < 1 for v in values):
                raise ValueError(f"{name} must be a non-empty tuple of integers >= 1, got {values}")
            object.__setattr__(self, name, tuple(int(v) for v in values))
        if self.ofi_window < 1:
            raise ValueError(f"ofi_window must be >= 1, got {self.ofi_window}")

    def canonical(self) -> dict:
        """A plain, JSON-able dict: what goes into the node key."""
        return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items()}

    @classmethod
    def from_dict(cls, values: dict) -> FeatureParams:
        unknown = set(values) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(
                f"unknown feature parameter(s) {sorted(unknown)}; "
                f"known: {sorted(cls.__dataclass_fields__)}"
            )
        return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in values.items()})


@dataclass(kw_only=True, slots=True, frozen=True)
class FeatureSet:
    """Column names a model reads from a feature table."""

    inputs: list[str] = field(default_factory=list)
    labels: list[str] = field(default_factory=list)


def feature_set(params: FeatureParams) -> FeatureSet:
    inputs = ["spread_bps", "micro_dev_bps"]
    inputs += [f"imbalance_{k}" for k in range(1, params.imbalance_levels + 1)]
    inputs += ["ofi"]
    inputs += [f"ret_{k}" for k in params.return_lags]
    inputs += [f"rv_{w}" for w in params.vol_windows]
    inputs += ["log_depth"]
    return FeatureSet(inputs=inputs, labels=[f"label_{h}" for h in params.label_horizons])


def _col(table: pa.Table, name: str) -> np.ndarray:
    return table.column(name).to_numpy(zero_copy_only=False)


def depth_imbalances(table: pa.Table, levels: int, book_levels: int) -> list[np.ndarray]:
    """(bid depth - ask depth) / total depth over the first k levels, for k = 1..levels.

    A book with fewer levels than asked uses all it has for the deeper ks, so
    products of different depth share one feature layout.
    """
    out: list[np.ndarray] = []
    bid = ask = None
    for i in range(1, min(levels, book_levels) + 1):
        b, a = _col(table, f"bid_size_{i}"), _col(table, f"ask_size_{i}")
        bid = b.astype(np.float64) if bid is None else bid + b
        ask = a.astype(np.float64) if ask is None else ask + a
        total = bid + ask
        out.append(np.divide(bid - ask, total, out=np.zeros_like(total), where=total > 0))
    return out + [out[-1]] * (levels - len(out))


def order_flow_imbalance(
    bid: np.ndarray, bid_size: np.ndarray, ask: np.ndarray, ask_size: np.ndarray
) -> np.ndarray:
    """Per-event order-flow imbalance at the touch (Cont, Kukanov & Stoikov 2014)."""
    e = np.zeros_like(bid, dtype=np.float64)
    pb, qb, pa_, qa = bid[1:], bid_size[1:], ask[1:], ask_size[1:]
    pb0, qb0, pa0, qa0 = bid[:-1], bid_size[:-1], ask[:-1], ask_size[:-1]
    e[1:] = (
        np.where(pb >= pb0, qb, 0.0)
        - np.where(pb <= pb0, qb0, 0.0)
        - np.where(pa_ <= pa0, qa, 0.0)
        + np.where(pa_ >= pa0, qa0, 0.0)
    )
    return e


def tradable_rows(table: pa.Table) -> np.ndarray | None:
    """Rows with a two-sided touch and no halt: the only rows features describe.

    None when every row qualifies (the common case, checked without a filter).
    """
    ask = table.column("ask_price_1")
    bid = table.column("bid_price_1")
    halted = _col(table, "halted").astype(bool)
    if ask.null_count == 0 and bid.null_count == 0 and not halted.any():
        return None
    ok = ask.is_valid().to_numpy(zero_copy_only=False) & bid.is_valid().to_numpy(
        zero_copy_only=False
    )
    return ok & ~halted


def compute_features(book: pa.Table, params: FeatureParams) -> pa.Table:
    """Features and labels of one order-book partition, one row per tradable event.

    book: a table in `tasks.schema.book_schema(levels)`.
    """
    return compute_features_many([book], params)[0]


def _segments(lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(position of each row within its segment, its segment's length), per row."""
    starts = np.cumsum(lengths) - lengths
    pos = np.arange(int(lengths.sum())) - np.repeat(starts, lengths)
    return pos, np.repeat(lengths, lengths)


def rolling_sums(x: np.ndarray, window: int, lengths: np.ndarray) -> np.ndarray:
    """Sum of the last `window` values (fewer at a segment's start) within each segment of
    `lengths` consecutive rows, each segment on its own, bit for bit.

    A cumsum across segments would round differently, and a node's output must not
    depend on which nodes shared its batch. Segments of one length are stacked into a
    2-D array and summed along rows: a row's cumsum is the same sequential sum as
    that segment's own 1-D cumsum, so nothing changes but the number of calls.
    """
    out = np.empty_like(x, dtype=np.float64)
    starts = np.cumsum(lengths) - lengths
    for n in np.unique(lengths).tolist():
        if n == 0:
            continue
        first = starts[lengths == n]
        rows = first[:, None] + np.arange(n)  # [segments, n] indices into x
        c = np.cumsum(x[rows], axis=1, dtype=np.float64)
        if window < n:
            c[:, window:] -= c[:, :-window].copy()
        out[rows] = c
    return out


def compute_features_many(books: list[pa.Table], params: FeatureParams) -> list[pa.Table]:
    """compute_features of several partitions of one depth, in one vectorized pass.

    Small partitions (a few dozen events) cost mostly per-call overhead, so the node
    engine hands a whole batch here. Rows never mix across partitions: every lag,
    lead and window stops at its partition's edge, and each partition's output is
    bit for bit what it would be alone (tests/test_features.py checks it).
    """
    if not books:
        return []
    levels = {levels_of(b.schema) for b in books}
    if len(levels) != 1:
        raise ValueError(f"compute_features_many needs books of one depth, got levels {levels}")
    kept = []
    for b in books:
        rows = tradable_rows(b)
        kept.append(b if rows is None else b.filter(pa.array(rows)))
    lengths = np.array([b.num_rows for b in kept], dtype=np.int64)
    book = pa.concat_tables(kept) if len(kept) > 1 else kept[0]
    (levels,) = levels
    pos, seg_len = _segments(lengths)

    ask = _col(book, "ask_price_1").astype(np.float64) / PRICE_SCALE
    bid = _col(book, "bid_price_1").astype(np.float64) / PRICE_SCALE
    ask_size = _col(book, "ask_size_1").astype(np.float64)
    bid_size = _col(book, "bid_size_1").astype(np.float64)
    mid = (ask + bid) / 2
    touch_depth = bid_size + ask_size
    microprice = np.divide(
        ask * bid_size + bid * ask_size, touch_depth, out=mid.copy(), where=touch_depth > 0
    )
    cols: dict[str, np.ndarray] = {
        "time": _col(book, "time").astype(np.float64),
        "bid": bid,
        "ask": ask,
        "mid": mid,
        "microprice": microprice,
        "spread_bps": (ask - bid) / mid * 1e4,
        "micro_dev_bps": (microprice - mid) / mid * 1e4,
    }
    for k, imbalance in enumerate(depth_imbalances(book, params.imbalance_levels, levels), 1):
        cols[f"imbalance_{k}"] = imbalance
    ofi = order_flow_imbalance(bid, bid_size, ask, ask_size)
    ofi[pos == 0] = 0.0  # a partition's first event has no previous book
    mean_depth = rolling_sums(touch_depth, params.ofi_window, lengths) / params.ofi_window
    cols["ofi"] = np.divide(
        rolling_sums(ofi, params.ofi_window, lengths),
        mean_depth,
        out=np.zeros_like(ofi),
        where=mean_depth > 0,
    )
    for k in params.return_lags:
        cols[f"ret_{k}"] = _lagged_diff_bps(mid, k, pos)
    step = _lagged_diff_bps(mid, 1, pos)
    for w in params.vol_windows:
        cols[f"rv_{w}"] = np.sqrt(rolling_sums(step**2, w, lengths))
    cols["log_depth"] = np.log1p(touch_depth)
    for h in params.label_horizons:
        cols[f"label_{h}"] = _future_move_bps(mid, h, pos, seg_len)
    out = pa.table(cols)
    starts = (np.cumsum(lengths) - lengths).tolist()
    return [out.slice(s, n) for s, n in zip(starts, lengths.tolist(), strict=True)]


def _lagged_diff_bps(mid: np.ndarray, lag: int, pos: np.ndarray) -> np.ndarray:
    """log(mid_t / mid_{t-lag}) in bps within each segment: 0 where the lag reaches before
    its start."""
    out = np.zeros_like(mid)
    if lag < len(mid):
        ok = pos[lag:] >= lag
        out[lag:][ok] = np.log(mid[lag:][ok] / mid[:-lag][ok]) * 1e4
    return out


def _future_move_bps(mid: np.ndarray, horizon: int, pos: np.ndarray, seg_len: np.ndarray):
    """(mid_{t+h} - mid_t) / mid_t in bps within each segment: NaN where the horizon
    passes its end."""
    out = np.full_like(mid, np.nan)
    if horizon < len(mid):
        ok = (pos + horizon < seg_len)[:-horizon]
        a, b = mid[:-horizon][ok], mid[horizon:][ok]
        out[:-horizon][ok] = (b - a) / a * 1e4
    return out


def features_node(book: pa.Table, params: dict) -> pa.Table:
    """The feature node's compute function: the form the node engine calls."""
    return compute_features(book, FeatureParams.from_dict(params))
