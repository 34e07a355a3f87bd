"""The `promote` flow: move the `champion` alias to a research run's model version, only
when its gates pass; every decision, passed or refused, is recorded on the version.

Gates:
- mark-out: the candidate and the model it would replace are replayed on one held-out
  window that neither was trained on (tasks/research/window.py): what the candidate held out (the
  test part of the fold its lineage record names: whole dates, or the end of one day)
  minus what the champion trained on (the training part of its own lineage's fold).
  Each model reads the features it was trained on (its run's feature parameters, found
  or computed by the features flow, the champion's on the window through a backtest's
  stage) and trades by the candidate run's simulation config, at a threshold from its
  own training part, as replay_all does. The test is tasks/research/gate.py's one-sided paired
  HAC t test of candidate minus champion > min_improvement_bps at `horizon`, its p-value
  adjusted (Sidak) for the trials on the same data pin and held-out window
  (tasks/records/runs.py count_trials). With no champion yet, the first one must beat the
  baseline signal (top-of-book imbalance) the same way, on the candidate's held-out
  part. An empty window, or too few effective horizon windows, is a refusal, never a
  pass.
- reproduction: the `reproduce` flow re-runs a sample of the run's nodes, its model and
  its simulation, and none fails.
- ladder: a model trained with GPU optimizations applied only rungs that the ladder
  result it relied on proved equivalent; passes for a model trained without them.
The version records the decision: `promotion.decision`, `promotion.gates` (every gate's
values, JSON), `promotion.markout.<field>` (the test, alpha, margin, windows, n_eff,
statistic, p-values raw and adjusted, trials, both trade counts, why) and
`promotion.markout.window`, and `promotion.history`. Promotion time is measured from the
end of the research run to the alias moving.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import getpass
import json
import math
import os
import socket
import time
from typing import Annotated

import pyarrow as pa
from mlflow.entities import Run
from prefect import flow, get_run_logger
from pydantic import Field, TypeAdapter

from quantloop.flows.backtest import backtest_stage
from quantloop.flows.features import features as features_flow
from quantloop.flows.reproduce import reproduce
from quantloop.profiling.replay import predictor_for
from quantloop.tasks.data.schema import Partition
from quantloop.tasks.engine import storage
from quantloop.tasks.records import promotion, registry, runs, tracking
from quantloop.tasks.records.recipe import RESOLVED_PARAMS, read_recipe
from quantloop.tasks.research.folds import split_fold
from quantloop.tasks.research.gate import GateConfig, GateResult, paired_gate
from quantloop.tasks.research.simulation import SimConfig, baseline_signal
from quantloop.tasks.research.sited import catalog_at, model_copy
from quantloop.tasks.research.stage import StageParams, feature_outputs, read_outputs
from quantloop.tasks.research.uncertainty import Sample, window_seconds
from quantloop.tasks.research.window import (
    Window,
    held_out_id,
    lineage_fold,
    replay_window,
    shared_window,
)
from quantloop.tasks.runtime import progress
from quantloop.tasks.runtime.workspace import Selection, Workspace

ALIAS = "champion"

Horizon = Annotated[
    str,
    Field(
        pattern=r"^[0-9]+(\.[0-9]+)?(s|ev)$",
        description="Mark-out horizon the gate tests: a horizon of the candidate run's "
        "simulation, in seconds ('5s') or order-book events ('100ev').",
    ),
]
Alpha = Annotated[
    float,
    Field(
        gt=0,
        lt=0.5,
        description="Significance level of the one-sided paired test, after the trials "
        "adjustment (0 to 0.5, exclusive).",
    ),
]
MinImprovement = Annotated[
    float,
    Field(
        ge=0,
        le=100,
        description="Margin in basis points (0 to 100) by which the candidate's mean "
        "mark-out must beat the incumbent's on the shared window.",
    ),
]


def run_stage(client, run: Run) -> tuple[StageParams, SimConfig]:
    """A research (or retrain) run's stage, from its records: its workspace, its pinned
    selection, its feature parameters and validation; and its simulation config."""
    resolved = json.loads(runs.read_artifact(client, run.info.run_id, RESOLVED_PARAMS))
    params = resolved["params"]
    stage = StageParams.model_validate({
        "workspace": Workspace.model_validate(json.loads(run.data.tags[tracking.WORKSPACE_TAG])),
        "selection": resolved["selection"], "features": params["features"],
        "product_features": params.get("product_features") or {},
        # a run from before the folds has holdout_fraction (the single split) instead
        **{k: params[k] for k in ("validation", "holdout_fraction") if k in params},
    })  # fmt: skip
    return stage, TypeAdapter(SimConfig).validate_python(params["simulation"])


def feature_tables(stage: StageParams) -> tuple[dict[Partition, pa.Table], dict[Partition, str]]:
    """The stage's feature tables, computed or found by the features flow as a
    backtest's are, then read (each checked against its digest); and their node keys."""
    features_flow(stage)
    outputs = feature_outputs(stage)
    return read_outputs(stage, outputs), {p: o.key for p, o in outputs.items()}


