"""LOBSTER ingest: the real sample files, and every kind of bad input we reject."""

from __future__ import annotations

import datetime as dt
import io
import zipfile
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from quantloop.tasks.data.ingest import (
    DataValidationError,
    IngestLimits,
    LobsterDay,
    find_lobster,
    halted_rows,
    read_lobster,
    scan_lobster,
    validate_book,
)
from quantloop.tasks.data.schema import book_schema

DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "lobster"
needs_data = pytest.mark.skipif(
    not DATA.is_dir(), reason=f"LOBSTER sample files not found at {DATA} (../shared/data/lobster)"
)

# file, ticker, levels, messages, first message, first orderbook row (level 1)
SAMPLES = [
    (
        "LOBSTER_SampleFile_AMZN_2012-06-21_1.zip",
        "AMZN",
        1,
        57_515,
        (34200.017459617, 5, 0, 1, 2238200, -1),
        (2239500, 100, 2231800, 100),
    ),
    (
        "LOBSTER_SampleFile_AMZN_2012-06-21_5.zip",
        "AMZN",
        5,
        155_935,
        (34200.017459617, 5, 0, 1, 2238200, -1),
        (2239500, 100, 2231800, 100),
    ),
    (
        "LOBSTER_SampleFile_GOOG_2012-06-21_10.zip",
        "GOOG",
        10,
        147_916,
        (34200.015105074, 4, 15818974, 4, 5794000, 1),
        (5802300, 100, 5794000, 496),
    ),
]


@pytest.fixture(scope="module")
def real_days() -> dict[str, list[LobsterDay]]:
    if not DATA.is_dir():
        pytest.skip(f"LOBSTER sample files not found at {DATA} (../shared/data/lobster)")
    return {name: read_lobster(DATA / name) for name, *_ in SAMPLES}


@needs_data
@pytest.mark.parametrize(("name", "ticker", "levels", "rows", "msg0", "book0"), SAMPLES)
def test_real_sample(real_days, name, ticker, levels, rows, msg0, book0):
    days = real_days[name]
    assert len(days) == 1
    day = days[0]
    assert (day.product, day.date, day.levels) == (ticker, dt.date(2012, 6, 21), levels)
    assert day.partition.path == f"product={ticker}/date=2012-06-21"
    assert name in day.source and day.source.endswith(f"_message_{levels}.csv")
    t = day.table
    assert t.schema.equals(book_schema(levels))
    assert t.num_rows == rows
    first = t.slice(0, 1).to_pylist()[0]
    assert (
        tuple(first[c] for c in ("time", "event_type", "order_id", "size", "price", "direction"))
        == msg0
    )
    assert (
        tuple(first[c] for c in ("ask_price_1", "ask_size_1", "bid_price_1", "bid_size_1")) == book0
    )
    # Facts of these samples: no halts, no empty (dummy) levels, never locked or crossed.
    assert day.halts == 0 and not np.any(t.column("halted").to_numpy())
    assert sum(t.column(c).null_count for c in t.column_names) == 0
    assert np.all(t.column("ask_price_1").to_numpy() > t.column("bid_price_1").to_numpy())
    times = t.column("time").to_numpy()
    assert 34_200 <= times[0] and times[-1] < 57_600 and np.all(np.diff(times) >= 0)
    assert set(np.unique(t.column("event_type").to_numpy())) == {1, 2, 3, 4, 5}
    validate_book(t, day.source)


@needs_data
def test_find_and_read_extracted_pair(real_days, tmp_path):
    name = SAMPLES[0][0]
    assert [p.name for p in find_lobster(DATA)] == sorted(s[0] for s in SAMPLES)
    with zipfile.ZipFile(DATA / name) as zf:
        zf.extractall(tmp_path)  # tmp only: the samples never enter the repo
    [msg] = find_lobster(tmp_path)
    assert msg.name == "AMZN_2012-06-21_34200000_57600000_message_1.csv"
    [day] = read_lobster(msg)
    assert day.table.equals(real_days[name][0].table)
    assert day.source == str(msg)


# --------------------------------------------------------------------------- small hand-made days

MSG = [  # time, type, order id, size, price, direction
    "34200.10,1,1,100,1000100,-1",
    "34200.20,1,2,50,999900,1",
    "34200.30,3,2,50,999900,1",
    "34200.40,4,1,40,1000100,-1",
]
BOOK = [  # 2 levels: ask p, ask s, bid p, bid s, ...; level 2 often empty (dummies)
    "1000100,100,1000000,200,9999999999,0,-9999999999,0",
    "1000100,100,1000000,200,9999999999,0,999900,50",
    "1000100,100,1000000,200,9999999999,0,-9999999999,0",
    "1000100,60,1000000,200,9999999999,0,-9999999999,0",
]
STEM = "TEST_2024-01-02_34200000_57600000"


