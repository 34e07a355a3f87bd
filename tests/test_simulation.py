"""Replay, mark-out, split and summary on hand-computed examples."""

from __future__ import annotations

import datetime as dt
import math

import numpy as np
import pyarrow as pa
import pytest

from quantloop.tasks.features import FeatureParams, compute_features
from quantloop.tasks.schema import Partition
from quantloop.tasks.simulation import (
    SimConfig,
    baseline_signal,
    greedy_cooldown,
    markout,
    simulate,
    split_train_test,
    summarize,
    thresholds_from,
)
from tests.books import random_book

CFG = SimConfig(markout_horizons_s=(1, 5), markout_horizons_events=(2,), min_gap_events=3)


def features(time, bid, ask) -> pa.Table:
    bid, ask = np.asarray(bid, float), np.asarray(ask, float)
    return pa.table(
        {"time": np.asarray(time, float), "bid": bid, "ask": ask, "mid": (bid + ask) / 2}
    )


def test_buy_and_sell_markouts_by_hand():
    # a buy at 100.00 (the ask) and 5 s later the mid is 100.10 -> +10 bps
    f = features(
        time=[0.0, 0.5, 2.0, 5.0, 6.0],
        bid=[99.90, 99.95, 100.00, 100.05, 100.05],
        ask=[100.00, 100.05, 100.10, 100.15, 100.15],
    )
    signal = np.array([1.0, 0.0, 0.0, -1.0, 0.0])
    trades = simulate(f, signal, 0.5, CFG)
    assert trades.column("row").to_pylist() == [0, 3]
    assert trades.column("side").to_pylist() == [1, -1]
    assert trades.column("price").to_pylist() == [100.00, 100.05]  # ask for buy, bid for sell
    m = markout(trades, f, CFG)
    buy, sell = m.slice(0, 1).to_pylist()[0], m.slice(1, 1).to_pylist()[0]
    # buy: 1 s -> last event at or before t=1 is row 1 (mid 100.00): 0 bps; 5 s -> row 3
    assert buy["markout_1s"] == pytest.approx(0.0)
    assert buy["markout_5s"] == pytest.approx(10.0)
    assert buy["markout_2ev"] == pytest.approx((100.05 - 100.00) / 100.00 * 1e4)
    # sell at the bid 100.05 at t=5: mid 1 s later is 100.10 -> -(0.05 / 100.05) bps
    assert sell["markout_1s"] == pytest.approx(-0.05 / 100.05 * 1e4)
    assert math.isnan(sell["markout_5s"])  # t + 5 = 10 is past the day's last event (6 s)
    assert math.isnan(sell["markout_2ev"])  # row 5 does not exist


def test_sell_that_earns():
    f = features(time=[0.0, 5.0], bid=[100.10, 99.95], ask=[100.20, 100.05])
    trades = simulate(f, np.array([-3.0, 0.0]), 1.0, CFG)
    m = markout(trades, f, CFG)
    # sell at 100.10, mid 5 s later 100.00 -> +(0.10 / 100.10) * 1e4 ~ +9.99 bps
    assert m.column("markout_5s").to_pylist() == [pytest.approx(0.10 / 100.10 * 1e4)]
    assert m.column("markout_1s").to_pylist() == [pytest.approx(-0.05 / 100.10 * 1e4)]


def test_min_gap_is_a_greedy_cooldown():
    # triggers at 0 1 2 3 4 | 7 8 | 10 with gap 3 -> 0, 3, 7, 10
    signal = np.zeros(12)
    signal[[0, 1, 2, 3, 4, 7, 8, 10]] = [2, -2, 2, -2, 2, 2, -2, -2]
    f = features(np.arange(12.0), np.full(12, 99.0), np.full(12, 101.0))
    trades = simulate(f, signal, 1.0, CFG)
    assert trades.column("row").to_pylist() == [0, 3, 7, 10]
    assert trades.column("side").to_pylist() == [1, -1, 1, -1]
    # against a plain loop on random trigger sets
    rng = np.random.default_rng(0)
    for _ in range(300):
        events = np.flatnonzero(rng.random(int(rng.integers(0, 120))) < rng.random())
        gap = int(rng.integers(1, 12))
        expected, last = [], -(10**9)
        for e in events:
            if e - last >= gap:
                expected.append(int(e))
                last = e
        assert greedy_cooldown(events, gap).tolist() == expected