def model_url(run: Run, model_key: str) -> str:
    """Where a run's model is stored: a copy its catalog records (the site that trained
    it first), else in the run's store."""
    root = run.data.tags[tracking.STORE_TAG]
    catalog = catalog_at(run.data.tags.get(tracking.CATALOG_TAG, ""))
    if catalog is not None:
        try:
            return model_copy(catalog, model_key, [root])
        except LookupError as exc:
            raise LookupError(f"model {model_key[:12]} of run {run.info.run_id}: {exc}") from exc
    url = storage.join(root, "models", f"{model_key}.pt")
    if not storage.exists(url):
        raise LookupError(f"model {model_key[:12]} of run {run.info.run_id} is not in its "
                          f"store ({url})")  # fmt: skip
    return url


def made_from(
    run: Run, lineage: dict, tables: dict[Partition, pa.Table], keys: dict[Partition, str]
) -> tuple[dict[Partition, pa.Table], bool]:
    """The tables of the partitions a model's lineage record names (from its run's stage),
    and whether they are the features it was trained on (the same feature node keys; not
    when the feature code has changed since)."""
    named = set(lineage["partitions"])
    found = {p: t for p, t in tables.items() if str(p) in named}
    if len(found) != len(named):
        missing = sorted(named - {str(p) for p in found})
        raise LookupError(f"run {run.info.run_id}'s selection lacks partitions its model was "
                          f"made from: {missing[:5]}")  # fmt: skip
    return found, sorted(keys[p] for p in found) == sorted(lineage.get("feature_keys", []))


def window_stage(recipe, workspace: Workspace, selection: Selection, window: Window) -> StageParams:
    """A model's features (its recipe's parameters, as a backtest reads them) on the
    window's partitions of the candidate's pinned data."""
    days = sorted({p.date for p in window.start})
    products = sorted({p.product for p in window.start})
    stage = backtest_stage(recipe, workspace, products, days[0], days[-1])
    return stage.model_copy(update={"selection": selection.model_copy(
        update={"products": products, "start": days[0], "end": days[-1]})})  # fmt: skip


def cut(tables: dict[Partition, pa.Table], window: Window) -> dict[Partition, pa.Table]:
    """Each window partition's table from the window's first row to the day's end."""
    out = {}
    for p, start in window.start.items():
        if tables[p].num_rows != window.rows[p]:
            raise ValueError(f"{p}: {tables[p].num_rows} feature rows here, {window.rows[p]} "
                             "in the candidate's: not the same events")  # fmt: skip
        out[p] = tables[p].slice(start)
    return out


def empty_window_result(window: Window, cfg: GateConfig, against: str, trials: int) -> GateResult:
    """The refusal when there is no window to test on: the test's fields with no trades,
    and the window's reason as the why."""
    empty = Sample.of([], f"markout_{cfg.horizon}")
    result = paired_gate(empty, empty, window_seconds(cfg.horizon), cfg, against=against,
                         trials=trials)  # fmt: skip
    return dataclasses.replace(result, why=window.why_empty())


