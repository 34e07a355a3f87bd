"""A promotion gate's predictions: made again (before) against read from the research
run's prediction store (tasks/research/predictions.py), on the default synthetic days.

    .venv/bin/python bench/gate_predictions.py [--products 2] [--days 4] [--repeat 3]

A model is trained on the first half of the days (the default model, few steps: its
weights do not change the cost), saved, then every day's feature table is predicted
three ways, each with a fresh predictor of the model:
- `predict, nothing kept`: what the gate did before, the peer;
- `predict and keep`: what a research run's simulation does now (hashing each table's
  inputs and writing its predictions), into an empty store;
- `read back`: what the gate does now, the model loaded from its file as the gate loads it.
Median of --repeat, wall and CPU seconds. Writes bench/results/gate-predictions.json and .md
with the machine, date and commit.
"""

from __future__ import annotations

import argparse
import datetime as dt
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.checkout import use_checkout  # noqa: E402
from bench.report import markdown_table, stamp, stamp_line, write  # noqa: E402

use_checkout()

import numpy as np  # noqa: E402

from quantloop.profiling.inference import Predictor  # noqa: E402
from quantloop.tasks.data.synthetic import SyntheticConfig, generate_day  # noqa: E402
from quantloop.tasks.research.features import FeatureParams, compute_features, feature_set  # noqa: E402
from quantloop.tasks.research.predictions import PredictionStore  # noqa: E402
from quantloop.tasks.research.training import TrainConfig, load_model, save_model, train  # noqa: E402


def timed(predictor: Predictor, tables) -> tuple[float, float, list[np.ndarray]]:
    w0, c0 = time.perf_counter(), time.process_time()
    out = [predictor(t) for t in tables]
    return time.perf_counter() - w0, time.process_time() - c0, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--products", type=int, default=2)
    ap.add_argument("--days", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    synth, params = SyntheticConfig(), FeatureParams()
    fs = feature_set(params)
    products = [f"SYN{chr(ord('A') + i)}" for i in range(args.products)]
    dates = [dt.date(2026, 1, 5) + dt.timedelta(days=i) for i in range(args.days)]
    tables = [compute_features(generate_day(p, d, synth), params) for p in products for d in dates]
    result = train(tables[: len(tables) // 2], fs.inputs, fs.labels,
                   TrainConfig(steps=20, device="cpu"))  # fmt: skip
    rows: dict[str, list[tuple[float, float]]] = {"peer": [], "keep": [], "read": []}
    with tempfile.TemporaryDirectory(prefix="quantloop-gate-bench-") as tmp:
        model_path = Path(tmp) / "model.pt"
        save_model(result, model_path)
        reference = None
        for i in range(args.repeat):
            root = str(Path(tmp) / f"store-{i}")
            wall, cpu, reference = timed(Predictor(load_model(model_path)), tables)
            rows["peer"].append((wall, cpu))
            keep = Predictor(load_model(model_path), store=PredictionStore(root))
            wall, cpu, _ = timed(keep, tables)
            rows["keep"].append((wall, cpu))
            read = Predictor(load_model(model_path), store=PredictionStore(root))
            wall, cpu, got = timed(read, tables)
            rows["read"].append((wall, cpu))
            assert read.stats.windows == 0 and read.stats.stored_windows == sum(
                t.num_rows for t in tables)  # fmt: skip
            assert all(np.array_equal(a, b) for a, b in zip(got, reference, strict=True))
    med = {k: (statistics.median(w for w, _ in v), statistics.median(c for _, c in v))
           for k, v in rows.items()}  # fmt: skip
    windows = sum(t.num_rows for t in tables)
    names = {"peer": "predict, nothing kept (the gate before)",
             "keep": "predict and keep (a simulation now)",
             "read": "read back (the gate now)"}  # fmt: skip
    table_rows = [(names[k], f"{w:.3f}", f"{c:.3f}", f"{med['peer'][0] / w:.1f}x")
                  for k, (w, c) in med.items()]  # fmt: skip
    s = stamp()
    out = {**s, "products": products, "days": [str(d) for d in dates], "windows": windows,
           "median_s": {k: {"wall": w, "cpu": c} for k, (w, c) in med.items()},
           "runs": rows, "speedup_read": med["peer"][0] / med["read"][0],
           "overhead_keep": med["keep"][0] / med["peer"][0]}  # fmt: skip
    md = (f"# A gate's predictions: made again against read back\n\n{stamp_line(s)}\n\n"
          f"{len(tables)} feature tables ({args.products} products x {args.days} default "
          f"synthetic days), {windows:,} windows, the default model on a CPU; median of "
          f"{args.repeat}, each with a fresh predictor. Ratio: the peer's wall over the "
          "row's.\n\n"
          + markdown_table(["", "wall s", "CPU s", "vs peer"], table_rows) + "\n")  # fmt: skip
    write("gate-predictions", out, md)
    print(md)


if __name__ == "__main__":
    main()