def test_threshold_is_a_quantile_of_abs_signal_and_sets_the_rate():
    rng = np.random.default_rng(1)
    train = rng.standard_normal((20_000, 2))
    cfg = SimConfig(signal_horizon=1, trade_quantile=0.9, min_gap_events=1)
    threshold = thresholds_from(train, cfg)
    assert threshold == pytest.approx(np.quantile(np.abs(train[:, 1]), 0.9))
    f = features(np.arange(20_000.0), np.full(20_000, 99.0), np.full(20_000, 101.0))
    trades = simulate(f, train, threshold, cfg)
    assert trades.num_rows == pytest.approx(2_000, abs=2)
    with pytest.raises(ValueError, match="signal_horizon"):
        thresholds_from(train, SimConfig(signal_horizon=2))


def label_table(n: int) -> pa.Table:
    mid = 100 + np.arange(n, dtype=float)
    return pa.table(
        {
            "time": np.arange(n, dtype=float),
            "mid": mid,
            "label_2": np.concatenate([mid[2:] - mid[:-2], [np.nan] * 2]),
            "label_5": np.concatenate([mid[5:] - mid[:-5], [np.nan] * 5]),
        }
    )


def test_split_one_date_cuts_rows_without_leak():
    p = Partition("AAA", dt.date(2026, 1, 5))
    train, test = split_train_test({p: label_table(20)}, holdout_fraction=0.3)
    assert list(train) == [p] and list(test) == [p]
    head, tail = train[p], test[p]
    assert head.num_rows == 14 and tail.num_rows == 6
    assert tail.column("time").to_pylist()[0] == 14.0
    label_2 = np.array(head.column("label_2").to_pylist(), float)
    label_5 = np.array(head.column("label_5").to_pylist(), float)
    # row r's label_h reads the mid at r + h: it must be < 14
    assert np.isfinite(label_2[:12]).all() and np.isnan(label_2[12:]).all()
    assert np.isfinite(label_5[:9]).all() and np.isnan(label_5[9:]).all()
    assert label_2[:12].tolist() == [2.0] * 12  # untouched where there is no leak


def test_split_several_dates_holds_out_the_last_ones():
    dates = [dt.date(2026, 1, d) for d in (5, 6, 7, 8)]
    tables = {Partition(x, d): label_table(5) for x in ("AAA", "BBB") for d in dates}
    train, test = split_train_test(tables, holdout_fraction=0.3)  # ceil(1.2) = 2 dates
    assert {p.date for p in test} == set(dates[2:]) and len(test) == 4
    assert {p.date for p in train} == set(dates[:2]) and len(train) == 4
    assert train[Partition("AAA", dates[0])] is tables[Partition("AAA", dates[0])]
    two = {Partition("AAA", d): label_table(5) for d in dates[:2]}
    train, test = split_train_test(two, holdout_fraction=0.9)  # keeps one date for training
    assert [p.date for p in train] == [dates[0]] and [p.date for p in test] == [dates[1]]
    with pytest.raises(ValueError, match="holdout_fraction"):
        split_train_test(two, holdout_fraction=1.0)


