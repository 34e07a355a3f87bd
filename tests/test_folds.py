"""Walk-forward folds: layout on exact dates, purge and embargo, and the single split
they replace (tasks/research/simulation.split_train_test) reproduced exactly."""

from __future__ import annotations

import datetime as dt
import json

import numpy as np
import pyarrow as pa
import pytest

from quantloop.tasks.data.schema import Partition
from quantloop.tasks.research.features import FeatureParams, compute_features
from quantloop.tasks.research.folds import Fold, WalkForward, folds, purge, split_fold
from quantloop.tasks.research.simulation import split_train_test
from tests.books import random_book

D = [dt.date(2026, 1, 5) + dt.timedelta(days=i) for i in range(12)]


def label_table(n: int, seed: int = 0) -> pa.Table:
    """Labels as tasks/research/features.py makes them: NaN where the horizon passes the
    day's end."""
    mid = 100 + np.cumsum(np.random.default_rng(seed).normal(size=n))

    def ahead(h: int) -> np.ndarray:
        out = np.full(n, np.nan)
        out[: max(0, n - h)] = mid[h:] - mid[: max(0, n - h)]
        return out

    return pa.table({"time": np.arange(n, dtype=float), "mid": mid, "label_2": ahead(2),
                     "label_5": ahead(5)})  # fmt: skip


def tables_on(dates, products=("AAA", "BBB"), rows=30) -> dict[Partition, pa.Table]:
    return {
        Partition(x, d): label_table(rows, seed=i)
        for i, (x, d) in enumerate((x, d) for x in products for d in dates)
    }


def assert_same(a: pa.Table, b: pa.Table) -> None:
    # pa.Table.equals treats NaN as unequal to itself; compare the values with NaN == NaN
    assert a.schema.equals(b.schema) and a.num_rows == b.num_rows
    for name in a.column_names:
        np.testing.assert_array_equal(a[name].to_numpy(), b[name].to_numpy())


def layout(fs: list[Fold]) -> list[tuple]:
    return [(f.index, f.train_dates, f.embargoed, f.test_dates) for f in fs]


# ---------------------------------------------------------------- layout


def test_expanding_window_tests_each_date_after_the_first_training_dates():
    cfg = WalkForward(folds=None, test_dates=1, min_train_dates=2)
    assert layout(folds(D[:5], cfg)) == [
        (0, (D[0], D[1]), (), (D[2],)),
        (1, (D[0], D[1], D[2]), (), (D[3],)),
        (2, (D[0], D[1], D[2], D[3]), (), (D[4],)),
    ]


def test_sliding_window_with_embargo_and_a_step_of_two_dates():
    cfg = WalkForward(folds=None, test_dates=2, train_dates=3, embargo_dates=1)
    fs = folds(reversed(D[:10]), cfg)  # any order in, oldest first out
    assert layout(fs) == [
        (0, (D[0], D[1], D[2]), (D[3],), (D[4], D[5])),
        (1, (D[2], D[3], D[4]), (D[5],), (D[6], D[7])),
        (2, (D[4], D[5], D[6]), (D[7],), (D[8], D[9])),
    ]
    # test windows step by test_dates and tile the dates after the origin; the last ends
    # at the last date (here 10 - origin 4 is a whole number of windows)
    tested = [d for f in fs for d in f.test_dates]
    assert tested == D[4:10] and fs[-1].test_dates[-1] == D[9]
    for f in fs:  # the embargo is right before the test window and trained on by no one
        assert f.train_dates[-1] < f.embargoed[0] < f.test_dates[0]
        assert not set(f.embargoed) & set(f.train_dates)


def test_a_number_of_folds_takes_the_most_recent_and_keeps_their_grid_index():
    every = folds(D[:8], WalkForward(folds=None, test_dates=1, min_train_dates=3))
    last2 = folds(D[:8], WalkForward(folds=2, test_dates=1, min_train_dates=3))
    assert len(every) == 5 and last2 == every[-2:]
    assert [f.index for f in last2] == [3, 4]


def test_whole_windows_only_a_partial_one_waits_for_its_dates():
    fs = folds(D[:7], WalkForward(folds=None, test_dates=2))  # origin 1: D1-2, D3-4, D5-6
    assert [f.test_dates for f in fs] == [(D[1], D[2]), (D[3], D[4]), (D[5], D[6])]
    fs = folds(D[:8], WalkForward(folds=None, test_dates=2))  # D7 waits for D8
    assert fs[-1].test_dates == (D[5], D[6])


