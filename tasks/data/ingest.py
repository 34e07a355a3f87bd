"""Read LOBSTER message + orderbook files into the canonical order-book table.

LOBSTER ships one day as two headerless CSVs with the same row count:
`TICKER_DATE_START_END_message_N.csv` (time, type, order id, size, price,
direction) and `..._orderbook_N.csv` (ask price, ask size, bid price, bid size
per level). Ticker, date and level count come from those names. Every failure
is a `DataValidationError` naming the file and the 1-based row, because the
first thing anyone does with a bad file is open it at that line.

Reading is streamed: both files of a day are parsed `IngestLimits.block_bytes` at a
time and checked row by row together, so checking a day (`scan_lobster`) holds a block
of each file whatever their size, and finding a bad line looks only inside its block;
`stream_lobster` hands the checked blocks on as they are read (landing writes them into
the day's Parquet file), `read_lobster` keeps them as a table. A zip member is refused
from its declared size and compression ratio before a byte of it is inflated, and
inflating stops at the size it declared (a 2 MB zip of 2 GiB of NUL bytes was read whole
and took 16 GiB to locate its "bad line").

`validate_book` holds the order-book invariants; ingest and the synthetic
generator both run it, so the two sources cannot drift apart.
"""

from __future__ import annotations

import datetime as dt
import os
import re
import zipfile
import zlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO, Protocol

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv

from quantloop.tasks.data.schema import (
    DUMMY_ASK,
    DUMMY_BID,
    EVENT_TYPES,
    HALT,
    MESSAGE_FIELDS,
    Partition,
    book_schema,
    levels_of,
)

MESSAGE_COLUMNS = 6
_MESSAGE_TYPES = [pa.float64()] + [pa.int64()] * (MESSAGE_COLUMNS - 1)
_SIDES = (("ask", DUMMY_ASK), ("bid", DUMMY_BID))
# Type-7 prices (LOBSTER ReadMe): -1 halt, 0 quoting resumes, 1 trading resumes.
_HALT_START, _QUOTE_RESUME, _TRADE_RESUME = -1, 0, 1

_NAME_RE = re.compile(
    r"^(?P<ticker>.+)_(?P<date>\d{4}-\d{2}-\d{2})_(?P<start>\d+)_(?P<end>\d+)"
    r"_(?P<kind>message|orderbook)_(?P<levels>\d+)\.csv$"
)
_INT_RE = r"^\s*[+-]?\d+\s*$"
_FLOAT_RE = r"^\s*[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?\s*$"
# The ratio limit applies from this declared size on: a smaller member costs at most this
# much inflating, whatever its ratio (a small test day of identical rows compresses >100x).
_RATIO_FROM_BYTES = 64 << 20
_GIB = 1 << 30


class DataValidationError(ValueError):
    """Input that breaks the LOBSTER format or an order-book invariant."""


