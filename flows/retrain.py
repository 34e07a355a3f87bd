"""The retrain flow: the champion's recipe on the newest landed data, as a new model
version. Never a promotion: the `champion` alias stays where it is (flows/promote.py
moves it, when a version passes its gates).

Run nightly from the `batch` work queue (infra/prefect.yaml), which a pool's worker
serves only when no research run waits. It lands nothing: it reads what ingestion
landed, the newest `days` trading days of the champion's products (as many as the
champion was made from, unless told), pins those versions, and runs the stage flows
the research flow runs (features, train, simulate) under one MLflow run shaped like a
research run, so `quantloop promote <run>` can gate the new version as it gates any.
"""

from __future__ import annotations

import datetime as dt
import time
from dataclasses import asdict

import pyarrow as pa
import pyarrow.compute as pc
from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact
from prefect.runtime import flow_run
from pydantic import BaseModel

from quantloop.flows.features import features as features_flow
from quantloop.flows.simulate import simulate as simulate_flow
from quantloop.flows.train import train as train_flow
from quantloop.tasks.data.schema import Partition
from quantloop.tasks.engine import sha256_json, storage
from quantloop.tasks.records import promotion, tracking
from quantloop.tasks.records.provenance import code_digest, git_commit
from quantloop.tasks.records.recipe import Recipe, read_recipe
from quantloop.tasks.records.tracking import CATALOG_TAG, STORE_TAG, WORKSPACE_TAG
from quantloop.tasks.research.simulation import SimConfig
from quantloop.tasks.research.stage import StageParams, plan_folds
from quantloop.tasks.research.train_config import TrainConfig
from quantloop.tasks.runtime import progress
from quantloop.tasks.runtime.workspace import Selection, Workspace

RETRAINED_FROM_TAG = "retrained_from"  # on the new version: "<name>/<version>"
RECIPE_TAG = "recipe_digest"


class RetrainSummary(BaseModel):
    model: str
    from_version: str  # the version whose recipe was used (the alias's, when run)
    alias: str
    new_version: str | None  # None: the model of these days was registered already
    version: str  # the version holding the model of these days (new or found)
    model_key: str
    model_cached: bool
    recipe_digest: str
    dataset: str
    products: list[str]
    start: dt.date
    end: dt.date
    data_digest: str
    markout_bps: dict[str, float]
    mlflow_run_id: str
    wall_s: float


def newest_selection(workspace: Workspace, recipe: Recipe, days: int) -> Selection:
    """The newest `days` landed trading days of the recipe's products, pinned: the run
    reads exactly these versions whatever lands meanwhile."""
    catalog = workspace.catalog()
    table = catalog.table(recipe.dataset)
    if recipe.products:
        wanted = pa.array(recipe.products, pa.string())
        table = table.filter(pc.is_in(table["product"], value_set=wanted))
    dates = sorted(set(table["date"].to_pylist()))
    if not dates:
        raise LookupError(f"dataset {recipe.dataset!r} has no landed days of products "
                          f"{recipe.products} in the catalog at {catalog.path}")  # fmt: skip
    chosen = dates[-days:]
    products = sorted(set(table["product"].to_pylist()))
    partitions = [Partition.trusted(p, dt.date.fromisoformat(d)) for p in products for d in chosen]
    entries = catalog.entries(recipe.dataset, partitions)
    pin = catalog.pin(recipe.dataset, entries)
    return Selection(dataset=recipe.dataset, products=products,
                     start=dt.date.fromisoformat(chosen[0]),
                     end=dt.date.fromisoformat(chosen[-1]), pin=pin)  # fmt: skip


