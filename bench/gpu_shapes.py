"""A research run's GPU training on shapes other than the ladder's: every rung `auto` may
apply, on windows of 32 to 256 events and models of 32 to 128 wide, each against the
plain loop.

    python bench/gpu_shapes.py --out DIR [--commit C] [--steps 60]

The ladder proves its rungs on one shape (rows of 256 events, d_model 128, 4 heads); a
research run applies them to whatever its parameters say, and TrainConfig's defaults are
windows of 32 events and a model 32 wide (head dimension 8); the last two shapes have
head dimensions 64 and 128. FlexAttention's sparse block
and its kernels' tiles depend on the row length (packing.flex_layout), so every shape here
trains with all the switches a research run can apply (autotune aside), for --steps steps,
and the same model is trained by the plain loop (eager float32) from the same seed; the
fast model's held-out predictions are also made by simulate's bulk path (Predictor). Per
shape: did it train, its samples/s after the warm-up, the sparse block, and how far its
predictions on a held-out table are from the plain loop's (relative L2; the ladder's bf16
tolerance is 0.05 after 300 steps). A failing shape is reported with its error.
Writes <out>/gpu-shapes.json (machine, date, commit) and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.checkout import use_checkout  # noqa: E402
from bench.report import commit, stamp  # noqa: E402

use_checkout()

import numpy as np  # noqa: E402
import pyarrow as pa  # noqa: E402
import torch  # noqa: E402

from quantloop.profiling.inference import Predictor  # noqa: E402
from quantloop.profiling.packing import MIN_HEAD_DIM, flex_layout  # noqa: E402
from quantloop.profiling.trainer import train_applied  # noqa: E402
from quantloop.tasks.research.train_config import OPTIMIZATIONS, TrainConfig  # noqa: E402
from quantloop.tasks.research.training import predict  # noqa: E402

# (window, window_s, d_model, n_heads): TrainConfig's defaults first (fixed windows), then
# clock windows (events ~1 s apart: ~window/4 events a window, varying) past each block size
SHAPES = (
    (32, None, 32, 4), (48, 12.0, 32, 2), (64, 16.0, 64, 4), (100, 25.0, 64, 4),
    (200, 50.0, 128, 4), (256, 64.0, 128, 4), (200, 50.0, 128, 2), (256, 64.0, 256, 2),
)  # fmt: skip


def table(n: int, seed: int) -> pa.Table:
    """label = sum of `a` over the last 4 events (a model must read the window to fit it)."""
    rng = np.random.default_rng(seed)
    a, b = rng.standard_normal(n), rng.standard_normal(n)
    c = np.cumsum(a)
    label = c - np.concatenate([np.zeros(4), c[:-4]]) + 0.05 * rng.standard_normal(n)
    time = np.cumsum(rng.exponential(1.0, n))
    return pa.table({"time": time, "a": a, "b": b, "label_4": label})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--commit", default=os.environ.get("QUANTLOOP_GIT_COMMIT", ""))
    ap.add_argument("--steps", type=int, default=60)
    args = ap.parse_args()
    tables, held_out = [table(4000, 0), table(4000, 1)], table(2000, 2)
    rungs = tuple(n for n in OPTIMIZATIONS if n != "autotune")
    rows = []
    for window, window_s, d_model, heads in SHAPES:
        base = dict(window=window, window_s=window_s, stride=2, d_model=d_model, n_heads=heads,
                    batch_size=64, steps=args.steps, lr=1e-3, log_every=10, seed=0)  # fmt: skip
        row = {"window": window, "window_s": window_s, "d_model": d_model, "heads": heads,
               "flex_block": flex_layout(window, d_model // heads, tuned=True)[0]
               if d_model // heads >= MIN_HEAD_DIM else None}  # fmt: skip
        try:
            fast = train_applied(tables, ["a", "b"], ["label_4"],
                                 TrainConfig(**base, optimizations=rungs))  # fmt: skip
            plain = train_applied(tables, ["a", "b"], ["label_4"],
                                  TrainConfig(**base, optimizations="none"))  # fmt: skip
            p_fast, p_plain = predict(fast, held_out), predict(plain, held_out)
            bulk = Predictor(fast)  # simulate's fast path, where it applies
            p_bulk = bulk(held_out)
            ok = np.isfinite(p_fast).all()
            row |= {
                "trained": bool(ok),
                "rungs": list(fast.rungs),
                "samples_per_s": fast.steady_samples_per_s,
                "plain_samples_per_s": plain.samples_per_s,  # no warm-up to leave out
                "final_loss": fast.loss_curve[-1],
                "plain_final_loss": plain.loss_curve[-1],
                "pred_rel_l2": float(np.linalg.norm(p_fast - p_plain) / np.linalg.norm(p_plain)),
                "inference_mode": bulk.stats.mode,
                "inference_rel_l2": float(np.linalg.norm(p_bulk - p_fast) / np.linalg.norm(p_fast)),
            }
        except Exception as exc:  # noqa: BLE001 - a shape that fails is the finding
            first = (str(exc).strip().splitlines() or [""])[0][:300]
            row |= {"trained": False, "error": f"{type(exc).__name__}: {first}"}
        rows.append(row)
        print(row, flush=True)
    print(
        "\n| window | d_model | heads | flex block | trained | samples/s | plain | pred rel L2 "
        "| bulk inference vs eager |"
    )
    print("|---:|---:|---:|---:|---|---:|---:|---:|---:|")
    for r in rows:
        if "error" in r:
            print(f"| {r['window']} | {r['d_model']} | {r['heads']} | {r['flex_block'] or '-'} | "
                  f"failed: {r['error']} | | | | |")  # fmt: skip
            continue
        print(f"| {r['window']} | {r['d_model']} | {r['heads']} | {r['flex_block'] or '-'} | "
              f"{'yes' if r['trained'] else 'NaN'} | {r['samples_per_s'] or 0:,.0f} | "
              f"{r['plain_samples_per_s'] or 0:,.0f} | {r['pred_rel_l2']:.1e} | "
              f"{r['inference_rel_l2']:.1e} |")  # fmt: skip
    result = {
        "machine": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__,
        "date": stamp()["date"],
        "commit": args.commit or commit(),
        "steps": args.steps,
        "rows": rows,
    }
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        Path(args.out, "gpu-shapes.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
