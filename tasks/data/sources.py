"""What each LOBSTER source held when it was last read: an index keyed by the files' stat,
as git's index keys a work tree, so a run over an unchanged folder neither checks nor lands
its files again. A no-op re-run on the LOBSTER samples read their 6 MB twice, 0.7 s of
checks and 1.6 s of landing in a 5.5 s run (bench/results/turnaround.md).

An entry is trusted only when every file it read (a zip, or a message CSV and its orderbook
CSV) has the same real path, size, mtime, ctime, inode and device as when it was read, the
reading code, pyarrow and the ingest limits are the same, and no file had been modified
within `RACY_NS` of the moment it was read: a write in the same clock tick as the read leaves
mtime as it was (git's "racily clean" entries, Documentation/technical/racy-git.txt), so
such a file is read again next time. A miss only costs the read the index saves.

The index is a JSON file in the workspace's home (it describes files on this host's disk,
so it is not in the catalog, which several hosts may share). It is replaced whole, by a
rename: two runs saving at once lose at most each other's new entries, read again later.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import pyarrow as pa

from quantloop.tasks.data import ingest, schema
from quantloop.tasks.data.ingest import IngestLimits, ScannedDay, source_files
from quantloop.tasks.engine import code_fingerprint, sha256_json, storage

log = logging.getLogger(__name__)

FILE_NAME = "lobster-sources.json"
FORMAT = 1
RACY_NS = 2_000_000_000  # coarser than any filesystem's mtime tick, and than NFS's

# (real path, size, mtime_ns, ctime_ns, inode, device) of each file a source reads
Stamp = list[list]


@dataclass(frozen=True, slots=True)
class Known:
    """A source as it was last read: its days, and the digest each landed as (None for a
    day only checked, or superseded by a deeper file of the same ticker and day)."""

    days: list[ScannedDay]
    digests: list[str | None]


def _stamp(path: Path) -> Stamp | None:
    try:
        stamp = []
        for f in source_files(path):
            st = os.stat(f)
            stamp.append([os.path.realpath(f), st.st_size, st.st_mtime_ns, st.st_ctime_ns,
                          st.st_ino, st.st_dev])  # fmt: skip
        return stamp
    except OSError:
        return None  # missing or dangling: read it, and let the reader name what is wrong


class SourceIndex:
    """The index of one workspace home; `get` what a source held, `put` what was read,
    `save` once the reads are done."""

    def __init__(self, path: str | os.PathLike[str], limits: IngestLimits):
        self.path = Path(path)
        # What decides what a file reads as: the reader's code, the Parquet writer's
        # (landed digests) and the limits (what is refused).
        self.salt = sha256_json([
            code_fingerprint(ingest, schema, storage.ParquetStream), pa.__version__, asdict(limits),
        ])  # fmt: skip
        self._entries: dict[str, dict] = {}
        self._changed = False
        try:
            saved = json.loads(self.path.read_text())
            if saved.get("format") == FORMAT and saved.get("salt") == self.salt:
                self._entries = saved["sources"]
        except (OSError, ValueError, KeyError, TypeError):
            pass  # none yet, or unreadable: every source is read

    @classmethod
    def in_home(cls, home: str, limits: IngestLimits) -> SourceIndex:
        return cls(Path(home) / FILE_NAME, limits)

    @staticmethod
    def stamp(path: Path) -> tuple[int, Stamp | None]:
        """Taken before a source is read: the clock, and its files' stat."""
        return time.time_ns(), _stamp(path)

    def get(self, path: Path) -> Known | None:
        entry = self._entries.get(str(path))
        if entry is None or entry["stamp"] != _stamp(path):
            return None
        days = [
            ScannedDay(product=d["product"], date=dt.date.fromisoformat(d["date"]),
                       levels=d["levels"], rows=d["rows"], source=d["source"], halts=d["halts"])
            for d in entry["days"]
        ]  # fmt: skip
        return Known(days, list(entry["digests"]))

    def put(self, path: Path, taken: tuple[int, Stamp | None], days: list[ScannedDay],
            digests: list[str | None] | None = None) -> None:  # fmt: skip
        """Record what `path` read as, `taken` its `stamp` from before the read. Not recorded
        when a file changed during the read or had changed just before it (racy)."""
        at, stamp = taken
        if stamp is None or _stamp(path) != stamp:
            return
        if any(max(mtime, ctime) >= at - RACY_NS for _, _, mtime, ctime, _, _ in stamp):
            return
        self._entries[str(path)] = {
            "stamp": stamp,
            "days": [
                {
                    "product": d.product,
                    "date": d.date.isoformat(),
                    "levels": d.levels,
                    "rows": d.rows,
                    "source": d.source,
                    "halts": d.halts,
                }
                for d in days
            ],  # fmt: skip
            "digests": digests or [None] * len(days),
        }
        self._changed = True

    def save(self) -> None:
        if not self._changed:
            return
        data = json.dumps({"format": FORMAT, "salt": self.salt, "sources": self._entries})
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            storage.write_bytes_atomic(str(self.path), data.encode())
            self._changed = False
        except OSError as exc:  # a read-only home: the next run reads the files again
            log.warning("could not save the LOBSTER source index %s: %s", self.path, exc)
