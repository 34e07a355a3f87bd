"""The node engine (quantloop.tasks.engine): keys, cache hits, incremental re-runs, crash
safety, manifests. Plans are the columnar planner's tables, as the features flow makes them."""

from __future__ import annotations

import datetime as dt
import os
import signal
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pytest

from quantloop.tasks.data.catalog import Catalog
from quantloop.tasks.data.schema import Partition
from quantloop.tasks.engine import (
    INDEX_SCHEMA,
    NodeKind,
    NodeStore,
    node_keys,
    plan_nodes,
    run_nodes,
    storage,
)
from quantloop.tasks.engine.batch import run_batch
from quantloop.tasks.engine.sizing import batch_size
from quantloop.tasks.research.features import FeatureParams, features_node
from quantloop.tasks.research.planning import feature_kind, plan_feature_table, product_params
from tests.books import random_book

PRODUCTS = ["AAA", "BBB"]
DATES = [dt.date(2026, 1, 5), dt.date(2026, 1, 6)]
BBB_ROWS = 400  # BBB's days are shorter, so a test's compute function can tell them apart


@pytest.fixture
def landed(tmp_path):
    root = str(tmp_path / "store")
    catalog = Catalog(tmp_path / "catalog.sqlite")
    for i, p in enumerate(Partition(x, d) for x in PRODUCTS for d in DATES):
        rows = BBB_ROWS if p.product == "BBB" else 500
        catalog.land("test", p, random_book(rows, seed=i), root=root)
    return catalog, NodeStore(root)


def plan(catalog, overrides=None, kind=None, base=None, dataset="test"):
    kind = kind or feature_kind()
    params = product_params(base or FeatureParams(), overrides or {}, PRODUCTS)
    return kind, *plan_feature_table(catalog.table(dataset), params, kind)


def not_hits(result):
    return result.manifest.filter(pc.invert(result.manifest["cache_hit"]))


def keys(nodes) -> list[str]:
    return nodes["key"].to_pylist()


def test_key_changes_exactly_with_code_params_inputs(landed):
    catalog, _ = landed
    kind, nodes, _ = plan(catalog)
    node = nodes.slice(0, 1).to_pylist()[0]

    def key(kind_name=kind.name, code=node["code"], params=node["params"], digest=node["digest"]):
        return node_keys(kind_name, code, [params], [digest])[0]

    assert key() == node["key"]  # the plan's key, deterministic
    for changed in ({"kind_name": "x"}, {"code": "x"}, {"params": "x"}, {"digest": "x"}):
        assert key(**changed) != node["key"], changed
    assert len(set(keys(nodes))) == nodes.num_rows
    # Where the input lives is not what it is: moved partitions keep their keys.
    entries = catalog.table("test")
    moved = entries.set_column(
        entries.schema.get_field_index("location"),
        "location",
        pa.array(["s3://elsewhere/x"] * entries.num_rows),
    )
    params_of = dict(zip(nodes["product"].to_pylist(), nodes["params"].to_pylist(), strict=True))
    assert keys(plan_nodes(kind, moved, params_of)) == keys(nodes)


def test_rerun_is_all_cache_hits_and_changed_param_reruns_only_its_nodes(landed):
    catalog, store = landed
    kind, nodes, params = plan(catalog)
    first = run_nodes(kind, params, nodes, store)
    assert (first.nodes, first.computed, first.cache_hits, first.failed) == (4, 4, 0, 0)
    assert set(first.manifest["reason"].to_pylist()) == {"new"}

    again = run_nodes(kind, params, nodes, store)
    assert (again.computed, again.cache_hits) == (0, 4)
    digests = again.manifest.sort_by("key")["output_digest"]
    assert digests.equals(first.manifest.sort_by("key")["output_digest"])

    kind, nodes, params = plan(catalog, overrides={"BBB": {"ofi_window": 20}})
    changed = run_nodes(kind, params, nodes, store)
    assert (changed.computed, changed.cache_hits) == (2, 2)
    assert set(not_hits(changed)["product"].to_pylist()) == {"BBB"}
    assert set(not_hits(changed)["reason"].to_pylist()) == {"params"}
    # hits and computed rows together, in the plan's order
    order = keys(nodes)
    assert changed.manifest["key"].to_pylist() == order
    assert changed.manifest["cache_hit"].to_pylist() == [True, True, False, False]
    backwards = nodes.take(pa.array(range(nodes.num_rows - 1, -1, -1)))
    assert run_nodes(kind, params, backwards, store).manifest["key"].to_pylist() == order[::-1]


