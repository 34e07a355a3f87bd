"""The backtest flow: a registered model over many products x days, as keyed nodes.

Bulk inference on idle capacity: it runs from the `batch` work queue, which a pool's
worker serves only when no research run is waiting (infra/prefect.yaml). The model is
a version of the Model Registry (a number or an alias); its recipe gives the feature
parameters it was trained on, so the features stage computes (or finds) exactly the
features it reads. Then one backtest node per (product, day) runs on the site's Dask
cluster (tasks/research/backtest.py): predictions, the day's trades and their mark-out, stored
under the node's key, which carries the model's weights digest: a re-run is all cache
hits, a new version recomputes. Prefect sees one task per shard, never one per node.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import math
import time
from dataclasses import asdict, dataclass, field

import pyarrow as pa
import pyarrow.compute as pc
from prefect import flow, get_run_logger, task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE
from prefect.utilities.annotations import quote
from pydantic import BaseModel, Field

from quantloop.blocks.site import Site
from quantloop.flows.features import SiteClient, manifest_url
from quantloop.flows.features import features as features_flow
from quantloop.tasks.engine import (
    NodeKind,
    NodeStore,
    RunRecords,
    RunSummary,
    plan_nodes,
    run_nodes,
    sha256_json,
    storage,
)
from quantloop.tasks.records import promotion, tracking
from quantloop.tasks.records.recipe import Recipe, read_recipe
from quantloop.tasks.research.backtest import backtest_kind, node_params
from quantloop.tasks.research.form import SimForm
from quantloop.tasks.research.planning import shards
from quantloop.tasks.research.simulation import SimConfig
from quantloop.tasks.research.sited import SiteOutputs
from quantloop.tasks.research.stage import StageParams, plan_features
from quantloop.tasks.runtime import progress
from quantloop.tasks.runtime.workspace import Selection, Workspace


class BacktestFailed(RuntimeError):
    """Some backtest nodes failed; the others are stored and cached."""


@dataclass
class Marks:
    """Mark-out sums of some trades, by horizon: enough for the mean, its standard
    error and the hit rate, added shard by shard without holding any trade."""

    trades: int = 0
    n: dict[str, int] = field(default_factory=dict)
    total: dict[str, float] = field(default_factory=dict)
    squares: dict[str, float] = field(default_factory=dict)
    hits: dict[str, int] = field(default_factory=dict)

    def add_table(self, table: pa.Table, horizons: list[str]) -> None:
        self.trades += table.num_rows
        for h in horizons:
            v = table[f"markout_{h}"].to_numpy(zero_copy_only=False)
            v = v[~(v != v)]  # finite: NaN past the day's end
            self.n[h] = self.n.get(h, 0) + len(v)
            self.total[h] = self.total.get(h, 0.0) + float(v.sum())
            self.squares[h] = self.squares.get(h, 0.0) + float((v * v).sum())
            self.hits[h] = self.hits.get(h, 0) + int((v > 0).sum())

    def add(self, other: Marks) -> None:
        self.trades += other.trades
        for mine, theirs in ((self.n, other.n), (self.total, other.total),
                             (self.squares, other.squares), (self.hits, other.hits)):  # fmt: skip
            for h, v in theirs.items():
                mine[h] = mine.get(h, 0) + v

    def figures(self) -> dict:
        """{trades, mean_bps, se_bps, hit_rate}: what simulation.summarize() reports."""
        mean, se, hit = {}, {}, {}
        for h, n in self.n.items():
            m = self.total[h] / n if n else math.nan
            var = (self.squares[h] - n * m * m) / (n - 1) if n > 1 else math.nan
            mean[h], hit[h] = m, self.hits[h] / n if n else math.nan
            se[h] = math.sqrt(max(var, 0.0) / n) if n > 1 else math.nan
        return {"trades": self.trades, "mean_bps": mean, "se_bps": se, "hit_rate": hit}


class BacktestSummary(BaseModel):
    model: str
    version: str
    model_digest: str
    device: str
    nodes: int
    cache_hits: int
    computed: int
    failed: int
    wall_s: float
    products: dict[str, dict] = Field(default_factory=dict)  # Marks.figures() per product
    total: dict = Field(default_factory=dict)
    manifest_url: str | None = None
    mlflow_run_id: str | None = None


@task(name="backtest-shard", cache_policy=NO_CACHE)
def backtest_shard(
    kind: NodeKind,
    params: dict[str, dict],
    params_of: dict[str, str],
    inputs: pa.Table,  # the shard's feature outputs (plan_nodes' INPUT_COLUMNS)
    store_root: str,
    site: str,
    connect: SiteClient,
    shard: int,
    records: RunRecords,
    horizons: list[str],
) -> tuple[RunSummary, dict[str, Marks]]:
    nodes = plan_nodes(kind, inputs, params_of)
    report = lambda done, total: progress.report(f"backtest {site}-{shard}", done, total)  # noqa: E731
    result = run_nodes(kind, params, nodes, NodeStore(store_root), connect=connect, site=site,
                       progress=report, priority=-shard)  # fmt: skip
    records.write(shard, result.manifest)
    # Each node's stored output (hits too): its trades' mark-out sums, per product.
    marks: dict[str, Marks] = {}
    reader = storage.BlobReader()
    ok = result.manifest.filter(pc.equal(result.manifest["status"], "ok"))
    for row in ok.select(["product", "output_url", "output_offset", "output_length",
                          "output_digest"]).to_pylist():  # fmt: skip
        blob = storage.Blob(row["output_url"], row["output_offset"], row["output_length"],
                            row["output_digest"])  # fmt: skip
        marks.setdefault(row["product"], Marks()).add_table(reader.table(blob), horizons)
    get_run_logger().info(
        "shard %s-%d: %d nodes, %d cache hits, %d computed, %d failed in %.2f s",
        site, shard, result.nodes, result.cache_hits, result.computed, result.failed,
        result.wall_s,
    )  # fmt: skip
    return result.summary(), marks


def resolve_backtest_device(device: str, site: Site) -> str:
    """'auto': a GPU when the site has one (a cluster's `gpus`, or this host's CUDA for
    the embedded LocalCluster), else the CPU."""
    if device != "auto":
        return device
    if site.scheduler_address:
        return "cuda" if site.gpus > 0 else "cpu"
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def feature_inputs(stage: StageParams) -> pa.Table:
    """The selection's feature outputs as a backtest plan's inputs: a feature node's
    output is a backtest node's input (its digest is the input digest of the key)."""
    plan = plan_features(stage)
    found = NodeStore(stage.workspace.resolve_site().root).lookup(plan.kind.name, plan.nodes)
    missing = pc.sum(pc.is_null(found["key"])).as_py() or 0
    if missing:
        raise LookupError(f"{missing} of {plan.nodes.num_rows} feature outputs are missing "
                          "after the features stage")  # fmt: skip
    return pa.table({
        "product": plan.nodes["product"], "date": plan.nodes["date"],
        "digest": found["output_digest"], "location": found["output_url"],
        "offset": found["output_offset"], "length": found["output_length"],
    })  # fmt: skip