def write_day(folder: Path, msg: list[str], book: list[str], levels: int = 2) -> Path:
    path = folder / f"{STEM}_message_{levels}.csv"
    path.write_text("\n".join(msg) + "\n")
    (folder / f"{STEM}_orderbook_{levels}.csv").write_text("\n".join(book) + "\n")
    return path


def raises_at(path: Path, *parts: str) -> str:
    with pytest.raises(DataValidationError) as err:
        read_lobster(path)
    text = str(err.value)
    for part in parts:
        assert part in text, text
    return text


def test_small_day_dummies_become_null(tmp_path):
    [day] = read_lobster(write_day(tmp_path, MSG, BOOK))
    assert (day.product, day.date, day.levels, day.halts) == ("TEST", dt.date(2024, 1, 2), 2, 0)
    t = day.table
    assert t.column("ask_price_2").to_pylist() == [None] * 4
    assert t.column("ask_size_2").to_pylist() == [0] * 4
    assert t.column("bid_price_2").to_pylist() == [None, 999900, None, None]
    assert t.column("bid_size_2").to_pylist() == [0, 50, 0, 0]
    assert t.column("event_type").type == pa.int8()


def test_halts_mark_rows_and_allow_locked_book(tmp_path):
    msg = MSG[:2] + [
        "34200.25,7,0,0,-1,-1",  # halt
        "34200.26,7,0,0,0,-1",  # quoting resumes
        "34200.27,1,3,10,1000000,-1",  # a quote locks the book: fine while halted
        "34200.28,7,0,0,1,-1",  # trading resumes (still the halted book)
        "34200.29,4,3,10,1000000,-1",  # the cross clears the lock
    ]
    locked = "1000000,10,1000000,200,1000100,100,999900,50"
    book = BOOK[:2] + [BOOK[1], BOOK[1], locked, locked, BOOK[1]]
    [day] = read_lobster(write_day(tmp_path, msg, book))
    assert day.halts == 1
    assert day.table.column("halted").to_pylist() == [False, False, True, True, True, True, False]
    # The same lock after trading resumed is an error.
    book = BOOK[:2] + [BOOK[1], BOOK[1], BOOK[1], BOOK[1], locked]
    raises_at(write_day(tmp_path, msg, book), f"{STEM}_orderbook_2.csv", "row 7", "locked")


def test_halted_rows_edge_cases():
    et = np.array([1, 7, 1, 7, 1, 7, 1])
    price = np.array([5, 1, 5, -1, 5, 1, 5])  # file opens inside a halt; a second halt
    assert halted_rows(et, price).tolist() == [True, True, False, True, True, True, False]
    open_end = halted_rows(np.array([1, 7, 1]), np.array([5, -1, 5]))
    assert open_end.tolist() == [False, True, True]


def test_wrong_column_count(tmp_path):
    msg = MSG[:2] + [MSG[2] + ",7"] + MSG[3:]
    raises_at(write_day(tmp_path, msg, BOOK), f"{STEM}_message_2.csv", "row 3", "7 columns")
    # The file name promises 2 levels (8 columns); this orderbook has 1.
    book = [",".join(r.split(",")[:4]) for r in BOOK]
    raises_at(write_day(tmp_path, MSG, book), f"{STEM}_orderbook_2.csv", "row 1", "4 columns")


def test_non_numeric_and_unknown_type(tmp_path):
    msg = [MSG[0], "34200.20,1,2,fifty,999900,1"] + MSG[2:]
    raises_at(write_day(tmp_path, msg, BOOK), f"{STEM}_message_2.csv", "row 2, column 4", "'fifty'")
    msg = MSG[:3] + ["34200.40,9,1,40,1000100,-1"]
    raises_at(write_day(tmp_path, msg, BOOK), f"{STEM}_message_2.csv", "row 4", "event type 9")


def test_crossed_book(tmp_path):
    book = BOOK[:2] + ["999000,100,1000000,200,9999999999,0,-9999999999,0"] + BOOK[3:]
    raises_at(write_day(tmp_path, MSG, book), f"{STEM}_orderbook_2.csv", "row 3", "crossed")