def test_small_known_work_runs_without_starting_a_cluster(landed):
    """A cluster to start (`connect`) is not started for nodes whose expected work, from
    the kind's history, is under `inline_below_s`; the outputs are those the cluster's
    workers would store. Work with no history, or over the bound, connects."""
    catalog, store = landed
    connected: list[int] = []

    def connect():
        connected.append(1)
        return None  # run_nodes then runs in-process: what is asserted is the call

    kind, nodes, params = plan(catalog)
    first = run_nodes(kind, params, nodes, store, connect=connect, inline_below_s=1e9)
    assert connected == [1] and first.computed == 4  # no history yet: the cluster

    kind, nodes, params = plan(catalog, overrides={"BBB": {"ofi_window": 20}})
    small = run_nodes(kind, params, nodes, store, connect=connect, inline_below_s=1e9)
    assert connected == [1] and (small.computed, small.cache_hits) == (2, 2)
    kind, nodes, params = plan(catalog, overrides={"BBB": {"ofi_window": 30}})
    run_nodes(kind, params, nodes, store, connect=connect, inline_below_s=1e-9)
    assert connected == [1, 1]  # expected work over the bound: the cluster
    alone = NodeStore(str(store.root) + "-alone")
    kind, nodes, params = plan(catalog, overrides={"BBB": {"ofi_window": 20}})
    fresh = run_nodes(kind, params, nodes, alone)
    assert not_hits(small)["output_digest"].equals(
        fresh.manifest.filter(pc.equal(fresh.manifest["product"], "BBB"))["output_digest"]
    )


def test_small_first_work_runs_without_a_cluster_when_sized_by_its_input_bytes(landed):
    """With no history, `unknown_s_per_mb` sizes the work by the nodes' input bytes: under
    `inline_below_s` it runs in-process, over it (or with an input of unknown length, or
    without the rate) the cluster is started."""
    catalog, store = landed
    connected: list[int] = []

    def connect():
        connected.append(1)
        return None  # run_nodes then runs in-process: what is asserted is the call

    kind, nodes, params = plan(catalog)
    mb = pc.sum(nodes["length"]).as_py() / 1e6
    assert 0 < mb < 1
    # 4 nodes of 16-19 KB: expected 0.07 s at 1 s per MB, over a bound of 1e-3 s
    over = run_nodes(kind, params, nodes, NodeStore(str(store.root) + "-over"),
                     connect=connect, inline_below_s=1e-3, unknown_s_per_mb=1.0)  # fmt: skip
    assert connected == [1] and over.computed == 4
    unsized = run_nodes(kind, params, nodes, NodeStore(str(store.root) + "-unsized"),
                        connect=connect, inline_below_s=1e9)  # fmt: skip
    assert connected == [1, 1] and unsized.computed == 4  # no rate: unknown, the cluster
    unknown = nodes.set_column(nodes.schema.get_field_index("length"), "length",
                               pa.array([None] * nodes.num_rows, pa.int64()))  # fmt: skip
    run_nodes(kind, params, unknown, NodeStore(str(store.root) + "-unknown"), connect=connect,
              inline_below_s=1e9, unknown_s_per_mb=1.0)  # fmt: skip
    assert connected == [1, 1, 1]  # a length not known: the cluster
    small = run_nodes(kind, params, nodes, store, connect=connect, inline_below_s=mb * 2,
                      unknown_s_per_mb=1.0)  # fmt: skip
    assert connected == [1, 1, 1] and small.computed == 4  # in-process
    assert small.manifest["output_digest"].equals(over.manifest["output_digest"])


