"""The simulation stage: each fold's model replays its own test window, trades, and the
trades are marked out; the out-of-sample mark-outs of all folds are pooled."""

from __future__ import annotations

import base64
import contextlib
import json
import logging
import time
from dataclasses import asdict

import pyarrow as pa
from prefect import flow, get_run_logger
from pydantic import BaseModel

from quantloop.profiling import inference, replay
from quantloop.tasks.engine import NoWorkers, code_fingerprint, storage
from quantloop.tasks.records import plots, tracking
from quantloop.tasks.research import folds, simulation, training, uncertainty
from quantloop.tasks.research.form import SimForm
from quantloop.tasks.research.simulation import (
    SimConfig,
    equal_counts,
    paired_difference,
    pnl,
    split_markouts,
    stack_markouts,
    summarize,
)
from quantloop.tasks.research.sited import (  # noqa: F401 - CHECK_SUFFIX: where they were
    CHECK_SUFFIX,
    SiteOutputs,
    load_checked,
    save_checked,
)
from quantloop.tasks.research.stage import (
    StageParams,
    feature_outputs,
    fold_part,
    output_key,
    plan_folds,
)
from quantloop.tasks.runtime import progress, timeline
from quantloop.tasks.runtime.sites import stage_site

log = logging.getLogger(__name__)


class SimSummary(BaseModel):
    # summarize(): {product|"total": {count, and per horizon mean_bps, se_bps (HAC),
    # se_iid_bps, net_bps, hit_rate, hit_rate_se, windows, n_eff, insufficient}}
    model: dict
    baseline: dict
    markout_bps: dict[str, float]  # model, all products, by horizon
    baseline_markout_bps: dict[str, float]
    markout_se_bps: dict[str, float]  # HAC standard error of markout_bps (NaN: insufficient)
    baseline_markout_se_bps: dict[str, float] = {}
    # model minus baseline on the same held-out data, paired HAC SE, p-values raw, Holm over
    # horizons and Sidak over trials: paired_difference()'s {horizon: {...}}
    paired_bps: dict[str, dict]
    # the same with both signals at one out-of-sample trade count (equal_counts)
    paired_equal_count_bps: dict[str, dict] = {}
    # with two folds or more: the same on the folds before the last (pooled) and on the
    # last alone, Holm over the horizons only (simulation.last_fold_split): a sweep picks
    # a setting on the first and tests the pick on the second
    paired_earlier_folds_bps: dict[str, dict] = {}
    paired_last_fold_bps: dict[str, dict] = {}
    pnl: dict = {}  # {"model"|"baseline": pnl(): daily P&L net of fees, total, its SE}
    trades: int
    baseline_trades: int
    cache_hit: bool = False
    mlflow_run_id: str | None = None
    inference_mode: str | None = None  # "eager", or the rungs the fast path applied
    inference_samples_per_s: float | None = None  # windows predicted per second (not cached)
    site: str = ""  # where it replayed (a cached simulation: where this run found it)
    worker: str = ""  # the Dask worker that replayed it ("": the flow's process, or cached)
    compute_s: float | None = None  # the replay's seconds where it ran (None: cached)
    # feature output and model bytes copied to the replay's site from others for it
    bytes_across: int = 0
    # the same by the site they were copied to (a GPU site that lost its workers after
    # copies were made there, then the site the replay was placed at again)
    bytes_across_at: dict[str, int] = {}
    # stored mark-outs and statistics found damaged (size or sha256) and computed again
    healed_outputs: int = 0
    # per fold, by its index: {window (Fold.window()), trades, baseline_trades, markout_bps
    # (the model's mean by horizon on that test window), cache_hit, simulation_key,
    # model_url}; the figures above pool every fold's test window
    per_fold: dict[int, dict] = {}


