"""Landing sources in the catalog: the synthetic generator and LOBSTER files."""

from __future__ import annotations

import datetime as dt
import logging
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from quantloop.tasks.catalog import Catalog, Landed
from quantloop.tasks.ingest import find_lobster, read_lobster
from quantloop.tasks.schema import Partition
from quantloop.tasks.synthetic import SyntheticConfig, generate_day

log = logging.getLogger(__name__)


def business_days(start: dt.date, count: int) -> list[dt.date]:
    """`count` weekdays from `start` on (exchange holidays are not modelled)."""
    days = np.busday_offset(np.datetime64(start), np.arange(count), roll="forward")
    return [d.astype(dt.date) for d in days]


def land_synthetic(
    catalog: Catalog,
    root: str,
    products: Sequence[str],
    dates: Sequence[dt.date],
    cfg: SyntheticConfig,
    *,
    dataset: str = "synthetic",
    progress: Callable[[int, int], None] | None = None,
) -> list[Landed]:
    """Generate and land every (product, date); unchanged partitions are no-ops."""
    landed = []
    parts = [Partition(p, d) for p in products for d in dates]
    for i, part in enumerate(parts):
        table = generate_day(part.product, part.date, cfg)
        landed.append(
            catalog.land(dataset, part, table, root=root, source=f"synthetic seed={cfg.seed}")
        )
        if progress:
            progress(i + 1, len(parts))
    return landed


def land_lobster(
    catalog: Catalog,
    root: str,
    folder: str | Path,
    *,
    dataset: str = "lobster",
    progress: Callable[[int, int], None] | None = None,
) -> list[Landed]:
    """Ingest every LOBSTER file in a folder (or one file) and land it.

    LOBSTER ships one file per depth for the same ticker and day; a deeper file
    holds every message of a shallower one (the shallower only drops messages
    beyond its levels), so for each (ticker, date) the deepest file is landed and
    the others are reported as superseded.
    """
    folder = Path(folder)
    files = [folder] if folder.is_file() else find_lobster(folder)
    if not files:
        raise FileNotFoundError(f"no LOBSTER zip or message/orderbook CSV pair in {folder}")
    days = [day for f in files for day in read_lobster(f)]
    deepest: dict[Partition, object] = {}
    for day in days:
        part = Partition(day.product, day.date)
        if part not in deepest or day.levels > deepest[part].levels:
            deepest[part] = day
    for day in days:
        chosen = deepest[Partition(day.product, day.date)]
        if chosen is not day:
            log.warning(
                "%s (%d levels) superseded by %s (%d levels) for %s/%s",
                day.source,
                day.levels,
                chosen.source,
                chosen.levels,
                day.product,
                day.date,
            )
    landed = []
    for i, (part, day) in enumerate(sorted(deepest.items())):
        landed.append(catalog.land(dataset, part, day.table, root=root, source=day.source))
        if progress:
            progress(i + 1, len(deepest))
    return landed
