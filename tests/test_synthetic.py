"""The synthetic order-book generator: deterministic, valid, plausible, and learnable."""

from __future__ import annotations

import datetime as dt
import hashlib
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from quantloop.tasks.data.ingest import validate_book
from quantloop.tasks.data.schema import book_schema
from quantloop.tasks.data.synthetic import SyntheticConfig, generate_day

DAY = dt.date(2024, 1, 2)
CFG = SyntheticConfig(seed=7, levels=5, events_per_day=20_000)


@pytest.fixture(scope="module")
def day() -> dict[str, np.ndarray]:
    table = generate_day("SYN", DAY, CFG)
    return {c: table.column(c).to_numpy() for c in table.column_names}


def test_deterministic_by_seed_product_date():
    small = SyntheticConfig(seed=1, levels=3, events_per_day=2_000)
    a = generate_day("SYN", DAY, small)
    assert a.equals(generate_day("SYN", DAY, small))
    assert not a.equals(
        generate_day("SYN", DAY, SyntheticConfig(seed=2, levels=3, events_per_day=2_000))
    )
    assert not a.equals(generate_day("OTHER", DAY, small))
    assert not a.equals(generate_day("SYN", DAY + dt.timedelta(days=1), small))


def _digest(table: pa.Table) -> str:
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    return hashlib.sha256(sink.getvalue().to_pybytes()).hexdigest()


def test_same_in_another_process():
    """The per-partition seed is a stable hash, not Python's salted hash()."""
    cfg = SyntheticConfig(levels=2, events_per_day=500)
    code = (
        "import datetime as dt; from tests.test_synthetic import _digest;"
        "from quantloop.tasks.data.synthetic import SyntheticConfig, generate_day;"
        "cfg = SyntheticConfig(levels=2, events_per_day=500);"
        "print(_digest(generate_day('SYN', dt.date(2024, 1, 2), cfg)), end='')"
    )
    digests = {
        subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            check=True,
            cwd=Path(__file__).resolve().parents[1],
            env={**os.environ, "PYTHONHASHSEED": seed},
        ).stdout
        for seed in ("1", "2")
    }
    assert digests == {_digest(generate_day("SYN", DAY, cfg))}


@pytest.mark.parametrize("levels", [1, 3, 10])
def test_any_number_of_levels_passes_validation(levels):
    cfg = SyntheticConfig(seed=3, levels=levels, events_per_day=5_000)
    table = generate_day("SYN", DAY, cfg)
    assert table.schema.equals(book_schema(levels))
    assert table.num_rows == 5_000
    validate_book(table, f"synthetic:SYN/{DAY}")
    for k in range(1, levels + 1):
        for side in ("ask", "bid"):
            assert table.column(f"{side}_price_{k}").null_count == 0
            assert pa.compute.min(table.column(f"{side}_size_{k}")).as_py() > 0


def test_plausible_book(day):
    spread = (day["ask_price_1"] - day["bid_price_1"]) / CFG.tick_size
    assert np.all(spread >= 1) and np.all(spread == np.round(spread))
    assert np.mean(spread <= 3) > 0.95
    assert np.bincount(spread.astype(int)).argmax() == 1  # one tick is the usual spread
    t = day["time"]
    assert 34_200 <= t[0] and t[-1] < 57_600 and np.all(np.diff(t) >= 0)
    assert set(np.unique(day["event_type"])) == {1, 2, 3, 4, 5}
    assert np.all(day["size"] > 0)
    # Queues differ across levels and over time.
    medians = [np.median(day[f"ask_size_{k}"]) for k in range(1, CFG.levels + 1)]
    assert len(set(medians)) > 1
    assert np.std(day["bid_size_1"]) > 0
    mid = (day["ask_price_1"] + day["bid_price_1"]) / 2
    assert np.count_nonzero(np.diff(mid)) > 500


def test_messages_match_book_changes(day):
    """Each event with unchanged best prices changes exactly the queue it names, by its size."""
    names = [(s, k) for k in range(1, CFG.levels + 1) for s in ("ask", "bid")]
    prices = np.stack([day[f"{s}_price_{k}"] for s, k in names], 1)
    sizes = np.stack([day[f"{s}_size_{k}"] for s, k in names], 1)
    is_ask = np.array([s == "ask" for s, _ in names])
    steady = np.all(prices[1:] == prices[:-1], axis=1)
    et, size, price, direction = (day[c][1:] for c in ("event_type", "size", "price", "direction"))
    sign = np.select([et == 1, np.isin(et, [2, 3, 4])], [1, -1], 0)
    named = (prices[1:] == price[:, None]) & (is_ask[None, :] == (direction == -1)[:, None])
    expected = np.where(named, (sign * size)[:, None], 0)
    assert np.all((sizes[1:] - sizes[:-1] == expected)[steady])
    assert steady.mean() > 0.8


def test_clustering_and_signal(day):
    mid = (day["ask_price_1"] + day["bid_price_1"]) / 2
    # Best-level imbalance foreshadows the sign of the next mid move.
    moves = np.flatnonzero(np.diff(mid))
    nxt = np.searchsorted(moves, np.arange(len(mid)))
    rows = np.flatnonzero(nxt < len(moves))
    up = np.sign(np.diff(mid)[moves[nxt[rows]]])
    bid, ask = day["bid_size_1"][rows], day["ask_size_1"][rows]
    imbalance = (bid - ask) / (bid + ask)
    assert np.corrcoef(imbalance, up)[0, 1] > 0.1
    # Trades come in bursts: one-minute trade counts are over-dispersed (Poisson: var = mean).
    trades = day["time"][day["event_type"] == 4]
    counts = np.bincount(((trades - 34_200) // 60).astype(int))
    assert counts.var() > 2 * counts.mean()
    # Volatility clusters: absolute one-minute mid changes are autocorrelated.
    minute = ((day["time"] - 34_200) // 60).astype(int)
    last = np.flatnonzero(np.diff(minute, append=minute[-1] + 1))
    moves_abs = np.abs(np.diff(mid[last]))
    assert np.corrcoef(moves_abs[:-1], moves_abs[1:])[0, 1] > 0.1


def test_config_validation():
    cfg = SyntheticConfig(levels=1, events_per_day=100)
    for field, bad in [("levels", 0), ("signal", 1.5), ("max_spread_ticks", 1), ("seed", -1)]:
        with pytest.raises(ValueError, match=field):
            SyntheticConfig(**{field: bad})
    with pytest.raises(ValueError, match="product"):
        generate_day("bad name!", DAY, cfg)
