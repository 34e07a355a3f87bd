"""Where a CUDA research run's training runs, and its samples/s: a bench for the train stage.

    python bench/research_modes.py --params bench/params/research-h200.json --out OUT \
        --modes own,flow,own:0.0005,flow:0.0005

Each mode is one cold `quantloop run` (a fresh home; the compile cache is shared) in a
process of its own: `flow` trains in the flow's process, `own` in a process spawned for
it (flows/train.py's choice on CUDA); `:S` sets Python's GIL switch interval to S
seconds while training runs (QUANTLOOP_GIL_SWITCH_S). Writes OUT/research-modes.json:
each mode's train samples/s (after the warm-up) and wall time.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

RUN = """
import sys
if __name__ == "__main__":
    import quantloop.flows.train as train
    own = {own}
    train.own_process = lambda config: own
    from quantloop.cli import app
    sys.argv = ["quantloop", *sys.argv[1:]]
    app()
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--modes", default="own,flow")
    ap.add_argument("--work", default="/tmp/research-modes")
    args = ap.parse_args()
    out, work = Path(args.out), Path(args.work)
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    results = []
    for i, mode in enumerate(args.modes.split(",")):
        where, _, switch = mode.partition(":")
        script = work / f"run_{where}.py"
        script.write_text(RUN.format(own=where == "own"))
        env = {**os.environ}
        env.pop("QUANTLOOP_GIL_SWITCH_S", None)
        if switch:
            env["QUANTLOOP_GIL_SWITCH_S"] = switch
        home, summary = work / f"home-{i}", work / f"summary-{i}.json"
        t0 = time.perf_counter()
        proc = subprocess.run(
            [sys.executable, "-P", str(script), "run", "--params", str(Path(args.params).resolve()),
             "--home", str(home), "--summary-json", str(summary)],
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