def test_non_monotonic_time(tmp_path):
    msg = MSG[:2] + ["34200.15,3,2,50,999900,1"] + MSG[3:]
    raises_at(write_day(tmp_path, msg, BOOK), f"{STEM}_message_2.csv", "row 3", "34200.15")


def test_row_count_mismatch(tmp_path):
    text = raises_at(write_day(tmp_path, MSG, BOOK[:3]), f"{STEM}_orderbook_2.csv", "row 4")
    assert f"{STEM}_message_2.csv" in text


def test_dummy_with_size_and_level_gap(tmp_path):
    book = [BOOK[0], "1000100,100,1000000,200,9999999999,5,999900,50"] + BOOK[2:]
    raises_at(write_day(tmp_path, MSG, book), "row 2, column 6", "size 5")
    book = [BOOK[0], "1000100,100,-9999999999,0,9999999999,0,999900,50"] + BOOK[2:]
    raises_at(write_day(tmp_path, MSG, book), "row 2", "level 1 is empty")


def test_missing_partner_and_bad_name(tmp_path):
    path = write_day(tmp_path, MSG, BOOK)
    (tmp_path / f"{STEM}_orderbook_2.csv").unlink()
    with pytest.raises(FileNotFoundError, match="orderbook_2.csv"):
        read_lobster(path)
    other = tmp_path / "prices.csv"
    other.write_text("1,2\n")
    raises_at(other, "prices.csv", "not a LOBSTER")


def make_zip(folder: Path) -> Path:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as zf:
        rows = range(1_000)
        zf.writestr(
            f"{STEM}_message_2.csv",
            "".join(f"{34200 + i / 100},1,{i},100,1000100,-1\n" for i in rows),
        )
        zf.writestr(f"{STEM}_orderbook_2.csv", "".join(BOOK[0] + "\n" for _ in rows))
        zf.writestr("ReadMe.txt", "not data")
    path = folder / "TEST.zip"
    path.write_bytes(buf.getvalue())
    return path


