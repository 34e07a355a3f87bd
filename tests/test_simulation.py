"""Replay, mark-out, split and summary on hand-computed examples."""

from __future__ import annotations

import dataclasses
import datetime as dt
import math
import re

import numpy as np
import pyarrow as pa
import pytest

from quantloop.tasks.data.schema import Partition
from quantloop.tasks.data.synthetic import SyntheticConfig, generate_day
from quantloop.tasks.research.features import FeatureParams, compute_features
from quantloop.tasks.research.simulation import (
    SimConfig,
    baseline_signal,
    daily_pnl,
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


def test_too_few_windows_is_insufficient_data_not_a_small_standard_error():
    from quantloop.tasks.research.simulation import paired_difference

    s = summarize({"A": markouts([1, 2, 3, 4], [1.0, 3.0, 5.0, float("nan")])})
    assert s["A"]["mean_bps"]["5s"] == pytest.approx(3.0)
    assert s["A"]["se_iid_bps"]["5s"] == pytest.approx(np.std([1, 3, 5], ddof=1) / math.sqrt(3))
    assert math.isnan(s["A"]["se_bps"]["5s"])
    assert s["A"]["insufficient"]["5s"].startswith("insufficient data: 1.0 effective 10 s")
    d = paired_difference({"A": markouts([10, 20], [2.0, 4.0])}, {"A": markouts([15], [1.0])},
                          ["5s"])["5s"]  # fmt: skip
    assert d["mean_bps"] == pytest.approx(2.0) and math.isnan(d["se_bps"])
    assert d["significant"] is False and d["insufficient"]


def test_paired_difference_takes_out_the_moves_both_signals_share():
    """Both signals trade the same minutes, each mark-out a shared market move plus its
    own noise, the model 0.5 bps better: the paired SE is the noise's, far under the two
    means' own SEs, and the difference is found."""
    from quantloop.tasks.research.simulation import paired_difference

    rng = np.random.default_rng(3)
    t = np.arange(2_000) * 12.0 + 34_200  # a trade every 12 s: 2,000 windows of 10 s
    market = rng.normal(0, 5.0, len(t))
    model = markouts(t, market + 0.5 + rng.normal(0, 1.0, len(t)))
    base = markouts(t + 1.0, market + rng.normal(0, 1.0, len(t)))
    d = paired_difference({"A": model}, {"A": base}, ["5s"])["5s"]
    alone = summarize({"A": model})["A"]["se_bps"]["5s"]
    assert d["mean_bps"] == pytest.approx(0.5, abs=0.1)
    assert d["se_bps"] == pytest.approx(math.sqrt(2 / len(t)), rel=0.2)
    assert alone > 3 * d["se_bps"] and d["significant"] and d["p_holm"] < 1e-6
    # the same data after 3 trials on it: Sidak over Holm's p
    tried = paired_difference({"A": model}, {"A": base}, ["5s"], trials=3)["5s"]
    assert tried["trials"] == 3
    assert tried["p_adjusted"] == pytest.approx(1 - (1 - d["p_holm"]) ** 3)


def test_markout_plot_keeps_clock_and_event_horizons_apart():
    from quantloop.tasks.records.plots import markout_curve

    curve = {"1s": -1.0, "5s": -0.8, "300s": -0.1, "10ev": -0.9, "100ev": -0.3}
    fig = markout_curve({"model": curve})
    clock, events = fig.axes
    [clock_line] = clock.get_lines()[:1]
    [event_line] = events.get_lines()[:1]
    assert list(clock_line.get_xdata()) == [1.0, 5.0, 300.0]
    assert list(event_line.get_xdata()) == [10.0, 100.0]
    assert list(event_line.get_ydata()) == [-0.9, -0.3]


# ---------------------------------------------------------------- latency, fees, daily P&L


def synthetic_day(events: int = 6_000) -> pa.Table:
    book = generate_day("SYNA", dt.date(2026, 3, 2), SyntheticConfig(events_per_day=events))
    return compute_features(book, FeatureParams())


def replay_before_latency(f: pa.Table, signal: np.ndarray, threshold: float, cfg: SimConfig):
    """The replay as it was before latency and fees (commit ef6231f), kept here as the
    reference: fill at the decision row's touch, mark out from the decision."""

    def col(table, name):
        return table.column(name).to_numpy(zero_copy_only=False).astype(np.float64)

    s = signal if signal.ndim == 1 else signal[:, cfg.signal_horizon]
    rows = greedy_cooldown(
        np.flatnonzero(np.abs(np.nan_to_num(s, nan=0.0)) > threshold), cfg.min_gap_events
    )
    side = np.sign(s[rows]).astype(np.int8)
    trades = pa.table({"row": rows.astype(np.int64), "time": col(f, "time")[rows],
                       "side": side,
                       "price": np.where(side > 0, col(f, "ask")[rows], col(f, "bid")[rows]),
                       "mid": col(f, "mid")[rows], "signal": s[rows]})  # fmt: skip
    time, mid = col(f, "time"), col(f, "mid")
    n, t, d, p = len(time), col(trades, "time"), col(trades, "side"), col(trades, "price")
    targets = [
        (np.searchsorted(time, t + h, side="right") - 1, t + h <= time[-1])
        for h in cfg.markout_horizons_s
    ] + [(rows + k, rows + k < n) for k in cfg.markout_horizons_events]
    out = trades
    for key, (j, ok) in zip(cfg.horizon_keys(), targets, strict=True):
        bps = np.where(ok, d * (mid[np.clip(j, 0, n - 1)] - p) / p * 1e4, np.nan)
        out = out.append_column(f"markout_{key}", pa.array(bps, pa.float64()))
    return out


def same_bits(a: pa.ChunkedArray, b: pa.ChunkedArray) -> bool:
    x, y = a.to_numpy(), b.to_numpy()
    return a.type == b.type and x.shape == y.shape and x.tobytes() == y.tobytes()


@pytest.mark.parametrize("min_gap", [1, 10])
def test_zero_latency_and_fee_is_the_replay_before_them_bit_for_bit(min_gap):
    f = synthetic_day()
    cfg = SimConfig(min_gap_events=min_gap)
    signal = baseline_signal(f)
    signal[::97] = np.nan  # a model's NaN predictions trade nowhere, as before
    threshold = thresholds_from(signal, cfg)
    expected = replay_before_latency(f, signal, threshold, cfg)
    marked = markout(simulate(f, signal, threshold, cfg), f, cfg)
    assert expected.num_rows > 100 and marked.num_rows == expected.num_rows
    for name in expected.column_names:
        assert same_bits(marked.column(name), expected.column(name)), name
    assert same_bits(marked.column("fill_row"), expected.column("row"))
    assert same_bits(marked.column("fill_time"), expected.column("time"))
    for key in cfg.horizon_keys():
        assert same_bits(marked.column(f"net_{key}"), expected.column(f"markout_{key}")), key
    # a table stored before fills had columns of their own is marked out as before
    old = markout(simulate(f, signal, threshold, cfg).drop_columns(["fill_row", "fill_time"]),
                  f, cfg)  # fmt: skip
    for name in expected.column_names:
        assert same_bits(old.column(name), expected.column(name)), name


def test_a_latency_in_events_fills_that_many_rows_later_at_that_rows_touch():
    f = features(time=[0.0, 0.5, 2.0, 5.0, 6.0],
                 bid=[99.90, 99.95, 100.00, 100.05, 100.05],
                 ask=[100.00, 100.05, 100.10, 100.15, 100.15])  # fmt: skip
    cfg = SimConfig(markout_horizons_s=(1,), markout_horizons_events=(1,), min_gap_events=1,
                    latency_events=2)  # fmt: skip
    [buy] = simulate(f, np.array([1.0, 0, 0, 0, 0]), 0.5, cfg).to_pylist()
    assert (buy["row"], buy["time"], buy["mid"]) == (0, 0.0, 99.95)  # the decision
    assert (buy["fill_row"], buy["fill_time"], buy["price"]) == (2, 2.0, 100.10)  # the fill
    # on a synthetic day: every fill k rows after its decision, at the touch there
    f = synthetic_day()
    cfg = SimConfig(latency_events=3)
    signal = baseline_signal(f)
    trades = simulate(f, signal, thresholds_from(signal, cfg), cfg)
    rows, fill = trades.column("row").to_numpy(), trades.column("fill_row").to_numpy()
    assert trades.num_rows > 100 and (fill == rows + 3).all()
    side = trades.column("side").to_numpy()
    touch = np.where(side > 0, f.column("ask").to_numpy()[fill], f.column("bid").to_numpy()[fill])
    assert np.array_equal(trades.column("price").to_numpy(), touch)
    assert np.array_equal(trades.column("fill_time").to_numpy(), f.column("time").to_numpy()[fill])
    assert np.array_equal(trades.column("mid").to_numpy(), f.column("mid").to_numpy()[rows])


def test_a_latency_in_seconds_fills_at_the_book_in_force_on_arrival():
    # rows 0 and 1 share a time stamp; rows 2.. follow at 0.4, 1.0, 1.5, 3.0
    f = features(time=[0.0, 0.0, 0.4, 1.0, 1.5, 3.0],
                 bid=[99.0, 99.1, 99.2, 99.3, 99.4, 99.5],
                 ask=[100.0, 100.1, 100.2, 100.3, 100.4, 100.5])  # fmt: skip
    buy = np.array([1.0, 0, 0, 0, 0, 0])

    def fill(**latency):
        cfg = SimConfig(markout_horizons_s=(1,), markout_horizons_events=(1,), **latency)
        [trade] = simulate(f, buy, 0.5, cfg).to_pylist()
        return trade["fill_row"], trade["fill_time"], trade["price"]

    assert fill() == (0, 0.0, 100.0)  # no latency: row 1, stamped the same time, is not passed
    assert fill(latency_s=0.1) == (1, 0.1, 100.1)  # any delay passes it
    assert fill(latency_s=0.5) == (2, 0.5, 100.2)  # last event at or before 0.5 is row 2
    assert fill(latency_s=1.0) == (3, 1.0, 100.3)  # an event exactly on arrival counts
    assert fill(latency_s=0.5, latency_events=3) == (3, 1.0, 100.3)  # the events are later
    assert fill(latency_s=1.4, latency_events=1) == (3, 1.4, 100.3)  # the clock is later


def test_a_trade_whose_fill_is_past_the_days_end_is_dropped():
    f = features(np.arange(5.0), np.full(5, 99.0), np.full(5, 101.0))
    signal = np.array([1.0, 0.0, 0.0, -1.0, 0.0])

    def decisions(**latency):
        cfg = SimConfig(markout_horizons_s=(1,), markout_horizons_events=(1,), min_gap_events=1,
                        **latency)  # fmt: skip
        return simulate(f, signal, 0.5, cfg).column("row").to_pylist()

    assert decisions(latency_events=1) == [0, 3]  # row 3 fills at row 4, the last
    assert decisions(latency_events=2) == [0]  # row 3 would fill at row 5: no such row
    assert decisions(latency_s=1.0) == [0, 3]  # 3 + 1 s is the last event's time
    assert decisions(latency_s=1.5) == [0]  # 3 + 1.5 s is after the close
    assert decisions(latency_events=5) == []


def test_the_fee_comes_off_every_mark_out_and_a_rebate_adds_to_it():
    f = synthetic_day()
    gross = None
    for fee in (0.0, 2.5, -0.3):
        cfg = SimConfig(fee_bps=fee, latency_s=0.2)
        signal = baseline_signal(f)
        marked = markout(simulate(f, signal, thresholds_from(signal, cfg), cfg), f, cfg)
        for key in cfg.horizon_keys():
            g = marked.column(f"markout_{key}").to_numpy()
            net = marked.column(f"net_{key}").to_numpy()
            assert np.array_equal(np.isnan(net), np.isnan(g)), key  # NaN stays NaN
            assert np.array_equal(net[~np.isnan(g)], g[~np.isnan(g)] - fee), key
            if gross is not None:  # the fee leaves the gross mark-out alone
                assert np.array_equal(g, gross[key], equal_nan=True), key
            if fee < 0:
                assert (net[~np.isnan(g)] > g[~np.isnan(g)]).all(), key
        gross = {k: marked.column(f"markout_{k}").to_numpy() for k in cfg.horizon_keys()}
        assert np.isnan(gross["300s"]).any()  # the day's last trades: NaN was tried


def test_elapsed_is_the_time_from_the_fill_to_the_event_the_mark_out_reads():
    f = features(time=[0.0, 0.0, 0.4, 1.0, 1.5, 3.0, 13.0],
                 bid=np.full(7, 99.0), ask=np.full(7, 101.0))  # fmt: skip
    cfg = SimConfig(markout_horizons_s=(1, 5, 20), markout_horizons_events=(2, 5),
                    latency_s=0.5)  # fmt: skip
    [trade] = markout(simulate(f, np.array([1.0, 0, 0, 0, 0, 0, 0]), 0.5, cfg), f, cfg).to_pylist()
    assert (trade["fill_row"], trade["fill_time"]) == (2, 0.5)
    assert trade["elapsed_1s"] == 1.0  # the last event at or before 1.5 is row 4, at 1.5
    assert trade["elapsed_5s"] == 2.5  # at or before 5.5: row 5, at 3.0
    assert math.isnan(trade["elapsed_20s"]) and math.isnan(trade["markout_20s"])  # past 13
    assert trade["elapsed_2ev"] == 1.0  # row 2 + 2 = 4, at 1.5: 1.5 - 0.5
    assert math.isnan(trade["elapsed_5ev"]) and math.isnan(trade["markout_5ev"])  # row 7
    # nothing happens within 1 s of a fill at 3.5: the mark-out reads the fill's own book
    [late] = markout(simulate(f, np.array([0, 0, 0, 0, 0, 1.0, 0]), 0.5, cfg), f, cfg).to_pylist()
    assert (late["fill_row"], late["fill_time"], late["elapsed_1s"]) == (5, 3.5, 0.0)
    # on a synthetic day: clock elapsed within [0, h], NaN exactly where the mark-out is
    f = synthetic_day()
    cfg = SimConfig(latency_s=0.7, latency_events=1)
    signal = baseline_signal(f)
    marked = markout(simulate(f, signal, thresholds_from(signal, cfg), cfg), f, cfg)
    time = f.column("time").to_numpy()
    fill, fill_time = marked.column("fill_row").to_numpy(), marked.column("fill_time").to_numpy()
    for key, h in zip(cfg.horizon_keys(), cfg.markout_horizons_s, strict=False):
        e = marked.column(f"elapsed_{key}").to_numpy()
        assert np.array_equal(np.isnan(e), np.isnan(marked.column(f"markout_{key}").to_numpy()))
        assert ((e[~np.isnan(e)] >= 0) & (e[~np.isnan(e)] <= h)).all(), key
    for k in cfg.markout_horizons_events:
        e = marked.column(f"elapsed_{k}ev").to_numpy()
        ok = fill + k < len(time)
        assert np.array_equal(e[ok], time[fill[ok] + k] - fill_time[ok]) and np.isnan(e[~ok]).all()


def test_daily_pnl_sums_each_days_net_mark_outs():
    cfg = SimConfig(markout_horizons_s=(1, 5), markout_horizons_events=(2,), min_gap_events=1,
                    fee_bps=1.0, pnl_horizon="5s")  # fmt: skip
    f = features(time=[0.0, 0.5, 2.0, 5.0, 6.0],
                 bid=[99.90, 99.95, 100.00, 100.05, 100.05],
                 ask=[100.00, 100.05, 100.10, 100.15, 100.15])  # fmt: skip
    days = []
    for day, signal in (("2026-03-03", [1.0, 0, 0, -1.0, 0]), ("2026-03-02", [0, -1.0, 0, 0, 0]),
                        ("2026-03-04", [0, 0, 0, 0, 1.0])):  # fmt: skip
        m = markout(simulate(f, np.array(signal), 0.5, cfg), f, cfg)
        days.append(m.append_column("day", pa.array([day] * m.num_rows)))
    pnl = daily_pnl(pa.concat_tables(days), cfg).to_pydict()
    assert pnl["day"] == ["2026-03-02", "2026-03-03", "2026-03-04"]
    # 03-03: the buy at 100.00 marks +10 bps at 5 s; the sell at 5.0 runs past the close
    # 03-02: a sell at the bid 99.95 at 0.5 s, mid 100.10 at 5.5 s; 03-04: past the close
    sell = -(100.10 - 99.95) / 99.95 * 1e4
    assert pnl["trades"] == [1, 1, 0]
    assert pnl["gross_bps"] == [pytest.approx(sell), pytest.approx(10.0), 0.0]
    assert pnl["fees_bps"] == [pytest.approx(1.0), pytest.approx(1.0), 0.0]
    assert pnl["pnl_bps"] == [pytest.approx(sell - 1), pytest.approx(9.0), 0.0]
    # the default horizon is the last clock one; an event horizon can be named
    assert SimConfig().pnl_key() == "300s" and SimConfig(pnl_horizon="100ev").pnl_key() == "100ev"
    by_events = daily_pnl(pa.concat_tables(days), dataclasses.replace(cfg, pnl_horizon="2ev"))
    assert by_events.column("trades").to_pylist() == [1, 1, 0]  # 03-03: row 3 + 2 is past the end
    with pytest.raises(ValueError, match="net_60s"):
        daily_pnl(days[0], SimConfig(pnl_horizon="60s"))


@pytest.mark.parametrize(
    ("field", "value"),
    [("latency_s", -0.5), ("latency_s", float("nan")), ("latency_events", -1),
     ("latency_events", 1.5), ("fee_bps", 100.5), ("fee_bps", -11.0), ("pnl_horizon", "7s")],
)  # fmt: skip
def test_config_errors_name_the_field_and_the_value(field, value):
    with pytest.raises(ValueError, match=rf"^{field} .*{re.escape(repr(value))}"):
        SimConfig(**{field: value})


def test_the_form_bounds_the_new_fields():
    from pydantic import TypeAdapter, ValidationError

    from quantloop.tasks.research.form import SimForm

    adapter = TypeAdapter(SimForm)
    cfg = adapter.validate_python({"latency_s": 0.25, "latency_events": 2, "fee_bps": -0.2,
                                   "pnl_horizon": "10ev"})  # fmt: skip
    assert cfg == SimConfig(latency_s=0.25, latency_events=2, fee_bps=-0.2, pnl_horizon="10ev")
    with pytest.raises(ValidationError) as err:
        adapter.validate_python({"latency_s": -1, "latency_events": -1, "fee_bps": 101})
    assert {e["loc"] for e in err.value.errors()} == {("latency_s",), ("latency_events",),
                                                     ("fee_bps",)}  # fmt: skip
    with pytest.raises(ValidationError, match="pnl_horizon"):
        adapter.validate_python({"pnl_horizon": "7s"})


def test_equal_counts_keeps_the_strongest_trades_of_the_more_active_signal():
    from quantloop.tasks.research.simulation import equal_counts

    busy = markouts([1, 2, 3, 4], [1.0, 2.0, 3.0, 4.0]).append_column(
        "signal", pa.array([0.5, -3.0, 1.0, 2.0])
    )
    quiet = markouts([5, 6], [9.0, 9.0]).append_column("signal", pa.array([1.0, -1.0]))
    m, b = equal_counts({"A": busy}, {"A": quiet})
    assert b["A"] is quiet
    assert m["A"]["signal"].to_pylist() == [-3.0, 2.0]  # |signal| 3 and 2, in time order
    assert m["A"]["time"].to_pylist() == [2.0, 4.0]


def test_pnl_sums_net_markouts_per_day_with_the_totals_se():
    from quantloop.tasks.research.simulation import pnl

    cfg = SimConfig(fee_bps=0.5, pnl_horizon="5s")
    day1 = markouts([1.0, 2.0], [1.0, 3.0], day="2026-03-02")
    day2 = markouts([1.0], [-2.0], day="2026-03-03")
    tables = {}
    for name, t in (("A", day1), ("B", day2)):
        v = t["markout_5s"].to_numpy()
        tables[name] = t.append_column("net_5s", pa.array(v - cfg.fee_bps))
    out = pnl(tables, cfg)
    assert out["days"] == {"2026-03-02": pytest.approx(3.0), "2026-03-03": pytest.approx(-2.5)}
    assert out["total_bps"] == pytest.approx(0.5)
    assert out["horizon"] == "5s" and math.isnan(out["se_bps"]) and out["insufficient"]


def test_replay_all_replays_a_folds_test_window_at_its_training_parts_threshold():
    """Each fold's replay: its test dates only, each signal's threshold from its training
    dates (other dates, the embargo's and later ones, change nothing), a `fold` column;
    a float is the single split of that share, as before the folds."""
    from quantloop.tasks.research.folds import WalkForward, folds
    from quantloop.tasks.research.simulation import replay_all

    days = [dt.date(2026, 3, 2) + dt.timedelta(days=i) for i in range(4)]
    tables = {Partition(x, d): compute_features(random_book(600, seed=i), FeatureParams())
              for i, (x, d) in enumerate((x, d) for x in ("AAA", "BBB") for d in days)}  # fmt: skip

    def predict(table: pa.Table) -> np.ndarray:  # a "model": the book's own flow imbalance
        return table.column("ofi").to_numpy(zero_copy_only=False)[:, None]

    cfg = SimConfig()
    fold = folds(days, WalkForward(folds=None, test_dates=1, embargo_dates=1))[0]
    assert [fold.train_dates, fold.embargoed, fold.test_dates] == [(d,) for d in days[:3]]
    merged = replay_all(predict, tables, cfg, fold)
    assert all(sorted(merged[n]) == ["AAA", "BBB"] for n in merged)
    assert min(t.num_rows for n in merged for t in merged[n].values()) > 0
    for name in ("model", "baseline"):
        for product, marks in merged[name].items():
            assert set(marks["day"].to_pylist()) == {"2026-03-04"}
            assert set(marks["fold"].to_pylist()) == {0}
            train = tables[Partition(product, days[0])]
            test = tables[Partition(product, days[2])]
            signal = predict if name == "model" else baseline_signal
            threshold = thresholds_from(signal(train), cfg)
            expected = markout(simulate(test, signal(test), threshold, cfg), test, cfg)
            assert_same(marks.drop_columns(["day", "fold"]), expected)
    only_fold = {p: t for p, t in tables.items() if p.date in (days[0], days[2])}
    assert_same_markouts(replay_all(predict, only_fold, cfg, fold), merged)
    (single,) = folds(days, WalkForward(holdout_fraction=0.3))
    assert_same_markouts(replay_all(predict, tables, cfg, 0.3),
                         replay_all(predict, tables, cfg, single))  # fmt: skip


def assert_same(a: pa.Table, b: pa.Table) -> None:
    # pa.Table.equals treats NaN as unequal to itself (a mark-out past the close is NaN)
    assert a.column_names == b.column_names and a.num_rows == b.num_rows
    for name in a.column_names:
        np.testing.assert_array_equal(a[name].to_numpy(), b[name].to_numpy())


def assert_same_markouts(a: dict, b: dict) -> None:
    assert {n: sorted(t) for n, t in a.items()} == {n: sorted(t) for n, t in b.items()}
    for name, by_product in a.items():
        for product, table in by_product.items():
            assert_same(table, b[name][product])


@pytest.mark.parametrize("horizons", [(float("inf"),), (5.0, float("nan")), (0.0,), (-1.0,)])
def test_sim_config_refuses_a_horizon_that_is_not_finite_and_positive(horizons):
    """backtest and retrain build SimConfig themselves, past the form's check: an infinite
    horizon was accepted here and made a mark-out column of NaN."""
    with pytest.raises(ValueError, match="markout_horizons_s must be finite and > 0"):
        SimConfig(markout_horizons_s=horizons)