def backtest_stage(
    recipe: Recipe,
    workspace: Workspace,
    products: list[str] | None = None,
    start: dt.date | None = None,
    end: dt.date | None = None,
) -> StageParams:
    """The model's features on the model's dataset: `products` (default: the model's)
    from `start` to `end` (default: every landed day)."""
    selection = Selection(dataset=recipe.dataset, products=products or recipe.products or None,
                          start=start, end=end)  # fmt: skip
    return StageParams.model_validate({
        "workspace": workspace, "selection": selection, "features": recipe.features,
        "product_features": recipe.product_features,
        "validation": recipe.validation,
    })  # fmt: skip


@flow(name="backtest")
def backtest(
    model: str | None = None,
    version: str = "champion",
    products: list[str] | None = None,
    start: dt.date | None = None,
    end: dt.date | None = None,
    workspace: Workspace = Workspace(),
    config: SimForm = SimConfig(),
    device: str = "auto",
    shard_size: int = 10_000,
) -> BacktestSummary:
    """Run a registered model over every selected (product, day): predictions, trades and
    mark-out per day as cached nodes; a summary in MLflow and in a Prefect artifact.

    Args:
        model: The registered model's name. None: the tracking block's.
        version: A version number ("3") or an alias ("champion").
        products: The products to run over, of the model's dataset. None: the model's.
        start: The first day. None: the first landed.
        end: The last day (included). None: the last landed.
        workspace: Where the data, node outputs and records live.
        config: Mark-out horizons and the trading rule; each day trades its top
            (1 - trade_quantile) of |prediction|.
        device: auto (a GPU when the site has one), cpu or cuda.
        shard_size: Backtest nodes per Prefect task.
    """
    t0 = time.perf_counter()
    logger = get_run_logger()
    if device not in ("auto", "cpu", "cuda") and not device.startswith("cuda:"):
        raise ValueError(f"device must be auto, cpu, cuda or cuda:N, got {device!r}")
    if shard_size < 1:
        raise ValueError(f"shard_size must be >= 1, got {shard_size}")
    if start is not None and end is not None and start > end:
        raise ValueError(f"start {start} is after end {end}")
    tracking_block = workspace.resolve_tracking()
    client, experiment = tracking.client_for(tracking_block)
    name = model or tracking_block.registered_model
    # The guarded model's versions (and the champion) only with a passing promotion
    # record (tasks/records/promotion.py); a candidate by its number in its own model.
    mv = promotion.resolve_for_use(client, name, version, guarded=tracking_block.registered_model)
    recipe = read_recipe(client, mv, workspace.catalog())
    site = workspace.resolve_site()
    # The model where it is stored (the site that trained it), copied here if it is only
    # at another of the workspace's sites.
    sited = SiteOutputs(workspace)
    held = sited.find("model", recipe.model_key, ".pt")
    if not held:
        raise LookupError(
            f"{name} version {mv.version}: its model {recipe.model_key[:12]} is at none of "
            f"the workspace's sites ({', '.join(s.root for s in sited.sites)}); backtest on "
            "a workspace with the site that trained it"
        )
    model_url, _ = sited.bring("model", held[0].url, site, lambda fn, *args: fn(*args))
    run_device = resolve_backtest_device(device, site)
    stage = backtest_stage(recipe, workspace, products, start, end)
    logger.info("backtest of %s version %s (weights %s) on %s", name, mv.version,
                recipe.model_digest[:12], run_device)  # fmt: skip
    with tracking.run(client, experiment, "backtest", tags={
        "registered_model": name, "model_version": mv.version,
        "model_digest": recipe.model_digest, "model_key": recipe.model_key, "site": site.name,
        "device": run_device, tracking.STORE_TAG: site.root,
    }) as run:  # fmt: skip
        feats = features_flow(stage, parent_run_id=run.run_id)
        inputs = feature_inputs(stage)
        kind = backtest_kind(model_url)
        values = node_params(recipe.model_key, recipe.model_digest, run_device, config)
        digest = sha256_json(values)
        planned = pc.unique(inputs["product"]).to_pylist()  # every product: one params set
        horizons = config.horizon_keys()
        records = RunRecords(manifest_url(site.root, kind.name))
        summary, marks = RunSummary(), {}
        with contextlib.ExitStack() as stack:
            connect = SiteClient(site, stack)
            for i, part in enumerate(shards(inputs, shard_size)):
                # quote(): Prefect would otherwise walk every argument for task inputs
                shard_summary, shard_marks = backtest_shard.submit(
                    quote(kind), {digest: values}, dict.fromkeys(planned, digest), quote(part),
                    site.root, site.name, quote(connect), i, quote(records), horizons,
                ).result()  # fmt: skip
                summary.add(shard_summary)
                for product, m in shard_marks.items():
                    marks.setdefault(product, Marks()).add(m)
        NodeStore(site.root).compact(kind.name)
        summary.wall_s = time.perf_counter() - t0
        total = Marks()
        for m in marks.values():
            total.add(m)
        result = BacktestSummary(
            model=name, version=str(mv.version), model_digest=recipe.model_digest,
            device=run_device, nodes=summary.nodes, cache_hits=summary.cache_hits,
            computed=summary.computed, failed=summary.failed, wall_s=summary.wall_s,
            products={p: m.figures() for p, m in sorted(marks.items())},
            total=total.figures(), manifest_url=records.url, mlflow_run_id=run.run_id,
        )  # fmt: skip
        record(run, result, recipe, config, feats, records)
    records.close(summary)
    line = (f"{result.nodes:,} backtest nodes: {result.cache_hits:,} cache hits, "
            f"{result.computed:,} computed, {result.failed:,} failed in {result.wall_s:.1f} s; "
            f"{total.trades:,} trades")  # fmt: skip
    logger.info("%s", line)
    progress.note("backtest", line)
    links = tracking_block.run_url(experiment, run.run_id)
    create_markdown_artifact(markdown=summary_markdown(result, horizons, links),
                             key="backtest-summary",
                             description=f"Backtest of {name} version {mv.version}")  # fmt: skip
    if summary.failed:
        raise BacktestFailed(
            f"{summary.failed} of {summary.nodes} backtest nodes failed (the others are "
            "stored and cached):\n  " + "\n  ".join(summary.failures)
        )
    return result