def test_partitions_with_identical_content_keep_a_row_each(tmp_path):
    """Two days with the same bytes share a key and an output (content addressing),
    but every node keeps its own manifest row, hit or not."""
    catalog = Catalog(tmp_path / "catalog.sqlite")
    root = str(tmp_path / "store")
    book = random_book(200, seed=3)
    for day in DATES:
        catalog.land("same", Partition("AAA", day), book, root=root)
    kind = feature_kind()
    params = product_params(FeatureParams(), {}, ["AAA"])
    nodes, by_digest = plan_feature_table(catalog.table("same"), params, kind)
    assert nodes["key"][0] == nodes["key"][1]
    for expected_hits in (0, 2):
        result = run_nodes(kind, by_digest, nodes, NodeStore(root))
        assert (result.cache_hits, result.computed) == (expected_hits, 2 - expected_hits)
        assert result.manifest["date"].to_pylist() == [d.isoformat() for d in DATES]


def test_manifest_rows_are_complete(landed):
    catalog, store = landed
    kind, nodes, params = plan(catalog)
    for result in (run_nodes(kind, params, nodes, store), run_nodes(kind, params, nodes, store)):
        m = result.manifest
        assert m.num_rows == nodes.num_rows
        assert sorted(m["key"].to_pylist()) == sorted(keys(nodes))
        for row in m.to_pylist():
            assert row["status"] == "ok" and row["error"] == ""
            assert all(len(row[c]) == 64 for c in ("key", "code", "params", "inputs",
                                                   "output_digest"))  # fmt: skip
            assert row["output_url"] and row["output_length"] > 0 and row["rows"] > 0
            assert row["duration_s"] > 0 and row["site"] == "local"
            assert (row["reason"] == "") == row["cache_hit"]
        assert [(r["product"], r["date"]) for r in m.to_pylist()] == sorted(
            zip(nodes["product"].to_pylist(), nodes["date"].to_pylist(), strict=True)
        )


def test_outputs_read_back_with_their_digest(landed):
    catalog, store = landed
    kind, nodes, params = plan(catalog)
    result = run_nodes(kind, params, nodes, store)
    entries = {(e.partition.product, e.partition.date.isoformat()): e
               for e in catalog.entries("test")}  # fmt: skip
    by_key = {n["key"]: n for n in nodes.to_pylist()}
    for row in result.manifest.to_pylist():
        node = by_key[row["key"]]
        out = store.read(row)
        book = storage.read_table(entries[node["product"], node["date"]].blob)
        # Byte equality: labels hold NaN at the day's end, and NaN != NaN in Table.equals.
        assert storage.arrow_bytes(out) == storage.arrow_bytes(
            features_node(book, params[node["params"]])
        )
        assert row["rows"] == out.num_rows


def test_changed_code_and_input_are_explained(landed):
    catalog, store = landed
    kind, nodes, params = plan(catalog)
    run_nodes(kind, params, nodes, store)
    edited = NodeKind(kind.name, kind.compute, code="edited-source", prepare=kind.prepare)
    _, nodes, params = plan(catalog, kind=edited)
    result = run_nodes(edited, params, nodes, store)
    assert result.computed == 4
    assert set(result.manifest["reason"].to_pylist()) == {"code"}

    catalog.land("test", Partition("AAA", DATES[0]), random_book(500, seed=99), root=store.root)
    _, nodes, params = plan(catalog, kind=edited)
    result = run_nodes(edited, params, nodes, store)
    assert result.computed == 1
    assert not_hits(result)["reason"].to_pylist() == ["input"]


def test_reasons_name_every_changed_part(landed):
    catalog, store = landed
    kind, nodes, params = plan(catalog)
    run_nodes(kind, params, nodes, store)
    # code and params of AAA change together; BBB keeps its params, so only code
    edited = NodeKind(kind.name, kind.compute, code="edited", prepare=kind.prepare)
    _, nodes, params = plan(catalog, {"AAA": {"ofi_window": 7}}, kind=edited)
    result = run_nodes(edited, params, nodes, store)
    reasons = dict(zip(result.manifest["product"].to_pylist(),
                       result.manifest["reason"].to_pylist(), strict=False))  # fmt: skip
    assert reasons == {"AAA": "code+params", "BBB": "code"}


