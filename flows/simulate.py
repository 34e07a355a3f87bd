"""The simulation stage: replay held-out data, trade on the model, mark out the trades."""

from __future__ import annotations

from dataclasses import asdict

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from prefect import flow, get_run_logger
from pydantic import BaseModel

from quantloop.tasks import plots, progress, simulation, storage, tracking, training
from quantloop.tasks.form import SimForm
from quantloop.tasks.nodes import code_fingerprint
from quantloop.tasks.schema import Partition
from quantloop.tasks.simulation import (
    SimConfig,
    baseline_signal,
    markout,
    signal_column,
    split_train_test,
    summarize,
    thresholds_from,
)
from quantloop.tasks.simulation import (
    simulate as replay,
)
from quantloop.tasks.stage import (
    FeatureOutput,
    StageParams,
    feature_outputs,
    keyed_output,
    output_key,
)
from quantloop.tasks.training import TrainResult, load_model, predict


class SimSummary(BaseModel):
    model: dict  # summarize(): {product|"total": {count, mean_bps, hit_rate}}
    baseline: dict
    markout_bps: dict[str, float]  # model, all products, by horizon
    baseline_markout_bps: dict[str, float]
    trades: int
    baseline_trades: int
    cache_hit: bool = False
    mlflow_run_id: str | None = None


@flow(name="simulate")
def simulate(
    model_url: str,
    stage: StageParams = StageParams(),
    config: SimForm = SimConfig(),
    parent_run_id: str | None = None,
) -> SimSummary:
    """Replay the held-out part of every selected partition with the model and the baseline.

    Args:
        model_url: A stored model (a train run's model_url: <storage root>/models/<key>.pt).
        stage: The workspace, the partitions and their feature parameters (the features
            must be computed).
        config: When the signal trades and the mark-out horizons.
        parent_run_id: An MLflow run to record under as a child run "simulate"; empty:
            nothing is recorded.
    """
    logger = get_run_logger()
    outputs = feature_outputs(stage)
    key = output_key(
        "simulation",
        code=code_fingerprint(simulation, training),
        config=asdict(config),
        model=model_url.rsplit("/", 1)[-1],
        features=sorted(o.key for o in outputs.values()),
        holdout_fraction=stage.holdout_fraction,
    )
    model = load_model(model_url)
    sim = keyed_output(
        stage.workspace.resolve_site().root, "simulation", key, ".parquet",
        load=lambda url: _split(storage.read_parquet(url)),
        compute=lambda: replay_all(model, outputs, config, stage.holdout_fraction),
        save=lambda url, merged: storage.write_parquet_atomic(url, _stack(merged)),
    )  # fmt: skip
    merged = sim.value
    if sim.cache_hit:
        logger.info("simulation %s is cached: not replayed", key[:12])
    model_summary = summarize(merged["model"])
    base_summary = summarize(merged["baseline"])
    result = SimSummary(
        model=model_summary,
        baseline=base_summary,
        markout_bps=model_summary["total"]["mean_bps"],
        baseline_markout_bps=base_summary["total"]["mean_bps"],
        trades=model_summary["total"]["count"],
        baseline_trades=base_summary["total"]["count"],
        cache_hit=sim.cache_hit,
    )
    logger.info("model mark-out (bps): %s", _fmt(result.markout_bps))
    logger.info("baseline mark-out (bps): %s", _fmt(result.baseline_markout_bps))
    progress.note(
        "simulate",
        ("cached: " if sim.cache_hit else "")
        + f"{result.trades:,} model trades, {result.baseline_trades:,} baseline trades "
        f"on the held-out part of {len(outputs)} partitions",
    )
    if parent_run_id is not None:
        client, experiment = tracking.client_for(stage.workspace.resolve_tracking())
        with tracking.run(client, experiment, "simulate", parent=parent_run_id) as run:
            run.params({f"sim.{k}": v for k, v in asdict(config).items()})
            run.params({"model_url": model_url, "model_digest": model.model_digest})
            for name, summary in (("model", model_summary), ("baseline", base_summary)):
                for product, stats in summary.items():
                    prefix = f"{name}.{product}"
                    run.metrics({f"{prefix}.trades": stats["count"]})
                    run.metrics(
                        {f"{prefix}.markout_bps.{h}": v for h, v in stats["mean_bps"].items()}
                    )
                    run.metrics({f"{prefix}.hit_rate.{h}": v for h, v in stats["hit_rate"].items()})
            run.flush()
            run.tags({"simulation_key": key, "cache_hit": sim.cache_hit})
            run.table(_stack(merged), "markouts.parquet", "markouts")
            run.figure(
                plots.markout_curve(
                    {"model": result.markout_bps, "baseline": result.baseline_markout_bps}
                ),
                "markout_curve.png",
            )
            result.mlflow_run_id = run.run_id
    return result


def replay_all(
    model: TrainResult,
    outputs: dict[Partition, FeatureOutput],
    config: SimConfig,
    holdout_fraction: float,
) -> dict[str, dict[str, pa.Table]]:
    """Mark-outs by signal ("model", "baseline") and product, over the held-out data."""
    tables = {p: o.read() for p, o in outputs.items()}
    train_parts, test_parts = split_train_test(tables, holdout_fraction)
    marks: dict[str, dict[str, list[pa.Table]]] = {"model": {}, "baseline": {}}
    for product in sorted({p.product for p in tables}):
        train_tables = [t for p, t in train_parts.items() if p.product == product]
        test = [t for p, t in sorted(test_parts.items()) if p.product == product]
        signals = {
            "model": lambda t: signal_column(predict(model, t), config),
            "baseline": baseline_signal,
        }
        for name, signal_of in signals.items():
            # Each product's threshold comes from its own training days: trading rates match.
            threshold = thresholds_from(
                np.concatenate([signal_of(t) for t in train_tables]), config
            )
            for table in test:
                trades = replay(table, signal_of(table), threshold, config)
                marks[name].setdefault(product, []).append(markout(trades, table, config))
    return {
        name: {p: pa.concat_tables(ts) for p, ts in by_product.items()}
        for name, by_product in marks.items()
    }


def _stack(merged: dict[str, dict[str, pa.Table]]) -> pa.Table:
    """One table of every mark-out, with `signal` and `product` columns."""
    parts = []
    for name, by_product in merged.items():
        for product, t in by_product.items():
            n = t.num_rows
            t = t.append_column("signal_name", pa.array([name] * n, pa.string()))
            parts.append(t.append_column("product", pa.array([product] * n, pa.string())))
    return pa.concat_tables(parts)


def _split(table: pa.Table) -> dict[str, dict[str, pa.Table]]:
    out: dict[str, dict[str, pa.Table]] = {}
    for name in ("model", "baseline"):
        rows = table.filter(pc.equal(table["signal_name"], name))
        out[name] = {
            p: rows.filter(pc.equal(rows["product"], p)).drop_columns(["signal_name", "product"])
            for p in sorted(set(rows["product"].to_pylist()))
        }
    return out


def _fmt(curve: dict[str, float]) -> str:
    return ", ".join(f"{h}={v:+.2f}" for h, v in curve.items())