def _finite(value):
    """NaN and infinities as None: the record is JSON that any reader parses."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value


def markout_gate(client, name: str, candidate: Run, version, cfg: GateConfig, alias: str,
                 logger) -> dict:  # fmt: skip
    """Candidate against champion (or, with no champion, the baseline) on the shared
    held-out window: the paired test's result, the window and what was compared."""
    stage, sim = run_stage(client, candidate)
    if cfg.horizon not in sim.horizon_keys():
        raise ValueError(f"horizon {cfg.horizon!r} is not one of the candidate run's mark-out "
                         f"horizons {sim.horizon_keys()}")  # fmt: skip
    tables, _ = feature_tables(stage)
    fold = lineage_fold(runs.model_lineage(client, candidate))  # what the candidate held out
    train, _ = split_fold(tables, fold)
    digest = candidate.data.tags.get("data_digest", "")
    trials = runs.count_trials(client, candidate.info.experiment_id, digest, held_out_id(fold))
    try:
        champion = client.get_model_version_by_alias(name, alias)
    except Exception:  # no such alias yet: the first champion
        champion = None
    record: dict = {"against": "baseline" if champion is None else "champion",
                    "champion": None if champion is None else str(champion.version)}  # fmt: skip
    if champion is None:
        window = shared_window(tables, fold)
    else:
        recipe = read_recipe(client, champion, stage.workspace.catalog())
        champion_run = client.get_run(recipe.source_run_id)
        champion_stage, _ = run_stage(client, champion_run)
        lineage = runs.model_lineage(client, champion_run)
        champion_fold = lineage_fold(lineage)
        trained_on, record["champion_features_as_trained"] = made_from(
            champion_run, lineage, *feature_tables(champion_stage))  # fmt: skip
        window = shared_window(tables, fold, trained_on, champion_fold)
    record["window"] = window.record()
    col = f"markout_{cfg.horizon}"
    if window.empty:
        return {**record, **empty_window_result(window, cfg, record["against"], trials).as_dict()}
    logger.info("mark-out gate: %s version %s against %s on %d partitions (%d events) of %s",
                name, version.version, record["against"], len(window.start), window.events(),
                ", ".join(record["window"]["days"]))  # fmt: skip
    candidate_url = model_url(candidate, version.tags["model_key"])
    # Both models' predictions of these days are read where the research runs that made
    # the models kept them (their simulations replayed the same days), else made and kept.
    root = stage.workspace.resolve_site().root
    predictors = {"candidate": predictor_for(candidate_url, root)}
    ours = replay_window(predictors["candidate"], train, cut(tables, window), sim)
    if champion is None:
        theirs = replay_window(baseline_signal, train, cut(tables, window), sim)
    else:
        at = window_stage(recipe, stage.workspace, stage.selection, window)
        champion_train, _ = split_fold(trained_on, champion_fold)
        predictors["incumbent"] = predictor_for(model_url(champion_run, recipe.model_key), root)
        theirs = replay_window(predictors["incumbent"], champion_train,
                               cut(feature_tables(at)[0], window), sim)  # fmt: skip
    record["predictions"] = {who: {"predicted": p.stats.windows, "stored": p.stats.stored_windows}
                             for who, p in predictors.items()}  # fmt: skip
    mine, incumbent = Sample.of(list(ours.values()), col), Sample.of(list(theirs.values()), col)
    result: GateResult = paired_gate(
        mine, incumbent, window_seconds(cfg.horizon, [*ours.values(), *theirs.values()]), cfg,
        against=record["against"], trials=trials,
    )  # fmt: skip
    means = {f"{who}_bps": float(s.values.mean()) if len(s) else math.nan
             for who, s in (("candidate", mine), ("incumbent", incumbent))}  # fmt: skip
    return {**record, **means, **result.as_dict()}


def ladder_gate(version) -> dict:
    """The rungs a model was trained with were proven equivalent: the ladder's by the
    ladder result it relied on; "stacked" (a sweep's models trained as one stack,
    flows/sweep.py) by its run's check of this model against its solo training (the
    version's `stack_check` tag)."""
    rungs = [r for r in version.tags.get("rungs", "none").split(",") if r and r != "none"]
    stacked = "stacked" in rungs
    rungs = [r for r in rungs if r != "stacked"]
    if stacked:
        check = json.loads(version.tags.get("stack_check") or "null")
        if not check or not check.get("equivalent"):
            why = ("trained in a stack without a check against its solo training"
                   if not check else "trained in a stack, and not equivalent to its solo "
                   f"training: loss curve {check['loss_max_rel_dev']:.2e}, predictions "
                   f"{check['pred_rel_l2']:.2e} against the {check['tolerance']}")  # fmt: skip
            return {"rungs": ["stacked", *rungs], "passed": False, "why": why}
    if not rungs:
        return {"rungs": ["stacked"] if stacked else [], "passed": True,
                "why": "trained stacked, equivalent to its solo training (the run's check)"
                if stacked else "trained without GPU optimizations"}  # fmt: skip
    proof = json.loads(version.tags.get("ladder_result") or "null") or {}
    proven = set(proof.get("proven", []))
    unproven = [r for r in rungs if r not in proven]
    return {"rungs": (["stacked"] if stacked else []) + rungs,
            "ladder_result": proof.get("source"), "passed": not unproven,
            "why": "every rung proven equivalent by " + str(proof.get("source"))
            + (" and the stack by the run's check" if stacked else "")
            if not unproven else f"not proven equivalent: {unproven}"}  # fmt: skip


