"""The features stage: one node per (product, date), run on the site's Dask cluster.

Prefect sees shards (a task per chunk of up to `shard_size` nodes); Dask sees
batches of nodes; every node keeps its own key, output and manifest row. A shard
plans its nodes, looks them up, runs them and writes its part of the run's
manifest; the flow holds a few shards at a time, never the whole run.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import os
import time
import uuid
from collections import deque
from collections.abc import Mapping
from dataclasses import asdict

import pyarrow as pa
import pyarrow.compute as pc
from prefect import flow, get_run_logger, task
from prefect.artifacts import create_progress_artifact, update_progress_artifact
from prefect.cache_policies import NO_CACHE
from prefect.runtime import flow_run
from prefect.utilities.annotations import quote

from quantloop.tasks.engine import (
    NoCopyReachable,
    NodeKind,
    NodeStore,
    NoWorkers,
    Policy,
    RunRecords,
    RunSummary,
    plan_nodes,
    run_nodes,
    storage,
)
from quantloop.tasks.records import tracking
from quantloop.tasks.records.summary import NODE_COLUMNS, csv_bytes, node_summary
from quantloop.tasks.research.planning import feature_kind, param_digests, product_params, shards
from quantloop.tasks.research.stage import StageParams
from quantloop.tasks.runtime import progress
from quantloop.tasks.runtime.sites import SiteClient, SiteCounts, place_selection, unreachable
from quantloop.tasks.runtime.workspace import Workspace

PROGRESS_EVERY_S = 5.0
# Shards planned and running at once: the next shard's batches (a lower Dask priority)
# wait while one runs and fill its tail, so no worker idles there, and the driver
# holds two shards' plans, index rows and manifest rows, never the run's (10^6 rows
# of each are ~0.3-0.6 GB).
SHARDS_IN_FLIGHT = 2
# Nodes expected to take less than this in all run in the flow's process when the site
# would start a LocalCluster for them: its start and stop took 2.7 s of a run that
# changed one product's features (1-4 nodes of ~0.2-2.5 s) on this 2-core machine.
# QUANTLOOP_INLINE_BELOW_S sets another bound; 0 always starts the cluster.
INLINE_BELOW_S = 2.5
# A kind's first nodes (no history) are expected to take this per MB of stored input:
# synthetic books of 2-10 levels computed at ~0.1 s per MB here (0.13 s for a 1.4 MB
# day); five times that, so that only clearly small first runs (a tiny data set's 0.5 MB:
# 0.05 s of nodes) skip the cluster, and the default research run's 6.6 MB does not.
UNKNOWN_S_PER_MB = 0.5


def inline_below_s() -> float:
    """INLINE_BELOW_S, or QUANTLOOP_INLINE_BELOW_S where it is set."""
    value = os.environ.get("QUANTLOOP_INLINE_BELOW_S", "").strip()
    return float(value) if value else INLINE_BELOW_S


class NodeFailures(RuntimeError):
    """Some nodes failed; their partitions and errors are listed, the rest are cached."""


@task(name="feature-shard", cache_policy=NO_CACHE)
def feature_shard(
    kind: NodeKind,
    params: Mapping[str, dict],  # canonical parameters by digest
    params_of: Mapping[str, str],  # parameters digest by product
    entries: pa.Table,  # the shard's rows of the catalog table
    store_root: str,
    site: str,
    connect: SiteClient,
    shard: int,
    records: RunRecords,
    verify_hits: bool = True,
) -> RunSummary:
    # Progress the researcher sees in the Prefect UI; each update is an API call that
    # costs the server CPU, so a shard sends one every few seconds. The artifact is
    # made at the first report, which comes once the shard's first batches are
    # submitted: the workers start while this call goes to the server.
    artifact: list = []
    last = [0.0]
    name = f"{site}-{shard}"

    def report(done: int, total: int) -> None:
        progress.report(f"features {name}", done, total)
        now = time.monotonic()
        percent = 100.0 * done / max(total, 1)
        if not artifact:
            artifact.append(
                create_progress_artifact(percent, description=f"feature nodes of shard {name}")
            )
            last[0] = now
        elif done == total or now - last[0] >= PROGRESS_EVERY_S:
            last[0] = now
            update_progress_artifact(artifact[0], percent)

    # Planned here, not in the flow: a task's arguments stay referenced until the
    # flow ends, and a slice of the catalog table costs nothing to hold.
    nodes = plan_nodes(kind, entries, params_of)
    if "input_site" in entries.column_names:  # placed: where each input copy is read from
        nodes = nodes.append_column("input_site", entries["input_site"])
    store = NodeStore(store_root)
    inline_s = inline_below_s() if connect.starts_cluster else 0.0
    t0 = time.perf_counter()
    try:
        result = run_nodes(kind, params, nodes, store, connect=connect, site=site,
                           progress=report, priority=-shard, verify_hits=verify_hits,
                           inline_below_s=inline_s, unknown_s_per_mb=UNKNOWN_S_PER_MB,
                           no_workers_timeout_s=connect.no_workers_timeout_s)  # fmt: skip
    except NoWorkers as exc:
        # The site lost its workers: what finished is recorded as this shard's part; the
        # flow fails naming the site, or places the rest (exc.pending, now catalog rows)
        # elsewhere. Nodes of the same key (identical inputs) share that key's fate.
        done = exc.finished
        if done.num_rows:
            records.write(shard, done)
        hits = pc.sum(done["cache_hit"]).as_py() or 0
        failed = pc.sum(pc.equal(done["status"], "failed")).as_py() or 0
        exc.summary = RunSummary.of(done, nodes=done.num_rows, cache_hits=hits,
                                    computed=done.num_rows - hits - failed, failed=failed,
                                    wall_s=time.perf_counter() - t0)  # fmt: skip
        exc.pending = entries.filter(pc.is_in(nodes["key"], value_set=exc.pending["key"]))
        raise
    records.write(shard, result.manifest)
    get_run_logger().info(
        "shard %s: %d nodes, %d cache hits, %d computed, %d failed in %.2f s",
        name,
        result.nodes,
        result.cache_hits,
        result.computed,
        result.failed,
        result.wall_s,
    )
    return result.summary()


def save_params(root: str, by_digest: Mapping[str, dict]) -> None:
    """Parameters by digest, so a node's lineage can show the values behind its hash."""
    for digest, values in by_digest.items():
        url = storage.join(root, "params", f"{digest}.json")
        if not storage.exists(url):
            storage.write_bytes_atomic(url, json.dumps(values, sort_keys=True).encode())


