"""Walk-forward folds over dates: train on the past, test on the next window, purge the
labels that reach a test window, keep an embargo between the two.

A fold is a set of whole dates (the dates present in the data, i.e. trading days, not
calendar days): `train_dates`, then `embargoed` (used by neither side of this fold),
then `test_dates`. Folds sit on a grid anchored at the *first* date, so a fold's window
depends only on where its test window starts, never on how many dates follow it: adding
a date to the data adds a fold at the end and leaves every earlier fold's window, and so
its model's key, unchanged (with `test_dates` = 1; with k, every k-th new date adds one).

One date of data has no date to test on: it keeps tasks/research/simulation.split_train_test's
intraday cut (the last `holdout_fraction` of each day's rows are the test part) as the
single fold, with the training labels that reach the cut purged.

Purging and embargo follow de Prado, *Advances in Financial Machine Learning* (2018),
ch. 7: a training label whose horizon reaches into a test window is removed (purging),
and observations next to a test window are dropped (embargo) because serially
correlated features and labels decay slowly.
"""

from __future__ import annotations

import datetime as dt
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa

from quantloop.tasks.data.schema import Partition

_LABEL_RE = re.compile(r"^label_(\d+)$")


@dataclass(kw_only=True, slots=True, frozen=True)
class WalkForward:
    """How the dates are split into walk-forward folds. The defaults are the single split
    the loop always made (tasks/research/simulation.split_train_test): the last
    ceil(holdout_fraction x dates) dates held out, the rest training.

    Walk-forward: `test_dates=1, folds=None` tests every date after the first
    `min_train_dates`, each on a model trained on the dates before it.
    """

    folds: int | None = 1
    """Test windows: an integer k >= 1 takes the last k windows that fit on the grid (the
    most recent data); None (or 0, stored as None) takes every window that fits."""
    test_dates: int | None = None
    """Dates per test window, also the step from one fold to the next (windows tile the
    dates after the grid's origin without overlap). None: the held-out-share rule, one
    window of the last ceil(holdout_fraction x dates) dates (at least one, leaving the
    training dates); only with folds=1."""
    train_dates: int = 0
    """0: an expanding window, every date from the first to the embargo; n > 0: a sliding
    window of the n dates right before the embargo."""
    min_train_dates: int = 1
    """Dates the first fold trains on. The grid's origin (the first test date) is
    max(min_train_dates, train_dates) + embargo_dates dates after the first date."""
    embargo_dates: int = 0
    """Dates between a fold's training window and its test window that the fold's model
    does not train on. de Prado's embargo drops training observations right *after* a
    test window, because in k-fold cross-validation training surrounds the test set; in
    walk-forward a fold's training always precedes its test window, so the embargo sits
    where the remaining leak is: before it. It covers what purging a label's own horizon
    cannot: a feature or label whose dependence decays over days (a volatility regime, a
    multi-day label, a feature with a multi-day look-back) and the day or so a model
    takes to reach production. The embargoed dates are still tested (by earlier folds,
    except the first fold's): only this fold's training skips them."""
    holdout_fraction: float = 0.3
    """Share held out. One date: each day is cut at row floor((1 - holdout_fraction) x
    rows), the rows from the cut on being the test part. Several dates and
    test_dates=None: the last ceil(holdout_fraction x dates) dates."""

    def __post_init__(self) -> None:
        if type(self.folds) is int and self.folds == 0:
            object.__setattr__(self, "folds", None)  # one spelling, so keys compare equal
        if self.folds is not None and not _is_int(self.folds, 1):
            raise ValueError(f"folds must be an integer >= 1, or 0/None (as many as fit), "
                             f"got {self.folds!r}")  # fmt: skip
        if self.test_dates is not None and not _is_int(self.test_dates, 1):
            raise ValueError(f"test_dates must be an integer >= 1 or None, got {self.test_dates!r}")
        if self.test_dates is None and self.folds != 1:
            raise ValueError(
                f"test_dates=None (hold out the last holdout_fraction of the dates) makes one "
                f"fold, but folds={self.folds!r}: set test_dates to a number of dates"
            )
        for name, low in (("train_dates", 0), ("min_train_dates", 1), ("embargo_dates", 0)):
            value = getattr(self, name)
            if not _is_int(value, low):
                raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
        if not 0.0 < self.holdout_fraction < 1.0:
            raise ValueError(f"holdout_fraction must be in (0, 1), got {self.holdout_fraction}")

    @property
    def origin(self) -> int:
        """How many dates come before the first test window: the first fold's training
        dates and its embargo."""
        return max(self.min_train_dates, self.train_dates) + self.embargo_dates