# The mark-out gate's values, each a tag of its own on the version (promotion.markout.*).
MARKOUT_TAGS = (
    "against", "champion", "test", "alpha", "min_improvement_bps", "horizon", "difference_bps",
    "se_bps", "windows", "n_eff", "statistic", "p_value", "p_adjusted", "trials",
    "candidate_trades", "incumbent_trades", "candidate_bps", "incumbent_bps", "why",
)  # fmt: skip


def promoter_of(tracking_block) -> str:
    """Who promotes: the MLflow identity the flow records as (the tracking block's user,
    else MLFLOW_TRACKING_USERNAME); on a store without identities (embedded SQLite), the
    operating-system user and host, said to be no MLflow identity."""
    user = tracking_block.username or os.environ.get("MLFLOW_TRACKING_USERNAME")
    if user and tracking_block.resolved_uri().startswith(("http://", "https://")):
        return user
    return f"{getpass.getuser()}@{socket.gethostname()} (no MLflow identity: local store)"


def skipped_reproduction(gates: dict) -> dict:
    failed = [g for g, v in gates.items() if not v["passed"]]
    return {"nodes": 0, "failures": 0, "passed": None, "skipped": True,
            "why": f"not run: the {' and '.join(failed)} gate failed, so the version is "
                   "refused whatever it would show"}  # fmt: skip


def record_decision(client, decision: dict, *, candidate, guarded: str, alias: str,
                    research_ended_s: float | None) -> dict:  # fmt: skip
    """Record `decision` (its gates, the promoter, when) on the candidate version; when
    promoted, copy the candidate into the guarded model (the copy carries the record, and
    names its source), and only then move `alias` to the copy. Returns the decision with
    `champion_version` (and `promotion_time_s`) when promoted."""
    name, number = candidate.name, str(candidate.version)
    accepted = decision["decision"] == "promoted"
    gates = decision["gates"]
    if accepted and research_ended_s is not None:
        decision["promotion_time_s"] = round(time.time() - research_ended_s, 3)
    # Every decision is kept: the latest as tags, all of them in the history.
    history = json.loads((candidate.tags or {}).get("promotion.history", "[]"))
    history.append({k: decision[k] for k in ("decision", "decided_at", "promoter")}
                   | {g: v["passed"] for g, v in gates.items()}
                   | {"p_adjusted": gates["markout"].get("p_adjusted")}
                   | ({"time_s": decision["promotion_time_s"]}
                      if "promotion_time_s" in decision else {}))  # fmt: skip
    markout = gates["markout"]
    tags = {
        "promotion.history": json.dumps(history),
        promotion.DECISION: decision["decision"],
        promotion.GATES: json.dumps(gates, sort_keys=True, default=str),
        promotion.DECIDED_AT: decision["decided_at"],
        promotion.PROMOTER: decision["promoter"],
        **{f"promotion.markout.{k}": "" if markout.get(k) is None else markout[k]
           for k in MARKOUT_TAGS},
        "promotion.markout.window": json.dumps(markout.get("window"), sort_keys=True),
        **({promotion.TIME_S: decision["promotion_time_s"]}
           if "promotion_time_s" in decision else {}),
    }  # fmt: skip
    for key, value in tags.items():
        client.set_model_version_tag(name, number, key, str(value))
    if promotion.TIME_S not in tags:  # a refusal: no promotion time of an earlier one stays
        with contextlib.suppress(Exception):  # MLflow's RESOURCE_DOES_NOT_EXIST: none there
            client.delete_model_version_tag(name, number, promotion.TIME_S)
    if not accepted:
        return decision
    source = f"{name}/{number}"
    if name == guarded:  # a version registered in the guarded model before candidates were
        champion = candidate
    else:
        champion = registry.copy_version(client, name, number, guarded)
    # The copy has the candidate's tags, the record included; it names its source.
    client.set_model_version_tag(guarded, champion.version, promotion.SOURCE, source)
    if name != guarded:
        client.set_model_version_tag(name, number, promotion.CHAMPION_VERSION,
                                     f"{guarded}/{champion.version}")  # fmt: skip
    client.set_registered_model_alias(guarded, alias, champion.version)
    decision["champion_version"] = str(champion.version)
    return decision


