"""Landing sources in the catalog: the synthetic generator and LOBSTER files."""

from __future__ import annotations

import datetime as dt
import logging
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path

import numpy as np

from quantloop.tasks.data import schema, synthetic
from quantloop.tasks.data.catalog import Catalog, Landed
from quantloop.tasks.data.ingest import (
    DataValidationError,
    IngestLimits,
    LobsterDay,
    ScannedDay,
    find_lobster,
    read_lobster,
    scan_lobster,
    stream_lobster,
)
from quantloop.tasks.data.schema import Partition, book_schema
from quantloop.tasks.data.sources import SourceIndex
from quantloop.tasks.data.synthetic import SyntheticConfig, generate_day
from quantloop.tasks.engine import code_fingerprint, sha256_json
from quantloop.tasks.engine.storage import ParquetStream

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
    site: str = "local",
    progress: Callable[[int, int], None] | None = None,
) -> list[Landed]:
    """Generate and land every (product, date); unchanged partitions are no-ops.

    A partition's source names the generator's code, settings, product and date: when
    the catalog's current version came from the same source and its file is intact,
    the day is not generated again (a cached re-run of the default data spent 0.3-0.6 s
    here generating 12 days to find them unchanged)."""
    landed = []
    parts = [Partition(p, d) for p in products for d in dates]
    code = code_fingerprint(synthetic, schema)  # what decides the generated table
    for i, part in enumerate(parts):
        made_by = sha256_json({"code": code, "config": asdict(cfg), "product": part.product,
                               "date": part.date.isoformat()})  # fmt: skip
        source = f"synthetic seed={cfg.seed} generator={made_by[:16]}"
        previous = catalog.get(dataset, part)
        if previous is not None and previous.source == source and catalog.intact(previous):
            landed.append(Landed(previous, "unchanged"))
        else:
            table = generate_day(part.product, part.date, cfg)
            landed.append(catalog.land(dataset, part, table, root=root, site=site, source=source))
        if progress:
            progress(i + 1, len(parts))
    return landed


def read_lobster_folder(
    folder: str | Path, *, limits: IngestLimits | None = None
) -> list[LobsterDay]:
    """Every LOBSTER day in a folder (or one file), read and validated, tables and all.

    Every file is read before anything is reported, so one error lists every bad
    file (each with its row and column), not only the first.
    """
    return _each_file(folder, lambda f: read_lobster(f, limits=limits))


def scan_lobster_folder(
    folder: str | Path,
    *,
    limits: IngestLimits | None = None,
    home: str | None = None,
) -> list[ScannedDay]:
    """What `read_lobster_folder` checks, keeping no table: a block of each file is all it
    holds, whatever the size of the folder (`quantloop run`'s checks before it starts).

    home: a workspace home whose source index (tasks/data/sources.py) says what the files
    held when last read; a file unchanged since is not read again."""
    limits = limits or IngestLimits.from_env()
    index = SourceIndex.in_home(home, limits) if home else None

    def read(f: Path) -> list[ScannedDay]:
        if index is None:
            return scan_lobster(f, limits=limits)
        if (known := index.get(f)) is not None:
            return known.days
        taken = index.stamp(f)
        days = scan_lobster(f, limits=limits)
        index.put(f, taken, days)
        return days

    days = _each_file(folder, read)
    if index is not None:
        index.save()  # only once every file is valid: a refused folder writes nothing
    return days


def _each_file(folder: str | Path, read: Callable[[Path], list]) -> list:
    folder = Path(folder)
    if not folder.exists() and not folder.is_symlink():
        raise FileNotFoundError(f"LOBSTER folder {folder} does not exist")
    files = [folder] if not folder.is_dir() else find_lobster(folder)
    if not files:
        raise FileNotFoundError(f"no LOBSTER zip or message/orderbook CSV pair in {folder}")
    days, errors = [], []
    for f in files:
        try:
            days += read(f)
        except DataValidationError as exc:
            errors.append(str(exc))
    if len(errors) == 1:
        raise DataValidationError(errors[0])
    if errors:
        raise DataValidationError(
            f"{len(errors)} of {len(files)} LOBSTER files are invalid:\n  " + "\n  ".join(errors)
        )
    return days