@flow(name="retrain")
def retrain(
    model: str | None = None,
    alias: str = "champion",
    days: int | None = None,
    workspace: Workspace = Workspace(),
) -> RetrainSummary:
    """Retrain `alias`'s version of `model` with its recipe on the newest landed days and
    register the result as a new version (the alias does not move).

    Args:
        model: The registered model's name. None: the tracking block's.
        alias: Whose recipe: an alias ("champion") or a version number.
        days: Trading days to train and hold out on, the newest landed. None: as many
            as the recipe's version was made from.
        workspace: Where the data, node outputs and records live.
    """
    t0 = time.perf_counter()
    logger = get_run_logger()
    if days is not None and days < 1:
        raise ValueError(f"days must be >= 1 (or None), got {days}")
    tracking_block = workspace.resolve_tracking()
    client, experiment = tracking.client_for(tracking_block)
    name = model or tracking_block.registered_model
    candidates = tracking_block.candidates  # where the retrained model is registered
    # The champion's recipe only if promote made it one (tasks/records/promotion.py).
    source = promotion.resolve_for_use(client, name, alias, guarded=tracking_block.registered_model)
    recipe = read_recipe(client, source, workspace.catalog())
    recipe_digest = sha256_json(recipe.digest_fields())
    train = TrainConfig(**recipe.train)
    sim = SimConfig(**recipe.simulation)
    selection = newest_selection(workspace, recipe, days or recipe.dates)
    stage = StageParams.model_validate({
        "workspace": workspace, "selection": selection, "features": recipe.features,
        "product_features": recipe.product_features, "validation": recipe.validation,
    })  # fmt: skip
    planned = plan_folds(stage)  # folds that do not fit these days fail here, named
    site = workspace.resolve_site()
    line = (f"retraining {name} version {source.version} ({alias}) on {selection.start}.."
            f"{selection.end} of {', '.join(selection.products or [])}, "
            f"{len(planned)} fold(s)")  # fmt: skip
    logger.info("%s", line)
    progress.note("retrain", line)
    tags = {
        "prefect_flow_run_id": flow_run.id or "", "site": site.name,
        "code_digest": code_digest(), "git_commit": git_commit(),
        "params_hash": recipe_digest, "data_digest": selection.pin,
        RETRAINED_FROM_TAG: f"{name}/{source.version}", RECIPE_TAG: recipe_digest,
        STORE_TAG: site.root, CATALOG_TAG: str(workspace.catalog().path),
        WORKSPACE_TAG: workspace.model_dump_json(),
    }  # fmt: skip
    with tracking.run(client, experiment, "retrain", tags=tags) as parent:
        parent.params({"model": name, "from_version": source.version, "alias": alias,
                       "dataset": selection.dataset, "products": selection.products or [],
                       "dates": f"{selection.start}..{selection.end}",
                       **{f"train.{k}": v for k, v in asdict(train).items()}})  # fmt: skip
        # The recipe again, in the research run's shape: a retrained version is a
        # recipe too (its next retrain, backtest and promotion read it from here).
        form = {"features": recipe.features, "product_features": recipe.product_features,
                "validation": recipe.validation, "simulation": recipe.simulation,
                "train": recipe.train}  # fmt: skip
        parent.json({"params": form, "selection": selection.model_dump(mode="json"),
                     "dates": len(set(selection.table(workspace.catalog())["date"].to_pylist())),
                     "retrained_from": {"model": name, "version": source.version,
                                        "run": recipe.source_run_id}},
                    "resolved_params.json", "params")  # fmt: skip
        parent.flush()
        parent.dataset(name=selection.dataset, digest=selection.pin or "", context="retrain",
                       source=storage.join(site.root, "datasets", selection.dataset),
                       rows=selection.table(workspace.catalog()).num_rows)  # fmt: skip
        features_flow(stage, parent_run_id=parent.run_id)
        trained = train_flow(stage, train, parent_run_id=parent.run_id)
        simulated = simulate_flow([f.model_url for f in trained.folds], stage, sim,
                                  parent_run_id=parent.run_id)  # fmt: skip
        # New only if this run registered it: the same model (the same key: the same recipe
        # and days) is found with the version it was first registered as, maybe by
        # a research run on these days.
        found = client.get_model_version(candidates, trained.model_version)
        new = trained.model_version if found.tags.get("research_run_id") == parent.run_id else None
        if new is not None:
            for key, value in {RETRAINED_FROM_TAG: f"{name}/{source.version}",
                               RECIPE_TAG: recipe_digest}.items():  # fmt: skip
                client.set_model_version_tag(candidates, new, key, value)
        parent.tags({"model_digest": trained.model_digest, "registered_model": candidates,
                     "model_version": trained.model_version or ""})  # fmt: skip
        markout = {f"markout_bps.{h}": v for h, v in simulated.markout_bps.items()}
        parent.metrics({"wall_s": time.perf_counter() - t0, "trades": simulated.trades, **markout})
    summary = RetrainSummary(
        model=name, from_version=str(source.version), alias=alias, new_version=new,
        version=trained.model_version,
        model_key=trained.model_key, model_cached=trained.cache_hit,
        recipe_digest=recipe_digest, dataset=selection.dataset,
        products=selection.products or [], start=selection.start, end=selection.end,
        data_digest=selection.pin or "", markout_bps=simulated.markout_bps,
        mlflow_run_id=parent.run_id, wall_s=time.perf_counter() - t0,
    )  # fmt: skip
    outcome = (
        f"new version {new}"
        if new
        else f"no new version: this model of these days is version {trained.model_version} already"
    )
    logger.info("retrain of %s: %s; %s stays on version %s", name, outcome, alias, source.version)
    link = tracking_block.run_url(experiment, parent.run_id)
    create_markdown_artifact(
        key="retrain-summary",
        description=f"Retrain of {name} version {source.version}",
        markdown="\n".join([
            f"# Retrain of `{name}` version {source.version} (`{alias}`)",
            "",
            f"{outcome.capitalize()}, trained on {selection.start}..{selection.end} of "
            f"{', '.join(summary.products)}; `{alias}` is unchanged (promote moves it).",
            "",
            "| horizon | " + " | ".join(simulated.markout_bps) + " |",
            "|---|" + "---:|" * len(simulated.markout_bps),
            "| mark-out (bps, held out) | "
            + " | ".join(f"{v:+.2f}" for v in simulated.markout_bps.values()) + " |",
            "",
            f"MLflow run: [{parent.run_id}]({link})" if link else f"MLflow run: `{parent.run_id}`",
            f"Promote it: `quantloop promote {parent.run_id}`",
        ]),
    )  # fmt: skip
    return summary
