"""Read LOBSTER message + orderbook files into the canonical order-book table.

LOBSTER ships one day as two headerless CSVs with the same row count:
`TICKER_DATE_START_END_message_N.csv` (time, type, order id, size, price,
direction) and `..._orderbook_N.csv` (ask price, ask size, bid price, bid size
per level). Ticker, date and level count come from those names. Every failure
is a `DataValidationError` naming the file and the 1-based row, because the
first thing anyone does with a bad file is open it at that line.

`validate_book` holds the order-book invariants; ingest and the synthetic
generator both run it, so the two sources cannot drift apart.
"""

from __future__ import annotations

import datetime as dt
import re
import zipfile
import zlib
from dataclasses import dataclass
from pathlib import Path

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
_SIDES = (("ask", DUMMY_ASK), ("bid", DUMMY_BID))
# Type-7 prices (LOBSTER ReadMe): -1 halt, 0 quoting resumes, 1 trading resumes.
_HALT_START, _QUOTE_RESUME, _TRADE_RESUME = -1, 0, 1

_NAME_RE = re.compile(
    r"^(?P<ticker>.+)_(?P<date>\d{4}-\d{2}-\d{2})_(?P<start>\d+)_(?P<end>\d+)"
    r"_(?P<kind>message|orderbook)_(?P<levels>\d+)\.csv$"
)
_INT_RE = r"^\s*[+-]?\d+\s*$"
_FLOAT_RE = r"^\s*[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?\s*$"


class DataValidationError(ValueError):
    """Input that breaks the LOBSTER format or an order-book invariant."""


@dataclass(kw_only=True, slots=True, frozen=True)
class LobsterDay:
    """One ticker-day read from LOBSTER, already in `book_schema(levels)`."""

    product: str
    date: dt.date
    levels: int
    table: pa.Table
    source: str  # the message file (zip members as "archive.zip!member.csv")
    halts: int  # number of trading halts (type-7 halt ... trade-resume spans)

    @property
    def partition(self) -> Partition:
        return Partition(self.product, self.date)


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


# --------------------------------------------------------------------------- finding files