def land_lobster(
    catalog: Catalog,
    root: str,
    folder: str | Path,
    *,
    dataset: str = "lobster",
    site: str = "local",
    progress: Callable[[int, int], None] | None = None,
    note: Callable[[str], None] | None = None,
    limits: IngestLimits | None = None,
    home: str | None = None,
) -> list[Landed]:
    """Ingest every LOBSTER file in a folder (or one file) and land it; `progress` gets
    (landed, total), `note` each line a watcher should see (a superseded file).

    home: a workspace home whose source index (tasks/data/sources.py) knows the files:
    when every file is unchanged since it was landed and the catalog still holds the
    versions they landed as, intact, nothing is read (every partition "unchanged").

    LOBSTER ships one file per depth for the same ticker and day; a deeper file
    holds every message of a shallower one (the shallower only drops messages
    beyond its levels), so for each (ticker, date) the deepest file is landed and
    the others are reported as superseded (checked, not written).

    One pass over the files: each day is checked and written into its Parquet file a
    block at a time (Catalog.stage), so memory is a row group of the file (1024 * 1024
    rows), not the day, and each file is read once (checking first, then landing, read
    it twice). Nothing is recorded until every file is read: a bad file anywhere lands
    nothing (its own day's file and the ones written before it are removed; the files
    after it are only checked), and the error lists every bad file.
    """
    limits = limits or IngestLimits.from_env()
    index = SourceIndex.in_home(home, limits) if home else None
    if index is not None:
        known = _unchanged(catalog, dataset, folder, index)
        if known is not None:
            days, chosen, landed = known
            _note_superseded(days, chosen, note)
            if progress:
                progress(len(landed), len(landed))
            return landed
    staged: dict[Partition, tuple[ScannedDay, ParquetStream]] = {}
    opened: list[ParquetStream] = []
    read_from: dict[Path, tuple[tuple, list[ScannedDay]]] = {}
    failed = False

    def sink_for(part: Partition, levels: int, source: str) -> ParquetStream | None:
        held = staged.get(part)
        if failed or (held is not None and held[0].levels >= levels):
            return None  # a bad file seen (nothing will land), or not the deepest: checked only
        opened.append(catalog.stage(dataset, part, book_schema(levels), root=root))
        return opened[-1]

    def read(f: Path) -> list[ScannedDay]:
        nonlocal failed
        taken = index.stamp(f) if index is not None else None
        try:
            days = stream_lobster(f, sink_for, limits=limits)
        except DataValidationError:
            failed = True
            raise
        for day, sink in days:
            if isinstance(sink, ParquetStream):
                held = staged.get(day.partition)
                if held is None or day.levels > held[0].levels:  # the first of the deepest
                    if held is not None:
                        held[1].discard()
                    sink.finish()  # its last rows written out: a folder costs a row group
                    staged[day.partition] = (day, sink)
                else:
                    sink.discard()
        read_from[f] = (taken, [day for day, _ in days])
        return read_from[f][1]

    try:
        days = _each_file(folder, read)
        _note_superseded(days, {p: held[0] for p, held in staged.items()}, note)
        landed = []
        for part in sorted(staged):
            day, written = staged[part]
            landed.append(catalog.land_stream(dataset, part, written, root=root, site=site,
                                              source=day.source))  # fmt: skip
            if progress:
                progress(len(landed), len(staged))
        if index is not None:
            digest_of = {x.entry.partition: x.entry.digest for x in landed}
            for f, (taken, file_days) in read_from.items():
                index.put(f, taken, file_days, [
                    digest_of[d.partition] if staged[d.partition][0] is d else None
                    for d in file_days
                ])  # fmt: skip
            index.save()
        return landed
    finally:
        # What did not land (a failure, a superseded day), newest first: each removes the
        # folders it made, once empty, so a refused folder leaves the store as it was.
        for written in reversed(opened):
            written.discard()


def _note_superseded(
    days: list[ScannedDay],
    chosen: dict[Partition, ScannedDay],
    note: Callable[[str], None] | None,
) -> None:
    for day in days:
        deepest = chosen[day.partition]
        if deepest is not day:
            line = (
                f"{day.source} ({day.levels} levels) superseded by {deepest.source} "
                f"({deepest.levels} levels) for {day.product}/{day.date}"
            )
            log.warning(line)
            if note:
                note(line)


def _unchanged(
    catalog: Catalog, dataset: str, folder: str | Path, index: SourceIndex
) -> tuple[list[ScannedDay], dict[Partition, ScannedDay], list[Landed]] | None:
    """A landing that reads nothing, when the index knows every file of the folder as it
    is now and the catalog's current version of each partition is the one its deepest
    file landed as, intact (what reading them all would find: every partition
    "unchanged"); None otherwise, and the folder is read."""
    folder = Path(folder)
    try:
        files = [folder] if not folder.is_dir() else find_lobster(folder)
    except OSError:
        return None
    known = [index.get(f) for f in files]
    if not files or any(k is None for k in known):
        return None
    days: list[ScannedDay] = []
    chosen: dict[Partition, tuple[ScannedDay, str | None]] = {}
    for k in known:
        for day, digest in zip(k.days, k.digests, strict=True):
            days.append(day)
            held = chosen.get(day.partition)
            if held is None or day.levels > held[0].levels:  # as `land_lobster` picks
                chosen[day.partition] = (day, digest)
    landed = []
    for part in sorted(chosen):
        digest = chosen[part][1]
        entry = catalog.get(dataset, part)
        if digest is None or entry is None or entry.digest != digest or not catalog.intact(entry):
            return None
        landed.append(Landed(entry, "unchanged"))
    return days, {p: held[0] for p, held in chosen.items()}, landed
