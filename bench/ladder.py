"""Run the whole GPU optimization ladder once and write its results.

    python bench/ladder.py --out $OUT [--preset h200] [--commit SHA] [--quick]
                           [--rungs 1,2] [--controls fp32] [--set lr=3e-4 --set signal=1]

Writes to --out: ladder-h200.json (every figure), ladder-h200.md (the report: the rung
and controls tables), ladder-h200.traces.tar.gz (one Chrome/Perfetto trace per rung) and
prints the report last.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tarfile
import time
from pathlib import Path

# The GPU machine has torch, Triton and pyarrow but no quantloop install: quantloop comes
# from this checkout (bench/checkout.py).
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.checkout import use_checkout  # noqa: E402
from bench.report import commit  # noqa: E402

use_checkout()

from quantloop.profiling.config import preset  # noqa: E402
from quantloop.profiling.evaluation import CONTROLS  # noqa: E402
from quantloop.profiling.ladder import run_ladder  # noqa: E402
from quantloop.profiling.report import report_markdown  # noqa: E402


def override(cfg, assignment: str):
    """cfg with one `field=value` applied, the value parsed as the field's current type."""
    name, _, text = assignment.partition("=")
    current = getattr(cfg, name)  # AttributeError names an unknown field
    if isinstance(current, tuple):
        value = tuple(int(v) for v in text.split(",") if v)
    elif isinstance(current, bool):
        value = text.lower() in ("1", "true", "yes")
    else:
        value = type(current)(text)
    return dataclasses.replace(cfg, **{name: value})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--preset", default="auto")
    ap.add_argument("--name", default="ladder-h200", help="file stem of the results")
    ap.add_argument("--work", default="/tmp/ladder-work", help="store and raw traces")
    ap.add_argument(
        "--commit", default="", help="the commit the tree was taken from (default: git's, if any)"
    )
    ap.add_argument("--quick", action="store_true", help="smoke test: few timed steps")
    ap.add_argument("--rungs", default="", help="comma-separated rung numbers (default: all)")
    ap.add_argument("--controls", default=",".join(CONTROLS), help="controls to run")
    ap.add_argument("--set", action="append", default=[], help="config field=value")
    args = ap.parse_args()

    cfg = preset(args.preset)
    for assignment in args.set:
        cfg = override(cfg, assignment)
    if args.quick:
        cfg = dataclasses.replace(cfg, timed_steps=50, n_days=3)
    out = Path(args.out)
    work = Path(args.work)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    rungs = tuple(int(r) for r in args.rungs.split(",") if r) or None
    controls = tuple(c for c in args.controls.split(",") if c)
    result = run_ladder(
        cfg, str(work), rungs=rungs, controls=controls, log=lambda m: print(m, flush=True)
    )
    result["commit"] = args.commit or commit()  # no git on the GPU machine
    result["wall_s"] = time.perf_counter() - t0
    report = report_markdown(result)
    (out / f"{args.name}.json").write_text(json.dumps(result, indent=2, default=str))
    (out / f"{args.name}.md").write_text(report)
    with tarfile.open(out / f"{args.name}.traces.tar.gz", "w:gz") as tar:
        for row in result["rungs"]:
            if row.get("trace"):
                tar.add(work / row["trace"], arcname=row["trace"])
    print(report)
    print(f"wall {result['wall_s']:.0f} s; results in {out}")


if __name__ == "__main__":
    main()
