"""Feature nodes on S3 (a moto server) computed by a real Dask LocalCluster.

Landing, node outputs and the cache index all go through s3fs, in this process
and in the Dask worker processes, which find the endpoint through the AWS_*
environment set by the `s3_endpoint` fixture before the cluster starts.
"""

from __future__ import annotations

import datetime as dt
import os
import uuid

import pytest
import s3fs
from distributed import Client, LocalCluster

from quantloop.tasks.data.catalog import Catalog
from quantloop.tasks.data.schema import Partition
from quantloop.tasks.data.synthetic import SyntheticConfig, generate_day
from quantloop.tasks.engine import NodeStore, run_nodes, storage
from quantloop.tasks.research.features import FeatureParams
from quantloop.tasks.research.planning import feature_kind, plan_feature_table, product_params

PRODUCTS = ["SYNA", "SYNB"]
DATES = [dt.date(2026, 3, 2), dt.date(2026, 3, 3)]
SYNTHETIC = SyntheticConfig(events_per_day=2000, levels=2)


@pytest.fixture
def bucket(s3_endpoint) -> str:
    """A fresh bucket on the moto server (created with s3fs, as an operator would)."""
    name = f"quantloop-{uuid.uuid4().hex[:12]}"
    s3fs.S3FileSystem(skip_instance_cache=True).mkdir(name)
    return name


@pytest.mark.slow
@pytest.mark.server
def test_feature_nodes_on_s3_with_dask_workers(bucket, s3_endpoint, tmp_path):
    root = f"s3://{bucket}/store"
    catalog = Catalog(tmp_path / "catalog.sqlite")
    for product in PRODUCTS:
        for date in DATES:
            part = Partition(product, date)
            landed = catalog.land(
                "synthetic", part, generate_day(product, date, SYNTHETIC), root=root
            )
            assert landed.status == "new"
    entries = catalog.entries("synthetic")
    assert all(e.location.startswith(f"{root}/datasets/") for e in entries)
    # Content-addressed: each landed object's bytes hash to the digest the catalog keeps.
    assert all(storage.sha256_hex(storage.read_bytes(e.location)) == e.digest for e in entries)

    kind = feature_kind()
    per_product = product_params(FeatureParams(), {}, PRODUCTS)
    nodes, params = plan_feature_table(catalog.table("synthetic"), per_product, kind)
    store = NodeStore(root)
    with (
        LocalCluster(
            n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None,
            silence_logs=40,
        ) as cluster,
        Client(cluster) as client,
    ):  # fmt: skip
        seen = client.run(lambda: (os.getpid(), os.environ.get("AWS_ENDPOINT_URL")))
        assert {endpoint for _, endpoint in seen.values()} == {s3_endpoint}
        assert os.getpid() not in {pid for pid, _ in seen.values()}  # separate processes

        first = run_nodes(kind, params, nodes, store, client=client, site="s3")
        assert first.failed == 0, first.failures
        assert (first.nodes, first.computed, first.cache_hits) == (4, 4, 0)
        again = run_nodes(kind, params, nodes, store, client=client, site="s3")
        # A fresh store object too: the hits come from the index on S3, not a memory cache.
        fresh = run_nodes(kind, params, nodes, NodeStore(root), client=client, site="s3")

    manifest = first.manifest.to_pylist()
    for row in manifest:
        # Each output is read back on its own: its bytes hash to the digest in the manifest.
        assert row["output_url"].startswith(f"{root}/")
        data = storage.read_range(row["output_url"], row["output_offset"], row["output_length"])
        assert storage.sha256_hex(data) == row["output_digest"]
        assert store.read(row).num_rows == row["rows"] > 0

    digests = {row["key"]: row["output_digest"] for row in manifest}
    for rerun in (again, fresh):
        assert (rerun.computed, rerun.cache_hits, rerun.failed) == (0, 4, 0)
        assert rerun.manifest["cache_hit"].to_pylist() == [True] * 4
        assert {r["key"]: r["output_digest"] for r in rerun.manifest.to_pylist()} == digests

    # Every object in the bucket is complete and expected: the landed partitions, one
    # output per node and the index segments; no temporary names, no open multipart upload.
    fs = s3fs.S3FileSystem(skip_instance_cache=True)
    objects = sorted(f"s3://{p}" for p in fs.find(bucket))
    assert not [o for o in objects if storage.TMP_MARK in o]
    outputs = {row["output_url"] for row in manifest}  # files holding the outputs
    landed = {e.location for e in entries}
    segments = [o for o in objects if o.startswith(store.index_url(kind.name) + "/")]
    assert segments and all(o.endswith(".parquet") for o in segments)
    assert set(objects) == outputs | landed | set(segments)
    indexed = store.rows(kind.name)
    assert set(indexed["key"].to_pylist()) == set(nodes["key"].to_pylist())
    assert fs.call_s3("list_multipart_uploads", Bucket=bucket).get("Uploads", []) == []
