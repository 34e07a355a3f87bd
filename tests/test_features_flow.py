"""The features flow, shard by shard: each shard writes its part of the run's manifest,
the flow sums what they did, and failed nodes are reported and recorded."""

from __future__ import annotations

import datetime as dt

import pyarrow.compute as pc
import pytest

from quantloop.flows.features import NodeFailures, features
from quantloop.tasks.data.schema import Partition
from quantloop.tasks.engine import RunRecords, storage
from quantloop.tasks.records.manifest import manifest_runs, query
from quantloop.tasks.research.stage import StageParams
from quantloop.tasks.runtime.workspace import Selection, Workspace
from tests.books import random_book

PRODUCTS = ["AAA", "BBB", "CCC"]
DATES = [dt.date(2026, 1, 5), dt.date(2026, 1, 6)]


@pytest.mark.slow
def test_features_flow_runs_and_records_shard_by_shard(prefect_api, tmp_path, monkeypatch):
    from quantloop.blocks import Site

    clusters: list[str] = []  # each start of the site's LocalCluster (Site.client)
    client = Site.client
    monkeypatch.setattr(Site, "client", lambda site: clusters.append(site.name) or client(site))
    workspace = Workspace(home=str(tmp_path / "home"), n_workers=1)
    root = workspace.resolve_site().root
    catalog = workspace.catalog()
    catalog.land_packed("d", [(Partition(p, d), random_book(100, seed=i))
                              for i, (p, d) in enumerate((p, d) for p in PRODUCTS
                                                         for d in DATES)], root=root)  # fmt: skip
    stage = StageParams(workspace=workspace, selection=Selection(dataset="d"))

    first = features(stage, shard_size=4)  # shards of 4 and 2 nodes
    assert (first.nodes, first.computed, first.cache_hits, first.failed) == (6, 6, 0, 0)
    # 6 first nodes of ~4 KB of input each: expected well under INLINE_BELOW_S at
    # UNKNOWN_S_PER_MB, so they ran in the flow's process, no cluster started
    assert clusters == []
    assert first.reasons == {"new": 6} and first.compute_s > 0 and first.output_rows == 600
    parts = RunRecords(first.manifest_url).parts()
    assert [storage.read_parquet(p).num_rows for p in parts] == [4, 2]
    assert manifest_runs(root, "features") == [first.manifest_url]
    rows = query(root, limit=10).rows
    pairs = list(zip(rows["product"].to_pylist(), rows["date"].to_pylist(), strict=True))
    assert pairs == [(p, d.isoformat()) for p in PRODUCTS for d in DATES]  # plan order

    again = features(stage, shard_size=4)
    assert (again.computed, again.cache_hits, again.batches) == (0, 6, 0)

    # CCC's pack changed in place, and CCC's parameters too, so its nodes must run:
    # they fail, the others are hits, the run is recorded with the failures, and the
    # error names the partitions.
    pack = {e.location for e in catalog.entries("d") if e.partition.product == "CCC"}.pop()
    storage.write_bytes_atomic(pack, storage.parquet_bytes(random_book(10, seed=9)))
    changed = stage.model_copy(update={"product_features": {"CCC": {"ofi_window": 12}}})
    # QUANTLOOP_INLINE_BELOW_S=0: the cluster starts, whatever the expected work
    monkeypatch.setenv("QUANTLOOP_INLINE_BELOW_S", "0")
    with pytest.raises(NodeFailures, match="(?s)2 of 6 feature nodes failed.*CCC/2026-01-05"):
        features(changed, shard_size=4)
    failed = query(root, status="failed")
    assert (failed.matched, failed.total, failed.cache_hits) == (2, 6, 0)
    assert "does not match its digest" in failed.rows["error"][0].as_py()
    assert clusters == ["local"]  # started once, for the failing run
    assert set(failed.rows["reason"].to_pylist()) == {"params"}
    assert pc.sum(query(root, limit=10).rows["cache_hit"]).as_py() == 4


def test_runs_of_one_second_are_ordered_as_they_were_made(tmp_path):
    """`query` reads the latest run by its folder's name: runs made in the same second
    (a failing run right after a cached one, as above) keep the order they were made in,
    whatever their ids."""
    from quantloop.flows.features import manifest_url
    from quantloop.tasks.engine.records import recorded_runs

    root = str(tmp_path)
    made = []
    for _ in range(20):  # outside a flow run, each id is random
        url = manifest_url(root, "features")
        storage.write_bytes_atomic(storage.join(url, "run.json"), b"{}")
        made.append(url)
    assert recorded_runs(storage.join(root, "manifests", "features")) == made