def manifest_url(root: str, kind: str) -> str:
    """Where this run's node records go, beside the outputs: what `quantloop nodes`
    queries (a folder per run, a Parquet file per shard). Its name starts with a UTC stamp
    to the microsecond: `recorded_runs` orders runs by name, and two runs of one second
    were ordered by their random ids (a failed run then read as older than the one
    before it). Names of whole seconds (before) sort first within their second."""
    run_id = flow_run.id or uuid.uuid4().hex
    stamp = dt.datetime.now(dt.UTC).strftime("%Y%m%dT%H%M%S.%f")
    return storage.join(root, "manifests", kind, f"{stamp}-{run_id}")


@flow(name="features")
def features(
    stage: StageParams = StageParams(),
    shard_size: int = 50_000,
    parent_run_id: str | None = None,
    verify_hits: bool = True,
) -> RunSummary:
    """Compute, or find in the cache, the feature node of every selected partition.

    With `parent_run_id`, records a "features" MLflow child run: counts, throughput,
    the hashes, and the node manifest (a Parquet file per shard) as artifacts, with a
    per-product summary and the failures as CSV tables the MLflow UI shows.

    Args:
        stage: The workspace, the partitions (products x dates of a landed dataset) and
            the feature parameters.
        shard_size: Feature nodes per Prefect task (>= 1): the UI shows one task per
            shard, never one per node.
        parent_run_id: An MLflow run to record under as a child run "features"; empty:
            nothing is recorded.
        verify_hits: Read every cached output and check its length and sha256 before
            counting it a hit (on by default; bench/cache_check.py measures the cost); a
            damaged one is recomputed, reason "corrupt" or "missing". Off: a hit is
            trusted unread.
    """
    t0 = time.perf_counter()
    logger = get_run_logger()
    workspace = stage.workspace
    # Columns, memory-mapped: no object per partition, and shards slice it for free.
    entries = stage.selection.table(workspace.catalog())
    kind = feature_kind()
    per_product = product_params(
        stage.features, stage.product_features, pc.unique(entries["product"]).to_pylist()
    )
    sites = workspace.resolve_sites()
    site = sites[0]  # the default: the run's records and parameters live there
    if len(sites) > 1:  # `verify` and `nodes --lineage` find every site's store from these
        workspace.catalog().note_sites((s.name, s.root) for s in sites)
    by_name = {s.name: s for s in sites}
    policy = Policy.parse(workspace.placement, list(by_name))
    params_of, by_digest = param_digests(per_product)
    records = RunRecords(manifest_url(site.root, kind.name))
    summary = RunSummary()
    counts = {s.name: SiteCounts() for s in sites}
    with contextlib.ExitStack() as stack:
        clients = {s.name: SiteClient(s, stack) for s in sites}
        down = unreachable(sites, clients) if workspace.on_unreachable == "replica" else []
        for name in down:
            logger.warning("site %s: its scheduler is unreachable; its nodes are re-placed "
                           "at sites holding copies of their inputs", name)  # fmt: skip
        placed = place_selection(entries, workspace.catalog(), stage.selection.dataset,
                                 sites, policy, down=down)  # fmt: skip
        groups = [(s, placed.filter(pc.equal(placed["site"], s.name))) for s in sites]
        groups = [(s, rows) for s, rows in groups if rows.num_rows]
        logger.info("%d feature nodes, placement %s: %s", entries.num_rows, policy,
                    ", ".join(f"{rows.num_rows} on site {s.name} ({s.root})"
                              for s, rows in groups))  # fmt: skip
        for root in dict.fromkeys([site.root, *(s.root for s, _ in groups)]):
            save_params(root, by_digest)
        # Shards of every site, taken in turn, run side by side: each site's client gets
        # its own shards while the others work on theirs.
        queue = deque(sorted(((s, i, part) for s, rows in groups
                              for i, part in enumerate(shards(rows, shard_size))),
                             key=lambda item: item[1]))  # fmt: skip
        running: deque = deque()
        in_flight = SHARDS_IN_FLIGHT * max(1, len(groups))
        number = 0
        down = set(down)

        def replace(rows: pa.Table) -> list:
            """Shards of `rows` placed again, without the sites that are down."""
            if len(sites) == 1:
                raise NoCopyReachable(f"site {sites[0].name!r} is the workspace's only site")
            again = place_selection(rows.drop_columns(["site", "input_site"]),
                                    workspace.catalog(), stage.selection.dataset, sites, policy,
                                    down=down)  # fmt: skip
            placed_again = []
            for s in sites:
                mine = again.filter(pc.equal(again["site"], s.name))
                if mine.num_rows:
                    save_params(s.root, by_digest)
                    placed_again += [(s, i, p) for i, p in enumerate(shards(mine, shard_size))]
            return placed_again

        def collect() -> None:
            s, shard = running.popleft()
            try:
                result = shard.result()
            except NoWorkers as exc:
                if workspace.on_unreachable != "replica":
                    raise
                result = exc.summary
                down.add(s.name)
                logger.warning("%s; its %d nodes not run are placed again at sites holding "
                               "copies of their inputs", exc, exc.pending.num_rows)  # fmt: skip
                try:
                    queue.extendleft(reversed(replace(exc.pending)))
                except NoCopyReachable as none:
                    raise NoCopyReachable(f"{exc}: {none}") from exc
            summary.add(result)
            counts[s.name].add(result.nodes, result.computed, result.compute_s,
                               result.bytes_across, s.cost_per_hour)  # fmt: skip

        while queue or running:
            while queue and len(running) < in_flight:
                s, _, shard_entries = queue.popleft()
                if s.name in down:  # lost its workers since it was placed
                    queue.extendleft(reversed(replace(shard_entries)))
                    continue
                # quote(): Prefect would otherwise walk every argument looking for task
                # dependencies (seconds per 10,000 nodes).
                running.append((s, feature_shard.submit(
                    quote(kind), quote(by_digest), quote(params_of), quote(shard_entries),
                    s.root, s.name, quote(clients[s.name]), number, quote(records),
                    verify_hits,
                )))  # fmt: skip
                number += 1
            if running:
                collect()
    for s in sites:
        if counts[s.name].computed:
            NodeStore(s.root).compact(kind.name)
    summary.sites = {name: asdict(c) for name, c in counts.items() if c.nodes}
    summary.placement = str(policy)
    summary.wall_s = time.perf_counter() - t0  # planning included; shards overlap
    summary.manifest_url = records.url
    line = (
        f"{summary.nodes:,} nodes: {summary.cache_hits:,} cache hits, {summary.computed:,} "
        f"computed, {summary.failed:,} failed in {summary.wall_s:.1f} s"
    )
    if summary.reasons:  # the part of each recomputed node's key that changed (new: none before)
        line += " (why: " + ", ".join(f"{k} {v:,}" for k, v in summary.reasons.items()) + ")"
    logger.info("features: %s", line)
    progress.note("features", line)
    if parent_run_id is not None:
        summary.mlflow_run_id = record(
            workspace, parent_run_id, kind, by_digest, site.name, summary, records
        )
    records.close(summary)  # last: the run is recorded once every part is
    logger.info("node manifest: %s", records.url)
    if summary.failed:
        lines = "\n  ".join(summary.failures)
        more = summary.failed - len(summary.failures)
        raise NodeFailures(
            f"{summary.failed} of {summary.nodes} feature nodes failed "
            f"(the other {summary.nodes - summary.failed} are stored and cached):\n  {lines}"
            + (f"\n  ... and {more} more (quantloop nodes --status failed)" if more else "")
        )
    return summary


