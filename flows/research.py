"""The research flow: data -> features -> train -> simulate, recorded in MLflow.

Its one parameter is a typed model, so the Prefect UI renders it as a form.
"""

from __future__ import annotations

import time
from dataclasses import asdict

from prefect import flow, get_run_logger, task
from prefect.artifacts import (
    create_markdown_artifact,
    create_progress_artifact,
    update_progress_artifact,
)
from prefect.cache_policies import NO_CACHE
from prefect.runtime import flow_run

from quantloop.flows.features import features, placement_metrics
from quantloop.flows.params import DataSource, ResearchParams  # noqa: F401 - the form
from quantloop.flows.simulate import simulate
from quantloop.flows.sweep import sweep
from quantloop.flows.train import import_inductor_ahead, records_in_background, train, with_version
from quantloop.tasks.data.landing import business_days, land_lobster, land_synthetic
from quantloop.tasks.engine import sha256_json, storage
from quantloop.tasks.records import runs, tracking
from quantloop.tasks.records.provenance import code_digest, git_commit
from quantloop.tasks.records.runs import TEST_WINDOWS_TAG, TRIALS_TAG
from quantloop.tasks.records.summary import (
    ResearchSummary,
    fold_table,
    markout_table,
    product_table,
    site_table,
    sweep_table,
    validity_notes,
)
from quantloop.tasks.records.tracking import CATALOG_TAG, STORE_TAG, WORKSPACE_TAG
from quantloop.tasks.research.planning import product_params
from quantloop.tasks.research.stage import DamagedOutputs, describe, plan_folds
from quantloop.tasks.runtime import progress, timeline
from quantloop.tasks.runtime.sites import SiteCounts
from quantloop.tasks.runtime.workspace import Selection

# The stages as this flow calls them: subflows that skip Prefect's check of their
# parameters, which builds a pydantic model of the flow's signature on every call (17-36
# samples of 1 ms a stage in a py-spy of a cached re-run on this VM, 2026-12-05; not timed
# alone) to check objects this flow made
# from its own checked ResearchParams. A stage run on its own (its deployment, the UI's
# form) checks its parameters as before.
features_flow = features.with_options(validate_parameters=False)
train_flow = train.with_options(validate_parameters=False)
simulate_flow = simulate.with_options(validate_parameters=False)
sweep_flow = sweep.with_options(validate_parameters=False)

# Per-product overrides also go in as MLflow params, up to this many (the full set is
# always in the resolved_params.json artifact): a run page stays readable.
MAX_OVERRIDE_PARAMS = 500


@task(name="land-data", cache_policy=NO_CACHE)
def land_data(params: ResearchParams) -> Selection:
    """Put the run's input partitions in the catalog (a no-op for unchanged ones)."""
    logger = get_run_logger()
    ws, data = params.workspace, params.data
    catalog, site = ws.catalog(), ws.resolve_site()
    report = lambda done, total: progress.report("data", done, total)  # noqa: E731
    if data.lobster_dir:
        landed = land_lobster(catalog, site.root, data.lobster_dir, site=site.name,
                              progress=report, home=ws.home_abs,
                              note=lambda line: progress.note("data", line))  # fmt: skip
        dataset = "lobster"
    else:
        dates = business_days(data.start_date, data.n_dates)
        landed = land_synthetic(catalog, site.root, data.products, dates, data.synthetic,
                                site=site.name, progress=report)  # fmt: skip
        dataset = "synthetic"
    counts = {
        s: sum(1 for x in landed if x.status == s)
        for s in ("new", "changed", "unchanged", "repaired")
    }
    line = f"{len(landed):,} partitions of {dataset}: " + ", ".join(
        f"{n:,} {status}" for status, n in counts.items() if n
    )
    logger.info("landed %s", line)
    progress.note("data", line)
    products = sorted({x.entry.partition.product for x in landed})
    dates = sorted({x.entry.partition.date for x in landed})
    # The run reads exactly these versions from here on (features, training, simulation),
    # whatever another run lands meanwhile.
    pin = catalog.pin(dataset, [x.entry for x in landed])
    return Selection(dataset=dataset, products=products, start=dates[0], end=dates[-1], pin=pin)


