"""The features stage: one node per (product, date), run on the site's Dask cluster.

Prefect sees shards (a task per chunk of up to `shard_size` nodes); Dask sees
batches of nodes; every node keeps its own key, output and manifest row.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import json
import time
import uuid
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor

import pyarrow as pa
import pyarrow.compute as pc
from prefect import flow, get_run_logger, task
from prefect.artifacts import create_progress_artifact, update_progress_artifact
from prefect.cache_policies import NO_CACHE
from prefect.runtime import flow_run
from prefect.utilities.annotations import quote

from quantloop.tasks import progress, storage, tracking
from quantloop.tasks.engine import MANIFEST_SCHEMA, NodeKind, NodeStore, RunResult, run_nodes
from quantloop.tasks.planning import (
    feature_kind,
    param_digests,
    plan_feature_table,
    product_params,
    shards,
)
from quantloop.tasks.stage import StageParams
from quantloop.tasks.summary import csv_bytes, failures, node_summary
from quantloop.tasks.workspace import Workspace

PROGRESS_EVERY_S = 5.0


class NodeFailures(RuntimeError):
    """Some nodes failed; their partitions and errors are listed, the rest are cached."""


@task(name="feature-shard", cache_policy=NO_CACHE)
def feature_shard(
    kind: NodeKind,
    params: Mapping[str, dict],
    nodes: pa.Table,  # a plan (NODES_SCHEMA)
    store_root: str,
    site: str,
    client: object | None,
    shard: str,
    index: pa.Table | None = None,
) -> RunResult:
    # Progress the researcher sees in the Prefect UI; each update is an API call that
    # costs the server CPU, so a shard sends one every few seconds. The artifact is
    # made at the first report, which comes once the shard's first batches are
    # submitted: the workers start while this call goes to the server.
    artifact: list = []
    last = [0.0]

    def report(done: int, total: int) -> None:
        progress.report(f"features {shard}", done, total)
        now = time.monotonic()
        percent = 100.0 * done / max(total, 1)
        if not artifact:
            artifact.append(
                create_progress_artifact(percent, description=f"feature nodes of shard {shard}")
            )
            last[0] = now
        elif done == total or now - last[0] >= PROGRESS_EVERY_S:
            last[0] = now
            update_progress_artifact(artifact[0], percent)

    result = run_nodes(
        kind,
        params,
        nodes,
        NodeStore(store_root),
        client=client,
        site=site,
        progress=report,
        index=index,
    )
    get_run_logger().info(
        "shard %s: %d nodes, %d cache hits, %d computed, %d failed in %.2f s",
        shard,
        result.nodes,
        result.cache_hits,
        result.computed,
        result.failed,
        result.wall_s,
    )
    return result


def why_recomputed(manifest: pa.Table) -> dict[str, int]:
    """Counts of computed nodes by the part of their key that changed (new, code, params, ...)."""
    ran = manifest["reason"].filter(pc.invert(manifest["cache_hit"]))  # one column, not all
    counts = pc.value_counts(ran).to_pylist() if len(ran) else []
    return {c["values"]: c["counts"] for c in counts}


def all_cached(nodes: pa.Table, index: pa.Table) -> bool:
    """Whether every node of a plan table is in the index."""
    if nodes.num_rows == 0:
        return True
    return bool(pc.all(pc.is_in(nodes["key"], value_set=index["key"].combine_chunks())).as_py())


def save_params(root: str, by_digest: Mapping[str, dict]) -> None:
    """Parameters by digest, so a node's lineage can show the values behind its hash."""
    for digest, values in by_digest.items():
        url = storage.join(root, "params", f"{digest}.json")
        if not storage.exists(url):
            storage.write_bytes_atomic(url, json.dumps(values, sort_keys=True).encode())


def manifest_url(root: str, kind: str) -> str:
    """Where this run's node records go, beside the outputs: what `quantloop nodes`
    queries (one Parquet file per run)."""
    run_id = flow_run.id or uuid.uuid4().hex
    stamp = dt.datetime.now(dt.UTC).strftime("%Y%m%dT%H%M%S")
    return storage.join(root, "manifests", kind, f"{stamp}-{run_id}.parquet")


