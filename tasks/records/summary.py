"""A research run's summary, and the one mark-out table the CLI and the Prefect
artifact both render."""

from __future__ import annotations

import io
import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Annotated

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pa_csv
from pydantic import BaseModel, BeforeValidator, Field

from quantloop.tasks.research.uncertainty import MIN_DAYS

# JSON has no NaN: --summary-json and Prefect's results write an untested horizon's SE (or a
# horizon with no trade's mark-out) as null, which reads back as NaN.
Bps = Annotated[float, BeforeValidator(lambda v: math.nan if v is None else v)]


class ResearchSummary(BaseModel):
    """What `research` returns, `--summary-json` writes and MLflow's parent run holds."""

    dataset: str
    nodes: int = Field(description="Feature nodes of the run.")
    cache_hits: int
    computed: int
    recomputed: dict[str, int] = Field(
        default_factory=dict,
        description="Computed feature nodes by why they ran: new, code, params, input, "
        "corrupt or missing (a stored output that failed its digest or was gone), ...",
    )
    healed_outputs: int = Field(
        default=0,
        description="Damaged stored outputs recomputed in this run: found by the check of "
        "every cache hit (verify_hits) or when read.",
    )
    markout_bps: dict[str, Bps] = Field(description="Model mark-out by horizon, all products.")
    baseline_markout_bps: dict[str, Bps]
    markout_se_bps: dict[str, Bps] = Field(
        default_factory=dict,
        description="HAC standard error of markout_bps (overlapping horizons, same-side runs: "
        "tasks/research/uncertainty.py); NaN where the horizon has too few independent windows.",
    )
    baseline_markout_se_bps: dict[str, Bps] = Field(default_factory=dict)
    insufficient: dict[str, str] = Field(
        default_factory=dict,
        description="Per horizon, why no standard error was given ('' where one was).",
    )
    paired_bps: dict[str, dict] = Field(
        default_factory=dict,
        description="Model minus baseline on the same held-out data per horizon: mean_bps, "
        "se_bps (paired HAC), p_value, p_holm (over horizons), p_adjusted (also over trials), "
        "significant (p_adjusted < 0.05), windows, n_eff, insufficient.",
    )
    trials: int = Field(
        default=1,
        description="Configurations evaluated on the same data pin and test windows (finished "
        "research runs with other parameters, and this one): the paired p-values are adjusted "
        "for them.",
    )
    paired_equal_count_bps: dict[str, dict] = Field(
        default_factory=dict,
        description="The same with both signals at one out-of-sample trade count (the more "
        "active one keeps its strongest trades). Descriptive: the cut is chosen on the test "
        "days, and bench/validity.py does not measure this SE's calibration.",
    )
    pnl: dict[str, dict] = Field(
        default_factory=dict,
        description="Per signal: daily P&L net of fees (bps of one unit per trade) at the "
        "P&L horizon, its total and the total's HAC standard error.",
    )
    hit_rate: dict[str, Bps]
    baseline_hit_rate: dict[str, Bps]
    trades: int
    baseline_trades: int
    per_product: dict[str, dict] = Field(
        description="Per product: {'model': stats, 'baseline': stats} (count, mean_bps, hit_rate)."
    )
    model_cached: bool = Field(description="Every fold's model was found by its key.")
    simulation_cached: bool = Field(description="Every fold's simulation was found by its key.")
    folds: int = Field(
        default=1,
        description="Walk-forward folds: models trained, each replayed on its own test window "
        "(the mark-outs above pool them).",
    )
    per_fold: list[dict] = Field(
        default_factory=list,
        description="Per fold, oldest first: index (its place on the walk-forward grid), "
        "train / embargo / test ({first, last, dates}), holdout_fraction (the intraday cut, "
        "None for whole dates), trades, baseline_trades, markout_bps (the model's, by "
        "horizon), model_digest, model_cached, simulation_cached.",
    )
    model_digest: str = Field(description="The last fold's model (the most recent data).")
    model_url: str
    registered_model: str | None = Field(
        default=None, description="The MLflow registered model the trained model is a version of."
    )
    model_version: str | None = None
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
    placement: str = Field(default="node", description="How feature nodes were placed.")
    bytes_across_sites: int = Field(
        default=0,
        description="Bytes read from a site other than the reader's: feature nodes' inputs, "
        "training's and simulation's feature outputs, simulation's model.",
    )
    cost: float = Field(
        default=0.0,
        description="Compute seconds (feature nodes, training loop, replay) x each site's "
        "cost_per_hour / 3600.",
    )
    sites: dict[str, dict] = Field(
        default_factory=dict,
        description="Per site: feature nodes, computed, compute_s (feature nodes), train_s, "
        "simulate_s, bytes_across, cost.",
    )
    sweep: list[dict] = Field(
        default_factory=list,
        description="A sweep's settings, best first (empty: no sweep): rank, setting (its "
        "place in the sweep), label, train (the swept fields), diff_bps and diff_se_bps (the "
        "setting's model minus the baseline at sweep_horizon, paired, all folds pooled), "
        "p_adjusted (Holm over horizons, Sidak over `trials`: every setting is a trial), "
        "significant, markout_bps, markout_se_bps, trades, per fold: model_keys, "
        "model_digests, final_loss, per_fold_markout_bps. The figures above the sweep are "
        "the best setting's; its last fold's model is the registered one.",
    )
    sweep_horizon: str | None = Field(
        default=None, description="The mark-out horizon a sweep's settings are ranked on."
    )
    sweep_models: int = Field(default=0, description="A sweep's (setting, fold) models.")
    sweep_models_cached: int = Field(default=0, description="Of them, found by their key.")
    sweep_stacks: list[dict] = Field(
        default_factory=list,
        description="The stacks a sweep trained in this run: k (models), shape, rungs, "
        "members, duration_s, warmup_s, step_ms, samples_per_s (all models, after the "
        "warm-up), peak_mem_gb, gpu_util.",
    )
    sweep_check: dict | None = Field(
        default=None,
        description="The registered model (trained stacked) against the same model trained "
        "alone: equivalent, loss_max_rel_dev, pred_rel_l2, tolerance.",
    )
    sweep_holdout: dict | None = Field(
        default=None,
        description="With two folds or more: the sweep's choice made on the folds before the "
        "last and tested on the last fold, which that choice did not see: setting, label, "
        "horizon, earlier_diff_bps and earlier_diff_se_bps (where it was chosen), diff_bps, "
        "diff_se_bps, p_adjusted (Holm over horizons, Sidak over `trials`: the other "
        "configurations tried on these data and this pick), significant, same_as_best; "
        "setting None with `why` when no setting could be judged on the earlier folds.",
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


def _bps(value: float | None) -> str:
    value = _nan(value)
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


def _nan(x: float | None) -> float:
    return math.nan if x is None else x  # a NaN that went through JSON


def _se(se: float | None) -> str:
    """An SE cell: 'n/a' where the horizon had too few independent windows for one."""
    se = _nan(se)
    return "n/a" if math.isnan(se) else f"{se:.2f}"


def _with_se(mean: float | None, se: float | None) -> str:
    """'-1.69 ± 0.12'; '-1.69 (n/a)' where the horizon had too few independent windows."""
    mean, se = _nan(mean), _nan(se)
    if math.isnan(mean):
        return "nan"
    return f"{mean:+.2f} ± {se:.2f}" if not math.isnan(se) else f"{mean:+.2f} (n/a)"


def markout_table(summary: ResearchSummary) -> TextTable:
    """Mark-out (bps) of the model and the baseline per horizon, each mean ± its HAC
    standard error on the row below it, the model-minus-baseline difference on the same
    data (paired; '*' on its SE where it survives the Holm and trials adjustment at 5%; 'n/a' where
    too few independent windows gave no SE), trade counts and the hit rate
    at the first horizon: the result of a run, in one table. A summary without standard
    errors (an older run's) shows the means alone."""
    horizons = list(summary.markout_bps)
    if not summary.markout_se_bps:
        rows = _markout_rows(horizons, [
            (["model"], summary.trades, summary.markout_bps, summary.hit_rate),
            (["baseline"], summary.baseline_trades, summary.baseline_markout_bps,
             summary.baseline_hit_rate),
        ])  # fmt: skip
        columns, numeric = _columns(["signal"], horizons)
        return TextTable("Mark-out on held-out data (bps)", columns, rows, numeric)

    def se_cells(ses: dict) -> list[str]:
        return [_se(ses.get(h, math.nan)) for h in horizons]

    def means(curve: dict) -> list[str]:
        return [_bps(curve.get(h, math.nan)) for h in horizons]

    def hit(hits: dict) -> str:
        return f"{hits.get(horizons[0], math.nan):.1%}" if horizons else "nan"

    paired = [summary.paired_bps.get(h, {}) for h in horizons]
    rows = [
        ["model", f"{summary.trades:,}", *means(summary.markout_bps), hit(summary.hit_rate)],
        ["  ± SE", "", *se_cells(summary.markout_se_bps), ""],
        ["baseline", f"{summary.baseline_trades:,}", *means(summary.baseline_markout_bps),
         hit(summary.baseline_hit_rate)],
        ["  ± SE", "", *se_cells(summary.baseline_markout_se_bps), ""],
        ["diff", "", *(_bps(d.get("mean_bps", math.nan)) for d in paired), ""],
        # the marker goes on the SE row: the diff row's cells keep the means' width
        ["  ± SE", "", *(_se(d.get("se_bps", math.nan)) + ("*" if d.get("significant") else "")
                         for d in paired), ""],
    ]  # fmt: skip
    columns, numeric = _columns(["signal"], horizons)
    return TextTable(
        "Mark-out on held-out data (bps; ± HAC SE; diff = model - baseline)", columns, rows, numeric
    )


def validity_notes(summary: ResearchSummary) -> list[str]:
    """What the table's numbers rest on, in sentences: untested horizons, the adjustment,
    the trade counts, the P&L."""
    notes = []
    untested = [h for h, why in summary.insufficient.items() if why]
    if untested:
        notes.append(
            "n/a: too few independent horizon windows for a standard error at "
            + ", ".join(untested)
            + " ("
            + summary.insufficient[untested[0]]
            + ")"
        )
    if summary.paired_bps:
        first = next(iter(summary.paired_bps.values()))
        survived = [h for h, d in summary.paired_bps.items() if d.get("significant")]
        notes.append(
            f"diff = model - baseline on the same held-out days, paired window by window; "
            f"'*' = p < 0.05 after Holm over {len(summary.paired_bps)} horizons and "
            f"{first.get('trials', 1)} trial(s) on this data: "
            f"{', '.join(survived) if survived else 'none'}"
        )
    if summary.trades != summary.baseline_trades:
        equal = summary.paired_equal_count_bps
        h = next(iter(summary.markout_bps), None)
        eq = equal.get(h) if h else None
        notes.append(
            f"trade counts differ out of sample ({summary.trades:,} vs "
            f"{summary.baseline_trades:,}); at an equal count"
            + (f" the {h} difference is {_with_se(eq['mean_bps'], eq['se_bps'])} bps"
               if eq else "") + " (summary: paired_equal_count_bps; which trades it keeps is "
            "chosen on the test days; on noise its SE held: bench/results/equal-count.md)"
        )  # fmt: skip
    days = max((len(p.get("days", {})) for p in summary.pnl.values()), default=0)
    if 0 < days < MIN_DAYS:
        notes.append(
            f"SEs are within-day: {days} test day(s) cannot show how a signal's level moves "
            f"from day to day (from {MIN_DAYS} days on, day clusters are in the SE; "
            "bench/results/validity.md: with two days the baseline's 1 s SE was 1.9x too small)"
        )
    if len(summary.sweep) > 1:
        notes.append(sweep_note(summary.sweep))
    if len(summary.sweep) > 1 and summary.sweep_holdout:
        notes.append(holdout_note(summary.sweep_holdout))
    for name, p in summary.pnl.items():
        if p.get("days"):
            notes.append(
                f"{name} P&L net of fees at {p['horizon']}: {_with_se(p['total_bps'], p['se_bps'])}"
                f" bps over {len(p['days'])} day(s)"
            )
    return notes


# The best of K no-edge settings' mean difference over its SE on noise, the range over the
# two correlations measured (bench/results/selection.md, 300 replications at 57f1c38).
BEST_OF_K_MEAN_T = {4: (0.48, 0.67), 16: (1.00, 1.27)}


def winners_curse(k: int) -> str:
    """The measured bias of the best of k settings, from the measured K beside k."""
    measured = sorted(BEST_OF_K_MEAN_T)

    def of(m: int) -> str:
        lo, hi = BEST_OF_K_MEAN_T[m]
        return f"+{lo:.1f} to +{hi:.1f} SE"

    if k in BEST_OF_K_MEAN_T:
        return f"the best of {k} averaged {of(k)}"
    if k < measured[0]:
        return f"the best of {measured[0]} averaged {of(measured[0])}, less for fewer"
    if k > measured[-1]:
        return (f"the best of {measured[-1]} averaged {of(measured[-1])}, more for more "
                f"(not measured past {measured[-1]})")  # fmt: skip
    below = max(m for m in measured if m < k)
    above = min(m for m in measured if m > k)
    return f"the best of {below} averaged {of(below)}, of {above} {of(above)}"


def sweep_note(rows: list[dict]) -> str:
    """What the best of a sweep's settings is worth: it was chosen on the same held-out
    days its figures come from, so its difference is the largest of K estimates and
    overstates the setting's edge (the winner's curse; Bailey and Lopez de Prado, "The
    Deflated Sharpe Ratio", 2014). The p-value counts the K settings (Sidak), which keeps
    the '*' calibrated (bench/results/selection.md); the point estimate is not shrunk."""
    k = len(rows)
    untested = sum(1 for r in rows if not _nan(r.get("diff_se_bps")) > 0)
    return (
        f"the best of {k} settings was chosen on these same held-out days: its diff is the "
        f"largest of {k} estimates and overstates its edge (on noise {winners_curse(k)}: "
        "bench/results/selection.md); its p adj. counts the settings as trials"
        + (f"; {untested} setting(s) with too few trades for an SE ranked after the tested "
           "ones" if untested else "")
    )  # fmt: skip


def holdout_note(h: dict) -> str:
    """The sweep's pick tested where it was not made (tasks/research/sweep.py held_out)."""
    if h.get("setting") is None:
        return f"held out: no test of the sweep's pick on the last fold: {h.get('why', '')}"
    same = "the pooled best too" if h.get("same_as_best") else "not the pooled best"
    p = _nan(h.get("p_adjusted"))
    p = "n/a" if math.isnan(p) else f"{p:.3g}"
    return (
        f"held out: chosen on the folds before the last alone, the sweep picks {h['label']} "
        f"({same}); on the last fold, which that choice did not see, its {h['horizon']} diff "
        f"is {_with_se(h.get('diff_bps'), h.get('diff_se_bps'))} bps"
        + ("*" if h.get("significant") else "")
        + f" (p adj. {p}, {h.get('trials', 1)} trial(s): this pick and "
        "the other configurations tried on these data; summary: sweep_holdout)"
    )


def site_table(summary: ResearchSummary) -> TextTable:
    """Where the run's work ran: per site, its feature nodes, the seconds of everything it
    ran (feature nodes, training, replay), the bytes it read from other sites, the cost."""
    rows = [[name, f"{c['nodes']:,}", f"{c['computed']:,}",
             f"{c['compute_s'] + c.get('train_s', 0.0) + c.get('simulate_s', 0.0):.2f}",
             f"{c['bytes_across']:,}", f"{c['cost']:.6f}"]
            for name, c in summary.sites.items()]  # fmt: skip
    columns = ["site", "nodes", "computed", "compute s", "bytes across", "cost"]
    return TextTable(f"placement {summary.placement}", columns, rows, [False] + [True] * 5)


def fold_table(summary: ResearchSummary) -> TextTable:
    """The model's mark-out on each fold's own test window: a row per fold, with the
    dates it trained and tested on and both signals' trade counts."""
    horizons = list(summary.markout_bps)

    def span(part: dict) -> str:
        if not part:
            return ""
        if part["dates"] == 1:
            return part["first"]
        return f"{part['first']}..{part['last']} ({part['dates']})"

    rows = []
    for row in summary.per_fold:
        test = span(row["test"])
        if row.get("holdout_fraction") is not None:
            test += f" last {row['holdout_fraction']:.0%}"
        curve = row["markout_bps"]
        rows.append([str(row["index"]), span(row["train"]), test, f"{row['trades']:,}",
                     f"{row['baseline_trades']:,}",
                     *(_bps(curve.get(h, math.nan)) for h in horizons)])  # fmt: skip
    columns = ["fold", "train", "test", "trades", "baseline", *horizons]
    return TextTable(
        "Model mark-out per fold (bps, each on its own test window)",
        columns,
        rows,
        [False, False, False] + [True] * (len(columns) - 3),
    )


def sweep_table(summary: ResearchSummary) -> TextTable:
    """A sweep's settings, best first: the paired difference from the baseline at the
    ranking horizon with its SE and adjusted p-value, the model's own mark-out there,
    its trades, and whether its models were found by key."""
    h = summary.sweep_horizon or ""

    def p(value: float | None) -> str:
        value = _nan(value)
        return "n/a" if math.isnan(value) else f"{value:.3g}"

    rows = [[str(r["rank"]), r["label"], _bps(r.get("diff_bps")),
             _se(r.get("diff_se_bps")) + ("*" if r.get("significant") else ""),
             p(r.get("p_adjusted")), _bps(r.get("markout_bps")), f"{r['trades']:,}",
             "yes" if r.get("models_cached") else "no"]
            for r in summary.sweep]  # fmt: skip
    columns = ["rank", "setting", f"diff {h}", "± SE", "p adj.", f"model {h}", "trades",
               "cached"]  # fmt: skip
    return TextTable(f"Sweep: settings ranked on the paired {h} mark-out (bps)", columns, rows,
                     [False, False] + [True] * 5 + [False])  # fmt: skip


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


NODE_COLUMNS = ["product", "date", "key", "cache_hit", "status", "reason", "error", "rows",
                "output_length", "duration_s"]  # fmt: skip
_COUNTS = ("nodes", "computed", "cache_hits", "failed", "output_rows", "output_bytes",
           "compute_s")  # fmt: skip


def node_summary(parts: Iterable[pa.Table]) -> tuple[pa.Table, pa.Table]:
    """A run's node records (its manifest, a part at a time: only one part is held) as
    (by product, failures). By product: nodes, computed, cache hits, failed, why they
    were recomputed, output rows and bytes, compute seconds: a table small enough for a
    UI to show. Failures: product, date, key and error of every failed node."""
    by: dict[str, dict] = {}
    failed_parts = []
    for part in parts:
        ran = pc.invert(part["cache_hit"])
        failed = pc.equal(part["status"], "failed")
        t = pa.table({
            "product": part["product"],
            "nodes": pa.repeat(pa.scalar(1, pa.int64()), part.num_rows),
            "computed": pc.cast(pc.and_(ran, pc.invert(failed)), pa.int64()),
            "cache_hits": pc.cast(part["cache_hit"], pa.int64()),
            "failed": pc.cast(failed, pa.int64()),
            "output_rows": part["rows"],
            "output_bytes": part["output_length"],
            "compute_s": pc.if_else(ran, part["duration_s"], 0.0),
        })  # fmt: skip
        sums = t.group_by("product").aggregate([(c, "sum") for c in _COUNTS]).to_pylist()
        for row in sums:
            acc = by.setdefault(row["product"], {c: 0 for c in _COUNTS} | {"why": {}})
            for c in _COUNTS:
                acc[c] += row[f"{c}_sum"] or 0
        reasons = part.filter(ran).group_by(["product", "reason"]).aggregate([("reason", "count")])
        for row in reasons.to_pylist():
            why = by[row["product"]]["why"]
            why[row["reason"] or "?"] = why.get(row["reason"] or "?", 0) + row["reason_count"]
        if pc.any(failed).as_py():
            failed_parts.append(part.filter(failed).select(["product", "date", "key", "error"]))
    products = sorted(by)
    summary = pa.table({
        "product": products,
        **{c: [by[p][c] for p in products] for c in _COUNTS[:-1]},
        "why_recomputed": [", ".join(f"{k} {v}" for k, v in sorted(by[p]["why"].items()))
                           for p in products],
        "compute_s": [round(by[p]["compute_s"], 4) for p in products],
    })  # fmt: skip
    order = ["product", "nodes", "computed", "cache_hits", "failed", "why_recomputed",
             "output_rows", "output_bytes", "compute_s"]  # fmt: skip
    failures = (
        pa.concat_tables(failed_parts)
        if failed_parts
        else pa.table({c: pa.array([], pa.string()) for c in ("product", "date", "key", "error")})
    )
    return summary.select(order), failures


def csv_bytes(table: pa.Table) -> bytes:
    """A table as CSV (MLflow's UI shows .csv artifacts as tables)."""
    sink = io.BytesIO()
    pa_csv.write_csv(table, sink)
    return sink.getvalue()