def mlflow_link(tracking_block, experiment_id: str, run_id: str) -> str:
    """A markdown link to the run's page in the MLflow UI, or, for a store no UI is known
    to serve, how to open one."""
    url = tracking_block.run_url(experiment_id, run_id)
    if url is not None:
        return f"[{run_id}]({url})"
    return (
        f"`{run_id}`: `mlflow ui --backend-store-uri {tracking_block.resolved_uri()}`, then "
        f"/#/experiments/{experiment_id}/runs/{run_id}"
    )


# Where each stage starts on the run's progress bar (percent), roughly by its share of
# a default run's time here.
STAGE_START = {"data": 0.0, "features": 10.0, "train": 40.0, "simulate": 85.0}
REPORT_EVERY_S = 5.0


class RunFeedback:
    """What the research run shows of its stages in the Prefect UI while it runs: a log
    line when a stage starts, each stage's notes, its counts every few seconds, and a
    progress artifact on the run. (Stage flows run in this process, so their reports
    reach it; their own logs stay on their own runs.)"""

    def __init__(self, logger) -> None:
        self.logger = logger
        self.artifact = None
        self.last: dict[str, float] = {}

    def start(self, stage: str, detail: str = "") -> None:
        self.logger.info("%s: started%s", stage, f" ({detail})" if detail else "")
        self._progress(STAGE_START[stage], f"{stage} running")

    def finish(self) -> None:
        self._progress(100.0, "done")

    def _progress(self, percent: float, what: str) -> None:
        description = f"Research run: data, features, train, simulate; now: {what}"
        if self.artifact is None:
            self.artifact = create_progress_artifact(percent, description=description)
        else:
            update_progress_artifact(self.artifact, percent, description=description)

    def report(self, stage: str, done: int, total: int) -> None:
        now = time.monotonic()
        if done == total or now - self.last.get(stage, 0.0) >= REPORT_EVERY_S:
            self.last[stage] = now
            self.logger.info("%s: %s of %s", stage, f"{done:,}", f"{total:,}")

    def note(self, stage: str, message: str) -> None:
        self.logger.info("%s: %s", stage, message)


@flow(name="research")
def research(params: ResearchParams = ResearchParams()) -> ResearchSummary:
    """The whole loop on the selected data; returns the run summary (also in MLflow).

    Args:
        params: Everything the run depends on; every field says what it is, its unit
            and its bounds.
    """
    feedback = RunFeedback(get_run_logger())
    # One MLflow experiment lookup for the run and its stages, not one a stage.
    with progress.adding(feedback), tracking.shared_clients():
        summary = research_loop(params, feedback)
    feedback.finish()
    return summary