def test_summarize_counts_means_and_hit_rates():
    a = pa.table({"markout_1s": [1.0, -1.0, 3.0], "markout_10ev": [2.0, np.nan, -2.0]})
    b = pa.table({"markout_1s": [0.0], "markout_10ev": [4.0]})
    s = summarize({"AAA": a, "BBB": b})
    assert set(s) == {"AAA", "BBB", "total"}
    assert s["AAA"]["count"] == 3 and s["total"]["count"] == 4
    assert s["AAA"]["mean_bps"] == {"1s": 1.0, "10ev": 0.0}
    assert s["AAA"]["hit_rate"] == {"1s": pytest.approx(2 / 3), "10ev": 0.5}  # NaN not counted
    assert s["total"]["mean_bps"] == {"1s": 0.75, "10ev": pytest.approx(4 / 3)}
    assert s["total"]["hit_rate"] == {"1s": 0.5, "10ev": pytest.approx(2 / 3)}  # 0 is no hit


def test_default_config_end_to_end_on_a_random_book():
    f = compute_features(random_book(3000, levels=5, seed=2), FeatureParams())
    cfg = SimConfig()
    signal = baseline_signal(f)
    assert np.array_equal(np.sign(signal), np.sign(f.column("imbalance_1").to_numpy()))
    trades = simulate(f, signal, thresholds_from(signal, cfg), cfg)
    rows = trades.column("row").to_numpy()
    assert trades.num_rows > 0 and (np.diff(rows) >= cfg.min_gap_events).all()
    s = summarize({"AAA": markout(trades, f, cfg)})
    keys = ["1s", "5s", "30s", "60s", "300s", "10ev", "100ev"]
    assert list(s["total"]["mean_bps"]) == keys and list(s["total"]["hit_rate"]) == keys
    assert s["total"]["count"] == trades.num_rows


def markouts(times, values, day="2026-03-02") -> pa.Table:
    return pa.table({"time": pa.array(times, pa.float64()),
                     "markout_5s": pa.array(values, pa.float64()),
                     "day": pa.array([day] * len(times))})  # fmt: skip


def test_standard_errors_and_the_paired_difference_by_hand():
    from quantloop.tasks.simulation import paired_difference

    s = summarize({"A": markouts([1, 2, 3, 4], [1.0, 3.0, 5.0, float("nan")])})
    assert s["A"]["se_bps"]["5s"] == pytest.approx(np.std([1, 3, 5], ddof=1) / math.sqrt(3))
    # Buckets of 300 s of one day pair up; the model's trades at 301 s and the baseline's
    # at 599 s share a bucket, the model's lone trade at 900 s has no partner.
    model = {"A": markouts([10, 20, 301, 900], [2.0, 4.0, 1.0, 50.0])}
    base = {"A": markouts([15, 599], [1.0, 3.0]), "B": markouts([5], [9.0])}
    [(key, d)] = paired_difference(model, base, ["5s"]).items()
    diffs = [3.0 - 1.0, 1.0 - 3.0]  # bucket 0: mean(2, 4) - 1; bucket 1: 1 - 3
    assert d == {"mean_bps": pytest.approx(np.mean(diffs)), "pairs": 2,
                 "se_bps": pytest.approx(np.std(diffs, ddof=1) / math.sqrt(2))}  # fmt: skip
    # another day is another bucket, not a pair
    other_day = {"A": markouts([15], [1.0], day="2026-03-03")}
    assert paired_difference(model, other_day, ["5s"])["5s"]["pairs"] == 0


def test_markout_plot_keeps_clock_and_event_horizons_apart():
    from quantloop.tasks.plots import markout_curve

    curve = {"1s": -1.0, "5s": -0.8, "300s": -0.1, "10ev": -0.9, "100ev": -0.3}
    fig = markout_curve({"model": curve})
    clock, events = fig.axes
    [clock_line] = clock.get_lines()[:1]
    [event_line] = events.get_lines()[:1]
    assert list(clock_line.get_xdata()) == [1.0, 5.0, 300.0]
    assert list(event_line.get_xdata()) == [10.0, 100.0]
    assert list(event_line.get_ydata()) == [-0.9, -0.3]
