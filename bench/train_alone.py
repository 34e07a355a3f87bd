"""The research run's training, outside the flow: why its samples/s differ from the ladder's.

    python bench/train_alone.py --params bench/params/research-h200.json --out $OUT

Builds the research run's training days (the same synthetic days and features the flow
lands and computes) and trains them with profiling.trainer in a bare process: no Prefect
API, no Dask scheduler, no progress bars; and with one Python thread spinning beside it
(a stand-in for the flow process's other threads: the step's host work, the loader
thread's packing and the graph launch, needs the GIL once per step).
Writes <out>/train-alone-h200.json.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.checkout import use_checkout  # noqa: E402

use_checkout()

import torch  # noqa: E402

from quantloop.profiling.proof import plan_rungs  # noqa: E402
from quantloop.profiling.trainer import train_applied, training_set  # noqa: E402
from quantloop.tasks.data.landing import business_days  # noqa: E402
from quantloop.tasks.data.synthetic import SyntheticConfig, generate_day  # noqa: E402
from quantloop.tasks.research.features import (  # noqa: E402
    FeatureParams,
    FeatureSet,
    compute_features,
    feature_set,
)
from quantloop.tasks.research.train_config import TrainConfig  # noqa: E402
from quantloop.tasks.research.training import prepare  # noqa: E402

RUNGS = ("compile", "bf16", "device_metrics", "fused_kernel", "streams", "cudagraph", "packing",
         "flex_attention", "flat_grads")  # fmt: skip


def research_days(params: dict) -> tuple[list, FeatureSet, TrainConfig]:
    """The research run's training days for a params file (synthetic, one product), their
    features as the flow computes them, its feature layout and train config."""
    synth = SyntheticConfig(**params["data"]["synthetic"])
    n_train = params["data"]["n_dates"] - 1  # the last date is held out (holdout 0.25)
    fs = feature_set(FeatureParams())
    tables = [
        compute_features(generate_day("SYNA", day, synth), FeatureParams())
        for day in business_days(dt.date(2026, 3, 2), n_train)
    ]
    cfg = TrainConfig(**{k: v for k, v in params["train"].items() if k != "optimizations"})
    return tables, fs, cfg


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--variants", default="alone")
    args = ap.parse_args()
    params = json.loads(Path(args.params).read_text())
    tables, fs, cfg = research_days(params)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    plan = plan_rungs(RUNGS, device, head_dim=cfg.head_dim)
    data = prepare(tables, fs.inputs, fs.labels, cfg)
    work = training_set(data, packing=True)
    out = {"pack_rows": work.pack_rows, "mean_window": float(work.train.lengths.mean()),
           "windows": len(work.train), "rungs": list(plan.rungs)}  # fmt: skip
    # Variants, in the order given: "alone" (this bare process), "spinning" (one pure
    # Python thread beside the training, holding the GIL for its switch interval).
    for i, label in enumerate(args.variants.split(",")):
        stop = threading.Event()
        if label == "spinning":

            def busy(stop: threading.Event = stop) -> None:
                x = 0
                while not stop.is_set():
                    x += 1

            threading.Thread(target=busy, daemon=True).start()
        r = train_applied(tables, fs.inputs, fs.labels, cfg, plan)
        stop.set()
        out[f"{i}_{label}"] = {"steady_samples_per_s": r.steady_samples_per_s, "step_ms": r.step_ms,
                              "gpu_util": r.gpu_util, "warmup_s": r.warmup_s,
                              "model_digest": r.model_digest}  # fmt: skip
        print(label, out[f"{i}_{label}"], flush=True)
        Path(args.out).mkdir(parents=True, exist_ok=True)  # what is done survives a time limit
        (Path(args.out) / "train-alone-h200.json").write_text(json.dumps(out, indent=1))
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
