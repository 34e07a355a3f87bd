"""The `promote` flow: move the `champion` alias to a research run's model version, only
when its gates pass; every decision, passed or refused, is recorded on the version.

Gates:
- mark-out: the candidate's out-of-sample mean mark-out at `horizon` is not worse than
  the current champion's beyond their standard errors (candidate >= champion -
  sqrt(se_c^2 + se_ch^2)); passes when there is no champion yet. Each is measured on
  its own run's held-out data.
- reproduction: the `reproduce` flow re-runs a sample of the run's nodes, its model and
  its simulation, and none fails.
- ladder: a model trained with GPU optimizations applied only rungs that the ladder
  result it relied on proved equivalent; passes for a model trained without them.
Promotion time is measured from the end of the research run to the alias moving.
"""

from __future__ import annotations

import datetime as dt
import json
import math
import time

from prefect import flow, get_run_logger

from quantloop.flows.reproduce import reproduce
from quantloop.tasks import progress, runs, tracking
from quantloop.tasks.workspace import Workspace

ALIAS = "champion"


def markout_gate(client, name: str, candidate, horizon: str, alias: str) -> dict:
    """The candidate's mark-out against the current champion's (each from its research
    run's simulation), with the standard errors."""

    def figures(run) -> tuple[float, float]:
        stages = runs.stage_runs(client, run)
        m = stages["simulate"].data.metrics
        return m[f"model.total.markout_bps.{horizon}"], m[f"model.total.markout_se_bps.{horizon}"]

    mean, se = figures(candidate)
    gate = {"horizon": horizon, "candidate_bps": mean, "candidate_se_bps": se}
    try:
        champion = client.get_model_version_by_alias(name, alias)
    except Exception:  # no such alias yet
        return {**gate, "champion": None, "passed": math.isfinite(mean),
                "why": "no champion yet" if math.isfinite(mean) else "no mark-out"}  # fmt: skip
    champion_run = client.get_run(champion.tags["research_run_id"])
    c_mean, c_se = figures(champion_run)
    margin = math.sqrt(se**2 + c_se**2)
    passed = mean >= c_mean - margin
    return {
        **gate,
        "champion": champion.version,
        "champion_bps": c_mean,
        "champion_se_bps": c_se,
        "margin_bps": margin,
        "passed": passed,
        "why": f"{mean:+.3f} {'>=' if passed else '<'} {c_mean:+.3f} - {margin:.3f} bps",
    }


def ladder_gate(version) -> dict:
    rungs = [r for r in version.tags.get("rungs", "none").split(",") if r and r != "none"]
    if not rungs:
        return {"rungs": [], "passed": True, "why": "trained without GPU optimizations"}
    proof = json.loads(version.tags.get("ladder_result") or "null") or {}
    proven = set(proof.get("proven", []))
    unproven = [r for r in rungs if r not in proven]
    return {"rungs": rungs, "ladder_result": proof.get("source"), "passed": not unproven,
            "why": "every rung proven equivalent by " + str(proof.get("source"))
            if not unproven else f"not proven equivalent: {unproven}"}  # fmt: skip


@flow(name="promote")
def promote(
    run: str,
    horizon: str = "5s",
    reproduce_sample: int = 20,
    workspace: Workspace = Workspace(),
    alias: str = ALIAS,
) -> dict:
    """Gate research run `run`'s model version (its MLflow or Prefect run id) and move
    `alias` to it when every gate passes. Returns the decision with the gate values."""
    logger = get_run_logger()
    client, _ = tracking.client_for(workspace.resolve_tracking())
    research = runs.find_research_run(client, run)
    name = research.data.tags.get("registered_model")
    number = research.data.tags.get("model_version")
    if not name or not number:
        raise LookupError(f"research run {research.info.run_id} registered no model version")
    version = client.get_model_version(name, number)
    reproduced = reproduce(research.info.run_id, sample=reproduce_sample, models=True,
                           workspace=workspace)  # fmt: skip
    gates = {
        "markout": markout_gate(client, name, research, horizon, alias),
        "reproduction": {
            "nodes": reproduced["nodes"],
            "failures": reproduced["failures"],
            "passed": reproduced["failures"] == 0,
        },  # fmt: skip
        "ladder": ladder_gate(version),
    }
    accepted = all(g["passed"] for g in gates.values())
    decided = dt.datetime.now(dt.UTC)
    decision = {
        "version": number, "model": name, "alias": alias,
        "decision": "promoted" if accepted else "refused", "gates": gates,
        "decided_at": decided.isoformat(timespec="seconds"),
    }  # fmt: skip
    if accepted:
        client.set_registered_model_alias(name, alias, number)
        ended = (research.info.end_time or research.info.start_time) / 1000
        decision["promotion_time_s"] = round(time.time() - ended, 3)
    # Every decision is kept: the latest as tags, all of them in the history.
    history = json.loads(version.tags.get("promotion.history", "[]"))
    history.append({k: decision[k] for k in ("decision", "decided_at")}
                   | {g: v["passed"] for g, v in gates.items()})  # fmt: skip
    for key, value in {
        "promotion.history": json.dumps(history),
        "promotion.decision": decision["decision"],
        "promotion.gates": json.dumps(gates, sort_keys=True, default=str),
        "promotion.decided_at": decision["decided_at"],
        **({"promotion.time_s": decision["promotion_time_s"]} if accepted else {}),
    }.items():
        client.set_model_version_tag(name, number, key, str(value))
    line = (
        f"{name} version {number}: {decision['decision']} ("
        + "; ".join(f"{g}: {'passed' if v['passed'] else 'failed'}" for g, v in gates.items())
        + ")"
    )
    logger.info(line)
    progress.note("promote", line)
    return decision