def record(
    workspace: Workspace,
    parent_run_id: str,
    kind: NodeKind,
    params: Mapping[str, dict],
    site: str,
    summary: RunSummary,
    records: RunRecords,
) -> str:
    """One MLflow child run for the stage: summary metrics and the manifest's parts as
    artifacts (copied one file at a time), no per-node call."""
    client, experiment = tracking.client_for(workspace.resolve_tracking())
    with tracking.run(client, experiment, "features", parent=parent_run_id) as run:
        run.params(
            {
                "node_kind": kind.name,
                "code_fingerprint": kind.code,
                "site": site,
                "placement": summary.placement,
                "sites": ",".join(summary.sites),
            }
        )
        run.params({"params_hashes": ",".join(sorted(params))})
        run.tags({"site": site, tracking.MANIFEST_TAG: records.url})
        run.metrics(
            {
                "nodes": summary.nodes,
                "cache_hits": summary.cache_hits,
                "computed": summary.computed,
                "failed": summary.failed,
                "wall_s": summary.wall_s,
                "nodes_per_s": summary.nodes / summary.wall_s if summary.wall_s else 0.0,
                "node_compute_s": summary.compute_s,
                "output_rows": summary.output_rows,
                "output_bytes": summary.output_bytes,
                **{f"recomputed.{k}": v for k, v in summary.reasons.items()},
                **placement_metrics(summary.sites),
            }
        )
        for url in records.parts():
            name = url.rsplit("/", 1)[-1]
            if "://" in url:  # on object storage: through this process, one part at a time
                run.file(storage.read_bytes(url), name, MANIFEST_ARTIFACTS)
            else:
                run.artifact(url, MANIFEST_ARTIFACTS)
        # What the UI can show of the nodes: per product, and every failure; read a
        # part at a time, as the manifest is written.
        by_product, failed = node_summary(
            storage.read_parquet(url, NODE_COLUMNS) for url in records.parts()
        )
        run.file(csv_bytes(by_product), "nodes_by_product.csv", "manifest")
        if failed.num_rows:
            run.file(csv_bytes(failed), "failed_nodes.csv", "manifest")
        return run.run_id


def placement_metrics(sites: dict[str, dict]) -> dict[str, float]:
    """What crossed sites and what each site's compute cost, as MLflow metrics (sites: a
    features run's per-site counts, or a research run's, which add train_s/simulate_s)."""
    metrics = {"bytes_across_sites": sum(c["bytes_across"] for c in sites.values()),
               "cost": sum(c["cost"] for c in sites.values())}  # fmt: skip
    for name, c in sites.items():
        for field, value in c.items():
            metrics[f"site.{name}.{field}"] = value
    return metrics


MANIFEST_ARTIFACTS = "manifest/features_manifest"  # the run's manifest parts in MLflow
