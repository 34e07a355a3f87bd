"""The simulation stage: replay held-out data, trade on the model, mark out the trades."""

from __future__ import annotations

from dataclasses import asdict

import numpy as np
import pyarrow as pa
from prefect import flow, get_run_logger
from pydantic import BaseModel

from flows.features import feature_outputs
from flows.train import fetch_model
from quantloop.workspace import Selection, Workspace
from tasks import plots, storage, tracking
from tasks.features import FeatureParams
from tasks.simulation import (
    SimConfig,
    baseline_signal,
    markout,
    signal_column,
    split_train_test,
    summarize,
    thresholds_from,
)
from tasks.simulation import (
    simulate as replay,
)
from tasks.training import predict


class SimSummary(BaseModel):
    model: dict  # summarize(): {product|"total": {count, mean_bps, hit_rate}}
    baseline: dict
    markout_bps: dict[str, float]  # model, all products, by horizon
    baseline_markout_bps: dict[str, float]
    trades: int
    baseline_trades: int
    mlflow_run_id: str | None = None


@flow(name="simulate")
def simulate(
    model_url: str,
    workspace: Workspace = Workspace(),
    selection: Selection = Selection(),
    features: FeatureParams = FeatureParams(),
    product_features: dict[str, dict] | None = None,
    config: SimConfig = SimConfig(),
    holdout_fraction: float = 0.3,
    parent_run_id: str | None = None,
) -> SimSummary:
    """Replay the held-out part of every selected partition with the model and the baseline."""
    logger = get_run_logger()
    model = fetch_model(model_url)
    outputs = feature_outputs(workspace, selection, features, product_features)
    tables = {p: storage.read_parquet(url) for p, url in outputs.items()}
    train_parts, test_parts = split_train_test(tables, holdout_fraction)
    products = sorted({p.product for p in tables})
    marks: dict[str, dict[str, list[pa.Table]]] = {"model": {}, "baseline": {}}
    for product in products:
        train_tables = [t for p, t in train_parts.items() if p.product == product]
        test = [(p, t) for p, t in sorted(test_parts.items()) if p.product == product]
        signals = {
            "model": lambda t: signal_column(predict(model, t), config),
            "baseline": baseline_signal,
        }
        for name, signal_of in signals.items():
            # Each product's threshold comes from its own training days: trading rates match.
            sample = np.concatenate([signal_of(t) for t in train_tables])
            threshold = thresholds_from(sample, config)
            for _, table in test:
                trades = replay(table, signal_of(table), threshold, config)
                marks[name].setdefault(product, []).append(markout(trades, table, config))
    merged = {
        name: {p: pa.concat_tables(ts) for p, ts in by_product.items()}
        for name, by_product in marks.items()
    }
    model_summary = summarize(merged["model"])
    base_summary = summarize(merged["baseline"])
    result = SimSummary(
        model=model_summary,
        baseline=base_summary,
        markout_bps=model_summary["total"]["mean_bps"],
        baseline_markout_bps=base_summary["total"]["mean_bps"],
        trades=model_summary["total"]["count"],
        baseline_trades=base_summary["total"]["count"],
    )
    logger.info("model mark-out (bps): %s", _fmt(result.markout_bps))
    logger.info("baseline mark-out (bps): %s", _fmt(result.baseline_markout_bps))
    if parent_run_id is not None:
        client, experiment = tracking.client_for(workspace.resolve_tracking())
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
            for name, by_product in merged.items():
                table = pa.concat_tables(
                    [
                        t.append_column("product", pa.array([p] * t.num_rows, pa.string()))
                        for p, t in by_product.items()
                    ]
                )
                run.table(table, f"{name}_markouts.parquet", "markouts")
            run.figure(
                plots.markout_curve(
                    {"model": result.markout_bps, "baseline": result.baseline_markout_bps}
                ),
                "markout_curve.png",
            )
            result.mlflow_run_id = run.run_id
    return result


def _fmt(curve: dict[str, float]) -> str:
    return ", ".join(f"{h}={v:+.2f}" for h, v in curve.items())
