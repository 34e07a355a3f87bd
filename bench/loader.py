"""The loader thread's host work per batch: a research run's training set against the
ladder's workload of the same shape.

    python bench/loader.py [--params bench/params/research-h200.json] [--out DIR]

The copy stream's loader packs every step's batch on the host (profiling.workload.
packed_batch) while the GPU runs the step before; when packing takes longer than the step,
the GPU waits. Rows (ms per batch, the median of --reps timings of --batches batches):
- ladder: the ladder's workload (preset h200: 4 synthetic days of 60,000 events);
- research: the research run's training days (params file), as profiling.trainer builds
  them;
- research, strided ends: the same, plus what each batch cost before the windows' ends
  were copied out of the [N, T] window index (the lengths read through that strided
  column for every batch): the peer this change replaced;
- research, block lists: the same, plus FlexAttention's block lists made on the host
  (rungs 12-13: loader_mask, 64-event blocks); predicted ~0.05 ms more a batch.
Writes <out>/loader.json (machine, date, commit) when --out is given.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.checkout import use_checkout  # noqa: E402
from bench.report import stamp  # noqa: E402

use_checkout()

import numpy as np  # noqa: E402

from bench.train_alone import research_days  # noqa: E402
from quantloop.profiling.config import preset  # noqa: E402
from quantloop.profiling.packing import FLEX_BLOCKS  # noqa: E402
from quantloop.profiling.trainer import training_set  # noqa: E402
from quantloop.profiling.workload import build_workload, packed_batch, packed_spec  # noqa: E402
from quantloop.tasks.research.training import prepare  # noqa: E402


def per_batch_ms(work, batches: int, reps: int, extra=None, mask_block: int = 0) -> float:
    spec = packed_spec(work, work.order.shape[1], mask_block)
    views = {k: np.empty(shape, dtype=dtype) for k, (shape, dtype) in spec.items()}
    packed_batch(work, 0, out=views, mask_block=mask_block)
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        for step in range(batches):
            packed_batch(work, step % len(work.order), out=views, mask_block=mask_block)
            if extra is not None:
                extra()
        times.append((time.perf_counter() - t) / batches * 1e3)
    return statistics.median(times)


def research_data(params: dict):
    tables, fs, cfg = research_days(params)
    return prepare(tables, fs.inputs, fs.labels, cfg)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", default="bench/params/research-h200.json")
    ap.add_argument("--store", default="/tmp/quantloop-loader-bench")
    ap.add_argument("--batches", type=int, default=200)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default="")
    ap.add_argument("--commit", default="", help="default: git rev-parse of the checkout")
    args = ap.parse_args()
    ladder = build_workload(preset("h200"), args.store)
    data = research_data(json.loads(Path(args.params).read_text()))
    research = training_set(data, packing=True)
    ends, starts = data.ends, data.starts  # the strided column, as the loader once read it
    rows = {
        "ladder": per_batch_ms(ladder, args.batches, args.reps),
        "research": per_batch_ms(research, args.batches, args.reps),
        "research, strided ends": per_batch_ms(
            research, args.batches, args.reps, extra=lambda: ends - starts + 1
        ),
        "research, block lists": per_batch_ms(
            research, args.batches, args.reps, mask_block=FLEX_BLOCKS
        ),
    }
    stamped = stamp()  # machine, date, commit (bench/report.py)
    result = {
        "machine": stamped["machine"],
        "date": stamped["date"],
        "commit": args.commit or stamped["commit"],
        "batch": int(research.order.shape[1]),
        "pack_rows": {"ladder": ladder.pack_rows, "research": research.pack_rows},
        "ms_per_batch": rows,
        "research_vs_ladder": rows["research"] / rows["ladder"],
        "strided_vs_research": rows["research, strided ends"] / rows["research"],
        "block_lists_vs_research": rows["research, block lists"] / rows["research"],
    }
    print(f"{'loader':<24} {'ms/batch':>9} {'vs ladder':>10}")
    for name, ms in rows.items():
        print(f"{name:<24} {ms:>9.3f} {ms / rows['ladder']:>9.2f}x")
    print(f"{result['machine']}; {result['date']}; commit {result['commit']}")
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "loader.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
