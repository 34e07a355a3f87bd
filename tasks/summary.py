"""A research run's summary, and the one mark-out table the CLI and the Prefect
artifact both render."""

from __future__ import annotations

import math
from dataclasses import dataclass

from pydantic import BaseModel, Field


class ResearchSummary(BaseModel):
    """What `research` returns, `--summary-json` writes and MLflow's parent run holds."""

    dataset: str
    nodes: int = Field(description="Feature nodes of the run.")
    cache_hits: int
    computed: int
    markout_bps: dict[str, float] = Field(description="Model mark-out by horizon, all products.")
    baseline_markout_bps: dict[str, float]
    hit_rate: dict[str, float]
    baseline_hit_rate: dict[str, float]
    trades: int
    baseline_trades: int
    per_product: dict[str, dict] = Field(
        description="Per product: {'model': stats, 'baseline': stats} (count, mean_bps, hit_rate)."
    )
    model_cached: bool
    simulation_cached: bool
    model_digest: str
    model_url: str
    data_digest: str
    code_digest: str
    params_hash: str
    mlflow_run_id: str
    mlflow_stage_runs: dict[str, str | None]
    mlflow_experiment_id: str
    tracking_uri: str
    prefect_flow_run_id: str
    wall_s: float
    train_rungs: list[str] = Field(
        default_factory=list,
        description="The ladder's optimizations the model was trained with ([]: none).",
    )
    train_samples_per_s: float | None = Field(
        default=None,
        description="Training samples/s after the warm-up (compile, capture), as the ladder "
        "measures its rungs; the whole loop's rate when there was no warm-up.",
    )
    train_ladder_result: dict | None = Field(
        default=None, description="The ladder result the rungs relied on (file, commit, date)."
    )
    inference_mode: str | None = Field(
        default=None, description="How simulate predicted: 'eager' or the rungs applied."
    )
    inference_samples_per_s: float | None = Field(
        default=None, description="Windows simulate predicted per second (None when cached)."
    )


@dataclass(frozen=True, slots=True)
class TextTable:
    """A table as text cells: header, rows, and which columns are numbers (right-aligned)."""

    title: str
    columns: list[str]
    rows: list[list[str]]
    numeric: list[bool]

    def markdown(self) -> str:
        head = "| " + " | ".join(self.columns) + " |"
        rule = "|" + "".join("---:|" if n else "---|" for n in self.numeric)
        return "\n".join([head, rule, *("| " + " | ".join(r) + " |" for r in self.rows)])


def _bps(value: float) -> str:
    return "nan" if math.isnan(value) else f"{value:+.2f}"


def markout_table(summary: ResearchSummary) -> TextTable:
    """Mark-out (bps) of the model and the baseline per horizon, with trade counts and
    the hit rate at the first horizon: the result of a run, in one table."""
    horizons = list(summary.markout_bps)
    rows = []
    for name, curve, trades, hits in (
        ("model", summary.markout_bps, summary.trades, summary.hit_rate),
        ("baseline", summary.baseline_markout_bps, summary.baseline_trades,
         summary.baseline_hit_rate),
    ):  # fmt: skip
        hit = hits.get(horizons[0], math.nan) if horizons else math.nan
        rows.append([name, f"{trades:,}", *(_bps(curve[h]) for h in horizons), f"{hit:.1%}"])
    columns = ["signal", "trades", *horizons, f"hit {horizons[0]}" if horizons else "hit"]
    return TextTable(
        title="Mark-out on held-out data (bps)",
        columns=columns,
        rows=rows,
        numeric=[False] + [True] * (len(columns) - 1),
    )