@flow(name="simulate")
def simulate(
    model_urls: list[str] | str,
    stage: StageParams = StageParams(),
    config: SimForm = SimConfig(),
    parent_run_id: str | None = None,
    trials: int = 1,
) -> SimSummary:
    """Replay each fold's test window with the fold's model and the baseline, and pool
    the mark-outs of all the test windows (they do not overlap).

    Args:
        model_urls: One stored model per fold of the stage's validation, oldest fold first
            (a train run's folds[].model_url: <storage root>/models/<key>.pt); one URL
            alone when there is one fold.
        stage: The workspace, the partitions, their feature parameters (the features
            must be computed) and the validation the models were trained with.
        config: When the signal trades and the mark-out horizons.
        parent_run_id: An MLflow run to record under as a child run "simulate"; empty:
            nothing is recorded.
        trials: Configurations evaluated on these held-out data, this one included (the
            research run counts them, runs.research_trials): the paired p-values are
            adjusted for them.
    """
    logger = get_run_logger()
    plan = timeline.Chain()
    plan.switch("simulate: plan")
    site = stage.workspace.resolve_site()
    urls = [model_urls] if isinstance(model_urls, str) else list(model_urls)
    planned = plan_folds(stage)
    if len(urls) != len(planned):
        raise ValueError(
            f"{len(urls)} model(s) for the {len(planned)} folds of the stage's validation: "
            "give one model per fold, oldest first (the train stage's folds[].model_url)"
        )
    sited = SiteOutputs(stage.workspace)  # the outputs at their sites, through the catalog
    down: set[str] = set()  # GPU sites that lost every worker during this stage
    spent: dict[str, int] = {}  # bytes copied to each site for the replay, whatever happens
    while True:
        with contextlib.ExitStack() as stack:
            try:
                replayed, at, ran, mode, model_digest, model_url = _replay(
                    stage, config, urls, planned, sited, stack, logger, down, spent, plan
                )
                break
            except NoWorkers as exc:
                # Past the site's no_workers_timeout_s: fail naming it, or (replica) replay
                # at the next GPU site, else here; folds stored meanwhile stay cached.
                if stage.workspace.on_unreachable != "replica" or exc.site is None:
                    raise
                down.add(exc.site)
                logger.warning("%s: the replay is placed again", exc)
    across = sum(spent.values())
    sim_cached = all(sim.cache_hit for _, _, sim, _ in replayed)
    key = output_key("simulations", folds=[sim.key for _, _, sim, _ in replayed])
    merged = pooled([sim.value for _, _, sim, _ in replayed])
    stats = inference.InferenceStats(
        mode=mode,
        windows=sum(x.windows for x in ran["stats"]),
        seconds=sum(x.seconds for x in ran["stats"]),
        warmup_s=sum(x.warmup_s for x in ran["stats"]),
        stored_windows=sum(x.stored_windows for x in ran["stats"]),
    )
    # throughput where windows were predicted (those read from the prediction store, a
    # replay of a model's days predicted before, took no prediction)
    predicted = bool(ran["stats"]) and stats.windows > 0

    # The statistics of these mark-outs are keyed like the mark-outs themselves (with the
    # estimators' code and the trials): a re-run reads them back instead of importing
    # arch and matplotlib and recomputing (3-5 s of a cached run here). They are computed
    # here, in the flow's process: stored at the default site, with the run's records.
    def compute_statistics(url: str):
        value = json.loads(to_json(statistics(merged, config, trials, replayed)))
        return value, *save_checked(url, to_json(value).encode())

    with timeline.phase("simulate: statistics"):
        stats_output = sited.keyed(
            site, "statistic",
            output_key("statistics", code=code_fingerprint(simulation, uncertainty, plots),
                       simulations=key, config=asdict(config), trials=trials),
            ".json",
            load=lambda url: json.loads(load_checked(url)),
            compute=compute_statistics,
        )  # fmt: skip
    figures = stats_output.value
    # stored outputs that failed their check (size, sha256) and were computed again
    healed = sum(k.reason == "corrupt" for k in [*(sim for _, _, sim, _ in replayed), stats_output])
    model_summary, base_summary = figures["model"], figures["baseline"]
    result = SimSummary(
        model=model_summary,
        baseline=base_summary,
        markout_bps=model_summary["total"]["mean_bps"],
        baseline_markout_bps=base_summary["total"]["mean_bps"],
        markout_se_bps=model_summary["total"]["se_bps"],
        baseline_markout_se_bps=base_summary["total"]["se_bps"],
        paired_bps=figures["paired"],
        paired_equal_count_bps=figures["paired_equal_count"],
        paired_earlier_folds_bps=figures.get("split", {}).get("earlier", {}),
        paired_last_fold_bps=figures.get("split", {}).get("last", {}),
        pnl=figures["pnl"],
        trades=model_summary["total"]["count"],
        baseline_trades=base_summary["total"]["count"],
        cache_hit=sim_cached,
        inference_mode=mode,
        inference_samples_per_s=stats.samples_per_s if predicted else None,
        site=at.name,
        worker=ran["worker"],
        compute_s=ran["compute_s"],
        bytes_across=across,
        bytes_across_at={name: n for name, n in spent.items() if n},
        healed_outputs=healed,
        per_fold={
            fold.index: fold_row(fold, url, sim, figures["folds"][str(fold.index)])
            for fold, url, sim, _ in replayed
        },
    )
    if predicted:
        logger.info(
            "predicted %d windows in %.2f s (%s): %.0f windows/s, warm-up %.1f s",
            stats.windows, stats.seconds, stats.mode, stats.samples_per_s, stats.warmup_s,
        )  # fmt: skip
    if stats.stored_windows:
        logger.info("%d windows' predictions read from the prediction store (this model "
                    "predicted those days before)", stats.stored_windows)  # fmt: skip
    logger.info("model mark-out (bps): %s", _fmt(result.markout_bps))
    logger.info("baseline mark-out (bps): %s", _fmt(result.baseline_markout_bps))
    progress.note(
        "simulate",
        ("cached: " if sim_cached else "")
        + f"{result.trades:,} model trades, {result.baseline_trades:,} baseline trades "
        f"on the test windows of {len(replayed)} fold(s) of {ran['partitions']} partitions",
    )
    if parent_run_id is not None:
        client, experiment = tracking.client_for(stage.workspace.resolve_tracking())
        with (
            timeline.phase("simulate: record"),
            tracking.run(client, experiment, "simulate", parent=parent_run_id) as run,
        ):
            run.params({f"sim.{k}": v for k, v in asdict(config).items()})
            run.params({"model_url": model_url, "model_digest": model_digest,
                        "inference_mode": mode, "site": at.name,
                        "folds": len(replayed)})  # fmt: skip
            if ran["stats"]:
                run.metrics({
                    **({"inference_samples_per_s": stats.samples_per_s} if predicted else {}),
                    "inference_s": stats.seconds,
                    "inference_warmup_s": stats.warmup_s,
                    "inference_windows": stats.windows,
                    "inference_stored_windows": stats.stored_windows,
                    "compute_s": ran["compute_s"],
                    "bytes_across_sites": across,
                })  # fmt: skip
            metrics: dict[str, float] = {}
            for name, summary in (("model", model_summary), ("baseline", base_summary)):
                for product, stats in summary.items():
                    prefix = f"{name}.{product}"
                    metrics[f"{prefix}.trades"] = stats["count"]
                    for field, label in (("mean_bps", "markout_bps"), ("se_bps", "markout_se_bps"),
                                         ("se_iid_bps", "markout_se_iid_bps"),
                                         ("net_bps", "markout_net_bps"), ("hit_rate", "hit_rate"),
                                         ("windows", "windows"), ("n_eff", "n_eff")):  # fmt: skip
                        metrics.update({f"{prefix}.{label}.{h}": v
                                        for h, v in stats[field].items()})  # fmt: skip
                day_pnl = result.pnl[name]
                metrics[f"{name}.pnl_bps"] = day_pnl["total_bps"]
                metrics[f"{name}.pnl_se_bps"] = day_pnl["se_bps"]
            for label, paired in (
                ("paired", result.paired_bps),
                ("paired_equal_count", result.paired_equal_count_bps),
            ):
                for h, d in paired.items():
                    metrics.update({
                        f"{label}.markout_bps.{h}": d["mean_bps"],
                        f"{label}.se_bps.{h}": d["se_bps"],
                        f"{label}.p_value.{h}": d["p_value"],
                        f"{label}.p_holm.{h}": d["p_holm"],
                        f"{label}.windows.{h}": d["windows"],
                        f"{label}.significant.{h}": float(d["significant"]),
                    })  # fmt: skip
            metrics |= fold_metrics(result.per_fold)
            # MLflow takes no NaN from every store: an untested horizon's SE is left out
            run.metrics({k: float(v) for k, v in metrics.items() if v == v})
            run.tags({"simulation_key": key, "cache_hit": sim_cached})
            run.json([{"index": i, **row} for i, row in result.per_fold.items()], "folds.json",
                     "folds")  # fmt: skip
            run.table(stack_markouts(merged), "markouts.parquet", "markouts")
            run.json({"paired": result.paired_bps,
                      "paired_equal_count": result.paired_equal_count_bps,
                      "pnl": result.pnl, "method": "tasks/research/uncertainty.py"},
                     "validation.json", "validation")  # fmt: skip
            run.file(base64.b64decode(figures["markout_curve_png"]), "markout_curve.png")
            result.mlflow_run_id = run.run_id
    return result