def test_zip_truncated_or_corrupt(tmp_path):
    good = make_zip(tmp_path)
    [day] = read_lobster(good)
    assert day.table.num_rows == 1_000 and day.source == f"{good}!{STEM}_message_2.csv"
    data = good.read_bytes()
    bad = tmp_path / "truncated.zip"
    bad.write_bytes(data[: len(data) // 2])
    raises_at(bad, "truncated.zip", "corrupt or truncated zip")
    # Flip bytes inside the compressed member: the directory is intact, the data is not.
    flipped = bytearray(data)
    flipped[100:140] = bytes(40)
    bad.write_bytes(bytes(flipped))
    raises_at(bad, "truncated.zip", "corrupt or truncated zip")


def test_zip_without_lobster_files(tmp_path):
    path = tmp_path / "empty.zip"
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("ReadMe.txt", "nothing")
    raises_at(path, "empty.zip", "no LOBSTER message file")


def test_validate_book_on_tables():
    n = 4
    cols = {
        "time": [1.0, 2.0, 3.0, 4.0],
        "event_type": [1, 1, 3, 4],
        "order_id": [1, 2, 2, 1],
        "size": [1, 1, 1, 1],
        "price": [101, 99, 99, 101],
        "direction": [-1, 1, 1, -1],
        "ask_price_1": [101] * n,
        "ask_size_1": [5] * n,
        "bid_price_1": [100, 100, 102, 100],  # row 3 crossed
        "bid_size_1": [5] * n,
        "halted": [False] * n,
    }
    table = pa.table(cols).cast(book_schema(1))
    with pytest.raises(
        DataValidationError,
        match=r"synthetic:X/2024-01-02: row 3, column 7 \(ask_price_1\): crossed",
    ):
        validate_book(table, "synthetic:X/2024-01-02")
    with pytest.raises(DataValidationError, match="schema"):
        validate_book(table.drop_columns(["halted"]), "t")
    ok = table.set_column(8, "bid_price_1", pa.array([100] * n, pa.int64()))
    validate_book(ok, "t")
    wrong_flag = ok.set_column(10, "halted", pa.array([False, True, False, False]))
    with pytest.raises(DataValidationError, match="row 2.*halted"):
        validate_book(wrong_flag, "t")


def test_trailing_blank_lines_are_not_rows_but_a_blank_line_inside_is_an_error(tmp_path):
    path = write_day(tmp_path, MSG, BOOK)
    path.write_text("\n".join(MSG) + "\n\n\r\n \n")  # what an editor or a script leaves
    [day] = read_lobster(path)
    assert day.table.num_rows == len(MSG)
    path.write_text("\n".join(MSG[:2] + [""] + MSG[2:]) + "\n")
    raises_at(path, f"{STEM}_message_2.csv", "row 3", "an empty line")


# --------------------------------------------------------------------------- read in blocks

SMALL = IngestLimits(block_bytes=4096)  # ~150 message rows a block: every day spans many


def one_level_day(folder: Path, msg: list[str], book: list[str]) -> Path:
    path = folder / f"{STEM}_message_1.csv"
    path.write_text("\n".join(msg) + "\n")
    (folder / f"{STEM}_orderbook_1.csv").write_text("\n".join(book) + "\n")
    return path


@needs_data
def test_reading_in_small_blocks_gives_the_same_day(real_days):
    name = SAMPLES[1][0]
    [day] = read_lobster(DATA / name, limits=IngestLimits(block_bytes=64 << 10))
    [whole] = real_days[name]
    assert day.table.equals(whole.table) and day.halts == whole.halts
    [scanned] = scan_lobster(DATA / name, limits=SMALL)
    assert (scanned.rows, scanned.source) == (whole.table.num_rows, whole.source)


def test_a_day_that_opens_inside_a_halt_blocks_before_its_first_marker(tmp_path):
    """The first marker (a trade resume at row 3001) is ~20 blocks in: the locked book
    before it is halted, not an error, and the halt is counted once."""
    n, resume = 4000, 3000
    msg = [f"{34200 + i / 1000:.3f},1,{i},10,1000000,-1" for i in range(n)]
    msg[resume] = f"{34200 + resume / 1000:.3f},7,0,0,1,-1"
    locked, ok = "1000000,10,1000000,200", "1000100,10,1000000,200"
    book = [locked] * (resume + 1) + [ok] * (n - resume - 1)
    [day] = read_lobster(one_level_day(tmp_path, msg, book), limits=SMALL)
    halted = day.table.column("halted").to_numpy()
    assert halted[: resume + 1].all() and not halted[resume + 1 :].any()
    assert day.halts == 1
    book[resume + 5] = locked  # after the resume: locked outside a halt
    raises_at_with(one_level_day(tmp_path, msg, book), SMALL, f"row {resume + 6}", "locked")


def raises_at_with(path: Path, limits: IngestLimits, *parts: str) -> str:
    with pytest.raises(DataValidationError) as err:
        read_lobster(path, limits=limits)
    for part in parts:
        assert part in str(err.value), err.value
    return str(err.value)


def test_rows_are_numbered_across_blocks(tmp_path):
    n = 3000
    msg = [f"{34200 + i / 1000:.3f},1,{i},10,1000100,-1" for i in range(n)]
    book = ["1000100,10,1000000,200"] * n
    # Time going back on each row near where blocks end (rows ~150 apart): one is a first row.
    for k in range(140, 320, 7):
        bad = list(msg)
        bad[k] = f"{34200 + (k - 2) / 1000:.3f},1,{k},10,1000100,-1"
        raises_at_with(one_level_day(tmp_path, bad, book), SMALL, f"row {k + 1}", "before")
    bad = list(book)
    bad[2500] += ",5"
    raises_at_with(
        one_level_day(tmp_path, msg, bad), SMALL, "orderbook_1.csv: row 2501", "5 columns"
    )
    bad = list(msg)
    bad[2700] = bad[2700].replace(",10,", ",ten,")
    raises_at_with(one_level_day(tmp_path, bad, book), SMALL, "row 2701, column 4", "'ten'")
    raises_at_with(one_level_day(tmp_path, msg, book[:-1]), SMALL, "2999 rows", "row 3000")


def test_blank_lines_at_the_end_span_blocks_but_one_inside_is_an_error(tmp_path):
    n = 1000
    msg = [f"{34200 + i / 1000:.3f},1,{i},10,1000100,-1" for i in range(n)]
    book = ["1000100,10,1000000,200"] * n
    path = one_level_day(tmp_path, msg, book)
    path.write_text("\n".join(msg) + "\n" + "\n \r\n" * 5000)  # ~20 KB of blank lines
    [day] = read_lobster(path, limits=SMALL)
    assert day.rows == n
    path.write_text("\n".join(msg[:500]) + "\n" + "\n" * 5000 + "\n".join(msg[500:]) + "\n")
    raises_at_with(path, SMALL, "row 501", "an empty line")