def test_unindexed_pack_and_temp_files_are_not_hits(landed):
    """What a crash leaves (a pack with no index segment, a temp file) is never used."""
    catalog, store = landed
    kind, nodes, params = plan(catalog)
    pack = storage.PackWriter(store.pack_url(kind.name))
    pack.add(random_book(10))
    pack.write()
    tmp = Path(store.index_url(kind.name)) / f"{storage.TMP_MARK}x-segment.parquet"
    tmp.parent.mkdir(parents=True)
    tmp.write_bytes(b"half a segment")
    result = run_nodes(kind, params, nodes, store)
    assert result.cache_hits == 0 and result.computed == 4


def test_failed_node_is_recorded_not_indexed(landed):
    catalog, store = landed
    kind, nodes, params = plan(catalog)
    broken = NodeKind(kind.name, fail_on_bbb, kind.code)
    result = run_nodes(broken, params, nodes, store)
    assert result.failed == 2 and result.computed == 2
    assert all("BBB/" in e and "boom" in e for e in result.failures)
    committed = store.existing(kind.name, nodes)
    assert set(committed["product"].to_pylist()) == {"AAA"}
    failed = result.manifest.filter(pc.equal(result.manifest["status"], "failed"))
    assert set(failed["output_url"].to_pylist()) == {""}
    # Fixed code: exactly the failed nodes run again.
    again = run_nodes(kind, params, nodes, store)
    assert again.cache_hits == 2 and set(not_hits(again)["product"].to_pylist()) == {"BBB"}


def test_failing_batched_compute_isolates_the_bad_nodes(landed):
    """A vectorized call that fails is retried node by node: only the bad nodes fail."""
    catalog, store = landed
    kind, nodes, params = plan(catalog)

    def many(tables, p):
        if any(t.num_rows == BBB_ROWS for t in tables):
            raise ValueError("one bad partition in the batch")
        return kind.compute_many(tables, p)

    def one(table, p):
        if table.num_rows == BBB_ROWS:
            raise ValueError("boom")
        return kind.compute(table, p)

    mixed = NodeKind(kind.name, one, kind.code, prepare=kind.prepare, compute_many=many)
    result = run_nodes(mixed, params, nodes, store)
    assert (result.computed, result.failed) == (2, 2)
    assert all("BBB/" in e and "boom" in e for e in result.failures)


def test_batch_of_mixed_depths_is_computed_per_layout(tmp_path):
    """A batch holding books of two depths (different columns) makes one vectorized
    call per layout, and every output is what the node gives alone."""
    catalog = Catalog(tmp_path / "catalog.sqlite")
    root = str(tmp_path / "store")
    parts = [(Partition(p, d), random_book(300, levels=2 if p == "AAA" else 5, seed=i))
             for i, (p, d) in enumerate((p, d) for p in PRODUCTS for d in DATES)]  # fmt: skip
    catalog.land_packed("mixed", parts, root=root)
    kind, nodes, params = plan(catalog, dataset="mixed")
    calls = []

    def many(books, p):
        calls.append({b.num_columns for b in books})
        return kind.compute_many(books, p)

    counting = NodeKind(kind.name, kind.compute, kind.code, kind.prepare, compute_many=many)
    rows = run_batch(counting, params, nodes, root, "local")  # one batch
    assert rows["status"].to_pylist() == ["ok"] * 4
    assert len(calls) == 2 and all(len(c) == 1 for c in calls)
    store = NodeStore(root)
    for i, (node, (_, book)) in enumerate(zip(nodes.to_pylist(), parts, strict=True)):
        [row] = store.existing(kind.name, nodes.slice(i, 1)).to_pylist()
        alone = kind.compute(book, kind.prepare(params[node["params"]]))
        assert storage.arrow_bytes(store.read(row)) == storage.arrow_bytes(alone)  # NaNs too


def test_input_changed_in_place_is_refused(landed):
    catalog, store = landed
    kind, nodes, params = plan(catalog)
    url = nodes["url"][0].as_py()
    storage.write_bytes_atomic(url, storage.parquet_bytes(random_book(10, seed=5)))
    result = run_nodes(kind, params, nodes.slice(0, 1), store)
    assert result.failed == 1
    assert "does not match its digest" in result.failures[0]


