"""Small hand-made order books for tests (the synthetic generator has its own tests)."""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from quantloop.tasks.data.schema import book_schema


def random_book(n: int = 2_000, levels: int = 2, seed: int = 0) -> pa.Table:
    """A valid book: mid on a tick random walk, 1-2 tick spread, random queue sizes."""
    rng = np.random.default_rng(seed)
    tick = 100  # one cent in LOBSTER units
    mid_ticks = 10_000 + np.cumsum(rng.integers(-1, 2, n))
    spread = rng.integers(1, 3, n)
    bid1 = mid_ticks * tick
    ask1 = bid1 + spread * tick
    cols = {
        "time": 34_200 + np.cumsum(rng.exponential(0.1, n)),
        "event_type": rng.choice([1, 2, 3, 4], n).astype(np.int8),
        "order_id": np.arange(n, dtype=np.int64),
        "size": rng.integers(1, 500, n),
        "price": bid1,
        "direction": rng.choice([-1, 1], n).astype(np.int8),
    }
    for i in range(1, levels + 1):
        cols[f"ask_price_{i}"] = ask1 + (i - 1) * tick
        cols[f"ask_size_{i}"] = rng.integers(1, 1_000, n)
        cols[f"bid_price_{i}"] = bid1 - (i - 1) * tick
        cols[f"bid_size_{i}"] = rng.integers(1, 1_000, n)
    cols["halted"] = np.zeros(n, dtype=bool)
    return pa.table(cols).cast(book_schema(levels))
