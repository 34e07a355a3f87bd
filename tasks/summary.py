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


def _markout_rows(
    horizons: list[str], signals: list[tuple[list[str], int, dict, dict]]
) -> list[list[str]]:
    """One row per signal: its leading cells, trades, mark-out per horizon, first hit rate."""
    rows = []
    for lead, trades, curve, hits in signals:
        hit = hits.get(horizons[0], math.nan) if horizons else math.nan
        marks = (_bps(curve.get(h, math.nan)) for h in horizons)
        rows.append([*lead, f"{trades:,}", *marks, f"{hit:.1%}"])
    return rows


def _columns(lead: list[str], horizons: list[str]) -> tuple[list[str], list[bool]]:
    columns = [*lead, "trades", *horizons, f"hit {horizons[0]}" if horizons else "hit"]
    return columns, [False] * len(lead) + [True] * (len(columns) - len(lead))


def markout_table(summary: ResearchSummary) -> TextTable:
    """Mark-out (bps) of the model and the baseline per horizon, with trade counts and
    the hit rate at the first horizon: the result of a run, in one table."""
    horizons = list(summary.markout_bps)
    rows = _markout_rows(horizons, [
        (["model"], summary.trades, summary.markout_bps, summary.hit_rate),
        (["baseline"], summary.baseline_trades, summary.baseline_markout_bps,
         summary.baseline_hit_rate),
    ])  # fmt: skip
    columns, numeric = _columns(["signal"], horizons)
    return TextTable("Mark-out on held-out data (bps)", columns, rows, numeric)


def product_table(summary: ResearchSummary) -> TextTable:
    """The same mark-out per product: a row per product and signal."""
    horizons = list(summary.markout_bps)
    signals = [
        ([product, signal], stats["count"], stats["mean_bps"], stats["hit_rate"])
        for product, by_signal in sorted(summary.per_product.items())
        for signal, stats in by_signal.items()
    ]
    columns, numeric = _columns(["product", "signal"], horizons)
    return TextTable(
        "Mark-out per product (bps)", columns, _markout_rows(horizons, signals), numeric
    )