def _replay(stage, config, urls, planned, sited, stack, logger, down, spent, plan):
    """Each fold's simulation, found at any site or replayed where training runs: a site
    whose workers declare a GPU, when there is one, else here in the flow's process (the
    default site). What it reads (the model, the feature outputs) is copied there first
    when it is stored only elsewhere, and counted. NoWorkers when that site loses every
    worker for longer than its setting."""
    where = stage_site(stage.workspace.resolve_sites(), stack, down=down, log=logger,
                       on_unreachable=stage.workspace.on_unreachable)  # fmt: skip
    at = where.site
    outputs = feature_outputs(stage, prefer=at.name)
    plan.close()  # the phase "simulate: plan" (placed again: its time is the replay's)
    ran: dict = {"stats": [], "worker": "", "compute_s": None, "partitions": len(outputs)}
    replayed = []  # (fold, model_url, Keyed, bytes across)
    mode = model_digest = model_url = None
    for fold, model_url in zip(planned, urls, strict=True):
        parts = fold_part(outputs, fold)
        # the model where it replays: a copy is made there if it is stored elsewhere
        with timeline.phase("simulate: model copy"):
            local_model, model_copied = sited.bring("model", model_url, at, where.run)
        spent[at.name] = spent.get(at.name, 0) + model_copied
        # where it runs decides how it predicts (the fast path on a GPU): part of the key
        with timeline.phase("simulate: model check"):
            mode, model_digest = where.run(replay.inference_mode, local_model)
        key = output_key(
            "simulation",
            code=code_fingerprint(simulation, training, inference, folds),
            config=asdict(config),
            model=model_url.rsplit("/", 1)[-1],
            features=sorted(o.key for o in parts.values()),
            window=fold.window(),
            # the fast path's predictions differ from the eager ones by its arithmetic
            inference=mode,
        )
        copied = [0]

        def compute(url, model_url=local_model, parts=parts, fold=fold, copied=copied):
            if where.remote:
                logger.info("replaying on site %s (a worker with the GPU resource)", at.name)
            local, copied[0] = sited.bring_features_for("simulate", parts, at, where.run, spent)
            outputs.update(local)  # later folds read the copies
            t0 = time.perf_counter()
            # stored at `url`, at the site that replays it
            merged, stats, ran["worker"], digest, length = where.run(
                replay.replay_and_store, model_url, stage, config, local, fold, url, at.root
            )
            ran["stats"].append(stats)
            ran["compute_s"] = (ran["compute_s"] or 0.0) + time.perf_counter() - t0
            return merged, digest, length

        with timeline.phase("simulate: replay"):
            sim = sited.keyed(
                at, "simulation", key, ".parquet",
                load=lambda url: split_markouts(storage.decode_table(load_checked(url))),
                compute=compute,
            )  # fmt: skip
        if sim.cache_hit:
            logger.info("fold %d: simulation %s is cached at site %s: not replayed", fold.index,
                        key[:12], sim.site)  # fmt: skip
        replayed.append((fold, model_url, sim, model_copied + copied[0]))
    return replayed, at, ran, mode, model_digest, model_url


