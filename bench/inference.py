"""Bulk prediction: a trained model over whole held-out days, eager against the fast path.

    python bench/inference.py --model MODEL.pt --out $OUT [--days 2] [--params params.json]

The days are new synthetic days of the research run's data settings (dates after the ones
it trained and was tested on). Eager is tasks.training.predict (padded windows, float32);
fast is profiling.inference.Predictor with the rungs the model was trained with (packed,
bf16, compiled, one CUDA graph per group of windows). The first day's fast pass includes
compiling and capturing (warmup_s); the figures are the later days'. Writes
<out>/inference-h200.json.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.checkout import use_checkout  # noqa: E402
from bench.report import commit, stamp  # noqa: E402

use_checkout()

import torch  # noqa: E402

from quantloop.profiling.equivalence import rel_l2  # noqa: E402
from quantloop.profiling.inference import Predictor  # noqa: E402
from quantloop.tasks.data.synthetic import SyntheticConfig, generate_day  # noqa: E402
from quantloop.tasks.research.features import FeatureParams, compute_features  # noqa: E402
from quantloop.tasks.research.training import load_model, predict  # noqa: E402


def timed(fn, *args):
    torch.cuda.synchronize() if torch.cuda.is_available() else None
    t0 = time.perf_counter()
    out = fn(*args)
    return out, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--params", default="", help="the research run's --params JSON")
    ap.add_argument("--days", type=int, default=3)
    ap.add_argument("--commit", default="")
    args = ap.parse_args()
    params = json.loads(Path(args.params).read_text()) if args.params else {}
    data = params.get("data", {})
    synth = SyntheticConfig(**{**data.get("synthetic", {}), "seed": 7})  # unseen days
    product = data.get("products", ["SYNA"])[0]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = load_model(args.model, device=device)
    fast = Predictor(model)
    rows = []
    for i in range(args.days):
        date = dt.date(2027, 1, 4) + dt.timedelta(days=i)
        table = compute_features(generate_day(product, date, synth), FeatureParams())
        eager_pred, eager_s = timed(predict, model, table)
        fast_pred, fast_s = timed(fast, table)
        rows.append({
            "date": str(date), "windows": table.num_rows, "eager_s": eager_s, "fast_s": fast_s,
            "eager_samples_per_s": table.num_rows / eager_s,
            "fast_samples_per_s": table.num_rows / fast_s,
            "pred_rel_l2": rel_l2(fast_pred, eager_pred),
        })  # fmt: skip
        print(json.dumps(rows[-1]), flush=True)
    later = rows[1:] or rows
    windows = sum(r["windows"] for r in later)
    eager = windows / sum(r["eager_s"] for r in later)
    fastest = windows / sum(r["fast_s"] for r in later)
    result = {
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "torch": torch.__version__,
        "date": stamp()["date"],
        "commit": args.commit or commit(),
        "model": Path(args.model).name,
        "model_rungs": list(model.rungs),
        "fast_mode": fast.stats.mode,
        "window": model.train_config.window,
        "window_s": model.train_config.window_s,
        "eager_samples_per_s": eager,
        "fast_samples_per_s": fastest,
        "speedup": fastest / eager,
        "fast_warmup_s": fast.stats.warmup_s,
        "max_pred_rel_l2": max(r["pred_rel_l2"] for r in rows),
        "days": rows,
        "note": "samples/s over the days after the first (the first fast pass compiles and "
        "captures); host packing and copies included in fast_s",
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "inference-h200.json").write_text(json.dumps(result, indent=2))
    print(json.dumps({k: v for k, v in result.items() if k != "days"}, indent=1))


if __name__ == "__main__":
    main()