def _is_int(value: Any, low: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= low


@dataclass(frozen=True, slots=True)
class Fold:
    """One train/test split. `index` is the fold's place on the grid (0 = the window at
    the origin), so a fold keeps its index when dates are added after it."""

    index: int
    train_dates: tuple[dt.date, ...]
    test_dates: tuple[dt.date, ...]
    embargoed: tuple[dt.date, ...] = ()
    # Set for one date of data: each day's last holdout_fraction of rows is the test part
    # (train_dates == test_dates, the one date); None for folds of whole dates.
    holdout_fraction: float | None = None

    @property
    def intraday(self) -> bool:
        return self.holdout_fraction is not None

    def window(self) -> dict[str, Any]:
        """The fold's data window as JSON values: what a simulation of it is keyed by."""
        return {
            "train": [d.isoformat() for d in self.train_dates],
            "embargo": [d.isoformat() for d in self.embargoed],
            "test": [d.isoformat() for d in self.test_dates],
            "holdout_fraction": self.holdout_fraction,
        }

    def training_window(self) -> dict[str, Any]:
        """What of the window decides the fold's model: the dates it trains on and, for an
        intraday fold, where each day is cut (its purge). A whole-date fold's test and
        embargo dates are not in it: labels stop at the day's end, so they change no
        training row, and two folds that train on the same dates share one model."""
        return {
            "train": [d.isoformat() for d in self.train_dates],
            "holdout_fraction": self.holdout_fraction,
        }


def folds(dates: Iterable[dt.date], cfg: WalkForward) -> list[Fold]:
    """The folds of `cfg` over `dates` (the distinct dates of the data, in any order),
    oldest first.

    Fold k (k = 0, 1, ... on the grid) tests the `test_dates` dates starting at position
    origin + k x test_dates, trains on the dates before its embargo, and exists only when
    its test window is whole: with test_dates > 1, up to test_dates - 1 dates at the end
    are not tested yet (they will be once the window fills). ValueError, naming the
    fields, when no fold (or fewer than `folds`) fits.
    """
    days = sorted(set(dates))
    if not days:
        raise ValueError("folds need at least one date, got none")
    if len(days) == 1:
        if cfg.folds not in (1, None):
            raise ValueError(
                f"one date of data makes one fold (the intraday cut at holdout_fraction="
                f"{cfg.holdout_fraction}), but folds={cfg.folds}: give more dates or folds=1"
            )
        return [Fold(0, (days[0],), (days[0],), (), holdout_fraction=cfg.holdout_fraction)]
    n, first_train = len(days), max(cfg.min_train_dates, cfg.train_dates)
    if cfg.test_dates is None:  # split_train_test's rule, as one fold
        n_test = min(max(1, math.ceil(cfg.holdout_fraction * n)), n - cfg.origin)
        if n_test < 1:
            raise ValueError(
                f"too few dates for folds=1: {n} dates, but the fold trains on "
                f"{first_train} (min_train_dates={cfg.min_train_dates}, train_dates="
                f"{cfg.train_dates}) and skips embargo_dates={cfg.embargo_dates} before "
                "testing at least one"
            )
        return [_fold(days, 0, n - n_test, n_test, cfg)]
    fit = max(0, (n - cfg.origin) // cfg.test_dates)
    want = fit if cfg.folds is None else cfg.folds
    if fit < max(1, want):
        need = cfg.origin + max(1, want) * cfg.test_dates
        raise ValueError(
            f"too few dates for folds={cfg.folds}: {n} dates, but {max(1, want)} fold(s) need "
            f"{need}: the first trains on {first_train} (min_train_dates={cfg.min_train_dates}, "
            f"train_dates={cfg.train_dates}), skips embargo_dates={cfg.embargo_dates}, then "
            f"each tests test_dates={cfg.test_dates}"
        )
    return [
        _fold(days, k, cfg.origin + k * cfg.test_dates, cfg.test_dates, cfg)
        for k in range(fit - want, fit)
    ]


def _fold(days: list[dt.date], index: int, start: int, n_test: int, cfg: WalkForward) -> Fold:
    """The fold whose test window is days[start : start + n_test]."""
    end = start - cfg.embargo_dates  # training stops here
    first = 0 if cfg.train_dates == 0 else end - cfg.train_dates
    return Fold(
        index,
        tuple(days[first:end]),
        tuple(days[start : start + n_test]),
        tuple(days[end:start]),
    )


def split_fold(
    tables: Mapping[Partition, pa.Table],
    fold: Fold,
    labels: Sequence[str] | None = None,
) -> tuple[dict[Partition, pa.Table], dict[Partition, pa.Table]]:
    """The fold's training and test tables, keyed by their Partition, in `tables`' order.

    labels: the label columns, each `label_<h>` (h events ahead); None: every column so
    named. Whole-date fold: the tables of its dates as they are, since a label never
    crosses the day's end (tasks/research/features._future_move_bps is NaN where the horizon passes
    the partition's last event), so no training label reaches an embargoed or test date;
    that is checked on the last training date, and a label that does cross raises rather
    than leak. Intraday fold: each day cut at row floor((1 - holdout_fraction) x rows), and
    label_h at training rows whose horizon reaches the cut (row + h >= cut) set to NaN:
    split_train_test's cut, bit for bit.
    """
    if fold.intraday:
        train, test = {}, {}
        for part, table in tables.items():
            if part.date not in fold.test_dates:
                continue
            cut = int(math.floor((1.0 - fold.holdout_fraction) * table.num_rows))
            train[part] = purge(table.slice(0, cut), cut, labels)
            test[part] = table.slice(cut)
        return train, test
    train_dates, test_dates = set(fold.train_dates), set(fold.test_dates)
    train = {p: t for p, t in tables.items() if p.date in train_dates}
    test = {p: t for p, t in tables.items() if p.date in test_dates}
    if fold.train_dates:
        last = fold.train_dates[-1]
        for part, table in train.items():
            if part.date == last:
                _check_day_end(part, table, labels)
    return train, test


def purge(table: pa.Table, cut: int, labels: Sequence[str] | None = None) -> pa.Table:
    """`table` (rows before `cut`) with label_h set to NaN at each row whose horizon
    reaches the cut: row + h >= cut."""
    rows = np.arange(table.num_rows)
    for i, name in enumerate(table.column_names):
        h = _horizon(name, labels)
        if h is None:
            continue
        values = table.column(i).to_numpy(zero_copy_only=False).astype(np.float64)
        values[rows + h >= cut] = np.nan
        table = table.set_column(i, table.field(i), pa.array(values, table.field(i).type))
    return table


def _horizon(name: str, labels: Sequence[str] | None) -> int | None:
    if labels is not None and name not in labels:
        return None
    match = _LABEL_RE.match(name)
    if match is None:
        if labels is not None:
            raise ValueError(f"label column {name!r} is not named label_<events ahead>")
        return None
    return int(match.group(1))


def _check_day_end(part: Partition, table: pa.Table, labels: Sequence[str] | None) -> None:
    """A label at the last h rows of a day would read the next day's mid: it must be NaN."""
    for name in table.column_names:
        h = _horizon(name, labels)
        if h is None:
            continue
        tail = table.column(name).slice(max(0, table.num_rows - h))
        values = tail.to_numpy().astype(np.float64)
        if np.isfinite(values).any():
            raise ValueError(
                f"{name} of {part} is set in its last {h} rows: it crosses the day's end, "
                "so purging at a fold edge would need the next day's rows (not supported)"
            )
