"""Synthetic order-book days in `book_schema(levels)`, for tests, demos and benchmarks.

Not a matching engine: the book is built from vectorized processes and only has
to be self-consistent (each message changes the one queue it names, or moves
the best price by one tick) and plausible:

* Best bid/ask move one side, one tick at a time. The mid (in half ticks) is a
  +-1 walk; the spread is a second +-1 walk folded into 1..max_spread_ticks.
  Together they fix which side moved: ask up / bid down (a queue emptied) or
  bid up / ask down (an order inside the spread).
* Volatility clusters: regimes scale how many events pass between moves and how
  fast the clock runs. Wide spreads are short-lived (filled quickly).
* Queues are stored per (side, price), so a level keeps its size when the
  ladder shifts; each event assigns one queue a new size and the message is
  the difference (submit if it grew; cancel, delete or execution if it shrank).
* Signal: before a queue empties it shrinks (and trades concentrate on it);
  before an order improves the quote, that side's best queue grows. So
  best-level imbalance and trade flow foreshadow the next mid move.
"""

from __future__ import annotations

import datetime as dt
import hashlib
from dataclasses import dataclass
from typing import Annotated

import numpy as np
import pyarrow as pa
from pydantic import Field

from quantloop.tasks.data.ingest import validate_book
from quantloop.tasks.data.schema import (
    CANCEL,
    DELETE,
    EXEC_HIDDEN,
    EXEC_VISIBLE,
    SUBMIT,
    Partition,
    book_schema,
)

ASK, BID = 0, 1
_DIRECTION = np.array([-1, 1], np.int8)  # ask queues hold sell orders, bid queues buy orders
_FIRST_ORDER_ID = 10_000_000  # ids below this stand for orders resting before the open


@dataclass(kw_only=True, slots=True, frozen=True)
class SyntheticConfig:
    """The synthetic order-book generator: deterministic by (seed, product, date)."""

    seed: Annotated[int, Field(ge=0, title="Seed", description="Generator seed (>= 0).")] = 0
    levels: Annotated[
        int, Field(ge=1, le=50, title="Book levels", description="Book levels per side (1 to 50).")
    ] = 10
    events_per_day: Annotated[
        int,
        Field(
            title="Events per day",
            ge=1,
            le=10_000_000,
            description="Messages per product and day (1 to 10,000,000); must exceed the "
            "longest label horizon to train.",
        ),
    ] = 20_000
    tick_size: Annotated[
        int,
        Field(
            title="Tick size ($0.0001 units)",
            ge=1,
            description="Tick in price units of $0.0001 (LOBSTER's): 100 = one cent (>= 1).",
        ),
    ] = 100
    start_price: Annotated[
        int,
        Field(
            title="Start price ($0.0001 units)",
            ge=1,
            description="Opening mid in price units of $0.0001: 1,000,000 = $100.00 "
            "(at least 100 ticks).",
        ),
    ] = 1_000_000
    max_spread_ticks: Annotated[
        int,
        Field(
            title="Max spread (ticks)",
            ge=2,
            le=100,
            description="Widest bid-ask spread in ticks (2 to 100); spreads walk from 1 to this.",
        ),
    ] = 3
    events_per_move: Annotated[
        float,
        Field(
            ge=1,
            title="Events per price move",
            description="Mean events between best-price changes (>= 1).",
        ),
    ] = 8.0
    moves_per_regime: Annotated[
        float,
        Field(
            ge=1,
            title="Price moves per regime",
            description="Mean best-price changes per volatility regime (>= 1).",
        ),
    ] = 150.0
    vol_of_vol: Annotated[
        float,
        Field(
            title="Vol of vol",
            ge=0,
            le=3,
            description="Log standard deviation of a regime's activity multiplier (0 to 3; "
            "0 = one regime).",
        ),
    ] = 0.6
    mean_depth: Annotated[
        float,
        Field(
            ge=1, title="Mean depth (shares)", description="Mean shares queued at level 1 (>= 1)."
        ),
    ] = 300.0
    depth_slope: Annotated[
        float,
        Field(
            ge=0,
            title="Depth slope",
            description="Level k holds (1 + slope x (k - 1)) times level 1's depth (>= 0).",
        ),
    ] = 0.4
    signal: Annotated[
        float,
        Field(
            ge=0,
            title="Signal strength",
            le=1,
            description="How strongly queues foreshadow the next price move (0 = not at all, "
            "1 = most).",
        ),
    ] = 0.7
    hidden_prob: Annotated[
        float,
        Field(
            title="Hidden executions",
            ge=0,
            lt=1,
            description="Share of events that are hidden executions (0 to <1).",
        ),
    ] = 0.03
    session_start: Annotated[
        float,
        Field(
            ge=0,
            title="Session open (seconds after midnight)",
            lt=86_400,
            description="Session open in seconds after midnight: 34,200 = 09:30.",
        ),
    ] = 34_200.0
    session_end: Annotated[
        float,
        Field(
            gt=0,
            title="Session close (seconds after midnight)",
            le=86_400,
            description="Session close in seconds after midnight: 57,600 = 16:00 "
            "(after the open, at most 86,400).",
        ),
    ] = 57_600.0

    def __post_init__(self) -> None:
        checks = {
            "seed": self.seed >= 0,
            "levels": self.levels >= 1,
            "events_per_day": self.events_per_day >= 1,
            "tick_size": self.tick_size >= 1,
            "start_price": self.start_price >= 100 * self.tick_size,
            "max_spread_ticks": self.max_spread_ticks >= 2,
            "events_per_move": self.events_per_move >= 1,
            "moves_per_regime": self.moves_per_regime >= 1,
            "vol_of_vol": 0 <= self.vol_of_vol <= 3,
            "mean_depth": self.mean_depth >= 1,
            "depth_slope": self.depth_slope >= 0,
            "signal": 0 <= self.signal <= 1,
            "hidden_prob": 0 <= self.hidden_prob < 1,
            "session_start": 0 <= self.session_start < self.session_end,
            "session_end": self.session_end <= 86_400,
        }
        for name, ok in checks.items():
            if not ok:
                raise ValueError(f"SyntheticConfig.{name} is out of range: {getattr(self, name)!r}")