def test_batch_size_follows_work_per_node():
    assert batch_size(100_000, 2, 0.0002) == 5_000  # tiny nodes: 1 s of work per task
    assert batch_size(100_000, 2, 2.0) == 1  # heavy nodes: one per task
    assert batch_size(1_000, 2, None) == 250  # nothing measured yet: small batches
    assert batch_size(100_000, 2, None) == 256
    # toward the end, a quarter of what remains (2 workers), so the workers end together,
    # but not below a sixteenth of the target work
    assert batch_size(4_000, 2, 0.0002) == 1_000
    assert batch_size(400, 2, 0.0002) == 312
    assert batch_size(100, 2, 0.0002) == 100


def test_compaction_keeps_every_key(landed):
    catalog, store = landed
    kind, nodes, params = plan(catalog)
    for i in range(nodes.num_rows):  # four runs, four segments
        run_nodes(kind, params, nodes.slice(i, 1), store)
    before = store.existing(kind.name, nodes)
    assert store.compact(kind.name, max_depth=3) == 0  # two segments per product at most
    assert store.compact(kind.name, max_depth=2) == 4
    assert len(storage.list_files(store.index_url(kind.name), ".parquet")) == 1
    after = store.existing(kind.name, nodes)
    assert after.sort_by("key").equals(before.sort_by("key"))


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
    assert remote.manifest.sort_by("key")["output_digest"].equals(
        local.manifest.sort_by("key")["output_digest"]
    )
    assert set(remote.manifest["site"].to_pylist()) == {"pool"}
    assert remote.manifest["key"].to_pylist() == keys(nodes)  # plan order


def test_worker_killed_mid_batch_leaves_nothing_half_done(landed, tmp_path):
    """A Dask worker process dies in the middle of a batch: Dask reruns the batch on a
    restarted worker; nothing of the dead attempt is counted, every node ends committed
    exactly as an undisturbed run would have made it."""
    from distributed import Client, LocalCluster

    catalog, store = landed
    kind, nodes, params = plan(catalog)
    reference = run_nodes(kind, params, nodes, NodeStore(store.root + "-ref"))
    marker = tmp_path / "killed-once"
    dying = NodeKind(kind.name, KillOnce(str(marker)), kind.code)
    with LocalCluster(n_workers=1, threads_per_worker=1, dashboard_address=None) as cluster:
        with Client(cluster) as client:
            result = run_nodes(dying, params, nodes, store, client=client)
    assert marker.exists()  # the worker really died once
    assert result.computed == 4 and result.failed == 0
    index = store.rows(kind.name)
    # Dask may also re-run finished tasks whose results died with the worker: a key can
    # then be committed twice, always with the same output digest.
    assert set(index["key"].to_pylist()) == set(keys(nodes))
    digests = {}
    for r in index.to_pylist():
        assert digests.setdefault(r["key"], r["output_digest"]) == r["output_digest"]
    got = {r["key"]: storage.arrow_bytes(store.read(r)) for r in index.to_pylist()}
    want = {r["key"]: storage.arrow_bytes(store.read(r)) for r in reference.manifest.to_pylist()}
    assert got == want


class KillOnce:
    """A compute function that kills its own worker process the first time it runs on BBB."""

    def __init__(self, marker: str):
        self.marker = marker

    def __call__(self, book, params):
        out = features_node(book, params)
        if book.num_rows == BBB_ROWS and not os.path.exists(self.marker):
            open(self.marker, "w").close()
            os.kill(os.getpid(), signal.SIGKILL)
        return out


def fail_on_bbb(book, params):
    if book.num_rows == BBB_ROWS:
        raise ValueError("boom")
    return features_node(book, params)


def test_a_lookup_reads_only_the_segments_of_its_products(landed):
    """Index segments are named by the products they cover: a plan's lookup opens only
    those of its own products (here the other product's segment is garbage)."""
    catalog, store = landed
    kind, nodes, params = plan(catalog)
    aaa, bbb = (nodes.filter(pc.equal(nodes["product"], p)) for p in PRODUCTS)
    run_nodes(kind, params, aaa, store)
    run_nodes(kind, params, bbb, store)
    segments = store.segments(kind.name)
    assert {(s.first, s.last) for s in segments} == {("AAA", "AAA"), ("BBB", "BBB")}
    for s in segments:
        if s.first == "AAA":
            Path(s.url).write_bytes(b"not a Parquet file")
    assert run_nodes(kind, params, bbb, store).cache_hits == 2
    with pytest.raises(Exception, match="Parquet"):
        run_nodes(kind, params, aaa, store)
    assert store.rows(kind.name, ("BBB", "BBB"))["product"].to_pylist() == ["BBB"] * 2