@pytest.mark.parametrize(
    "cfg",
    [
        WalkForward(folds=None, test_dates=1),
        WalkForward(folds=None, test_dates=1, min_train_dates=3, embargo_dates=2),
        WalkForward(folds=None, test_dates=1, train_dates=4, embargo_dates=1),
    ],
)
def test_adding_a_date_adds_one_fold_and_keeps_the_earlier_ones(cfg):
    for n in range(cfg.origin + 1, len(D)):
        before, after = folds(D[:n], cfg), folds(D[: n + 1], cfg)
        assert len(after) == len(before) + 1
        assert after[:-1] == before  # same windows, same indices
        assert [f.window() for f in after[:-1]] == [f.window() for f in before]
        assert after[-1].test_dates == (D[n],) and after[-1].index == before[-1].index + 1


def test_with_two_test_dates_every_second_new_date_adds_a_fold():
    cfg = WalkForward(folds=None, test_dates=2, train_dates=2)
    counts = [len(folds(D[:n], cfg)) for n in range(4, 11)]
    assert counts == [1, 1, 2, 2, 3, 3, 4]
    assert folds(D[:11], cfg)[:3] == folds(D[:8], cfg)


def test_too_few_dates_raises_naming_the_fields():
    with pytest.raises(ValueError, match=r"folds=4.*need 5"):
        folds(D[:4], WalkForward(folds=4, test_dates=1))
    with pytest.raises(ValueError, match=r"embargo_dates=2"):
        folds(D[:3], WalkForward(folds=None, test_dates=1, embargo_dates=2))
    with pytest.raises(ValueError, match=r"train_dates=5"):
        folds(D[:5], WalkForward(folds=None, test_dates=1, train_dates=5))
    with pytest.raises(ValueError, match=r"folds=1.*embargo_dates=1"):
        folds(D[:2], WalkForward(embargo_dates=1))  # the held-out-share rule too
    with pytest.raises(ValueError, match="folds=2"):
        folds(D[:1], WalkForward(folds=2, test_dates=1))  # one date: one intraday fold
    with pytest.raises(ValueError, match="at least one date"):
        folds([], WalkForward())


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"folds": -1}, "folds"),
        ({"folds": 1.5}, "folds"),
        ({"test_dates": 0}, "test_dates"),
        ({"folds": None}, "test_dates"),  # the held-out share makes one fold only
        ({"folds": 3}, "test_dates"),
        ({"train_dates": -1}, "train_dates"),
        ({"min_train_dates": 0}, "min_train_dates"),
        ({"embargo_dates": True}, "embargo_dates"),
        ({"holdout_fraction": 1.0}, "holdout_fraction"),
    ],
)
def test_config_errors_name_the_field_and_value(fields, named):
    with pytest.raises(ValueError, match=rf"{named}.*{fields[next(iter(fields))]!r}"):
        WalkForward(**fields)


def test_zero_folds_is_as_many_as_fit_spelled_once():
    assert WalkForward(folds=0, test_dates=1) == WalkForward(folds=None, test_dates=1)
    assert WalkForward(folds=0, test_dates=1).folds is None


# ---------------------------------------------------------------- the single split


@pytest.mark.parametrize("n_dates", [2, 3, 4, 7, 10])
@pytest.mark.parametrize("holdout", [0.1, 0.3, 0.5, 0.9])
def test_one_fold_is_split_train_test_on_several_dates(n_dates, holdout):
    tables = tables_on(D[:n_dates])
    (fold,) = folds(D[:n_dates], WalkForward(holdout_fraction=holdout))
    train, test = split_fold(tables, fold)
    old_train, old_test = split_train_test(tables, holdout)
    assert list(train) == list(old_train) and list(test) == list(old_test)
    assert all(train[p] is old_train[p] for p in train)  # the very tables, not copies
    assert all(test[p] is old_test[p] for p in test)
    assert fold.embargoed == () and not fold.intraday