def research_loop(params: ResearchParams, feedback: RunFeedback) -> ResearchSummary:
    t0 = time.perf_counter()
    # The flow's own time, outside its stages, in phases of its own (`--profile`): what
    # Prefect's start of the flow run costs shows as the gap before `flow: set-up`.
    set_up = timeline.TIMELINE.begin("flow: set-up")
    logger = get_run_logger()
    ws = params.workspace
    swept = None
    site = ws.resolve_site()
    tracking_block = ws.resolve_tracking()
    client, experiment = tracking.client_for(tracking_block)
    closing = tracking.senders().submit(tracking.close_dead_runs, client, experiment)
    timeline.TIMELINE.end(set_up)
    feedback.start("data", params.data.lobster_dir or "synthetic")
    with timeline.phase("landing"):
        selection = land_data(params)
    after_landing = timeline.TIMELINE.begin("flow: after landing")
    for dead in closing.result():  # looked for while the data landed
        logger.warning("MLflow run %s was left RUNNING by a process that died: marked KILLED", dead)
    partitions = selection.table(ws.catalog()).num_rows
    data_digest = selection.pin  # the digest of exactly the versions landed (and read)
    stage = params.stage(selection)
    timeline.TIMELINE.end(after_landing)
    # A training that will compile on a GPU here needs Inductor: imported in a thread
    # while the run records, computes its features and plans (the trainer waits for it)
    import_inductor_ahead(stage, params.train)
    # The folds over the landed dates, before any feature is computed: folds that do not
    # fit the dates fail here, naming the validation's fields.
    with timeline.phase("planning"):
        planned = plan_folds(stage)
    shown = planned if len(planned) <= 4 else [planned[0], planned[-1]]
    progress.note("validation", f"{len(planned)} fold(s): "
                  + (" ... " if len(shown) < len(planned) else "; ").join(
                      f"fold {f.index}: {describe(f)}" for f in shown))  # fmt: skip
    opening = timeline.TIMELINE.begin("flow: records opened")
    tags = {
        "prefect_flow_run_id": flow_run.id or "",
        "site": site.name,
        "sites": ",".join(s.name for s in ws.resolve_sites()),
        "placement": ws.placement,
        "code_digest": code_digest(),
        "git_commit": git_commit(),
        "params_hash": params.hash(),
        "data_digest": data_digest,
        # With the data pin, the validation fixes the test windows: runs that share both
        # were evaluated on the same held-out data (trials counted by runs.research_trials)
        TEST_WINDOWS_TAG: sha256_json(asdict(params.validation)),
        # Where the run's records are: `quantloop nodes --run` and `quantloop reproduce`
        # find the store and the catalog from these, without the workspace's folders.
        STORE_TAG: site.root,
        CATALOG_TAG: str(ws.catalog().path),
        WORKSPACE_TAG: ws.model_dump_json(),
    }
    # Trials: how many configurations were evaluated on these held-out data, this one
    # included (a sweep: each of its settings); the simulation adjusts the paired p-values
    # for them (Sidak, after Holm).
    sweeping = params.sweep.active
    own_trials = params.trial_ids()
    if sweeping:
        tags[TRIALS_TAG] = runs.trials_tag(own_trials)
    trials, repeat_of = runs.trials_on(client, experiment, data_digest, tags[TEST_WINDOWS_TAG],
                                       own_trials, params_hash=tags["params_hash"])  # fmt: skip
    if repeat_of:  # later runs need not read this one to count its trials
        tags[runs.REPEAT_TAG] = repeat_of
    with tracking.run(client, experiment, "research", tags=tags) as parent:
        parent.params(
            {
                "dataset": selection.dataset,
                "products": ",".join(selection.products or []),
                "dates": f"{selection.start}..{selection.end}",
                "partitions": partitions,
                **{f"features.{k}": v for k, v in params.features.canonical().items()},
                **{f"train.{k}": v for k, v in asdict(params.train).items()},
                **{f"sim.{k}": v for k, v in asdict(params.simulation).items()},
                **{f"validation.{k}": v for k, v in asdict(params.validation).items()},
                "folds": len(planned),
                **(
                    {f"sweep.{k}": v for k, v in params.sweep.model_dump(mode="json").items()}
                    | {"sweep.count": len(own_trials)}
                    if sweeping
                    else {}
                ),
            }
        )
        # Every input, resolved: the form as run, and each product's effective feature
        # parameters (a per-product override is visible here, not only as another hash).
        effective = product_params(params.features, params.product_features,
                                   selection.products or [])  # fmt: skip
        parent.json(
            {"params": params.model_dump(mode="json"),
             "effective_features": {p: v.canonical() for p, v in sorted(effective.items())},
             "selection": selection.model_dump(mode="json")},
            "resolved_params.json", "params",
        )  # fmt: skip
        overrides = {
            f"product_features.{p}.{k}": v
            for p, o in sorted(params.product_features.items())
            for k, v in o.items()
        }
        parent.params(dict(list(overrides.items())[:MAX_OVERRIDE_PARAMS]))
        parent.send()  # in the background, while the stages run; the run's end waits for it
        parent.dataset(name=selection.dataset, digest=data_digest, context="research",
                       source=storage.join(site.root, "datasets", selection.dataset),
                       rows=partitions)  # fmt: skip
        timeline.TIMELINE.end(opening)
        feedback.start("features", f"{partitions:,} nodes, placement {ws.placement}")
        with timeline.phase("features"):
            feats = features_flow(stage, shard_size=params.shard_size,
                                  parent_run_id=parent.run_id,
                                  verify_hits=params.verify_hits)  # fmt: skip
        # damaged outputs the features stage found by checking its hits, recomputed
        healed = sum(feats.reasons.get(r, 0) for r in ("corrupt", "missing"))
        # The model is registered in the background while the simulation runs
        # (torch.export and its uploads: 2 s here, 7.6 s on an H200); joined here.
        with records_in_background() as registered:
            for attempt in (1, 2):
                try:
                    if sweeping:
                        feedback.start("train", f"sweep of {len(own_trials)} settings x "
                                       f"{len(planned)} folds, {params.train.steps:,} "
                                       "steps each")  # fmt: skip
                        with timeline.phase("sweep"):
                            swept = sweep_flow(stage, params.train, params.sweep,
                                               params.simulation, parent_run_id=parent.run_id,
                                               trials=trials)  # fmt: skip
                        trained, sim = swept.train, swept.simulate
                    else:
                        feedback.start("train", f"{params.train.steps:,} steps")
                        with timeline.phase("train"):
                            trained = train_flow(stage, params.train,
                                                 parent_run_id=parent.run_id)  # fmt: skip
                        feedback.start("simulate", f"{len(selection.products or []):,} products")
                        with timeline.phase("simulate"):
                            sim = simulate_flow([f.model_url for f in trained.folds], stage,
                                                params.simulation, parent_run_id=parent.run_id,
                                                trials=trials)  # fmt: skip
                    healed += sim.healed_outputs  # its mark-outs and statistics
                    break
                except DamagedOutputs as exc:
                    # The store heals itself: the damaged outputs are out of the index, so
                    # the features stage recomputes exactly them (reason corrupt/missing).
                    if attempt == 2:
                        raise
                    healed += len(exc.damaged)
                    logger.warning("%s", exc)
                    feedback.start("features", f"recomputing {healed:,} damaged outputs")
                    feats = features_flow(stage, shard_size=params.shard_size,
                                          parent_run_id=parent.run_id)  # fmt: skip
        closing_records = timeline.TIMELINE.begin("flow: records closed")
        if registered:
            trained = with_version(trained, registered[-1].result())
        paired, paired_equal = sim.paired_bps, sim.paired_equal_count_bps
        if trials > 1:
            survived = [h for h, d in paired.items() if d["significant"]]
            logger.info("%d configurations were evaluated on these held-out data: the paired "
                        "p-values are adjusted for them; significant at 5%%: %s", trials,
                        ", ".join(survived) or "none")  # fmt: skip
        wall_s = time.perf_counter() - t0
        sites = site_counts(ws, feats, trained, sim, swept)
        parent.tags({"model_digest": trained.model_digest})
        if trained.model_version:
            parent.tags({"registered_model": trained.registered_model,
                         "model_version": trained.model_version})  # fmt: skip
        parent.metrics(
            {
                "wall_s": wall_s,
                "nodes": feats.nodes,
                "cache_hits": feats.cache_hits,
                "computed": feats.computed,
                "train_samples_per_s": trained.steady_samples_per_s or trained.samples_per_s,
                "trades": sim.trades,
                **{f"markout_bps.{h}": v for h, v in sim.markout_bps.items()},
                **{f"baseline_markout_bps.{h}": v for h, v in sim.baseline_markout_bps.items()},
                **{f"markout_se_bps.{h}": v for h, v in sim.markout_se_bps.items() if v == v},
                **{f"paired.markout_bps.{h}": d["mean_bps"] for h, d in paired.items()},
                **{
                    f"paired.p_adjusted.{h}": d["p_adjusted"]
                    for h, d in paired.items()
                    if d["p_adjusted"] == d["p_adjusted"]
                },
                **{f"paired.significant.{h}": float(d["significant"]) for h, d in paired.items()},
                "trials": trials,
                "model.pnl_bps": sim.pnl["model"]["total_bps"],
                "baseline.pnl_bps": sim.pnl["baseline"]["total_bps"],
                **placement_metrics(sites),
                **(sweep_metrics(swept) if swept is not None else {}),
            }
        )
        if swept is not None:
            parent.tags({"sweep_setting": swept.chosen,
                         "sweep_label": swept.settings[0]["label"]})  # fmt: skip
            parent.json({"horizon": swept.horizon, "chosen": swept.chosen,
                         "trials": swept.trials, "settings": swept.settings,
                         "stacks": swept.stacks, "check": swept.check},
                        "sweep.json", "sweep")  # fmt: skip
        run_id = parent.run_id
    timeline.TIMELINE.end(closing_records)
    summary = ResearchSummary(
        dataset=selection.dataset,
        nodes=feats.nodes,
        cache_hits=feats.cache_hits,
        computed=feats.computed,
        recomputed=feats.reasons,
        healed_outputs=healed,
        markout_bps=sim.markout_bps,
        baseline_markout_bps=sim.baseline_markout_bps,
        markout_se_bps=sim.markout_se_bps,
        baseline_markout_se_bps=sim.baseline_markout_se_bps,
        insufficient=sim.model["total"]["insufficient"],
        paired_bps=paired,
        paired_equal_count_bps=paired_equal,
        trials=trials,
        pnl=sim.pnl,
        hit_rate=sim.model["total"]["hit_rate"],
        baseline_hit_rate=sim.baseline["total"]["hit_rate"],
        trades=sim.trades,
        baseline_trades=sim.baseline_trades,
        per_product={
            p: {"model": sim.model[p], "baseline": sim.baseline[p]}
            for p in sim.model
            if p != "total"
        },
        model_cached=(
            all(f.cache_hit for f in trained.folds)
            if swept is None
            else swept.models_cached == swept.models
        ),
        simulation_cached=(
            sim.cache_hit if swept is None else all(r["simulation_cached"] for r in swept.settings)
        ),
        folds=len(trained.folds),
        per_fold=fold_rows(trained, sim),
        model_digest=trained.model_digest,
        model_url=trained.model_url,
        registered_model=trained.registered_model,
        model_version=trained.model_version,
        data_digest=data_digest,
        code_digest=tags["code_digest"],
        params_hash=tags["params_hash"],
        mlflow_run_id=run_id,
        mlflow_stage_runs={
            "features": feats.mlflow_run_id,
            "train": trained.mlflow_run_id,
            "simulate": sim.mlflow_run_id,
        },
        mlflow_experiment_id=experiment,
        tracking_uri=tracking_block.resolved_uri(),
        prefect_flow_run_id=tags["prefect_flow_run_id"],
        wall_s=time.perf_counter() - t0,
        train_rungs=trained.rungs,
        train_samples_per_s=trained.steady_samples_per_s or trained.samples_per_s,
        train_ladder_result=trained.ladder_result,
        inference_mode=sim.inference_mode,
        inference_samples_per_s=sim.inference_samples_per_s,
        placement=feats.placement,
        bytes_across_sites=sum(c["bytes_across"] for c in sites.values()),
        cost=sum(c["cost"] for c in sites.values()),
        sites=sites,
        **(sweep_fields(swept) if swept is not None else {}),
    )
    links = {
        name: mlflow_link(tracking_block, experiment, rid)
        for name, rid in {"research": run_id, **summary.mlflow_stage_runs}.items()
        if rid
    }
    with timeline.phase("flow: summary artifact"):
        create_markdown_artifact(
            markdown=summary_markdown(summary, links),
            key="research-summary",
            description="Mark-out of the model and the baseline, cache hits and MLflow links",
        )
    logger.info("research done in %.1f s; MLflow run %s", summary.wall_s, run_id)
    return summary