def record(run: tracking.RunLog, result: BacktestSummary, recipe: Recipe, config: SimConfig,
           feats: RunSummary, records: RunRecords) -> None:  # fmt: skip
    """The backtest's MLflow run: parameters, counts and mark-out per product and horizon
    in batches (a few calls, never one per node or value), the manifest's parts."""
    run.params({"model": result.model, "version": result.version, "device": result.device,
                "recipe_run_id": recipe.source_run_id,
                **{f"sim.{k}": v for k, v in asdict(config).items()}})  # fmt: skip
    run.metrics({"nodes": result.nodes, "cache_hits": result.cache_hits,
                 "computed": result.computed, "failed": result.failed, "wall_s": result.wall_s,
                 "feature_nodes": feats.nodes, "feature_cache_hits": feats.cache_hits})  # fmt: skip
    for product, figures in {**result.products, "total": result.total}.items():
        run.metrics({f"{product}.trades": figures["trades"]})
        for what, name in (
            ("mean_bps", "markout_bps"),
            ("se_bps", "markout_se_bps"),
            ("hit_rate", "hit_rate"),
        ):
            run.metrics({f"{product}.{name}.{h}": v for h, v in figures[what].items()
                         if not math.isnan(v)})  # fmt: skip
    run.tags({tracking.MANIFEST_TAG: records.url})
    run.flush()
    for url in records.parts():
        if "://" in url:
            run.file(storage.read_bytes(url), url.rsplit("/", 1)[-1], "manifest/backtest_manifest")
        else:
            run.artifact(url, "manifest/backtest_manifest")
    run.json(result.model_dump(mode="json"), "backtest_summary.json", "summary")


def summary_markdown(result: BacktestSummary, horizons: list[str], link: str | None) -> str:
    def row(label: str, f: dict) -> str:
        cells = [f"{f['mean_bps'].get(h, math.nan):+.2f}" for h in horizons]
        return f"| {label} | {f['trades']:,} | " + " | ".join(cells) + " |"

    return "\n".join([
        f"# Backtest of `{result.model}` version {result.version}",
        "",
        f"{result.nodes:,} product-days ({result.cache_hits:,} cache hits, {result.computed:,} "
        f"computed, {result.failed:,} failed) on {result.device} in {result.wall_s:.1f} s; "
        f"weights `{result.model_digest[:16]}`.",
        "",
        "## Mark-out (bps)",
        "| product | trades | " + " | ".join(horizons) + " |",
        "|---|---:|" + "---:|" * len(horizons),
        *(row(p, f) for p, f in result.products.items()),
        row("**total**", result.total),
        "",
        f"MLflow run: [{result.mlflow_run_id}]({link})" if link else
        f"MLflow run: `{result.mlflow_run_id}`",
        f"Node manifest: `{result.manifest_url}`",
    ])  # fmt: skip