@pytest.mark.parametrize("rows", [1, 7, 20, 333])
@pytest.mark.parametrize("holdout", [0.1, 0.3, 0.77])
def test_one_date_is_split_train_test_intraday_cut(rows, holdout):
    tables = tables_on(D[:1], products=("AAA", "BBB", "CCC"), rows=rows)
    single = WalkForward(holdout_fraction=holdout)
    for cfg in (single, WalkForward(folds=None, test_dates=1, holdout_fraction=holdout)):
        (fold,) = folds(D[:1], cfg)
        assert fold.intraday and fold.train_dates == fold.test_dates == (D[0],)
        train, test = split_fold(tables, fold)
        old_train, old_test = split_train_test(tables, holdout)
        assert list(train) == list(old_train) and list(test) == list(old_test)
        for p in tables:
            assert_same(train[p], old_train[p])
            assert_same(test[p], old_test[p])


def test_purge_at_an_intraday_cut():
    p = Partition("AAA", D[0])
    table = label_table(20)
    (fold,) = folds([D[0]], WalkForward(holdout_fraction=0.3))
    train, test = split_fold({p: table}, fold)
    head, tail = train[p], test[p]
    assert head.num_rows == 14 and tail.num_rows == 6  # cut at floor(0.7 * 20)
    for h in (2, 5):
        got = head[f"label_{h}"].to_numpy()
        want = table[f"label_{h}"].to_numpy()[:14]
        # row r's label_h reads the mid at r + h: NaN from row 14 - h on, the rest as it was
        assert np.isnan(got[14 - h :]).all()
        np.testing.assert_array_equal(got[: 14 - h], want[: 14 - h])
        assert np.isfinite(got[: 14 - h]).all()
    assert_same(tail, table.slice(14))  # the test part is not purged
    assert head["mid"].to_numpy().tolist() == table["mid"].to_numpy()[:14].tolist()


def test_purge_only_the_labels_named():
    table = label_table(10)
    out = purge(table.slice(0, 8), 8, labels=["label_5"])
    assert np.isnan(out["label_5"].to_numpy()[3:]).all()
    assert_same(out.select(["label_2"]), table.slice(0, 8).select(["label_2"]))
    with pytest.raises(ValueError, match="mid"):
        purge(table, 8, labels=["mid"])


# ---------------------------------------------------------------- whole-date folds


def test_feature_labels_stop_at_the_days_end_so_whole_dates_need_no_purge():
    params = FeatureParams(label_horizons=(3, 40))
    day = compute_features(random_book(300, seed=1), params)
    for h in params.label_horizons:
        values = day[f"label_{h}"].to_numpy()
        assert np.isnan(values[-h:]).all() and np.isfinite(values[:-h]).all()
    tables = {Partition("AAA", d): compute_features(random_book(300, seed=i), params)
              for i, d in enumerate(D[:4])}  # fmt: skip
    cfg = WalkForward(folds=None, test_dates=1, embargo_dates=1)
    for fold in folds(D[:4], cfg):
        train, test = split_fold(tables, fold)
        assert sorted(p.date for p in train) == list(fold.train_dates)
        assert sorted(p.date for p in test) == list(fold.test_dates)
        assert not {p.date for p in train} & set(fold.embargoed)  # embargo: in neither
        assert not {p.date for p in test} & set(fold.embargoed)
        assert all(train[p] is tables[p] for p in train)  # nothing purged, nothing copied


def test_a_label_crossing_the_days_end_is_refused_not_leaked():
    crossing = label_table(10).set_column(3, "label_5", pa.array(np.arange(10.0)))
    tables = {Partition("AAA", D[0]): crossing, Partition("AAA", D[1]): label_table(10)}
    (fold,) = folds(D[:2], WalkForward())
    with pytest.raises(ValueError, match=r"label_5 of AAA/2026-01-05.*crosses the day's end"):
        split_fold(tables, fold)
    split_fold(tables, fold, labels=["label_2"])  # only the labels named are checked


def test_windows_are_json_and_the_model_part_leaves_the_test_dates_out():
    cfg = WalkForward(folds=None, test_dates=1, embargo_dates=1)
    fold = folds(D[:4], cfg)[0]
    assert json.loads(json.dumps(fold.window())) == {
        "train": ["2026-01-05"],
        "embargo": ["2026-01-06"],
        "test": ["2026-01-07"],
        "holdout_fraction": None,
    }
    assert fold.training_window() == {"train": ["2026-01-05"], "holdout_fraction": None}
    (day,) = folds(D[:1], WalkForward())
    assert day.training_window() == {"train": ["2026-01-05"], "holdout_fraction": 0.3}
    # a wider test window trains the same first model: one model key for both
    wider = folds(D[:5], WalkForward(folds=None, test_dates=2, embargo_dates=1))[0]
    assert wider.training_window() == fold.training_window() != wider.window()
