"""Node records: a run's manifest written part by part, recorded by its run.json, and
queried a file at a time (tasks/records/manifest.py, `quantloop nodes`)."""

from __future__ import annotations

import datetime as dt

import pyarrow.compute as pc

from quantloop.tasks.data.catalog import Catalog
from quantloop.tasks.data.schema import Partition
from quantloop.tasks.engine import NodeStore, RunRecords, RunSummary, run_nodes, storage
from quantloop.tasks.records.manifest import manifest_runs, query
from quantloop.tasks.research.features import FeatureParams
from quantloop.tasks.research.planning import (
    feature_kind,
    plan_feature_table,
    product_params,
    shards,
)
from tests.books import random_book

PRODUCTS = ["AAA", "BBB"]
DATES = [dt.date(2026, 1, 5), dt.date(2026, 1, 6)]


def record_run(root: str, name: str, kind, params, nodes, *, close: bool = True) -> RunRecords:
    """A run as the features flow records it: a part per shard of 3 nodes, then run.json."""
    records = RunRecords(storage.join(root, "manifests", kind.name, name))
    summary = RunSummary()
    for i, shard in enumerate(shards(nodes, 3)):
        result = run_nodes(kind, params, shard, NodeStore(root))
        records.write(i, result.manifest)
        summary.add(result.summary())
    if close:
        records.close(summary)
    return records


def test_runs_are_recorded_part_by_part_and_queried(tmp_path):
    root = str(tmp_path / "store")
    catalog = Catalog(tmp_path / "catalog.sqlite")
    catalog.land_packed("d", [(Partition(p, d), random_book(100, seed=i))
                              for i, (p, d) in enumerate((p, d) for p in PRODUCTS
                                                         for d in DATES)], root=root)  # fmt: skip
    kind = feature_kind()
    params = product_params(FeatureParams(), {}, PRODUCTS)
    nodes, by_digest = plan_feature_table(catalog.table("d"), params, kind)

    first = record_run(root, "20260105T000000-first", kind, by_digest, nodes, close=False)
    assert len(first.parts()) == 2  # shards of 3 and 1 nodes
    assert manifest_runs(root, "features") == []  # not recorded before its run.json
    first.close(RunSummary(nodes=4))
    assert manifest_runs(root, "features") == [first.url]

    found = query(root, limit=3)
    assert (found.total, found.matched, found.cache_hits, found.failed) == (4, 4, 0, 0)
    assert found.rows["key"].to_pylist() == nodes["key"].to_pylist()[:3]  # plan order
    assert set(found.rows["run"].to_pylist()) == {"20260105T000000-first"}
    bbb = query(root, product="BBB")
    assert bbb.matched == 2 and set(bbb.rows["product"].to_pylist()) == {"BBB"}
    last = nodes["key"][3].as_py()
    assert query(root, key=last[:12]).rows["key"].to_pylist() == [last]
    assert query(root, date=DATES[1], cache_hit=True).matched == 0

    # The next run is all hits; an older store's run is a single Parquet file.
    second = record_run(root, "20260106T000000-second", kind, by_digest, nodes)
    older = storage.join(root, "manifests", "features", "20250101T000000-older.parquet")
    storage.write_parquet_atomic(older, storage.read_parquet(first.parts()[0]))
    assert manifest_runs(root, "features") == [older, first.url, second.url]
    latest = query(root)
    assert (latest.total, latest.cache_hits) == (4, 4)
    every = query(root, all_runs=True, limit=100, status="ok")
    assert (every.total, every.matched, every.cache_hits) == (11, 11, 4)
    runs = every.rows["run"].to_pylist()
    assert (
        runs
        == ["20250101T000000-older"] * 3
        + ["20260105T000000-first"] * 4
        + ["20260106T000000-second"] * 4
    )
    assert pc.all(pc.equal(every.rows["status"], "ok")).as_py()
