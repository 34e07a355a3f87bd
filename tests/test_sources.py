"""The LOBSTER source index (tasks/data/sources.py): an unchanged folder is neither checked
nor landed again, and anything that could have changed what a file reads as is read."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from quantloop.tasks.data import landing, sources
from quantloop.tasks.data.catalog import Catalog
from quantloop.tasks.data.ingest import DataValidationError, IngestLimits
from quantloop.tasks.data.landing import land_lobster, scan_lobster_folder
from quantloop.tasks.data.sources import SourceIndex
from tests.test_ingest import BOOK, MSG, STEM, write_day


class Reads:
    """Counts the files landing and checking read (the real readers, wrapped)."""

    def __init__(self, monkeypatch):
        self.files: list[str] = []
        for name in ("stream_lobster", "scan_lobster"):
            real = getattr(landing, name)

            def counted(path, *args, _real=real, **kwargs):
                self.files.append(Path(path).name)
                return _real(path, *args, **kwargs)

            monkeypatch.setattr(landing, name, counted)


@pytest.fixture
def not_racy(monkeypatch):
    # Files written by a test are seconds old at most; the racy window is what
    # test_a_file_written_just_before_it_is_read_is_read_again covers.
    monkeypatch.setattr(sources, "RACY_NS", 0)


def land(catalog, root, folder, home, notes=None):
    return land_lobster(catalog, str(root), folder, home=str(home),
                        note=notes.append if notes is not None else None)  # fmt: skip


def test_an_unchanged_folder_is_neither_checked_nor_landed_again(
    tmp_path, lobster_dir, monkeypatch
):
    """The samples landed once: the next check and landing read no file, and give what
    reading them gave (the same days, the same entries, all unchanged, the 1-level AMZN
    day reported as superseded again)."""
    catalog, home, root = Catalog(tmp_path / "c.sqlite"), tmp_path / "home", tmp_path / "store"
    checked = scan_lobster_folder(lobster_dir, home=str(home))
    first_notes: list[str] = []
    first = land(catalog, root, lobster_dir, home, first_notes)
    assert [x.status for x in first] == ["new", "new"]
    assert (home / sources.FILE_NAME).is_file()

    reads = Reads(monkeypatch)
    assert scan_lobster_folder(lobster_dir, home=str(home)) == checked
    notes: list[str] = []
    again = land(catalog, root, lobster_dir, home, notes)
    assert reads.files == []
    assert [x.status for x in again] == ["unchanged", "unchanged"]
    assert [x.entry for x in again] == [x.entry for x in first]
    assert notes == first_notes and len(notes) == 1 and "superseded" in notes[0]

    # without a home (or with another one) every file is read, and lands the same
    reads.files.clear()
    assert [x.entry for x in land_lobster(catalog, str(root), lobster_dir)] == [
        x.entry for x in first
    ]
    assert len(reads.files) == 3


def test_a_changed_file_is_read_again(tmp_path, not_racy, monkeypatch):
    """A message file rewritten with other content of the same length lands as a new
    version; a file only touched (its ctime moved) is read again and found unchanged."""
    folder = tmp_path / "lobster"
    folder.mkdir()
    path = write_day(folder, MSG, BOOK)
    catalog, home, root = Catalog(tmp_path / "c.sqlite"), tmp_path / "home", tmp_path / "store"
    [first] = land(catalog, root, folder, home)
    reads = Reads(monkeypatch)

    os.chmod(path, 0o644 if (path.stat().st_mode & 0o777) != 0o644 else 0o640)
    [touched] = land(catalog, root, folder, home)
    assert reads.files == [path.name]
    assert touched.status == "unchanged" and touched.entry == first.entry

    text = path.read_text()
    changed = text.replace("34200.10,", "34200.11,", 1)
    assert changed != text and len(changed) == len(text)
    size_before = path.stat().st_size
    path.write_text(changed)
    assert path.stat().st_size == size_before
    reads.files.clear()
    [landed] = land(catalog, root, folder, home)
    assert reads.files == [path.name]
    assert landed.status == "changed" and landed.previous_digest == first.entry.digest


def test_a_file_written_just_before_it_is_read_is_read_again(tmp_path, monkeypatch):
    """A file modified within the racy window before its read is not recorded (a write in
    the same clock tick would leave its stat as it was): the next run reads it again."""
    folder = tmp_path / "lobster"
    folder.mkdir()
    path = write_day(folder, MSG, BOOK)
    home = tmp_path / "home"
    land(Catalog(tmp_path / "c.sqlite"), tmp_path / "store", folder, home)
    index = SourceIndex.in_home(str(home), IngestLimits.from_env())
    assert index.get(path) is None
    reads = Reads(monkeypatch)
    land(Catalog(tmp_path / "c.sqlite"), tmp_path / "store", folder, home)
    assert reads.files == [path.name]


def test_a_damaged_landed_file_is_landed_again(tmp_path, not_racy):
    """The index says the file is unchanged, but the catalog's version of its day no
    longer hashes to its digest: the file is read and the version repaired."""
    folder = tmp_path / "lobster"
    folder.mkdir()
    write_day(folder, MSG, BOOK)
    catalog, home, root = Catalog(tmp_path / "c.sqlite"), tmp_path / "home", tmp_path / "store"
    [first] = land(catalog, root, folder, home)
    location = Path(first.entry.location)
    location.write_bytes(b"x" * location.stat().st_size)
    [again] = land(catalog, root, folder, home)
    assert again.status == "repaired"
    assert catalog.intact(again.entry)


def test_another_reader_or_limit_is_another_index(tmp_path, not_racy):
    """What decides how a file reads (the reader's code, pyarrow, the ingest limits) keys
    the whole index: other limits find nothing recorded."""
    folder = tmp_path / "lobster"
    folder.mkdir()
    path = write_day(folder, MSG, BOOK)
    home = tmp_path / "home"
    scan_lobster_folder(folder, home=str(home))
    assert SourceIndex.in_home(str(home), IngestLimits.from_env()).get(path) is not None
    assert SourceIndex.in_home(str(home), IngestLimits(block_bytes=4096)).get(path) is None


def test_a_refused_folder_records_nothing(tmp_path, not_racy):
    """One bad day beside a good one: the check fails naming it, and no index is written
    (nor any landing), so the next run checks both again."""
    folder = tmp_path / "lobster"
    folder.mkdir()
    write_day(folder, MSG, BOOK)
    bad = folder / f"{STEM.replace('TEST', 'BAD')}_message_2.csv"
    bad.write_text("\n".join(MSG[:2] + ["not,a,row"]) + "\n")
    (folder / bad.name.replace("message", "orderbook")).write_text("\n".join(BOOK) + "\n")
    home = tmp_path / "home"
    with pytest.raises(DataValidationError, match=bad.name):
        scan_lobster_folder(folder, home=str(home))
    with pytest.raises(DataValidationError, match=bad.name):
        land(Catalog(tmp_path / "c.sqlite"), tmp_path / "store", folder, home)
    assert not home.exists()


def test_the_racy_window_passes(tmp_path, monkeypatch):
    """Once the window has passed since the last write, the file is recorded."""
    monkeypatch.setattr(sources, "RACY_NS", 200_000_000)
    folder = tmp_path / "lobster"
    folder.mkdir()
    path = write_day(folder, MSG, BOOK)
    time.sleep(0.3)
    home = tmp_path / "home"
    scan_lobster_folder(folder, home=str(home))
    assert SourceIndex.in_home(str(home), IngestLimits.from_env()).get(path) is not None