def partition_seed(seed: int, product: str, date: dt.date) -> np.random.SeedSequence:
    """A stable per-partition seed: same on every machine and run (unlike hash())."""
    digest = hashlib.sha256(product.encode()).digest()
    return np.random.SeedSequence([seed, int.from_bytes(digest[:8], "little"), date.toordinal()])


def generate_day(product: str, date: dt.date, cfg: SyntheticConfig) -> pa.Table:
    """One synthetic day in `book_schema(cfg.levels)`, deterministic by (seed, product, date)."""
    Partition(product, date)  # validates both
    rng = np.random.default_rng(partition_seed(cfg.seed, product, date))
    n, levels = cfg.events_per_day, cfg.levels

    # --- best quotes per state; state j follows the j-th move (n moves always suffice,
    # since every segment holds at least one event).
    period = cfg.max_spread_ticks - 1
    folded = period + np.cumsum(np.concatenate([[0], rng.choice([-1, 1], n)]))
    spread = 1 + np.abs(folded % (2 * period) - period)  # starts at 1, steps +-1
    mid2 = 1 + np.cumsum(np.concatenate([[0], rng.choice([-1, 1], n)]))  # mid in half ticks
    bid, ask = (mid2 - spread) // 2, (mid2 + spread) // 2  # ticks; parity keeps them whole

    # --- volatility regimes and segment lengths (events per state)
    regime = np.cumsum(rng.random(n + 1) < 1 / cfg.moves_per_regime)
    activity = np.exp(cfg.vol_of_vol * rng.standard_normal(n + 1) - cfg.vol_of_vol**2 / 2)
    activity = activity[regime]
    stay = 1.0 / (spread**2 * activity)  # wide spreads fill quickly; busy regimes move often
    mean_len = np.maximum(cfg.events_per_move * stay / stay.mean(), 1.0)
    length = rng.geometric(1.0 / mean_len)
    starts = np.concatenate([[0], np.cumsum(length)[:-1]])
    state = np.repeat(np.arange(n + 1), length)[:n]
    last = int(state[-1])
    idx = np.arange(n)
    is_move = (idx == starts[state]) & (state > 0)

    # --- the upcoming move, from each event's point of view
    dm, ds = np.diff(mid2), np.diff(spread)  # move j (1-based) is dm[j-1], ds[j-1]
    move_side = np.where(dm == ds, ASK, BID)  # ask moves by dm when both agree
    move_out = ds > 0  # spread widens: a best queue emptied
    nxt = state  # index into dm/ds of the move that ends this state
    focus_side, focus_out = move_side[nxt], move_out[nxt]
    tau = (idx - starts[state]) / length[state]  # 0..1 through the segment

    # --- what each event touches. A move empties the old best queue (value 0) or
    # places an order at the new best; other events re-size one visible queue.
    mv = np.flatnonzero(is_move)
    j = state[mv]  # the move that starts state j is dm[j-1]
    mout = move_out[j - 1]
    hidden = ~is_move & (rng.random(n) < cfg.hidden_prob * (0.5 + tau))
    focused = is_move | (rng.random(n) < 0.6 * tau)
    side = np.where(focused, focus_side, rng.integers(0, 2, n))
    side[mv] = move_side[j - 1]
    level_w = 1.0 / np.arange(1, levels + 1) ** 0.7
    level = np.where(focused, 1, rng.choice(np.arange(1, levels + 1), n, p=level_w / level_w.sum()))
    best = np.where(side == ASK, ask[state], bid[state])
    price = best + np.where(side == ASK, 1, -1) * (level - 1)  # deeper = away from the spread
    out, prev = mv[mout], j[mout] - 1
    price[out] = np.where(side[out] == ASK, ask[prev], bid[prev])  # the queue that emptied

    profile = rng.lognormal(0.0, 0.3, (2, levels))  # each day's depth varies per level
    value = _shares(
        rng, cfg.mean_depth * (1 + cfg.depth_slope * (level - 1)) * profile[side, level - 1]
    )
    at_focus = ~is_move & (side == focus_side) & (level == 1)
    shrink = np.where(focus_out, 1 - cfg.signal * tau, 1 + cfg.signal * tau)
    value = np.where(at_focus, np.maximum(np.round(value * shrink), 1), value).astype(np.int64)
    value[out] = 0

    # --- queues by (side, price): lookups of the latest assigned size
    lo, hi = int(bid[: last + 1].min()) - levels, int(ask[: last + 1].max()) + levels
    book = _Queues(lo, hi, n)
    dist = np.abs(np.arange(lo, hi + 1)[None, :] - np.array([[ask[0]], [bid[0]]]))
    init_level = np.minimum(dist, levels - 1)
    init = _shares(
        rng,
        cfg.mean_depth
        * (1 + cfg.depth_slope * init_level)
        * profile[np.arange(2)[:, None], init_level],
    )
    assign = ~hidden
    old = book.lookup(side, price, idx - 1, init, *book.index(side, price, idx, value, assign))
    # An assignment that changes nothing is no message: make it a hidden execution.
    same = assign & ~is_move & (value == old)
    hidden |= same
    assign &= ~same
    keys = book.index(side, price, idx, value, assign)

    # --- messages
    grew = value > old
    exec_p = np.where(at_focus & focus_out, 0.5, 0.15)
    u = rng.random(n)
    etype = np.where(
        grew,
        SUBMIT,
        np.where((level == 1) & (u < exec_p), EXEC_VISIBLE, np.where(u > 0.85, CANCEL, DELETE)),
    )
    etype[mv] = np.where(mout, np.where(u[mv] < 0.7, EXEC_VISIBLE, DELETE), SUBMIT)
    size = np.abs(value - old)
    size[mv] = np.where(mout, old[mv], value[mv])
    etype[hidden] = EXEC_HIDDEN
    size[hidden] = _shares(rng, np.full(int(hidden.sum()), cfg.mean_depth / 3))
    price[hidden] = best[hidden]

    new = etype == SUBMIT
    issued = _FIRST_ORDER_ID + np.cumsum(new) - new  # ids issued before each event
    order_id = np.where(new, issued, rng.integers(1, issued))
    order_id[hidden] = 0  # LOBSTER reports hidden executions without an order id

    base = cfg.start_price // cfg.tick_size
    if base + lo < 1:
        raise ValueError(
            f"start_price {cfg.start_price} is too low: the walk for {product}/{date} "
            "falls below zero; raise start_price or lower events_per_day"
        )
    # Busy regimes run fast, and so does the race to empty a queue: trades bunch in time.
    pace = activity[state] * (1 + 4 * focus_out * tau)
    gaps = rng.exponential(1.0, n + 1) / np.append(pace, 1.0)
    clock = np.cumsum(gaps)
    span = cfg.session_end - cfg.session_start
    time = cfg.session_start + span * clock[:n] / clock[n]

    cols: dict[str, np.ndarray | pa.Array] = {
        "time": time,
        "event_type": etype.astype(np.int8),
        "order_id": order_id.astype(np.int64),
        "size": size.astype(np.int64),
        "price": (base + price) * cfg.tick_size,
        "direction": _DIRECTION[side],
    }
    for k in range(1, levels + 1):
        for s, name in ((ASK, "ask"), (BID, "bid")):
            p = ask[state] + (k - 1) if s == ASK else bid[state] - (k - 1)
            q = book.lookup(np.full(n, s), p, idx, init, *keys)
            cols[f"{name}_price_{k}"] = (base + p) * cfg.tick_size
            cols[f"{name}_size_{k}"] = q
    cols["halted"] = np.zeros(n, bool)
    schema = book_schema(levels)
    table = pa.Table.from_arrays([pa.array(cols[f.name], f.type) for f in schema], schema=schema)
    validate_book(table, f"synthetic:{product}/{date.isoformat()}")
    return table


