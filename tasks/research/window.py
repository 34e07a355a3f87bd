"""The held-out window two models share, and a replay of one signal on it.

A promotion compares the candidate with the model it would replace on data neither was
trained on: the candidate model's held-out part minus everything the incumbent trained
on. Each model's split is the fold its lineage record names (flows/train.py
record_lineage), cut by tasks/research/folds.split_fold, the rule it was trained by:

- whole dates: the held-out part is whole days; a day the incumbent trained on leaves
  the window whole;
- one date (an intraday fold): the held-out part is the end of the day, cut by row; the
  incumbent trained on the rows before its own cut, so the window is the rows after
  both cuts.

Rows are those of the feature tables (one per tradable event, whatever the feature
parameters), so a window's first row is the same event in either model's features.
Each signal then trades the window by the rule replay_all uses: per product, the
threshold is a quantile of |signal| on that signal's own training part.
"""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa

from quantloop.tasks.data.schema import Partition
from quantloop.tasks.research.folds import Fold, WalkForward, folds, split_fold
from quantloop.tasks.research.simulation import SimConfig, markout, simulate, thresholds_from


def lineage_fold(lineage: Mapping[str, Any]) -> Fold:
    """The fold a model was trained for, from its lineage record: its `window` (train,
    embargo and test dates, the intraday cut), or, in a record from before walk-forward
    folds, the single split of `holdout_fraction` over its `partitions` (which then
    held its held-out days too)."""
    window = lineage.get("window")
    if window is not None:

        def days(name: str) -> tuple[dt.date, ...]:
            return tuple(dt.date.fromisoformat(d) for d in window.get(name) or ())

        return Fold(int(lineage.get("fold", 0)), days("train"), days("test"), days("embargo"),
                    holdout_fraction=window.get("holdout_fraction"))  # fmt: skip
    dates = {dt.date.fromisoformat(p.split("/", 1)[1]) for p in lineage["partitions"]}
    (fold,) = folds(dates, WalkForward(holdout_fraction=float(lineage["holdout_fraction"])))
    return fold


def held_out_id(fold: Fold) -> str:
    """A fold's held-out part in words a run can be matched by: its test dates and
    intraday cut (with the data pin, they are the held-out data)."""
    return json.dumps({"test": [d.isoformat() for d in fold.test_dates],
                       "holdout_fraction": fold.holdout_fraction}, sort_keys=True)  # fmt: skip


@dataclass(frozen=True, slots=True)
class Window:
    """Rows of the candidate's held-out data that neither model trained on."""

    start: dict[Partition, int]  # the window's first row in each partition's feature table
    rows: dict[Partition, int]  # each partition's rows (the window runs to the day's end)
    excluded: dict[str, str]  # what of the candidate's held-out part was left out, and why

    @property
    def empty(self) -> bool:
        return not self.start

    def events(self) -> int:
        return sum(self.rows[p] - s for p, s in self.start.items())

    def why_empty(self) -> str:
        reasons = "; ".join(f"{what}: {why}" for what, why in self.excluded.items())
        return "no held-out window shared: " + (reasons or "the candidate held nothing out")

    def record(self) -> dict:
        """What the decision records: the days, products and events of the window, each
        partition's first row when it starts inside the day, and what was left out."""
        return {
            "days": sorted({p.date.isoformat() for p in self.start}),
            "products": sorted({p.product for p in self.start}),
            "partitions": len(self.start),
            "events": self.events(),
            "from_row": {str(p): s for p, s in sorted(self.start.items()) if s},
            "excluded": self.excluded,
        }


def shared_window(
    candidate: Mapping[Partition, pa.Table],
    candidate_fold: Fold,
    incumbent: Mapping[Partition, pa.Table] | None = None,
    incumbent_fold: Fold | None = None,
) -> Window:
    """The candidate's held-out rows minus the rows the incumbent trained on.

    candidate: the candidate's feature tables (at least its fold's training and test
    partitions); incumbent: the incumbent's, of the partitions it was made from. No
    incumbent (the first champion, against the baseline): the candidate's whole held-out
    part. A product the incumbent never trained on is left out: its threshold would have
    no training part to come from.
    """
    _, test = split_fold(candidate, candidate_fold)
    rows = {p: candidate[p].num_rows for p in test}
    held = {p: rows[p] - t.num_rows for p, t in test.items()}
    if incumbent is None:
        start = {p: s for p, s in held.items() if s < rows[p]}
        return Window(start, {p: rows[p] for p in start}, {})
    if incumbent_fold is None:
        raise ValueError("incumbent_fold is needed with an incumbent")
    train, _ = split_fold(incumbent, incumbent_fold)
    trained = {p: t.num_rows for p, t in train.items() if t.num_rows}
    products = {p.product for p in trained}
    start: dict[Partition, int] = {}
    excluded: dict[str, str] = {}
    for p, first in sorted(held.items()):
        if p.product not in products:
            excluded[str(p)] = "the incumbent has no training part of this product"
            continue
        if p in trained and incumbent[p].num_rows != rows[p]:
            raise ValueError(
                f"{p}: the incumbent's feature table has {incumbent[p].num_rows} rows, the "
                f"candidate's {rows[p]}: not the same events (another version of the data?)"
            )
        s = max(first, trained.get(p, 0))
        if s >= rows[p]:
            excluded[str(p)] = (f"the incumbent trained on it (rows 0..{trained[p] - 1} of "
                                f"{rows[p]}; the candidate held out from row {first})")  # fmt: skip
            continue
        start[p] = s
    return Window(start, {p: rows[p] for p in start}, excluded)


def replay_window(
    signal_of: Callable[[pa.Table], np.ndarray],
    train: Mapping[Partition, pa.Table],
    window: Mapping[Partition, pa.Table],
    config: SimConfig,
) -> dict[str, pa.Table]:
    """Mark-outs by product of one signal on the window's tables (each already cut to
    the window), with a `day` column, as replay_all makes them: per product, the
    threshold from the signal on that product's training tables in `train`."""
    out: dict[str, list[pa.Table]] = {}
    for product in sorted({p.product for p in window}):
        trained = [t for p, t in sorted(train.items()) if p.product == product and t.num_rows]
        if not trained:
            raise ValueError(f"no training part of {product} to take a threshold from")
        threshold = thresholds_from(np.concatenate([signal_of(t) for t in trained]), config)
        for part, table in sorted(window.items()):
            if part.product != product:
                continue
            marked = markout(simulate(table, signal_of(table), threshold, config), table, config)
            day = pa.array([part.date.isoformat()] * marked.num_rows, pa.string())
            out.setdefault(product, []).append(marked.append_column("day", day))
    return {p: pa.concat_tables(ts) for p, ts in out.items()}