@dataclass(kw_only=True, slots=True, frozen=True)
class IngestLimits:
    """What reading LOBSTER input may cost. Each field can be set for a process through
    the environment variable named beside it (`from_env`), e.g. for `quantloop run`."""

    max_member_bytes: int = _GIB
    """A zip member declaring this many uncompressed bytes or more is refused before any
    of it is inflated (QUANTLOOP_INGEST_MAX_MEMBER_BYTES; default 1 GiB: LOBSTER's sample
    members are 1.3-34 MB, a 50-level day of a busy ticker a few hundred MB)."""
    max_ratio: float = 500.0
    """A zip member over 64 MiB declaring more than this many bytes per compressed byte is
    refused (QUANTLOOP_INGEST_MAX_RATIO; LOBSTER's samples compress 3.8-28x; deflate tops
    out at ~1032x, which NUL bytes reach)."""
    block_bytes: int = 1 << 20
    """Bytes of a CSV parsed at a time, so what a read holds of a file whatever its size;
    also the longest line accepted (a 50-level LOBSTER row is ~2.5 KB)."""

    # Not a field (no annotation): the environment variable of each limit.
    _ENV = {
        "max_member_bytes": ("QUANTLOOP_INGEST_MAX_MEMBER_BYTES", int),
        "max_ratio": ("QUANTLOOP_INGEST_MAX_RATIO", float),
        "block_bytes": ("QUANTLOOP_INGEST_BLOCK_BYTES", int),
    }

    def __post_init__(self) -> None:
        for name in ("max_member_bytes", "max_ratio", "block_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
                raise ValueError(f"IngestLimits.{name} must be a number > 0, got {value!r}")
        if self.block_bytes < 4096:
            raise ValueError(f"IngestLimits.block_bytes must be >= 4096, got {self.block_bytes}")

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> IngestLimits:
        """The defaults, with any QUANTLOOP_INGEST_* variable set in `env` instead."""
        values = {}
        for name, (var, kind) in cls._ENV.items():
            if var in env:
                try:
                    values[name] = kind(env[var])
                except ValueError:
                    raise ValueError(f"{var}={env[var]!r} is not a number") from None
        try:
            return cls(**values)
        except ValueError as e:
            raise ValueError(f"{e} (from the QUANTLOOP_INGEST_* environment)") from None


@dataclass(kw_only=True, slots=True, frozen=True)
class ScannedDay:
    """One ticker-day read from LOBSTER and checked, without its table (`scan_lobster`)."""

    product: str
    date: dt.date
    levels: int
    rows: int
    source: str  # the message file (zip members as "archive.zip!member.csv"; a symlink
    # as "link -> the file it points to", so provenance names the bytes read)
    halts: int  # number of trading halts (type-7 halt ... trade-resume spans)

    @property
    def partition(self) -> Partition:
        return Partition(self.product, self.date)


@dataclass(kw_only=True, slots=True, frozen=True)
class LobsterDay(ScannedDay):
    """One ticker-day read from LOBSTER, already in `book_schema(levels)`."""

    table: pa.Table = field(repr=False)


@dataclass(frozen=True, slots=True)
class _Name:
    ticker: str
    date: dt.date
    start: str
    end: str
    levels: int

    def file(self, kind: str) -> str:
        day = self.date.isoformat()
        return f"{self.ticker}_{day}_{self.start}_{self.end}_{kind}_{self.levels}.csv"


def _parse_name(name: str, source: str) -> tuple[str, _Name] | None:
    """(kind, parsed name) for a LOBSTER file name; None for other files."""
    m = _NAME_RE.match(name)
    if m is None:
        return None
    try:
        date = dt.date.fromisoformat(m["date"])
        levels = int(m["levels"])
        Partition(m["ticker"], date)  # the ticker must be a valid product name
    except ValueError as e:
        raise DataValidationError(f"{source}: bad LOBSTER file name: {e}") from e
    if levels < 1:
        raise DataValidationError(f"{source}: bad LOBSTER file name: levels must be >= 1")
    return m["kind"], _Name(m["ticker"], date, m["start"], m["end"], levels)


@dataclass(frozen=True, slots=True)
class _Source:
    """One CSV to read: what messages (and the catalog) call it, and how to open it."""

    name: str
    open: Callable[[], BinaryIO]


def _named(path: Path) -> str:
    """A path as the user gave it, and the file it resolves to when a symlink is on the way."""
    real = path.resolve()
    return str(path) if real == Path(os.path.abspath(path)) else f"{path} -> {real}"


def _dangling(path: Path) -> DataValidationError | None:
    if path.is_symlink() and not path.exists():
        return DataValidationError(
            f"{path}: a symlink to {os.readlink(path)}, which does not exist"
        )
    return None


# --------------------------------------------------------------------------- finding files


def _lobster_like(name: str) -> bool:
    return name.lower().endswith(".zip") or _NAME_RE.match(name) is not None


def find_lobster(folder: str | Path, *, recursive: bool = False) -> list[Path]:
    """LOBSTER zips and message CSVs (each standing for its message+orderbook pair) in a folder.

    Every zip is listed, so a corrupt one fails loudly in `read_lobster` instead of vanishing,
    and so is a symlink that points nowhere under a LOBSTER-like name (read_lobster names
    it and its missing target; skipping it silently dropped a product).
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"{folder}: not a folder")
    files = folder.rglob("*") if recursive else folder.iterdir()
    found = []
    for p in files:
        if p.is_symlink() and not p.exists():
            if _lobster_like(p.name) or _lobster_like(Path(os.readlink(p)).name):
                found.append(p)
            continue
        if not p.is_file():
            continue
        if p.suffix.lower() == ".zip":
            found.append(p)
        elif (m := _NAME_RE.match(p.name)) and m["kind"] == "message":
            found.append(p)
    return sorted(found)


def source_files(path: str | Path) -> list[Path]:
    """The files a LOBSTER source (`find_lobster`'s item) reads: a zip itself, a message
    CSV and the orderbook CSV beside it. What tasks/data/sources.py stats to know whether
    a source changed since it was read."""
    path = Path(path)
    parsed = None if path.suffix.lower() == ".zip" else _NAME_RE.match(path.name)
    if parsed is None:
        return [path]
    kind = parsed["kind"]
    other = "orderbook" if kind == "message" else "message"
    partner = path.name[: parsed.start("kind")] + other + path.name[parsed.end("kind") :]
    return [path, path.with_name(partner)]


class DaySink(Protocol):
    """Where a day's rows go as they are read and checked (`stream_lobster`)."""

    def write(self, block: pa.Table) -> None:
        """The next rows of the day, in `book_schema(levels)`."""

    def discard(self) -> None:
        """The day failed (or is read again from its start): drop what was written."""


# (partition, levels, source) of a day about to be read -> its sink, or None to check only
SinkFor = Callable[[Partition, int, str], DaySink | None]


def read_lobster(path: str | Path, *, limits: IngestLimits | None = None) -> list[LobsterDay]:
    """Read a LOBSTER zip, a message CSV (orderbook CSV beside it) or a folder of those.

    limits: what reading may cost; default `IngestLimits.from_env()`."""
    days = stream_lobster(path, lambda *_: _Columns(), limits=limits)
    return [LobsterDay(product=d.product, date=d.date, levels=d.levels, rows=d.rows,
                       source=d.source, halts=d.halts, table=sink.table(book_schema(d.levels)))
            for d, sink in days if isinstance(sink, _Columns)]  # fmt: skip


def scan_lobster(path: str | Path, *, limits: IngestLimits | None = None) -> list[ScannedDay]:
    """Check what `read_lobster` reads, row by row, keeping no table: memory is a block of
    each file, whatever the size of the day."""
    return [day for day, _ in stream_lobster(path, lambda *_: None, limits=limits)]


def stream_lobster(
    path: str | Path, sink_for: SinkFor, *, limits: IngestLimits | None = None
) -> list[tuple[ScannedDay, DaySink | None]]:
    """Read and check what `read_lobster` reads, handing each day's rows, a block at a time,
    to the sink `sink_for(partition, levels, source)` gives it (None: checked only). A day
    that fails is discarded from its sink before the error is raised; the sinks of days
    read before it in the same file are the caller's to drop. Memory: a block of each
    file, besides what the sinks keep."""
    return _days(Path(path), limits or IngestLimits.from_env(), sink_for)


class _Columns:
    """A sink that keeps a day's blocks, for `read_lobster`'s table."""

    def __init__(self) -> None:
        self.blocks: list[pa.Table] = []

    def write(self, block: pa.Table) -> None:
        self.blocks.append(block)

    def discard(self) -> None:
        self.blocks = []

    def table(self, schema: pa.Schema) -> pa.Table:
        columns = [[b.column(i).chunk(0) for b in self.blocks] for i in range(len(schema))]
        self.blocks = []
        return _one_chunk(columns, schema)


def _days(
    path: Path, limits: IngestLimits, sink_for: SinkFor
) -> list[tuple[ScannedDay, DaySink | None]]:
    if path.is_dir():
        return [day for p in find_lobster(path) for day in _days(p, limits, sink_for)]
    if (err := _dangling(path)) is not None:
        raise err
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file")
    if path.suffix.lower() == ".zip":
        return _read_zip(path, limits, sink_for)
    parsed = _parse_name(path.name, str(path))
    if parsed is None:
        raise DataValidationError(
            f"{path}: not a LOBSTER zip or file (TICKER_DATE_START_END_message_N.csv)"
        )
    kind, name = parsed
    msg_path = path.with_name(name.file("message"))
    ob_path = path.with_name(name.file("orderbook"))
    for p in (msg_path, ob_path):
        if (err := _dangling(p)) is not None:
            raise err
        if not p.is_file():
            raise FileNotFoundError(f"{p}: missing; LOBSTER {kind} file {path} needs it beside it")
    msg = _Source(_named(msg_path), lambda: msg_path.open("rb"))
    ob = _Source(_named(ob_path), lambda: ob_path.open("rb"))
    return [_read_day(msg, ob, name, limits, sink_for)]


def _read_zip(
    path: Path, limits: IngestLimits, sink_for: SinkFor
) -> list[tuple[ScannedDay, DaySink | None]]:
    zip_name = _named(path)
    try:
        with zipfile.ZipFile(path) as zf:
            infos = {i.filename: i for i in zf.infolist() if not i.is_dir()}
            pairs = []
            for member in sorted(infos):
                folder, _, base = member.rpartition("/")
                parsed = _parse_name(base, f"{zip_name}!{member}")
                if parsed is None:
                    continue  # ReadMe and other extras
                kind, name = parsed
                prefix = f"{folder}/" if folder else ""
                partner = prefix + name.file("orderbook" if kind == "message" else "message")
                if partner not in infos:
                    raise DataValidationError(f"{zip_name}: {member} has no partner {partner}")
                _check_declared(infos[member], f"{zip_name}!{member}", limits)
                if kind == "message":
                    pairs.append((member, partner, name))
            # Every member's declared size is checked before any is inflated.
            days = [
                _read_day(
                    _member(zf, infos[member], f"{zip_name}!{member}"),
                    _member(zf, infos[partner], f"{zip_name}!{partner}"),
                    name,
                    limits,
                    sink_for,
                )
                for member, partner, name in pairs
            ]
    except (zipfile.BadZipFile, zlib.error, EOFError) as e:
        raise DataValidationError(f"{zip_name}: corrupt or truncated zip ({e})") from e
    except (RuntimeError, NotImplementedError) as e:  # encrypted; deflate64, bzip2 absent
        raise DataValidationError(f"{zip_name}: cannot read this zip ({e})") from e
    if not days:
        raise DataValidationError(
            f"{zip_name}: no LOBSTER message file (TICKER_DATE_START_END_message_N.csv) inside"
        )
    return days


def _check_declared(info: zipfile.ZipInfo, source: str, limits: IngestLimits) -> None:
    """Refuse a member from its header alone: too large, or compressed too well to be CSV."""
    size = info.file_size
    if size >= limits.max_member_bytes:
        raise DataValidationError(
            f"{source}: declares {size:,} bytes ({size / _GIB:.1f} GiB) uncompressed, at or "
            f"over the {_bytes(limits.max_member_bytes)} limit for a zip member; refused "
            "unread (set QUANTLOOP_INGEST_MAX_MEMBER_BYTES to allow larger members)"
        )
    ratio = size / max(info.compress_size, 1)
    if size >= _RATIO_FROM_BYTES and ratio > limits.max_ratio:
        raise DataValidationError(
            f"{source}: declares {size:,} bytes from {info.compress_size:,} compressed "
            f"({ratio:,.0f}x; LOBSTER CSVs compress 4-30x), over the {limits.max_ratio:g}x "
            "limit; refused unread (set QUANTLOOP_INGEST_MAX_RATIO to allow it)"
        )


def _bytes(n: int) -> str:
    for unit, size in (("GiB", _GIB), ("MiB", 1 << 20)):
        if n >= size and n % size == 0:
            return f"{n // size} {unit}"
    return f"{n:,}-byte"


def _member(zf: zipfile.ZipFile, info: zipfile.ZipInfo, source: str) -> _Source:
    return _Source(source, lambda: _Budgeted(zf.open(info), info.file_size, source))


class _Budgeted:
    """A zip member's stream that fails once it yields more than its header declared.

    CPython's zipfile cuts a member at its declared size, but a whole-member read
    inflates everything first (300 MB of NULs declaring 1 MiB took 768 MB to refuse);
    read in blocks, inflating stops at the block, and this budget holds whatever the
    reader below does."""

    def __init__(self, raw: BinaryIO, declared: int, source: str):
        self._raw, self._left, self._declared, self._source = raw, declared, declared, source

    def read(self, n: int) -> bytes:
        data = self._raw.read(n)
        self._left -= len(data)
        if self._left < 0:
            raise DataValidationError(
                f"{self._source}: inflates past the {self._declared:,} bytes its zip header "
                "declares; refused (a damaged or crafted zip)"
            )
        return data

    def close(self) -> None:
        self._raw.close()

    def __enter__(self) -> _Budgeted:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# --------------------------------------------------------------------------- parsing


class _Lines:
    """A CSV stream cut into runs of whole lines of about `block` bytes."""

    def __init__(self, stream: BinaryIO, source: str, block: int):
        self._stream, self._source, self._block = stream, source, block
        self._held = b""
        self.rows = 0  # lines handed out so far

    def piece(self) -> bytes | None:
        """The next run of whole lines (the file's last may lack its newline); None at the end."""
        while True:
            data = self._stream.read(self._block)
            if not data:
                out, self._held = self._held, b""
                return out or None
            held = self._held + data
            cut = held.rfind(b"\n")
            if cut < 0:
                if len(held) > self._block:
                    raise DataValidationError(
                        f"{self._source}: row {self.rows + 1}: no line end in its first "
                        f"{len(held):,} bytes ({held[:40]!r}...): not a LOBSTER row"
                    )
                self._held = held
                continue
            out, self._held = held[: cut + 1], held[cut + 1 :]
            self.rows += out.count(b"\n")
            return out

    def rest_is_blank(self) -> bool:
        """Whether nothing but blank space is left (read to the end to know)."""
        if self._held.strip():
            return False
        while data := self._stream.read(self._block):
            if data.strip():
                return False
        return True


def _parse(piece: bytes, types: list[pa.DataType], as_strings: bool = False) -> pa.Table:
    names = [f"c{i}" for i in range(len(types))]
    return pacsv.read_csv(
        pa.py_buffer(piece),
        read_options=pacsv.ReadOptions(column_names=names),
        # Blank lines must not vanish: row numbers in errors are line numbers.
        parse_options=pacsv.ParseOptions(ignore_empty_lines=False),
        convert_options=pacsv.ConvertOptions(
            column_types={
                n: pa.string() if as_strings else t for n, t in zip(names, types, strict=True)
            },
            null_values=[],
            strings_can_be_null=False,
            quoted_strings_can_be_null=False,
        ),
    )


def _csv_tables(src: _Source, types: list[pa.DataType], block: int) -> Iterator[pa.Table]:
    """A headerless numeric CSV with exactly len(types) columns, a block at a time.

    Blank lines at the end of a file (an editor's or a script's trailing newlines) are
    not rows; a blank line anywhere else is an error naming its row.
    """
    with src.open() as stream:
        lines = _Lines(stream, src.name, block)
        row = 0  # rows of the file before this piece
        while (piece := lines.piece()) is not None:
            try:
                table = _parse(piece, types)
            except pa.ArrowInvalid as e:
                # Arrow's messages carry no row number, so find the first bad line ourselves
                # (only on this failure path, and only in this piece).
                i, start, blank, err = _locate(piece, src.name, types, e, row)
                if not (blank and not piece[start:].strip() and lines.rest_is_blank()):
                    raise err from e
                if row + i == 0:
                    raise DataValidationError(f"{src.name}: file is empty") from e
                if i:
                    yield _parse(piece[:start], types)
                return
            row += table.num_rows
            yield table
        if row == 0:
            raise DataValidationError(f"{src.name}: file is empty")


def _locate(
    piece: bytes, source: str, types: list[pa.DataType], err: Exception, row0: int
) -> tuple[int, int, bool, DataValidationError]:
    """The first bad line of a piece: (its index, its first byte, whether it is blank, the
    error naming it). Memory: a few bytes per line and per comma, never per byte."""
    buf = np.frombuffer(piece, np.uint8)
    ends = np.flatnonzero(buf == ord("\n"))
    if len(buf) and buf[-1] != ord("\n"):
        ends = np.append(ends, len(buf))
    starts = np.concatenate([[0], ends[:-1] + 1])
    # Commas per line: each comma's line is the first line end after it.
    commas = np.bincount(
        np.searchsorted(ends, np.flatnonzero(buf == ord(","))), minlength=len(ends)
    )
    bad = np.flatnonzero(commas + 1 != len(types))
    first_bad = int(bad[0]) if len(bad) else len(ends)
    # A number that does not parse, on a line before the first with a wrong column count.
    if first_bad > 0:
        strings = _parse(piece[: int(starts[first_bad]) if first_bad < len(ends) else len(piece)],
                         types, as_strings=True)  # fmt: skip
        first: tuple[int, int] | None = None
        for j, t in enumerate(types):
            pattern = _FLOAT_RE if pa.types.is_floating(t) else _INT_RE
            ok = pc.match_substring_regex(strings.column(j), pattern).to_numpy(zero_copy_only=False)
            wrong = np.flatnonzero(~ok)
            if len(wrong) and (first is None or wrong[0] < first[0]):
                first = (int(wrong[0]), j)
        if first is not None:
            i, j = first
            value = strings.column(j)[i].as_py()
            kind = "a number" if pa.types.is_floating(types[j]) else "an integer"
            return (
                i,
                int(starts[i]),
                False,
                DataValidationError(
                    f"{source}: row {row0 + i + 1}, column {j + 1}: {value!r} is not {kind}"
                ),
            )
    if first_bad < len(ends):
        i = first_bad
        raw = piece[starts[i] : ends[i]]
        line = raw.decode("utf-8", "replace").rstrip("\r")
        got = "an empty line" if not line else f"{commas[i] + 1} columns"
        return (
            i,
            int(starts[i]),
            not raw.strip(),
            DataValidationError(
                f"{source}: row {row0 + i + 1}: {got}, expected {len(types)} ({line[:80]!r})"
            ),
        )
    return 0, 0, False, DataValidationError(f"{source}: unreadable CSV ({err})")


class _Rows:
    """One CSV's rows, handed out in any count: the message and orderbook files are cut
    into different pieces but checked row by row together."""

    def __init__(self, tables: Iterator[pa.Table]):
        self._tables, self._held, self.total = tables, None, 0

    def ready(self) -> int:
        """Rows held now, reading the next piece if none are; 0 at the end of the file."""
        while self._held is None or self._held.num_rows == 0:
            table = next(self._tables, None)
            if table is None:
                return 0
            self._held = table
            self.total += table.num_rows
        return self._held.num_rows

    def take(self, n: int) -> pa.Table:
        out, self._held = self._held.slice(0, n), self._held.slice(n)
        return out

    def count_rest(self) -> int:
        """Every row of the file (reads the rest)."""
        for table in self._tables:
            self.total += table.num_rows
        return self.total


class _OpensHalted(Exception):
    """The file began inside a halt: its first type-7 marker is a resume."""


def _read_day(
    msg: _Source, ob: _Source, name: _Name, limits: IngestLimits, sink_for: SinkFor
) -> tuple[ScannedDay, DaySink | None]:
    # Whether the day opens inside a halt shows only at its first type-7 marker, which can
    # be blocks in; read as if not, and read again (into a new sink) in the rare case it does.
    for opens_halted in (False, True):
        sink = sink_for(Partition(name.ticker, name.date), name.levels, msg.name)
        try:
            return _stream_day(msg, ob, name, limits, sink, opens_halted=opens_halted), sink
        except _OpensHalted:
            if sink is not None:
                sink.discard()
            if opens_halted:
                raise
        except BaseException:
            if sink is not None:
                sink.discard()
            raise
    raise AssertionError("unreachable")


def _stream_day(
    msg: _Source,
    ob: _Source,
    name: _Name,
    limits: IngestLimits,
    sink: DaySink | None,
    opens_halted: bool,
) -> ScannedDay:
    block = limits.block_bytes
    messages = _Rows(_csv_tables(msg, _MESSAGE_TYPES, block))
    books = _Rows(_csv_tables(ob, [pa.int64()] * (4 * name.levels), block))
    schema = book_schema(name.levels)
    row, last_time, halts = 0, None, 0
    state = opens_halted  # halted after the last type-7 marker so far
    last_halted, marker_seen = False, opens_halted
    while (n := min(messages.ready(), books.ready())) > 0:
        m, b = messages.take(n), books.take(n)
        msgs = {f.name: m.column(i).to_numpy() for i, f in enumerate(MESSAGE_FIELDS)}
        # before the int8 casts below, which would overflow
        _check_messages(msgs, msg.name, row0=row, previous_time=last_time)
        markers = _markers(msgs["event_type"], msgs["price"])
        if not marker_seen and len(markers) and msgs["price"][markers[0]] != _HALT_START:
            raise _OpensHalted
        halted, state_after = _halt_spans(msgs["event_type"], msgs["price"], start=state)
        book = _book_columns(b, name.levels, ob.name, row)
        try:
            _check_book(book, halted, name.levels, ob.name, column_offset=0, row0=row)
        except DataValidationError:
            # A locked book before the first marker is fine if the day opened halted.
            if not marker_seen and not len(markers) and _first_marker_resumes(msg, block):
                raise _OpensHalted from None
            raise
        rises = int(np.count_nonzero(halted[1:] & ~halted[:-1]))
        halts += int(halted[0] and not last_halted) + rises
        marker_seen = marker_seen or bool(len(markers))
        state, last_halted = state_after, bool(halted[-1])
        last_time, row = float(msgs["time"][-1]), row + n
        if sink is not None:
            arrays = [pa.array(msgs[f.name]).cast(f.type) for f in MESSAGE_FIELDS]
            arrays += [pa.array(v, mask=~present) for v, present in book.values()]
            arrays.append(pa.array(halted))
            sink.write(pa.Table.from_arrays(arrays, schema=schema))
    m_rows, b_rows = messages.count_rest(), books.count_rest()
    if m_rows != b_rows:
        raise DataValidationError(
            f"{ob.name}: {b_rows} rows but {msg.name} has {m_rows}; "
            f"row {min(m_rows, b_rows) + 1} has no partner row"
        )
    info = dict(product=name.ticker, date=name.date, levels=name.levels, rows=row,
                source=msg.name, halts=halts)  # fmt: skip
    return ScannedDay(**info)


def _one_chunk(columns: list[list[pa.Array]], schema: pa.Schema) -> pa.Table:
    """The table of a day's blocks, one chunk per column, as landing's Parquet row groups
    are (storage.ParquetStream): chunk boundaries move Parquet's page boundaries, so the
    digests. A column's blocks are dropped as it is joined. Landing does not hold the
    table (landing.land_lobster streams each day into its file)."""
    joined = []
    for i, f in enumerate(schema):
        parts, columns[i] = columns[i], []
        joined.append(pa.concat_arrays(parts) if parts else pa.array([], f.type))
    return pa.Table.from_arrays(joined, schema=schema)


def _book_columns(
    b: pa.Table, levels: int, source: str, row0: int
) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Column name -> (values, present) of a block of orderbook rows; dummies are absent."""
    book: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    for k in range(levels):
        for s, (side, dummy) in enumerate(_SIDES):
            col = 4 * k + 2 * s
            price = b.column(col).to_numpy()
            size = b.column(col + 1).to_numpy()
            empty = price == dummy
            bad = np.flatnonzero(empty & (size != 0))
            if len(bad):
                raise DataValidationError(
                    f"{source}: row {row0 + bad[0] + 1}, column {col + 2}: "
                    f"empty level (price {dummy}) has size {size[bad[0]]}"
                )
            book[f"{side}_price_{k + 1}"] = (price, ~empty)
            book[f"{side}_size_{k + 1}"] = (size, np.ones(len(size), bool))
    return book


def _first_marker_resumes(msg: _Source, block: int) -> bool:
    """Whether the first type-7 marker (halt or trade resume) of a message file is a resume."""
    try:
        for table in _csv_tables(msg, _MESSAGE_TYPES, block):
            et, price = table.column(1).to_numpy(), table.column(4).to_numpy()
            markers = _markers(et, price)
            if len(markers):
                return bool(price[markers[0]] != _HALT_START)
    except DataValidationError:
        pass  # a later error: the book error at hand comes first
    return False


# --------------------------------------------------------------------------- halts


def halted_rows(
    event_type: np.ndarray, price: np.ndarray, *, start: bool | None = None
) -> np.ndarray:
    """True for rows from a halt message (type 7, price -1) through its trade resume (price 1).

    The resume row itself counts as halted: LOBSTER repeats the halted book on
    every type-7 row. Quote-resume (price 0) keeps the halt: quotes, no trades,
    and that is when a book may legitimately lock or cross. A trade resume with
    no halt before it means the file began inside a halt. start: whether the rows
    begin halted (a block of a file read in blocks); None: as a whole file's do.
    """
    return _halt_spans(event_type, price, start)[0]


def _markers(event_type: np.ndarray, price: np.ndarray) -> np.ndarray:
    """Rows of the type-7 messages that start or end a halt (quote resumes keep it)."""
    return np.flatnonzero((event_type == HALT) & (price != _QUOTE_RESUME))


def _halt_spans(
    event_type: np.ndarray, price: np.ndarray, start: bool | None
) -> tuple[np.ndarray, bool]:
    """(halted per row, whether the rows after these are halted)."""
    n = len(event_type)
    rows = _markers(event_type, price)
    if len(rows) == 0:
        return np.full(n, bool(start)), bool(start)
    state = price[rows] == _HALT_START  # halted after this type-7 row?
    # None: the first marker tells; a resume means the rows before it were halted.
    before_first = (not state[0]) if start is None else start
    last = np.searchsorted(rows, np.arange(n), side="right") - 1
    halted = np.where(last >= 0, state[np.maximum(last, 0)], before_first)
    prev = np.concatenate([[before_first], state[:-1]])
    halted[rows[~state & prev]] = True  # the resume row of a real halt
    return halted, bool(state[-1])


def count_halts(halted: np.ndarray) -> int:
    """Number of halted spans."""
    if len(halted) == 0:
        return 0
    return int(halted[0]) + int(np.count_nonzero(halted[1:] & ~halted[:-1]))


# --------------------------------------------------------------------------- validation


def _fail(source: str, row: int, column: str | None, what: str) -> DataValidationError:
    where = f"row {row + 1}" + (f", column {column}" if column else "")
    return DataValidationError(f"{source}: {where}: {what}")


def _failing_from(row0: int) -> Callable[[str, int, str | None, str], DataValidationError]:
    """`_fail` for rows that start `row0` rows into their file."""
    return lambda source, row, column, what: _fail(source, row0 + row, column, what)


def _first(mask: np.ndarray) -> int | None:
    bad = np.flatnonzero(mask)
    return int(bad[0]) if len(bad) else None


def _check_messages(
    m: dict[str, np.ndarray],
    source: str,
    *,
    row0: int = 0,
    previous_time: float | None = None,
) -> None:
    """Message invariants; m maps MESSAGE_FIELDS names to numpy arrays.

    row0: rows of the file before these; previous_time: the time of the row before them."""
    col = {f.name: f"{i + 1} ({f.name})" for i, f in enumerate(MESSAGE_FIELDS)}
    t, et, price = m["time"], m["event_type"], m["price"]
    _fail = _failing_from(row0)
    if (i := _first(~np.isfinite(t) | (t < 0))) is not None:
        raise _fail(source, i, col["time"], f"time {t[i]} is not a time of day in seconds")
    if (i := _first(np.diff(t) < 0)) is not None:
        raise _fail(
            source, i + 1, col["time"], f"time {t[i + 1]} is before the previous row's {t[i]}"
        )
    if previous_time is not None and len(t) and t[0] < previous_time:
        raise _fail(
            source, 0, col["time"], f"time {t[0]} is before the previous row's {previous_time}"
        )
    if (i := _first(~np.isin(et, sorted(EVENT_TYPES)))) is not None:
        raise _fail(source, i, col["event_type"], f"unknown event type {et[i]}")
    if (i := _first(~np.isin(m["direction"], [-1, 1]))) is not None:
        raise _fail(source, i, col["direction"], f"direction {m['direction'][i]} is not -1 or 1")
    if (i := _first(m["size"] < 0)) is not None:
        raise _fail(source, i, col["size"], f"negative size {m['size'][i]}")
    halt_price = np.isin(price, [_HALT_START, _QUOTE_RESUME, _TRADE_RESUME])
    if (i := _first((et == HALT) & ~halt_price)) is not None:
        raise _fail(source, i, col["price"], f"type-7 message with price {price[i]} (not -1/0/1)")


def _check_book(
    book: dict[str, tuple[np.ndarray, np.ndarray]],
    halted: np.ndarray,
    levels: int,
    source: str,
    column_offset: int,
    row0: int = 0,
) -> None:
    """Book invariants; book maps column name to (values, present) arrays.

    column_offset: columns before ask_price_1 (0 in an orderbook CSV, 6 in a table);
    row0: rows of the file before these.
    """
    _fail = _failing_from(row0)

    def col(name: str) -> str:
        return f"{list(book).index(name) + column_offset + 1} ({name})"

    for k in range(1, levels + 1):
        for side in ("ask", "bid"):
            pn, sn = f"{side}_price_{k}", f"{side}_size_{k}"
            price, present = book[pn]
            size = book[sn][0]
            if (i := _first(present & (price <= 0))) is not None:
                raise _fail(source, i, col(pn), f"price {price[i]} is not positive")
            if (i := _first(present & (size <= 0))) is not None:
                raise _fail(source, i, col(sn), f"size {size[i]} at price {price[i]}")
            if (i := _first(~present & (size != 0))) is not None:
                raise _fail(source, i, col(sn), f"empty level has size {size[i]}")
            if k == 1:
                continue
            above_price, above = book[f"{side}_price_{k - 1}"]
            if (i := _first(present & ~above)) is not None:
                raise _fail(source, i, col(pn), f"level {k} has a price but level {k - 1} is empty")
            worse = price <= above_price if side == "ask" else price >= above_price
            if (i := _first(present & worse)) is not None:
                raise _fail(
                    source,
                    i,
                    col(pn),
                    f"price {price[i]} does not follow level {k - 1}'s "
                    f"{above_price[i]} ({side} levels must get strictly worse)",
                )
    (ask, has_ask), (bid, has_bid) = book["ask_price_1"], book["bid_price_1"]
    both = has_ask & has_bid & ~halted
    # Locked or crossed quotes can only stand while the market is halted.
    if (i := _first(both & (ask <= bid))) is not None:
        what = "crossed" if ask[i] < bid[i] else "locked"
        raise _fail(
            source,
            i,
            col("ask_price_1"),
            f"{what} book outside a halt: best ask {ask[i]} vs best bid {bid[i]}",
        )


def validate_book(table: pa.Table, source: str) -> None:
    """Raise DataValidationError unless `table` is a valid book in `book_schema(levels)`.

    source names the data in messages (a file, or "synthetic:PRODUCT/DATE");
    rows are 1-based, columns 1-based in table order.
    """
    levels = levels_of(table.schema)
    if levels < 1:
        raise DataValidationError(f"{source}: no ask_price_1 column: not an order-book table")
    expected = book_schema(levels)
    if not table.schema.equals(expected):
        diff = [
            f"{f.name}: {f.type}"
            for f in expected
            if table.schema.get_field_index(f.name) < 0 or table.schema.field(f.name).type != f.type
        ]
        raise DataValidationError(
            f"{source}: schema differs from book_schema({levels})"
            + (f"; expected {', '.join(diff[:5])}" if diff else "; wrong column order or extras")
        )
    for j, name in enumerate(table.column_names):
        if name.split("_")[0] in ("ask", "bid") and "_price_" in name:
            continue  # prices are the only nullable columns
        column = table.column(j)
        if column.null_count:
            i = _first(column.is_null().to_numpy(zero_copy_only=False))
            raise _fail(source, i or 0, f"{j + 1} ({name})", "null value")
    msgs = {f.name: table.column(f.name).to_numpy() for f in MESSAGE_FIELDS}
    _check_messages(msgs, source)
    halted = table.column("halted").to_numpy()
    recomputed = halted_rows(msgs["event_type"], msgs["price"])
    if (i := _first(halted != recomputed)) is not None:
        raise _fail(
            source,
            i,
            f"{len(table.column_names)} (halted)",
            f"halted is {bool(halted[i])} but the type-7 messages say {bool(recomputed[i])}",
        )
    book: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    for name in table.column_names[len(MESSAGE_FIELDS) : -1]:
        column = table.column(name)
        present = column.is_valid().to_numpy(zero_copy_only=False)
        book[name] = (pc.fill_null(column, 0).to_numpy(), present)
    _check_book(book, halted, levels, source, column_offset=len(MESSAGE_FIELDS))