@flow(name="features")
def features(
    stage: StageParams = StageParams(),
    shard_size: int = 50_000,
    parent_run_id: str | None = None,
) -> RunResult:
    """Compute, or find in the cache, the feature node of every selected partition.

    With `parent_run_id`, records a "features" MLflow child run: counts, throughput,
    the hashes, and the node manifest as a Parquet artifact.

    Args:
        stage: The workspace, the partitions (products x dates of a landed dataset) and
            the feature parameters.
        shard_size: Feature nodes per Prefect task (>= 1): the UI shows one task per
            shard, never one per node.
        parent_run_id: An MLflow run to record under as a child run "features"; empty:
            nothing is recorded.
    """
    t0 = time.perf_counter()
    logger = get_run_logger()
    workspace = stage.workspace
    entries = stage.selection.table(workspace.catalog())  # columns: no object per partition
    kind = feature_kind()
    per_product = product_params(
        stage.features, stage.product_features, pc.unique(entries["product"]).to_pylist()
    )
    site = workspace.resolve_site()
    logger.info("%d feature nodes on site %s (%s)", entries.num_rows, site.name, site.root)
    _, by_digest = param_digests(per_product)
    save_params(site.root, by_digest)
    store = NodeStore(site.root)
    index = store.index(kind.name)  # one read for every shard of the run
    with contextlib.ExitStack() as stack:
        client = None
        futures = []
        # Shards are planned and submitted one after the other, so the workers start
        # on the first while the rest are planned; they run side by side, so the
        # cluster sees every batch at once and no worker idles at a shard's tail.
        for i, shard_entries in enumerate(shards(entries, shard_size)):
            nodes, _ = plan_feature_table(shard_entries, per_product, kind)
            if client is None and not all_cached(nodes, index):
                # The cluster is started (or connected to) only if a node must run.
                client = stack.enter_context(site.client())
            futures.append(
                # quote(): Prefect would otherwise walk every node of the shard to find
                # task dependencies (seconds per 10,000 nodes).
                feature_shard.submit(
                    quote(kind), quote(by_digest), quote(nodes), site.root, site.name,
                    quote(client), f"{site.name}-{i}", quote(index),
                )
            )  # fmt: skip
        results = [f.result() for f in futures]
    store.compact(kind.name, min_segments=256)
    manifest = (
        pa.concat_tables([r.manifest for r in results])
        if results
        else MANIFEST_SCHEMA.empty_table()
    )
    result = RunResult(
        manifest=manifest,
        nodes=sum(r.nodes for r in results),
        cache_hits=sum(r.cache_hits for r in results),
        computed=sum(r.computed for r in results),
        failed=sum(r.failed for r in results),
        wall_s=time.perf_counter() - t0,  # planning included; shards overlap
        batch_size=max((r.batch_size for r in results), default=0),
        batches=sum(r.batches for r in results),
    )
    reasons = why_recomputed(manifest)
    line = (
        f"{result.nodes:,} nodes: {result.cache_hits:,} cache hits, {result.computed:,} "
        f"computed, {result.failed:,} failed in {result.wall_s:.1f} s"
    )
    if reasons:  # the part of each recomputed node's key that changed (new: none before)
        line += " (why: " + ", ".join(f"{k} {v:,}" for k, v in reasons.items()) + ")"
    logger.info("features: %s", line)
    progress.note("features", line)
    url = manifest_url(site.root, kind.name)
    with ThreadPoolExecutor(max_workers=2) as pool:
        # The manifest is encoded once (for its file and MLflow's artifact) while the
        # MLflow run is made: Parquet encoding releases the GIL, MLflow calls wait on I/O.
        encoded = pool.submit(storage.parquet_bytes, manifest)
        written = pool.submit(lambda: storage.write_bytes_atomic(url, encoded.result()))
        if parent_run_id is not None:
            run_id = record(
                workspace, parent_run_id, kind, by_digest, site.name, result, encoded.result
            )
            result = dataclasses.replace(result, mlflow_run_id=run_id)
        written.result()
    logger.info("node manifest: %s", url)
    if result.failed:
        lines = "\n  ".join(result.failures[:20])
        raise NodeFailures(
            f"{result.failed} of {result.nodes} feature nodes failed "
            f"(the other {result.nodes - result.failed} are stored and cached):\n  {lines}"
        )
    return result


def record(
    workspace: Workspace,
    parent_run_id: str,
    kind: NodeKind,
    params: Mapping[str, dict],
    site: str,
    result: RunResult,
    manifest_bytes: Callable[[], bytes],
) -> str:
    """One MLflow child run for the stage: summary metrics and the manifest, no per-node call."""
    m = result.manifest
    compute_s = pc.sum(m["duration_s"].filter(pc.invert(m["cache_hit"]))).as_py() or 0.0
    client, experiment = tracking.client_for(workspace.resolve_tracking())
    with tracking.run(client, experiment, "features", parent=parent_run_id) as run:
        run.params({"node_kind": kind.name, "code_fingerprint": kind.code, "site": site})
        run.params({"params_hashes": ",".join(sorted(params))})
        run.tags({"site": site})
        run.metrics(
            {
                "nodes": result.nodes,
                "cache_hits": result.cache_hits,
                "computed": result.computed,
                "failed": result.failed,
                "wall_s": result.wall_s,
                "nodes_per_s": result.nodes / result.wall_s if result.wall_s else 0.0,
                "node_compute_s": compute_s,
                "output_rows": pc.sum(m["rows"]).as_py() or 0,
                "output_bytes": pc.sum(m["output_length"]).as_py() or 0,
                **{f"recomputed.{k}": v for k, v in why_recomputed(m).items()},
            }
        )
        run.file(manifest_bytes(), "features_manifest.parquet", "manifest")
        # What the UI can show of the nodes: per product, and every failure.
        run.file(csv_bytes(node_summary(m)), "nodes_by_product.csv", "manifest")
        if result.failed:
            run.file(csv_bytes(failures(m)), "failed_nodes.csv", "manifest")
        return run.run_id