def _shares(rng: np.random.Generator, mean: np.ndarray) -> np.ndarray:
    """Order/queue sizes around `mean`: heavy-tailed, mostly round lots, always >= 1."""
    raw = np.asarray(mean) * rng.lognormal(-0.245, 0.7, np.shape(mean))  # E[lognormal] = 1
    lots = np.maximum(np.round(raw / 100), 1) * 100
    return np.where(rng.random(np.shape(mean)) < 0.6, lots, np.maximum(np.round(raw), 1)).astype(
        np.int64
    )


@dataclass(slots=True, frozen=True)
class _Queues:
    """Queue sizes by (side, price tick, event): a level keeps its size as the ladder shifts."""

    lo: int
    hi: int
    n: int

    def _key(self, side: np.ndarray, price: np.ndarray, event: np.ndarray) -> np.ndarray:
        queue = side.astype(np.int64) * (self.hi - self.lo + 1) + (price - self.lo)
        return queue * (self.n + 1) + (event + 1)

    def index(
        self,
        side: np.ndarray,
        price: np.ndarray,
        event: np.ndarray,
        value: np.ndarray,
        assign: np.ndarray,
    ) -> tuple[np.ndarray, np.ndarray]:
        """Sorted assignment keys and their values."""
        keys = self._key(side[assign], price[assign], event[assign])
        order = np.argsort(keys, kind="stable")
        return keys[order], value[assign][order]

    def lookup(
        self,
        side: np.ndarray,
        price: np.ndarray,
        event: np.ndarray,
        init: np.ndarray,
        keys: np.ndarray,
        values: np.ndarray,
    ) -> np.ndarray:
        """Size of queue (side, price) after `event`: its latest assignment, else `init`."""
        q = self._key(side, price, event)
        pos = np.searchsorted(keys, q, side="right") - 1
        found = (pos >= 0) & (keys[np.maximum(pos, 0)] // (self.n + 1) == q // (self.n + 1))
        fallback = init[side, price - self.lo]
        return np.where(found, values[np.maximum(pos, 0)], fallback)