def sweep_metrics(swept) -> dict[str, float]:
    """The research run's figures of its sweep: how many settings and models, how many
    were found by key, each setting's rank and paired difference at the horizon, and the
    held-out test of the pick made on the earlier folds."""
    out = {"sweep.settings": len(swept.settings), "sweep.models": swept.models,
           "sweep.models_cached": swept.models_cached, "sweep.chosen": swept.chosen}  # fmt: skip
    for row in swept.settings:
        out[f"sweep.s{row['setting']}.rank"] = row["rank"]
        if row["diff_bps"] is not None and row["diff_bps"] == row["diff_bps"]:
            out[f"sweep.s{row['setting']}.diff_bps.{swept.horizon}"] = row["diff_bps"]
    if (h := swept.holdout) and h["setting"] is not None:  # the earlier folds' pick, on the last
        out["sweep.holdout.setting"] = h["setting"]
        for name in ("diff_bps", "diff_se_bps", "p_adjusted"):
            if h[name] is not None and h[name] == h[name]:
                out[f"sweep.holdout.{name}.{swept.horizon}"] = h[name]
    for i, stack in enumerate(swept.stacks):
        out[f"sweep.stack{i}.samples_per_s"] = stack["samples_per_s"]
        out[f"sweep.stack{i}.k"] = stack["k"]
    return out