def find_lobster(folder: str | Path, *, recursive: bool = False) -> list[Path]:
    """LOBSTER zips and message CSVs (each standing for its message+orderbook pair) in a folder.

    Every zip is listed, so a corrupt one fails loudly in `read_lobster` instead of vanishing.
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"{folder}: not a folder")
    files = folder.rglob("*") if recursive else folder.iterdir()
    found = []
    for p in files:
        if not p.is_file():
            continue
        if p.suffix.lower() == ".zip":
            found.append(p)
        elif (m := _NAME_RE.match(p.name)) and m["kind"] == "message":
            found.append(p)
    return sorted(found)


def read_lobster(path: str | Path) -> list[LobsterDay]:
    """Read a LOBSTER zip, a message CSV (orderbook CSV beside it) or a folder of those."""
    path = Path(path)
    if path.is_dir():
        return [day for p in find_lobster(path) for day in read_lobster(p)]
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file")
    if path.suffix.lower() == ".zip":
        return _read_zip(path)
    parsed = _parse_name(path.name, str(path))
    if parsed is None:
        raise DataValidationError(
            f"{path}: not a LOBSTER zip or file (TICKER_DATE_START_END_message_N.csv)"
        )
    kind, name = parsed
    msg_path = path.with_name(name.file("message"))
    ob_path = path.with_name(name.file("orderbook"))
    for p in (msg_path, ob_path):
        if not p.is_file():
            raise FileNotFoundError(f"{p}: missing; LOBSTER {kind} file {path} needs it beside it")
    return [
        _read_day(msg_path.read_bytes(), ob_path.read_bytes(), str(msg_path), str(ob_path), name)
    ]


def _read_zip(path: Path) -> list[LobsterDay]:
    try:
        with zipfile.ZipFile(path) as zf:
            members = {m for m in zf.namelist() if not m.endswith("/")}
            days = []
            for member in sorted(members):
                folder, _, base = member.rpartition("/")
                parsed = _parse_name(base, f"{path}!{member}")
                if parsed is None:
                    continue  # ReadMe and other extras
                kind, name = parsed
                prefix = f"{folder}/" if folder else ""
                partner = prefix + name.file("orderbook" if kind == "message" else "message")
                if partner not in members:
                    raise DataValidationError(f"{path}: {member} has no partner {partner}")
                if kind == "message":
                    days.append(
                        _read_day(
                            zf.read(member),
                            zf.read(partner),
                            f"{path}!{member}",
                            f"{path}!{partner}",
                            name,
                        )
                    )
    except (zipfile.BadZipFile, zlib.error, EOFError) as e:
        raise DataValidationError(f"{path}: corrupt or truncated zip ({e})") from e
    if not days:
        raise DataValidationError(
            f"{path}: no LOBSTER message file (TICKER_DATE_START_END_message_N.csv) inside"
        )
    return days


# --------------------------------------------------------------------------- parsing


def _read_csv(data: bytes, source: str, types: list[pa.DataType]) -> pa.Table:
    """Parse a headerless numeric CSV with exactly len(types) columns.

    Blank lines at the end of a file (an editor's or a script's trailing newlines) are
    not rows; a blank line anywhere else is an error naming its row.
    """
    data = data.rstrip(b"\r\n\t ") + b"\n" if data.strip() else data
    names = [f"c{i}" for i in range(len(types))]
    try:
        return pacsv.read_csv(
            pa.py_buffer(data),
            read_options=pacsv.ReadOptions(column_names=names),
            # Blank lines must not vanish: row numbers in errors are line numbers.
            parse_options=pacsv.ParseOptions(ignore_empty_lines=False),
            convert_options=pacsv.ConvertOptions(
                column_types=dict(zip(names, types, strict=True)),
                null_values=[],
                strings_can_be_null=False,
                quoted_strings_can_be_null=False,
            ),
        )
    except pa.ArrowInvalid as e:
        # Arrow's messages carry no row number, so find the first bad line ourselves
        # (only on this failure path; the fast path is untouched).
        raise _locate_csv_error(data, source, types, e) from e


def _locate_csv_error(
    data: bytes, source: str, types: list[pa.DataType], err: Exception
) -> DataValidationError:
    if not data.strip():
        return DataValidationError(f"{source}: file is empty")
    buf = np.frombuffer(data, np.uint8)
    ends = np.flatnonzero(buf == ord("\n"))
    if buf[-1] != ord("\n"):
        ends = np.append(ends, len(buf))
    starts = np.concatenate([[0], ends[:-1] + 1])
    commas = np.concatenate([[0], np.cumsum(buf == ord(","))])
    ncols = commas[ends] - commas[starts] + 1
    bad = np.flatnonzero(ncols != len(types))
    if len(bad):
        i = int(bad[0])
        line = data[starts[i] : ends[i]].decode("utf-8", "replace").rstrip("\r")
        got = "an empty line" if not line else f"{ncols[i]} columns"
        return DataValidationError(
            f"{source}: row {i + 1}: {got}, expected {len(types)} ({line[:80]!r})"
        )
    strings = pacsv.read_csv(
        pa.py_buffer(data),
        read_options=pacsv.ReadOptions(column_names=[f"c{i}" for i in range(len(types))]),
        parse_options=pacsv.ParseOptions(ignore_empty_lines=False),
        convert_options=pacsv.ConvertOptions(
            column_types={f"c{i}": pa.string() for i in range(len(types))}
        ),
    )
    first: tuple[int, int] | None = None
    for j, t in enumerate(types):
        pattern = _FLOAT_RE if pa.types.is_floating(t) else _INT_RE
        ok = pc.match_substring_regex(strings.column(j), pattern).to_numpy(zero_copy_only=False)
        bad = np.flatnonzero(~ok)
        if len(bad) and (first is None or bad[0] < first[0]):
            first = (int(bad[0]), j)
    if first is not None:
        i, j = first
        value = strings.column(j)[i].as_py()
        kind = "a number" if pa.types.is_floating(types[j]) else "an integer"
        return DataValidationError(
            f"{source}: row {i + 1}, column {j + 1}: {value!r} is not {kind}"
        )
    return DataValidationError(f"{source}: unreadable CSV ({err})")


def _read_day(msg: bytes, ob: bytes, msg_src: str, ob_src: str, name: _Name) -> LobsterDay:
    m = _read_csv(msg, msg_src, [pa.float64()] + [pa.int64()] * (MESSAGE_COLUMNS - 1))
    b = _read_csv(ob, ob_src, [pa.int64()] * (4 * name.levels))
    if m.num_rows != b.num_rows:
        raise DataValidationError(
            f"{ob_src}: {b.num_rows} rows but {msg_src} has {m.num_rows}; "
            f"row {min(m.num_rows, b.num_rows) + 1} has no partner row"
        )
    msgs = {f.name: m.column(i).to_numpy() for i, f in enumerate(MESSAGE_FIELDS)}
    _check_messages(msgs, msg_src)  # before the int8 casts below, which would overflow
    halted = halted_rows(msgs["event_type"], msgs["price"])
    book: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    for k in range(name.levels):
        for s, (side, dummy) in enumerate(_SIDES):
            col = 4 * k + 2 * s
            price = b.column(col).to_numpy()
            size = b.column(col + 1).to_numpy()
            empty = price == dummy
            bad = np.flatnonzero(empty & (size != 0))
            if len(bad):
                raise DataValidationError(
                    f"{ob_src}: row {bad[0] + 1}, column {col + 2}: "
                    f"empty level (price {dummy}) has size {size[bad[0]]}"
                )
            book[f"{side}_price_{k + 1}"] = (price, ~empty)
            book[f"{side}_size_{k + 1}"] = (size, np.ones(len(size), bool))
    _check_book(book, halted, name.levels, ob_src, column_offset=0)
    arrays = [pa.array(msgs[f.name]).cast(f.type) for f in MESSAGE_FIELDS]
    arrays += [pa.array(v, mask=~present) for v, present in book.values()]
    arrays.append(pa.array(halted))
    table = pa.Table.from_arrays(arrays, schema=book_schema(name.levels))
    return LobsterDay(
        product=name.ticker,
        date=name.date,
        levels=name.levels,
        table=table,
        source=msg_src,
        halts=count_halts(halted),
    )


# --------------------------------------------------------------------------- halts


def halted_rows(event_type: np.ndarray, price: np.ndarray) -> np.ndarray:
    """True for rows from a halt message (type 7, price -1) through its trade resume (price 1).

    The resume row itself counts as halted: LOBSTER repeats the halted book on
    every type-7 row. Quote-resume (price 0) keeps the halt: quotes, no trades,
    and that is when a book may legitimately lock or cross. A trade resume with
    no halt before it means the file began inside a halt.
    """
    n = len(event_type)
    rows = np.flatnonzero((event_type == HALT) & (price != _QUOTE_RESUME))
    if len(rows) == 0:
        return np.zeros(n, bool)
    state = price[rows] == _HALT_START  # halted after this type-7 row?
    last = np.searchsorted(rows, np.arange(n), side="right") - 1
    before_first = not state[0]  # first marker is a resume: halted from row 0
    halted = np.where(last >= 0, state[np.maximum(last, 0)], before_first)
    prev = np.concatenate([[before_first], state[:-1]])
    halted[rows[~state & prev]] = True  # the resume row of a real halt
    return halted


def count_halts(halted: np.ndarray) -> int:
    """Number of halted spans."""
    if len(halted) == 0:
        return 0
    return int(halted[0]) + int(np.count_nonzero(halted[1:] & ~halted[:-1]))


# --------------------------------------------------------------------------- validation


def _fail(source: str, row: int, column: str | None, what: str) -> DataValidationError:
    where = f"row {row + 1}" + (f", column {column}" if column else "")
    return DataValidationError(f"{source}: {where}: {what}")


def _first(mask: np.ndarray) -> int | None:
    bad = np.flatnonzero(mask)
    return int(bad[0]) if len(bad) else None


def _check_messages(m: dict[str, np.ndarray], source: str) -> None:
    """Message invariants; m maps MESSAGE_FIELDS names to numpy arrays."""
    col = {f.name: f"{i + 1} ({f.name})" for i, f in enumerate(MESSAGE_FIELDS)}
    t, et, price = m["time"], m["event_type"], m["price"]
    if (i := _first(~np.isfinite(t) | (t < 0))) is not None:
        raise _fail(source, i, col["time"], f"time {t[i]} is not a time of day in seconds")
    if (i := _first(np.diff(t) < 0)) is not None:
        raise _fail(
            source, i + 1, col["time"], f"time {t[i + 1]} is before the previous row's {t[i]}"
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
) -> None:
    """Book invariants; book maps column name to (values, present) arrays.

    column_offset: columns before ask_price_1 (0 in an orderbook CSV, 6 in a table).
    """

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