def test_segment_names_keep_any_product_range(tmp_path):
    store = NodeStore(str(tmp_path))
    rows = INDEX_SCHEMA.empty_table().to_pydict()
    for product in ("a~b/c", "zz%"):
        for name in rows:
            rows[name].append(product if name == "product" else None)
    store.commit("k", pa.table(rows, schema=INDEX_SCHEMA))
    [segment] = store.segments("k")
    assert (segment.first, segment.last) == ("a~b/c", "zz%")
    assert store.rows("k", ("zz", "zzz"))["product"].to_pylist() == ["zz%"]


def test_compaction_merges_into_sorted_product_ranges(tmp_path):
    """Compaction streams: merged segments cover ranges of products, sorted, each
    partition's row once; a segment of an older store (named without a range) is
    merged too."""
    catalog = Catalog(tmp_path / "catalog.sqlite")
    root = str(tmp_path / "store")
    products = ["P0", "P1", "P2", "P3"]
    catalog.land_packed("d", [(Partition(p, d), random_book(50, seed=i * 7 + j))
                              for i, p in enumerate(products)
                              for j, d in enumerate(DATES)], root=root)  # fmt: skip
    kind = feature_kind()
    params = product_params(FeatureParams(), {}, products)
    nodes, by_digest = plan_feature_table(catalog.table("d"), params, kind)
    store = NodeStore(root)
    for i in range(nodes.num_rows - 1, -1, -1):  # one segment per node, newest first
        run_nodes(kind, by_digest, nodes.slice(i, 1), store)
    # An older store's segment: no range in its name, and a duplicate of a P2 row.
    [p2] = [s for s in store.segments(kind.name) if s.first == "P2"][:1]
    old = Path(store.index_url(kind.name)) / "20250101T000000-0123456789ab.parquet"
    old.write_bytes(Path(p2.url).read_bytes())
    before = store.existing(kind.name, nodes).sort_by("key")
    assert store.compact(kind.name, max_depth=2, rows_per_segment=4) == nodes.num_rows + 1
    merged = sorted(store.segments(kind.name), key=lambda s: s.first)
    assert [(s.first, s.last) for s in merged] == [("P0", "P1"), ("P2", "P3")]
    for s in merged:
        rows = store.rows(kind.name, segments=[s])
        assert rows.num_rows == 4  # two products x two dates, the duplicate dropped
        pairs = list(zip(rows["product"].to_pylist(), rows["date"].to_pylist(), strict=True))
        assert pairs == sorted(pairs)
    assert store.existing(kind.name, nodes).sort_by("key").equals(before)
    assert run_nodes(kind, by_digest, nodes, store).cache_hits == nodes.num_rows


@pytest.mark.parametrize("rows", [1_000, 200_000])  # stored plain / zstd-compressed
def test_a_slice_of_a_batch_table_stores_the_bytes_of_the_same_table_alone(rows):
    """A node's output is a slice of its batch's table when stored, and a table of its
    own when reproduced: both must encode to the same bytes (and digest)."""
    import numpy as np

    rng = np.random.default_rng(0)
    values = {f"c{i}": rng.standard_normal(500_000) for i in range(4)}  # a big batch
    values["c0"][::7] = np.nan
    batch = pa.table(values)
    alone = pa.table({k: v[1000 : 1000 + rows].copy() for k, v in values.items()})
    sliced = batch.slice(1000, rows)
    assert storage.arrow_bytes(sliced) == storage.arrow_bytes(alone)
    compressed = rows * 4 >= storage.COMPRESS_FROM_CELLS
    assert (len(storage.arrow_bytes(alone)) < alone.nbytes) == compressed
    back = storage.decode_table(storage.arrow_bytes(sliced))  # NaN != NaN: compare bytes
    assert back.num_rows == rows and storage.arrow_bytes(back) == storage.arrow_bytes(alone)