def sweep_fields(swept) -> dict:
    """ResearchSummary's sweep fields."""
    return {"sweep": swept.settings, "sweep_horizon": swept.horizon,
            "sweep_models": swept.models, "sweep_models_cached": swept.models_cached,
            "sweep_stacks": swept.stacks, "sweep_check": swept.check,
            "sweep_holdout": swept.holdout}  # fmt: skip


def site_counts(ws, feats, trained, sim, swept=None) -> dict[str, dict]:
    """Per site: the feature nodes' counts, then training's and the replay's seconds there
    and the bytes copied there for them from other sites (a cached stage's seconds add
    nothing; a copy made for it, of a model to replay, still counts). A sweep's training:
    every model it trained (its best setting's replay only)."""
    per_hour = {s.name: s.cost_per_hour for s in ws.resolve_sites()}
    sites = {name: SiteCounts(**counts) for name, counts in feats.sites.items()}
    train_s = (
        swept.train_s if swept is not None
        else sum(f.duration_s for f in trained.folds if not f.cache_hit)
        if not all(f.cache_hit for f in trained.folds) else None
    )  # fmt: skip
    stages = (
        ("train", trained.site, train_s, trained),
        ("simulate", sim.site, sim.compute_s, sim),
    )  # fmt: skip
    for stage, name, seconds, summary in stages:
        # by the site each copy was made at (a stage placed again after a site lost its
        # workers made some at each); a summary from before had the total only
        across = dict(summary.bytes_across_at or {name: summary.bytes_across})
        if name and seconds is not None:
            sites.setdefault(name, SiteCounts()).add_stage(
                stage, seconds, across.pop(name, 0), per_hour.get(name, 0.0)
            )
        for other, n in across.items():
            if other and n:
                sites.setdefault(other, SiteCounts()).add_stage(stage, 0.0, n, 0.0)
    return {name: asdict(counts) for name, counts in sites.items()}


