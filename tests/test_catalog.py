"""The catalog: packed landing, streamed product by product, and its columnar snapshot."""

from __future__ import annotations

import datetime as dt

import pytest

from quantloop.tasks.data.catalog import Catalog
from quantloop.tasks.data.schema import Partition
from quantloop.tasks.engine import storage
from tests.books import random_book

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
