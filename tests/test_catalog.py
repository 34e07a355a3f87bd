"""The catalog: packed landing, streamed product by product, and its columnar snapshot."""

from __future__ import annotations

import contextlib
import datetime as dt
import tempfile
import uuid
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from quantloop.tasks.data.catalog import Catalog
from quantloop.tasks.data.schema import Partition
from quantloop.tasks.engine import storage
from tests.books import random_book
from tests.forking import in_forked_child

PRODUCTS = ["AAA", "BBB"]
DATES = [dt.date(2026, 1, 5), dt.date(2026, 1, 6)]


def books(seed: int = 0) -> list[tuple[Partition, object]]:
    return [(Partition(x, d), random_book(200, seed=seed + i))
            for i, (x, d) in enumerate((x, d) for x in PRODUCTS for d in DATES)]  # fmt: skip


def test_catalog_table_follows_every_write(tmp_path):
    """The columnar snapshot is per version: a re-landed partition shows at once."""
    catalog = Catalog(tmp_path / "catalog.sqlite")
    root = str(tmp_path / "store")
    parts = books()
    catalog.land_packed("d", parts, root=root)
    first = catalog.table("d")
    expected = [(e.partition.product, e.partition.date.isoformat(), e.digest, e.location,
                 e.offset, e.length) for e in catalog.entries("d")]  # fmt: skip
    assert list(zip(*first.to_pydict().values(), strict=True)) == expected
    changed = catalog.land("d", parts[0][0], random_book(200, seed=99), root=root)
    second = catalog.table("d")
    assert second["digest"][0].as_py() == changed.entry.digest != first["digest"][0].as_py()
    assert second["location"][0].as_py() == changed.entry.location
    assert second.slice(1).to_pylist() == first.slice(1).to_pylist()
    snapshots = list((tmp_path / "catalog.sqlite.snapshots").iterdir())
    assert len(snapshots) == 1  # the old version's snapshot is gone
    assert Catalog(tmp_path / "catalog.sqlite").table("d").equals(second)
    assert catalog.table("other").num_rows == 0


def test_snapshot_is_built_in_batches_with_one_location_dictionary(tmp_path, monkeypatch):
    """A snapshot larger than one record batch reads back whole, in catalog order."""
    monkeypatch.setattr(Catalog, "_SNAPSHOT_ROWS", 3)
    catalog = Catalog(tmp_path / "catalog.sqlite")
    root = str(tmp_path / "store")
    catalog.land_packed("d", books(), root=root)
    table = catalog.table("d")
    assert table["location"].num_chunks == 2  # 4 rows in batches of 3
    assert table.to_pylist() == [
        {"product": e.partition.product, "date": e.partition.date.isoformat(),
         "digest": e.digest, "location": e.location, "offset": e.offset, "length": e.length}
        for e in catalog.entries("d")
    ]  # fmt: skip


def test_packed_partitions_match_single_files(tmp_path):
    catalog = Catalog(tmp_path / "catalog.sqlite")
    root = str(tmp_path / "store")
    parts = [(Partition(x, d), random_book(300, seed=i)) for i, (x, d) in
             enumerate((x, d) for x in PRODUCTS for d in DATES)]  # fmt: skip
    assert catalog.land_packed("packed", iter(parts), root=root) == {
        "new": 4,
        "unchanged": 0,
        "changed": 0,
    }
    entries = catalog.entries("packed")
    assert len({e.location for e in entries}) == 2  # one pack per product
    for (_, table), e in zip(parts, entries, strict=True):
        assert storage.read_table(e.blob).equals(table)
    again = catalog.land_packed("packed", parts, root=root)
    assert again == {"new": 0, "unchanged": 4, "changed": 0}
    # One day of BBB changed: BBB gets a new pack, its other day an unchanged row in it.
    parts[3] = (parts[3][0], random_book(300, seed=42))
    assert catalog.land_packed("packed", parts, root=root) == {
        "new": 0,
        "unchanged": 3,
        "changed": 1,
    }
    after = {(e.partition.product, e.partition.date): e for e in catalog.entries("packed")}
    for part, table in parts:
        assert storage.read_table(after[part.product, part.date].blob).equals(table)


