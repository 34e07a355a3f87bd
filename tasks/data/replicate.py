"""Replicas: copy landed partition versions to another site's storage and record them.

A copy is the version's bytes (a whole Parquet file, or one blob of a pack) written
atomically as its own file at the target site, read back and checked against the
version's digest before the catalog records it: a recorded replica is always whole.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.compute as pc

from quantloop.tasks.data.catalog import Catalog
from quantloop.tasks.data.schema import Partition
from quantloop.tasks.engine import storage


@dataclass(slots=True)
class Replicated:
    """What a replicate call did."""

    site: str
    copied: int = 0  # partitions copied now
    present: int = 0  # partitions the site held already
    bytes_copied: int = 0


def replicate(
    catalog: Catalog, dataset: str, entries: pa.Table, *, site: str, root: str
) -> Replicated:
    """Copy the versions of `entries` (a catalog table: product, date, digest, location,
    offset, length) to the site `site` whose storage root is `root`.

    A version the site already holds (where it landed, or an earlier replica) is left.
    Bytes that do not hash to the version's digest, at the source or read back at the
    target, raise ValueError naming the location; nothing is recorded for them.
    """
    done = Replicated(site)
    copies = catalog.copies(dataset)
    here = copies.filter(pc.equal(copies["site"], site))["digest"]
    held = set(here.to_pylist())
    columns = ("product", "date", "digest", "location", "offset", "length")
    for product, date, digest, location, offset, length in zip(
        *(entries[c].to_pylist() for c in columns), strict=True
    ):
        if digest in held:
            done.present += 1
            continue
        data = storage.read_range(location, offset, length)
        if storage.sha256_hex(data) != digest:
            raise ValueError(f"{location} [{offset}:{offset + length}] does not match its "
                             f"digest {digest[:12]}: not replicated to site {site!r}")  # fmt: skip
        part = Partition.trusted(product, dt.date.fromisoformat(date))
        suffix = ".parquet" if data[:4] == storage.PARQUET_MAGIC else ".arrows"
        url = storage.join(root, "datasets", dataset, part.path, f"{digest}{suffix}")
        storage.write_bytes_atomic(url, data)
        if storage.sha256_hex(storage.read_bytes(url)) != digest:
            raise ValueError(f"{url}: the copy read back does not match digest {digest[:12]}")
        catalog.add_copy(dataset, part, storage.Blob(url, 0, len(data), digest), site)
        held.add(digest)
        done.copied += 1
        done.bytes_copied += len(data)
    return done