@flow(name="promote")
def promote(
    run: str,
    horizon: Horizon = "5s",
    alpha: Alpha = 0.05,
    min_improvement_bps: MinImprovement = 0.0,
    reproduce_sample: int = 20,
    workspace: Workspace = Workspace(),
    alias: str = ALIAS,
) -> dict:
    """Gate research run `run`'s candidate model version (its MLflow or Prefect run id);
    when every gate passes, copy it into the guarded registered model and move `alias`
    to the copy. Returns the decision with the gate values.

    Args:
        run: The research (or retrain) run: its MLflow run id or Prefect flow run id.
        horizon: Mark-out horizon the gate tests: a horizon of the candidate run's
            simulation, in seconds ('5s') or order-book events ('100ev').
        alpha: Significance level of the one-sided paired test, after the trials
            adjustment (0 to 0.5, exclusive).
        min_improvement_bps: Margin in basis points (0 to 100) by which the candidate's
            mean mark-out must beat the incumbent's on the shared window.
        reproduce_sample: Feature nodes the reproduction gate re-runs (only when the
            mark-out and ladder gates have passed).
        workspace: Where the tracking server is (the runs' own records say where their
            data and outputs are); under `quantloop serve`, as the promoter identity.
        alias: The alias to move.
    """
    logger = get_run_logger()
    cfg = GateConfig(alpha=alpha, min_improvement_bps=min_improvement_bps, horizon=horizon)
    tracking_block = workspace.resolve_tracking()
    client, _ = tracking.client_for(tracking_block)
    guarded = tracking_block.registered_model
    research = runs.find_research_run(client, run)
    name = research.data.tags.get("registered_model")
    number = research.data.tags.get("model_version")
    if not name or not number:
        raise LookupError(f"research run {research.info.run_id} registered no model version")
    version = client.get_model_version(name, number)
    # The cheap gates first: the reproduction (1.5-3 min) runs only when they pass.
    gates = {
        "ladder": ladder_gate(version),
        "markout": markout_gate(client, guarded, research, version, cfg, alias, logger),
    }
    if all(g["passed"] for g in gates.values()):
        reproduced = reproduce(research.info.run_id, sample=reproduce_sample, models=True,
                               workspace=workspace)  # fmt: skip
        gates["reproduction"] = {"nodes": reproduced["nodes"],
                                 "failures": reproduced["failures"],
                                 "passed": reproduced["failures"] == 0}  # fmt: skip
    else:
        gates["reproduction"] = skipped_reproduction(gates)
    gates = _finite({g: gates[g] for g in ("markout", "reproduction", "ladder")})
    accepted = all(g["passed"] for g in gates.values())
    decision = {
        "version": number, "model": name, "alias": alias, "guarded_model": guarded,
        "decision": "promoted" if accepted else "refused", "gates": gates,
        "decided_at": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "promoter": promoter_of(tracking_block),
    }  # fmt: skip
    ended = (research.info.end_time or research.info.start_time) / 1000
    decision = record_decision(client, decision, candidate=version, guarded=guarded,
                               alias=alias, research_ended_s=ended)  # fmt: skip
    line = (
        f"{name} version {number}: {decision['decision']} ("
        + "; ".join(f"{g}: passed" if v["passed"] else
                    f"{g}: {'skipped' if v.get('skipped') else 'failed'}, {v.get('why', '')}"
                    for g, v in gates.items())
        + ")"
        + (f"; {alias} -> {guarded} version {decision['champion_version']}"
           if accepted else "")
    )  # fmt: skip
    logger.info(line)
    progress.note("promote", line)
    return decision