def test_a_pin_keeps_reading_the_versions_it_pinned(tmp_path):
    """A run pins what it landed; another run landing new versions of the same partitions
    changes the current versions, not the pin, and every version stays findable."""
    from quantloop.tasks.runtime.workspace import Selection

    catalog = Catalog(tmp_path / "catalog.sqlite")
    root = str(tmp_path / "store")
    mine = [catalog.land("d", p, t, root=root).entry for p, t in books(seed=0)]
    pin = catalog.pin("d", mine)
    theirs = [catalog.land("d", p, t, root=root) for p, t in books(seed=10)]
    assert {x.status for x in theirs} == {"changed"}
    selection = Selection(dataset="d", pin=pin)
    assert selection.table(catalog)["digest"].to_pylist() == [e.digest for e in mine]
    current = Selection(dataset="d").table(catalog)["digest"].to_pylist()
    assert current == [x.entry.digest for x in theirs]
    # the replaced versions are still found by digest (lineage, reproduction)
    assert [e.location for e in catalog.with_digest(mine[0].digest)] == [mine[0].location]
    assert pin == catalog.pin("d", reversed(mine))  # the same versions, the same pin
    with pytest.raises(LookupError, match="no pinned selection"):
        catalog.pinned("0" * 64)


def test_landing_the_same_source_again_repairs_a_corrupted_partition(tmp_path):
    catalog = Catalog(tmp_path / "catalog.sqlite")
    root = str(tmp_path / "store")
    part, table = books()[0]
    entry = catalog.land("d", part, table, root=root).entry
    data = bytearray(open(entry.location, "rb").read())
    data[len(data) // 2] ^= 0xFF
    open(entry.location, "wb").write(bytes(data))
    again = catalog.land("d", part, table, root=root)
    assert again.status == "repaired" and again.entry.digest == entry.digest
    assert storage.sha256_hex(storage.read_bytes(entry.location)) == entry.digest
    assert catalog.land("d", part, table, root=root).status == "unchanged"


# ------------------------------------------------------------------ landing streamed

# The digests landing wrote for these days before it streamed (land_lobster holding each
# day's table, Catalog.land writing it whole: 47392bd's code), with pyarrow 25.0.1. A
# change here changes every existing workspace's data digests: its runs would see their
# inputs as changed. (A pyarrow whose zstd or Parquet writer writes other bytes would too.)
SAMPLE_DIGESTS = {
    "LOBSTER_SampleFile_AMZN_2012-06-21_1.zip":
        "07187faea10bcd0d9f3d80698be99468b9ec5aa6490dfd4c4b98b6f6538dfd95",
    "LOBSTER_SampleFile_AMZN_2012-06-21_5.zip":
        "b1fde81245d930b56f7d5d55e739f42316d70dee3afc9705cf9a9b882ace5e69",
    "LOBSTER_SampleFile_GOOG_2012-06-21_10.zip":
        "b1054fb1251ac68390e861a7fc48f03a195d76d29c87b7b8775af7fb7f84e23b",
}  # fmt: skip
BIG_ROWS = 1_100_000  # more than one row group (1024 * 1024 rows)
BIG_DIGEST = "634a623cfb5a355f984249da8a1f75f17637c654cf0e41dd956b8b22c1596659"
BIG_STEM = "BIG_2024-01-02_34200000_57600000"


def big_day(folder, rows: int = BIG_ROWS):
    """A valid 1-level LOBSTER day of varied rows, every 1000th with an empty ask (a null
    price), written as two CSVs; its message file."""
    folder.mkdir(parents=True, exist_ok=True)
    message = folder / f"{BIG_STEM}_message_1.csv"
    message.write_text("".join(
        f"{34200 + k * 0.001:.3f},{1 + k % 5},{k},{1 + k % 500},{1000000 + (k % 97) * 100},"
        f"{1 if k % 3 else -1}\n" for k in range(rows)
    ))  # fmt: skip
    (folder / f"{BIG_STEM}_orderbook_1.csv").write_text("".join(
        (f"{1000100 + (k % 13) * 100},{100 + k % 7}" if k % 1000 != 999 else "9999999999,0")
        + f",{1000000 - (k % 11) * 100},{200 + k % 5}\n" for k in range(rows)
    ))  # fmt: skip
    return message


@pytest.fixture(scope="module")
def big_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("big") / "lobster"
    big_day(folder)
    return folder


def leftovers(root) -> list[str]:
    return [str(p) for p in Path(root).rglob("*") if storage.TMP_MARK in p.name]


def book_with_nulls(rows: int) -> pa.Table:
    table = random_book(rows, levels=3, seed=4)
    prices = table.column("bid_price_3").to_numpy()
    return table.set_column(table.schema.get_field_index("bid_price_3"), "bid_price_3",
                            pa.array(prices, mask=np.arange(rows) % 7 == 0))  # fmt: skip


@pytest.mark.parametrize(
    ("rows", "row_group_size", "blocks"),
    [
        (5_000, 1000, (1, 7, 1024, 5_000)),
        (5_000, 3000, (7, 333)),
        # pages of ~1 MB: blocks cut at the wrong rows would move page boundaries
        (300_000, 100_000, (333, 1024, 40_000, 300_000)),
        (300_000, 1024 * 128, (999, 65_537)),
    ],
)
def test_a_stream_writes_the_bytes_of_the_whole_table(tmp_path, rows, row_group_size, blocks):
    """ParquetStream, fed in blocks of any size (one row, across row group boundaries, of
    several chunks), writes parquet_bytes(the whole table) byte for byte, nulls and all,
    and hashes what it wrote; nothing is under the final name before publish, nothing is
    left after discard."""
    table = book_with_nulls(rows)
    whole = storage.parquet_bytes(table, row_group_size)
    for block in blocks:
        stream = storage.ParquetStream(str(tmp_path / "day"), table.schema, row_group_size)
        for i in range(0, table.num_rows, block):
            piece = table.slice(i, block)
            if block > 1:  # a block of two chunks, cut at an odd row
                piece = pa.concat_tables(
                    [piece.slice(0, block // 2 + 1), piece.slice(block // 2 + 1)]
                )
            stream.write(piece)
        digest, size = stream.finish()
        assert (digest, size) == (storage.sha256_hex(whole), len(whole)), block
        out = tmp_path / "day" / f"{block}.parquet"
        assert not out.exists()
        stream.publish(str(out))
        assert out.read_bytes() == whole
    dropped = storage.ParquetStream(str(tmp_path / "new" / "deeper"), table.schema, 1000)
    dropped.write(table)  # row groups written, under a temporary name
    assert len(leftovers(tmp_path / "new")) == 1
    dropped.discard()
    assert not (tmp_path / "new").exists()  # the folders it made, gone with it


def test_landed_lobster_days_keep_the_digests_of_whole_table_landing(
    tmp_path, lobster_dir, big_folder
):
    """Landing streamed writes the bytes landing the whole table wrote: the three samples
    and a day of two row groups land to the digests pinned above (and each equals
    parquet_bytes of read_lobster's table), with nothing temporary left behind."""
    from quantloop.tasks.data.ingest import read_lobster
    from quantloop.tasks.data.landing import land_lobster

    root = tmp_path / "store"
    for name, expected in SAMPLE_DIGESTS.items():
        catalog = Catalog(tmp_path / f"{name}.sqlite")
        [landed] = land_lobster(catalog, str(root), lobster_dir / name)
        assert landed.entry.digest == expected, name
        [day] = read_lobster(lobster_dir / name)
        assert storage.sha256_hex(storage.parquet_bytes(day.table)) == expected, name
        assert storage.sha256_hex(Path(landed.entry.location).read_bytes()) == expected
    catalog = Catalog(tmp_path / "big.sqlite")
    [landed] = land_lobster(catalog, str(root), big_folder)
    assert (landed.entry.digest, landed.entry.rows) == (BIG_DIGEST, BIG_ROWS)
    assert storage.parquet_file(landed.entry.location).metadata.num_row_groups == 2
    assert catalog.intact(landed.entry)
    assert land_lobster(catalog, str(root), big_folder)[0].status == "unchanged"
    # the whole folder: the 1-level AMZN day is superseded by the 5-level one (its
    # temporary file, written first, is dropped)
    folder = Catalog(tmp_path / "folder.sqlite")
    landed = land_lobster(folder, str(tmp_path / "folder"), lobster_dir)
    assert [x.entry.digest for x in landed] == list(SAMPLE_DIGESTS.values())[1:]
    assert leftovers(tmp_path) == []
    assert len(list((tmp_path / "folder").rglob("*.parquet"))) == 2


def test_a_bad_row_after_a_written_row_group_lands_nothing(tmp_path, big_folder):
    """A locked book past the first row group (so a million rows are already in the
    day's temporary file) beside a good day: the error names the row, and the store is
    left as it was: no file, no folder, no catalog row."""
    from quantloop.tasks.data.ingest import DataValidationError
    from quantloop.tasks.data.landing import land_lobster
    from tests.test_ingest import BOOK, MSG, write_day

    folder = tmp_path / "lobster"
    folder.mkdir()
    write_day(folder, MSG, BOOK)  # TEST, 2024-01-02: valid, read first
    rows = (big_folder / f"{BIG_STEM}_orderbook_1.csv").read_text().splitlines()
    ask, size, bid, bid_size = rows[1_050_005].split(",")
    rows[1_050_005] = f"{bid},{size},{bid},{bid_size}"  # locked: best ask at the best bid
    (folder / f"{BIG_STEM}_orderbook_1.csv").write_text("\n".join(rows) + "\n")
    (folder / f"{BIG_STEM}_message_1.csv").symlink_to(big_folder / f"{BIG_STEM}_message_1.csv")
    catalog = Catalog(tmp_path / "catalog.sqlite")
    root = tmp_path / "store"
    with pytest.raises(DataValidationError, match=r"orderbook_1\.csv: row 1050006,.*locked"):
        land_lobster(catalog, str(root), folder)
    assert catalog.entries("lobster") == []
    assert not root.exists(), leftovers(root)


@pytest.mark.slow
@pytest.mark.server
def test_a_streamed_day_lands_on_s3_with_its_digest(s3_endpoint, tmp_path, lobster_dir):
    """On an object store the day is written to a local temporary file and uploaded once
    whole: the same digest as on disk, checked intact by a streamed read, no temporary
    object or file left."""
    import s3fs

    from quantloop.tasks.data.landing import land_lobster

    bucket = f"quantloop-{uuid.uuid4().hex[:12]}"
    fs = s3fs.S3FileSystem(skip_instance_cache=True)
    fs.mkdir(bucket)
    name = "LOBSTER_SampleFile_AMZN_2012-06-21_1.zip"
    catalog = Catalog(tmp_path / "catalog.sqlite")
    [landed] = land_lobster(catalog, f"s3://{bucket}/store", lobster_dir / name, site="s3")
    assert landed.entry.digest == SAMPLE_DIGESTS[name]
    assert landed.entry.location.startswith(f"s3://{bucket}/store/datasets/lobster/")
    assert storage.sha256_hex(storage.read_bytes(landed.entry.location)) == SAMPLE_DIGESTS[name]
    assert catalog.intact(landed.entry)
    assert storage.sha256_range(landed.entry.location) == SAMPLE_DIGESTS[name]  # streamed
    again = land_lobster(catalog, f"s3://{bucket}/store", lobster_dir / name, site="s3")
    assert again[0].status == "unchanged"
    assert [p for p in fs.find(bucket) if storage.TMP_MARK in p] == []
    assert [p for p in Path(tempfile.gettempdir()).glob(f"{storage.TMP_MARK}*.parquet")] == []


def test_a_catalog_opened_again_is_the_same_database_until_its_file_is_made_again(tmp_path):
    """A run opens its catalog a dozen times: one Database a file (its schema checked once,
    its idle connection kept, so the WAL is not checkpointed at each close); a catalog
    deleted and made again is a new file, checked and migrated again, and still works."""
    import os

    from quantloop.tasks.data import catalog as catalog_module

    path = tmp_path / "catalog.sqlite"
    first, again = Catalog(path), Catalog(path)
    assert first._db is again._db
    first.land("d", Partition("AAA", DATES[0]), random_book(50, seed=1), root=str(tmp_path))
    assert [e.partition.product for e in again.entries("d")] == ["AAA"]
    pin = first.pin("d", first.entries("d"))
    assert again.pinned(pin) is first.pinned(pin)  # a pin never changes: read once
    for suffix in ("", "-wal", "-shm"):
        with contextlib.suppress(FileNotFoundError):
            os.remove(f"{path}{suffix}")
    made_again = Catalog(path)
    assert made_again._db is not first._db and made_again.entries("d") == []
    # the last few files only, each holding a connection
    for i in range(catalog_module._OPENED_MAX + 2):
        Catalog(tmp_path / f"c{i}" / "catalog.sqlite")
    assert len(catalog_module._OPENED) == catalog_module._OPENED_MAX
    assert first._db._keeper is None  # let go when it left the list; it still works
    assert [e.partition.product for e in first.entries("d")] == []  # the new file's


def test_a_forked_child_opens_its_own_database(tmp_path):
    """The connections a forked child inherits are not reused there (SQLite's rule)."""
    path = tmp_path / "catalog.sqlite"
    parent = Catalog(path)

    def child_lands_and_reads() -> bool:  # a Database of its own
        child = Catalog(path)
        child.land("d", Partition("BBB", DATES[1]), random_book(50, seed=2), root=str(tmp_path))
        return child._db is not parent._db and len(child.entries("d")) == 1

    assert in_forked_child(child_lands_and_reads)
    assert [e.partition.product for e in parent.entries("d")] == ["BBB"]
