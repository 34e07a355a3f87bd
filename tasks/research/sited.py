"""Stage outputs at their sites: a model, a simulation's mark-outs and its statistics are
stored at the site that computed them and recorded in the catalog with it; a stage that
runs at one site and reads an output stored only at another gets a copy made at its own
site first (read across once, written there, checked, recorded), and those bytes are
counted as bytes across sites. Feature outputs (node outputs, indexed per site) are
copied the same way, into the reading site's pack files and cache index.

Where a stage computes: a site whose Dask workers declare the GPU resource, or the flow's
own process, which is the default site (tasks/runtime/sites.stage_site). The functions
`copy_file` and `copy_feature_outputs` here, and profiling's `fit_and_store` and
`replay_and_store`, are what runs there (on the site's worker, or here): each writes at
the site it runs at.

What is not counted: what comes back to the flow's process as a task's result (the
trained model for the registry, the mark-outs the statistics and MLflow are made from),
and what the flow reads to describe a cached output. The flow is the run's driver, as
the feature batches' manifest rows that come back to it are not counted either.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import os
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import pyarrow as pa

from quantloop.blocks.site import Site
from quantloop.tasks.data.catalog import Catalog, OutputCopy
from quantloop.tasks.data.schema import Partition
from quantloop.tasks.engine import INDEX_SCHEMA, NodeStore, output_blob, storage
from quantloop.tasks.research.stage import FeatureOutput, Keyed
from quantloop.tasks.runtime import timeline

T = TypeVar("T")
log = logging.getLogger(__name__)

# Beside each stored mark-out and statistics file: its size and sha256, written before it,
# so a file without one was stored before outputs had one (see load_checked).
CHECK_SUFFIX = ".check"  # JSON: {"bytes": size, "sha256": digest}


def save_checked(url: str, data: bytes) -> tuple[str, int]:
    """Store an output with its size and sha256 beside it: a later hit is checked against
    them (a damaged file that still parses, a changed number in a JSON, is not a hit).
    Returns the sha256 and the size."""
    check = {"bytes": len(data), "sha256": storage.sha256_hex(data)}
    storage.write_bytes_atomic(url + CHECK_SUFFIX, json.dumps(check).encode())
    storage.write_bytes_atomic(url, data)
    return check["sha256"], check["bytes"]


def load_checked(url: str) -> bytes:
    """A stored output's bytes, if they have the size and sha256 stored beside them; else
    ValueError (the output is then computed again, reason "corrupt"). An output stored
    before checks were kept is taken once as it is and its check written: the check is
    written first, so only such an output lacks one."""
    data = storage.read_bytes(url)
    try:
        check = json.loads(storage.read_bytes(url + CHECK_SUFFIX))
    except FileNotFoundError:
        log.info("%s has no stored check (stored before checks were kept): its check is "
                 "written from it as it is", url)  # fmt: skip
        storage.write_bytes_atomic(
            url + CHECK_SUFFIX,
            json.dumps({"bytes": len(data), "sha256": storage.sha256_hex(data)}).encode(),
        )
        return data
    digest = storage.sha256_hex(data)
    if (len(data), digest) != (check.get("bytes"), check.get("sha256")):
        raise ValueError(
            f"{url}: {len(data):,} bytes with sha256 {digest[:12]}, stored as "
            f"{check.get('bytes')} bytes with {str(check.get('sha256'))[:12]}: changed or truncated"
        )
    return data


# ---------------------------------------------------------------- run at a stage's site


def copy_file(src: str, dst: str, digest: str | None = None) -> tuple[str, int]:
    """Copy a stored output's bytes from another site to `dst` (run at the site of `dst`);
    ValueError if they do not hash to `digest` (when known). Returns sha256 and size."""
    data = storage.read_bytes(src)
    found = storage.sha256_hex(data)
    if digest and found != digest:
        raise ValueError(f"{src}: sha256 {found[:12]}, recorded as {digest[:12]}: not copied")
    storage.write_bytes_atomic(dst, data)
    return found, len(data)


def copy_feature_outputs(rows: list[dict], root: str) -> list[dict]:
    """Copy feature outputs (their index rows at another site) into the store at `root`:
    one pack of their blobs, each checked against its digest as it is read, then their
    index rows there (the same keys, the copies' places). Run at the site of `root`."""
    reader = storage.BlobReader()
    made: list[dict] = []
    store = NodeStore(root)
    for kind in dict.fromkeys(r["kind"] for r in rows):
        mine = [r for r in rows if r["kind"] == kind]
        blobs = [reader.read(output_blob(r)) for r in mine]
        url = store.pack_url(kind)
        storage.write_bytes_atomic(url, b"".join(blobs))  # the pack whole before its index
        now = dt.datetime.now(dt.UTC).isoformat(timespec="microseconds")
        offset, copied = 0, []
        for row, data in zip(mine, blobs, strict=True):
            copied.append({**row, "output_url": url, "output_offset": offset, "written_at": now})
            offset += len(data)
        store.commit(kind, pa.Table.from_pylist(copied, schema=INDEX_SCHEMA))
        made += copied
    return made


def at_front(stage, site: Site):
    """The stage with `site` as its workspace's default site (the others after it): what
    the training site's worker is given, so the compile cache (profiling/compile_cache.py,
    kept in the default site's store) is its own site's, not read across."""
    ws = stage.workspace
    sites = ws.resolve_sites()
    if sites[0].name == site.name:
        return stage
    others = [s for s in sites if s.name != site.name]
    return stage.model_copy(
        update={"workspace": ws.model_copy(update={"site": site, "sites": others})}
    )


def device_type(name: str) -> str:
    """The device type `name` resolves to where this runs (on a GPU site's worker). Here,
    not in flows/train.py: a worker given it imports this module, not the flow's (MLflow,
    the registry)."""
    from quantloop.tasks.research.training import resolve_device

    return resolve_device(name).type


# ---------------------------------------------------------------- in the flow


Run = Callable[..., Any]  # runs a function at a stage's site: StageSite.run


def _unreachable(exc: BaseException) -> bool:
    """A store that did not answer (not a missing or damaged file): its copy is passed
    over, not forgotten."""
    return isinstance(exc, (ConnectionError, TimeoutError)) or (
        isinstance(exc, OSError) and not isinstance(exc, FileNotFoundError)
        and "No such file" not in str(exc)
    )  # fmt: skip


class SiteOutputs:
    """A workspace's stage outputs at its sites, through its catalog.

    A copy counts as this workspace's only when its URL lies under one of its sites'
    storage roots (a catalog shared by workspaces whose sites have the same names and
    other roots keeps their outputs apart). An output stored before the catalog kept
    them is found where it was always stored, `<default root>/<kind>s/<key><suffix>`,
    and recorded once read."""

    def __init__(self, workspace, catalog: Catalog | None = None):
        self.sites: list[Site] = workspace.resolve_sites()
        self.default = self.sites[0]
        self.catalog = catalog if catalog is not None else workspace.catalog()
        if len(self.sites) > 1:  # a one-site workspace's store is the one verify reads
            self.catalog.note_sites((s.name, s.root) for s in self.sites)

    @staticmethod
    def url(site: Site, kind: str, key: str, suffix: str) -> str:
        return storage.join(site.root, f"{kind}s", f"{key}{suffix}")

    def site_of(self, url: str) -> Site | None:
        return next((s for s in self.sites if s.holds(url)), None)

    def find(self, kind: str, key: str, suffix: str) -> list[OutputCopy]:
        """The output's copies at this workspace's sites (length -1: one stored before
        the catalog kept them, its digest not known yet)."""
        mine = []
        for copy in self.catalog.output_copies(kind, key):
            site = self.site_of(copy.url)
            if site is not None:
                mine.append(copy._replace(site=site.name))
        if not mine:
            legacy = self.url(self.default, kind, key, suffix)
            if storage.exists(legacy):
                mine.append(OutputCopy(self.default.name, legacy, "", -1, self.default.name))
        return mine

    def keyed(
        self,
        at: Site,
        kind: str,
        key: str,
        suffix: str,
        *,
        load: Callable[[str], T],
        compute: Callable[[str], tuple[T, str, int]],
    ) -> Keyed[T]:
        """The output found at any of the sites (`at`'s copy first), else computed at
        `at`: compute(url) stores it at `url` under `at`'s root and returns the value,
        the stored bytes' sha256 and size; it is then recorded in the catalog.

        A copy whose bytes fail their check (or are gone) is forgotten and, when no other
        copy is whole, the output is computed again (reason "corrupt"); a copy whose
        store does not answer is passed over."""
        copies = sorted(self.find(kind, key, suffix), key=lambda c: c.site != at.name)
        damaged = False
        for copy in copies:
            try:
                value = load(copy.url)
            except Exception as exc:  # noqa: BLE001 - any unreadable copy is passed over
                if _unreachable(exc):
                    log.warning("%s %s at site %s: its store did not answer (%s: %s)", kind,
                                key[:12], copy.site, type(exc).__name__, exc)  # fmt: skip
                    continue
                log.warning("%s %s at site %s is damaged (%s: %s): not used", kind, key[:12],
                            copy.site, type(exc).__name__, exc)  # fmt: skip
                damaged = True
                if copy.length >= 0:
                    self.catalog.drop_output(kind, key, copy.url)
                continue
            if copy.length < 0:  # stored before the catalog kept outputs: recorded now
                data = storage.read_bytes(copy.url)
                self.catalog.record_output(kind, key, copy._replace(
                    digest=storage.sha256_hex(data), length=len(data)))  # fmt: skip
            return Keyed(key, copy.url, value, cache_hit=True, site=copy.site)
        url = self.url(at, kind, key, suffix)
        value, digest, length = compute(url)
        self.catalog.record_output(kind, key, OutputCopy(at.name, url, digest, length, at.name))
        return Keyed(key, url, value, cache_hit=False, reason="corrupt" if damaged else "",
                     site=at.name)  # fmt: skip

    def bring(self, kind: str, url: str, to: Site, run: Run) -> tuple[str, int]:
        """The stored output at `url` (`<root>/<kind>s/<key><suffix>`) as a copy at site
        `to`: its URL there and the bytes copied now (0: `to` holds it already). The copy
        is made by `run` (at `to`), checked against the recorded digest, and recorded."""
        if to.holds(url):
            return url, 0
        key, suffix = os.path.splitext(url.rsplit("/", 1)[-1])
        copies = self.find(kind, key, suffix)
        here = next((c for c in copies if c.site == to.name), None)
        if here is not None:
            return here.url, 0
        source = next((c for c in copies if c.url == url), None)
        known = source is not None and source.length >= 0
        held = self.site_of(url)
        origin = source.origin if source else (held.name if held else "")
        dst = self.url(to, kind, key, suffix)
        digest, length = run(copy_file, url, dst, source.digest if known else None)
        self.catalog.record_output(kind, key, OutputCopy(to.name, dst, digest, length, origin))
        log.info("%s %s copied from %s to site %s (%d bytes)", kind, key[:12],
                 held.name if held else url, to.name, length)  # fmt: skip
        return dst, length

    def _index_rows(self, outputs: Mapping[Partition, FeatureOutput]) -> list[dict]:
        """The index rows of feature outputs at the sites holding them (what their copies
        are indexed with), one per key; LookupError if one is not indexed there."""
        from quantloop.tasks.research.planning import feature_kind

        kind = feature_kind().name
        rows: dict[str, dict] = {}
        for site in self.sites:
            mine = {o.key: p.product for p, o in outputs.items() if site.holds(o.blob.url)}
            if mine:
                nodes = pa.table({"key": list(mine), "product": list(mine.values())})
                found = NodeStore(site.root).existing(kind, nodes).to_pylist()
                rows |= {r["key"]: r for r in found}
        missing = {o.key for o in outputs.values()} - set(rows)
        if missing:
            raise LookupError(f"{len(missing)} feature outputs are not indexed where they are "
                              f"stored (e.g. {sorted(missing)[0][:12]})")  # fmt: skip
        return list(rows.values())

    def bring_features(
        self, parts: Mapping[Partition, FeatureOutput], to: Site, run: Run
    ) -> tuple[dict[Partition, FeatureOutput], int]:
        """The feature outputs with those stored elsewhere copied to site `to` first (one
        pack, indexed there: a later stage or run at `to` finds them there), and the
        bytes copied."""
        away = {p: o for p, o in parts.items() if not to.holds(o.blob.url)}
        if not away:
            return dict(parts), 0
        rows = self._index_rows(away)
        made = {r["key"]: r for r in run(copy_feature_outputs, rows, to.root)}
        out = dict(parts)
        for part, o in away.items():
            out[part] = FeatureOutput(o.key, output_blob(made[o.key]), site=to.name)
        copied = sum(r["output_length"] for r in made.values())
        log.info("%d feature outputs copied to site %s (%d bytes)", len(made), to.name, copied)
        return out, copied

    def bring_features_for(
        self,
        stage: str,
        parts: Mapping[Partition, FeatureOutput],
        to: Site,
        run: Run,
        spent: dict[str, int],
    ) -> tuple[dict[Partition, FeatureOutput], int]:
        """bring_features as stage `stage`'s "copy features" phase, the bytes added to
        spent[to.name] at once (a stage's bytes across by site, counted whatever happens
        after: the train and simulate stages)."""
        with timeline.phase(f"{stage}: copy features"):
            local, copied = self.bring_features(parts, to, run)
        spent[to.name] = spent.get(to.name, 0) + copied
        return local, copied


def lineage_roots(catalog: Catalog, key: str, roots: list[str]) -> list[str]:
    """Where a model's lineage record may be, most likely first: beside each recorded copy
    of the model (the one where it was trained first), then `roots`, then every site
    root the catalog has seen."""
    found = [c.url.rsplit("/models/", 1)[0] for c in catalog.output_copies("model", key)]
    found += roots + [root for _, root in catalog.site_roots()]
    return list(dict.fromkeys(r.rstrip("/") for r in found if r))


def read_lineage(catalog: Catalog, key: str, roots: list[str]) -> dict:
    """A model's lineage record (flows/train.py record_lineage), wherever it is stored;
    LookupError naming where it was looked for."""
    looked = []
    for root in lineage_roots(catalog, key, roots):
        url = storage.join(root, "lineage", "models", f"{key}.json")
        looked.append(url)
        try:
            return json.loads(storage.read_bytes(url))
        except FileNotFoundError:
            continue
        except OSError as exc:
            if "No such file" in str(exc):
                continue
            raise
    raise LookupError(f"model {key[:12]}: no lineage record at {', '.join(looked)}")


def model_copy(catalog: Catalog, key: str, roots: list[str]) -> str:
    """The URL of a stored copy of model `key`: a recorded one that is there (the one
    where it was trained first), else `<root>/models/<key>.pt` under the first of `roots`
    that has it; LookupError naming where it was looked for."""
    urls = [c.url for c in catalog.output_copies("model", key)]
    urls += [storage.join(r, "models", f"{key}.pt") for r in roots]
    for url in dict.fromkeys(urls):
        if storage.exists(url):
            return url
    raise LookupError(f"model {key[:12]} is at none of {', '.join(dict.fromkeys(urls))}")


def catalog_at(where: str) -> Catalog | None:
    """The catalog a run recorded (its CATALOG_TAG), or None when it is a SQLite file that
    is not there (opening it would make an empty one)."""
    from quantloop.tasks.data.catalog_db import is_url

    if not where or (not is_url(where) and not os.path.exists(where)):
        return None
    return Catalog(where)


def site_roots(sites: list[tuple[str, str]], catalog: Catalog | None) -> list[tuple[str, str]]:
    """(site, root) of `sites` (a workspace's, the default first), then of every other
    root the catalog has seen a site use; each root once."""
    pairs = list(sites) + (catalog.site_roots() if catalog is not None else [])
    seen, out = set(), []
    for name, root in pairs:
        if root and root.rstrip("/") not in seen:
            seen.add(root.rstrip("/"))
            out.append((name, root.rstrip("/")))
    return out
