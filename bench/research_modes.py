"""A CUDA research run's training samples/s in the flow's process, by how it runs there.

    python bench/research_modes.py --params bench/params/research-h200.json --out OUT \
        --modes flow,flow:default

Each mode is one cold `quantloop run` (a fresh home; the compile cache is shared) in a
process of its own, training in the flow's process (what the train stage does); `:S`
sets Python's GIL switch interval while training runs to S seconds, or Python's own 5
ms with `default` (QUANTLOOP_GIL_SWITCH_S). Training in a process spawned for it (mode
`own`) was measured at db5ee62 (bench/results/research-modes-h200.json), found slower,
and removed.
Writes OUT/research-modes.json: each mode's train samples/s (after the warm-up) and
wall time.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--modes", default="flow,flow:default")
    ap.add_argument("--work", default="/tmp/research-modes")
    args = ap.parse_args()
    out, work = Path(args.out), Path(args.work)
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    results = []
    for i, mode in enumerate(args.modes.split(",")):
        _, _, switch = mode.partition(":")
        env = {**os.environ}
        env.pop("QUANTLOOP_GIL_SWITCH_S", None)
        if switch:
            env["QUANTLOOP_GIL_SWITCH_S"] = switch
        home, summary = work / f"home-{i}", work / f"summary-{i}.json"
        t0 = time.perf_counter()
        proc = subprocess.run(
            [sys.executable, "-P", "-m", "quantloop.cli", "run", "--params",
             str(Path(args.params).resolve()), "--home", str(home), "--summary-json", str(summary)],
            cwd=work, env=env, capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        row = {"mode": mode, "rc": proc.returncode, "wall_s": time.perf_counter() - t0}
        if proc.returncode == 0:
            s = json.loads(summary.read_text())
            row |= {k: s.get(k) for k in ("train_samples_per_s", "inference_samples_per_s")}
        else:
            row["error"] = (proc.stdout + proc.stderr)[-2000:]
        results.append(row)
        print(row, flush=True)
        (out / "research-modes.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
