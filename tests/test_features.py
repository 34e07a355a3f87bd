"""Features against a hand-computed example, and the rows they describe."""

from __future__ import annotations

import math

import numpy as np
import pyarrow as pa
import pytest

from quantloop.tasks.data.schema import book_schema
from quantloop.tasks.research.features import (
    FeatureParams,
    compute_features,
    feature_set,
    rolling_sums,
)

PARAMS = FeatureParams(
    imbalance_levels=3, return_lags=(1,), vol_windows=(2,), ofi_window=2, label_horizons=(1, 2)
)

# Four events of a two-level book; prices in LOBSTER units (dollars x 10^4).
#        ask1    as1  bid1    bs1  ask2    as2  bid2   bs2
ROWS = [
    (100200, 100, 100000, 300, 100300, 50, 99900, 150),
    (100200, 100, 100100, 200, 100300, 50, 100000, 300),
    (100300, 80, 100100, 200, 100400, 60, 100000, 300),
    (100300, 80, 100200, 120, 100400, 60, 100100, 200),
]


def book(rows=ROWS, halted=None) -> pa.Table:
    n = len(rows)
    cols = {
        "time": [34_200.0 + i for i in range(n)],
        "event_type": [1] * n,
        "order_id": list(range(n)),
        "size": [10] * n,
        "price": [r[0] for r in rows],
        "direction": [1] * n,
    }
    for i, name in enumerate(
        ["ask_price_1", "ask_size_1", "bid_price_1", "bid_size_1",
         "ask_price_2", "ask_size_2", "bid_price_2", "bid_size_2"]
    ):  # fmt: skip
        cols[name] = [r[i] for r in rows]
    cols["halted"] = halted or [False] * n
    return pa.table(cols).cast(book_schema(2))


def test_hand_computed_example():
    f = compute_features(book(), PARAMS).to_pydict()
    approx = lambda xs: pytest.approx(xs, rel=1e-12, nan_ok=True)  # noqa: E731

    assert f["mid"] == approx([10.01, 10.015, 10.02, 10.025])
    assert f["spread_bps"] == approx([0.02 / 10.01e-4, 0.01 / 10.015e-4, 0.02 / 10.02e-4,
                                      0.01 / 10.025e-4])  # fmt: skip
    # microprice: (ask * bid size + bid * ask size) / (bid size + ask size)
    assert f["microprice"][0] == pytest.approx((10.02 * 300 + 10.00 * 100) / 400)
    assert f["micro_dev_bps"][0] == pytest.approx((10.015 - 10.01) / 10.01 * 1e4)
    # depth imbalance over the first k levels; a 2-level book repeats level 2 for k = 3
    assert f["imbalance_1"] == approx([0.5, 1 / 3, 120 / 280, 40 / 200])
    assert f["imbalance_2"][:2] == approx([300 / 600, 350 / 650])
    assert f["imbalance_3"] == f["imbalance_2"]
    # order-flow imbalance per event: [0, 200, 100, 120]; window 2 sums over mean depth
    depth = np.array([400, 300, 280, 200])
    mean_depth = np.array([400, 700, 580, 480]) / 2
    assert f["ofi"] == approx((np.array([0, 200, 300, 220]) / mean_depth).tolist())
    assert f["log_depth"] == approx(np.log1p(depth).tolist())
    step = [0.0] + [math.log(b / a) * 1e4 for a, b in zip(f["mid"], f["mid"][1:], strict=False)]
    assert f["ret_1"] == approx(step)
    assert f["rv_2"] == approx([0.0, abs(step[1]), math.hypot(step[1], step[2]),
                                math.hypot(step[2], step[3])])  # fmt: skip
    assert f["label_1"] == approx([0.005 / 10.01e-4, 0.005 / 10.015e-4, 0.005 / 10.02e-4, math.nan])
    assert f["label_2"] == approx([0.01 / 10.01e-4, 0.01 / 10.015e-4, math.nan, math.nan])
    assert set(feature_set(PARAMS).inputs + feature_set(PARAMS).labels) <= set(f)


def test_halted_and_one_sided_rows_are_dropped():
    rows = ROWS[:2] + [(None, 0, 100100, 200, None, 0, 100000, 300)] + ROWS[2:]
    rows = [tuple(v for v in r) for r in rows]
    table = book(rows, halted=[False, True, False, False, False])
    f = compute_features(table, PARAMS)
    # row 1 is halted, row 2 has no ask: three rows remain, in order
    assert f["time"].to_pylist() == [34_200.0, 34_203.0, 34_204.0]


def test_rolling_sums_match_a_loop_within_each_segment():
    x = np.random.default_rng(0).normal(size=200)
    lengths = np.array([120, 0, 50, 30])  # an empty segment too
    starts = np.cumsum(lengths) - lengths
    for w in (1, 3, 50, 500):
        want = [
            x[max(start, i - w + 1) : i + 1].sum()
            for start, n in zip(starts, lengths, strict=True)
            for i in range(start, start + n)
        ]
        assert rolling_sums(x, w, lengths) == pytest.approx(want)


def test_unknown_and_bad_parameters_name_the_field():
    with pytest.raises(ValueError, match="unknown feature parameter.*ofi_windw"):
        FeatureParams.from_dict({"ofi_windw": 3})
    with pytest.raises(ValueError, match="label_horizons"):
        FeatureParams(label_horizons=(0,))


def test_batched_partitions_are_bit_identical_to_single_ones():
    """A node's output must not depend on which nodes shared its batch."""
    from quantloop.tasks.engine import storage
    from quantloop.tasks.research.features import compute_features_many
    from tests.books import random_book

    params = FeatureParams(imbalance_levels=3, return_lags=(1, 5), vol_windows=(4, 50),
                           ofi_window=7, label_horizons=(3, 40))  # fmt: skip
    lengths = [60, 3, 1, 45, 200, 7, 60]  # some shorter than the lags, windows, horizons
    books = [random_book(n, levels=2, seed=i) for i, n in enumerate(lengths)]
    halted = books[4]["halted"].to_numpy(zero_copy_only=False).copy()
    halted[10:20] = True  # a halt inside one partition: its rows are dropped
    books[4] = books[4].set_column(books[4].schema.get_field_index("halted"), "halted",
                                   pa.array(halted))  # fmt: skip
    together = compute_features_many(books, params)
    for book, out in zip(books, together, strict=True):
        alone = compute_features(book, params)
        assert storage.arrow_bytes(out) == storage.arrow_bytes(alone)
    assert [t.num_rows for t in together] == [60, 3, 1, 45, 190, 7, 60]
    with pytest.raises(ValueError, match="one depth"):
        compute_features_many([random_book(10, levels=1), random_book(10, levels=2)], params)