def pooled(per_fold: list[dict[str, dict[str, pa.Table]]]) -> dict[str, dict[str, pa.Table]]:
    """The folds' mark-outs as one set, by signal and product, oldest fold first: their
    test windows do not overlap, so this is every out-of-sample trade once."""
    out: dict[str, dict[str, pa.Table]] = {}
    for name in ("model", "baseline"):
        products = sorted({p for merged in per_fold for p in merged[name]})
        out[name] = {
            p: pa.concat_tables([m[name][p] for m in per_fold if p in m[name]]) for p in products
        }
    return out


def statistics(merged: dict, config: SimConfig, trials: int, replayed: list) -> dict:
    """Everything the summary and the records say of the pooled mark-outs, JSON-able: both
    signals' summaries, the paired differences (all trades, equal counts), the P&L, each
    fold's model mark-out and the mark-out curve as a PNG (base64)."""
    part = timeline.Chain()  # its parts, phases of the run's timeline
    part.switch("statistics: summaries")
    model_summary = summarize(merged["model"], config.fee_bps)
    base_summary = summarize(merged["baseline"], config.fee_bps)
    keys = config.horizon_keys()
    folds = {}
    for fold, _, sim, _ in replayed:
        model = summarize(sim.value["model"], config.fee_bps)["total"]
        folds[str(fold.index)] = {
            "trades": model["count"],
            "baseline_trades": sum(t.num_rows for t in sim.value["baseline"].values()),
            "markout_bps": model["mean_bps"],
        }
    part.switch("statistics: mark-out curve")
    figure = plots.markout_curve(
        {"model": model_summary["total"]["mean_bps"],
         "baseline": base_summary["total"]["mean_bps"]},
        {"model": model_summary["total"]["se_bps"], "baseline": base_summary["total"]["se_bps"]},
    )  # fmt: skip
    png = plots.png(figure)
    part.switch("statistics: paired differences")
    paired = paired_difference(merged["model"], merged["baseline"], keys, trials=trials)
    paired_equal = paired_difference(*equal_counts(merged["model"], merged["baseline"]), keys,
                                     trials=trials)  # fmt: skip
    split = {}
    if len(replayed) >= 2:
        earlier = pooled([sim.value for _, _, sim, _ in replayed[:-1]])
        split = simulation.last_fold_split(earlier, replayed[-1][2].value, keys)
    part.switch("statistics: P&L")
    day_pnl = {name: pnl(merged[name], config) for name in ("model", "baseline")}
    part.close()
    return {
        "model": model_summary,
        "baseline": base_summary,
        "paired": paired,
        "paired_equal_count": paired_equal,
        "split": split,
        "pnl": day_pnl,
        "folds": folds,
        "markout_curve_png": base64.b64encode(png).decode(),
    }