def fold_rows(trained, sim) -> list[dict]:
    """One row per fold, oldest first: its window (first and last date and how many of
    each part), its model and simulation, its trades and the model's mark-out."""

    def span(dates: list[str]) -> dict:
        return {"first": dates[0], "last": dates[-1], "dates": len(dates)} if dates else {}

    rows = []
    for model in trained.folds:
        replayed = sim.per_fold[model.index]
        window = model.window
        rows.append({
            "index": model.index,
            "train": span(window["train"]), "embargo": span(window["embargo"]),
            "test": span(window["test"]), "holdout_fraction": window["holdout_fraction"],
            "trades": replayed["trades"], "baseline_trades": replayed["baseline_trades"],
            "markout_bps": replayed["markout_bps"],
            "model_digest": model.model_digest, "model_cached": model.cache_hit,
            "simulation_cached": replayed["cache_hit"],
        })  # fmt: skip
    return rows


def summary_markdown(summary: ResearchSummary, links: dict[str, str]) -> str:
    return "\n".join(
        [
            f"# Research run on `{summary.dataset}`",
            "",
            f"Feature nodes: **{summary.nodes}** ({summary.cache_hits} cache hits, "
            f"{summary.computed} computed). Wall time {summary.wall_s:.1f} s.",
            "",
            "## Mark-out (bps, held-out data)",
            markout_table(summary).markdown(),
            "",
            *(f"- {note}" for note in validity_notes(summary)),
            "",
            *(
                [
                    f"## Sweep ({len(summary.sweep)} settings, ranked on the "
                    f"{summary.sweep_horizon} paired mark-out; the best, above, is the "
                    "registered model)",
                    sweep_table(summary).markdown(),
                    "",
                ]
                if summary.sweep
                else []
            ),
            f"## Per fold ({summary.folds}: each model replays its own test window)",
            fold_table(summary).markdown(),
            "",
            "## Sites",
            f"Placement `{summary.placement}`: {summary.bytes_across_sites:,} bytes "
            f"read across sites, compute cost {summary.cost:.6f}.",
            "",
            site_table(summary).markdown(),
            "",
            "## Per product",
            product_table(summary).markdown(),
            "",
            "## MLflow runs",
            *(f"- {name}: {link}" for name, link in links.items()),
            "",
            f"Model `{summary.model_digest[:16]}`, data `{summary.data_digest[:16]}`, "
            f"code `{summary.code_digest[:16]}`, params `{summary.params_hash[:16]}`.",
        ]
    )
