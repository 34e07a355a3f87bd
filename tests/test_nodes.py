"""The node engine: keys, cache hits, incremental re-runs, crash safety."""

from __future__ import annotations

import datetime as dt
from dataclasses import replace

import pyarrow.compute as pc
import pytest

from tasks import storage
from tasks.catalog import Catalog
from tasks.features import FeatureParams
from tasks.nodes import NodeKind, NodeStore, run_nodes
from tasks.planning import feature_kind, plan_feature_nodes, product_params
from tasks.schema import Partition
from tests.books import random_book

PRODUCTS = ["AAA", "BBB"]
BBB_ROWS = 400
DATES = [dt.date(2026, 1, 5), dt.date(2026, 1, 6)]


@pytest.fixture
def landed(tmp_path):
    root = str(tmp_path / "store")
    catalog = Catalog(tmp_path / "catalog.sqlite")
    for i, p in enumerate(Partition(x, d) for x in PRODUCTS for d in DATES):
        # BBB's days are shorter, so a test's compute function can tell them apart.
        rows = BBB_ROWS if p.product == "BBB" else 500
        catalog.land("test", p, random_book(rows, seed=i), root=root)
    return catalog, NodeStore(root)


def plan(catalog, overrides=None, kind=None, base=FeatureParams()):
    kind = kind or feature_kind()
    params = product_params(base, overrides or {}, PRODUCTS)
    return kind, *plan_feature_nodes(catalog.entries("test"), params, kind)


def test_key_changes_exactly_with_code_params_inputs(landed):
    catalog, _ = landed
    _, nodes, _ = plan(catalog)
    node = nodes[0]
    assert node.key == replace(node).key  # deterministic
    assert replace(node, code="x").key != node.key
    assert replace(node, params="x").key != node.key
    assert replace(node, inputs="x").key != node.key
    assert replace(node, input_url="elsewhere").key == node.key  # location is not identity
    assert len({n.key for n in nodes}) == len(nodes)


def test_rerun_is_all_cache_hits_and_changed_param_reruns_only_its_nodes(landed):
    catalog, store = landed
    kind, nodes, params = plan(catalog)
    first = run_nodes(kind, params, nodes, store)
    assert (first.nodes, first.computed, first.cache_hits, first.failed) == (4, 4, 0, 0)
    assert set(first.manifest["reason"].to_pylist()) == {"new"}

    again = run_nodes(kind, params, nodes, store)
    assert (again.computed, again.cache_hits) == (0, 4)
    assert (
        again.manifest["output_digest"].to_pylist() == first.manifest["output_digest"].to_pylist()
    )

    kind, nodes, params = plan(catalog, overrides={"BBB": {"ofi_window": 20}})
    changed = run_nodes(kind, params, nodes, store)
    assert (changed.computed, changed.cache_hits) == (2, 2)
    ran = changed.manifest.filter(pc.invert(changed.manifest["cache_hit"]))
    assert set(ran["product"].to_pylist()) == {"BBB"}
    assert set(ran["reason"].to_pylist()) == {"params"}


def test_changed_code_and_input_are_explained(landed):
    catalog, store = landed
    kind, nodes, params = plan(catalog)
    run_nodes(kind, params, nodes, store)
    edited = NodeKind(kind.name, kind.compute, code="edited-source")
    _, nodes, params = plan(catalog, kind=edited)
    result = run_nodes(edited, params, nodes, store)
    assert result.computed == 4
    assert set(result.manifest["reason"].to_pylist()) == {"code"}

    p = Partition("AAA", DATES[0])
    catalog.land("test", p, random_book(500, seed=99), root=store.root)
    kind, nodes, params = plan(catalog, kind=edited)
    result = run_nodes(edited, params, nodes, store)
    assert result.computed == 1
    assert result.manifest.filter(pc.invert(result.manifest["cache_hit"]))[
        "reason"
    ].to_pylist() == ["input"]


def test_output_without_index_entry_is_not_a_hit(landed):
    """A crash after the output write but before the index commit: recomputed, not trusted."""
    catalog, store = landed
    kind, nodes, params = plan(catalog)
    node = nodes[0]
    storage.write_bytes_atomic(store.output_url(kind.name, node.key), b"partial garbage")
    result = run_nodes(kind, params, nodes, store)
    assert result.cache_hits == 0 and result.computed == 4
    out = storage.read_parquet(store.output_url(kind.name, node.key))
    assert out.num_rows > 0


def test_failed_node_is_recorded_not_indexed(landed):
    catalog, store = landed

    kind, nodes, params = plan(catalog)
    broken = NodeKind(kind.name, _fail_on_bbb, kind.code)
    result = run_nodes(broken, params, nodes, store)
    assert result.failed == 2 and result.computed == 2
    assert all("BBB/" in e and "boom" in e for e in result.failures)
    assert store.existing(kind.name, [n.key for n in nodes]).num_rows == 2
    assert not any(
        storage.exists(store.output_url(kind.name, n.key))
        for n in nodes
        if n.partition.product == "BBB"
    )


def test_input_changed_in_place_is_refused(landed):
    catalog, store = landed
    kind, nodes, params = plan(catalog)
    storage.write_bytes_atomic(nodes[0].input_url, storage.parquet_bytes(random_book(10, seed=5)))
    result = run_nodes(kind, params, nodes[:1], store)
    assert result.failed == 1
    assert "does not match its catalog digest" in result.failures[0]


def test_dask_cluster_gives_same_outputs(landed):
    from distributed import Client, LocalCluster

    catalog, store = landed
    kind, nodes, params = plan(catalog)
    local = run_nodes(kind, params, nodes, store)
    other = NodeStore(store.root + "-dask")
    with LocalCluster(n_workers=2, threads_per_worker=1, dashboard_address=None) as cluster:
        with Client(cluster) as client:
            remote = run_nodes(kind, params, nodes, other, client=client, site="pool")
    assert remote.computed == 4
    assert (
        remote.manifest["output_digest"].to_pylist() == local.manifest["output_digest"].to_pylist()
    )
    assert set(remote.manifest["site"].to_pylist()) == {"pool"}


def _fail_on_bbb(book, params):
    from tasks.features import features_node

    if book.num_rows == BBB_ROWS:
        raise ValueError("boom")
    return features_node(book, params)