def to_json(value: dict) -> str:
    """NumPy scalars as Python numbers; NaN (an untested horizon) as JSON's NaN."""
    return json.dumps(value, default=lambda o: o.item() if hasattr(o, "item") else str(o))


def fold_row(fold, model_url: str, sim, figures: dict) -> dict:
    """A fold's line of the summary: its window, trade counts and the model's mark-out."""
    return {"window": fold.window(), **figures, "cache_hit": sim.cache_hit,
            "simulation_key": sim.key, "model_url": model_url}  # fmt: skip


def fold_metrics(per_fold: dict[int, dict]) -> dict[str, float]:
    """fold<k>.trades, fold<k>.baseline_trades, fold<k>.markout_bps.<h>, fold<k>.cache_hit."""
    metrics: dict[str, float] = {}
    for index, row in per_fold.items():
        k = f"fold{index}"
        metrics |= {f"{k}.trades": row["trades"], f"{k}.baseline_trades": row["baseline_trades"],
                    f"{k}.cache_hit": float(row["cache_hit"])}  # fmt: skip
        metrics |= {f"{k}.markout_bps.{h}": v for h, v in row["markout_bps"].items()}
    return metrics


def _fmt(curve: dict[str, float]) -> str:
    return ", ".join(f"{h}={v:+.2f}" for h, v in curve.items())
