"""What checking every cache hit costs: a hit's stored output read and its length and
sha256 checked before it counts (`verify_hits`, on by default) against trusting it
unread (off).

    python bench/cache_check.py [--repeat 3] [--work DIR] [--results DIR]

1. The embedded defaults (3 synthetic products x 4 days) run once cold with the real CLI,
   then no-op re-runs with the check off and on, alternated, `--repeat` of each: the
   whole command's wall and its features phase (from its profile).
2. The features stage's engine call alone, in this process, on the same store: every
   node a hit, checked and not, 5 times each: the cost per hit and per MB of output.

Prints a table; writes <results>/cache-check.json and .md (machine, date, commit).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.report import markdown_table, stamp, stamp_line, write  # noqa: E402
from bench.turnaround import run_once, stop_api  # noqa: E402


def engine_alone(home: Path, reps: int = 5) -> dict:
    """The features stage's lookup and hit check alone: run_nodes on an all-hit plan."""
    from quantloop.tasks.engine import NodeStore, run_nodes
    from quantloop.tasks.research.stage import StageParams, plan_features
    from quantloop.tasks.runtime.workspace import Workspace

    ws = Workspace(home=str(home))
    plan = plan_features(StageParams(workspace=ws))
    store = NodeStore(ws.resolve_site().root)
    times: dict[bool, list[float]] = {False: [], True: []}
    hits = 0
    for _ in range(reps):
        for verify in (False, True):
            t = time.perf_counter()
            ran = run_nodes(plan.kind, plan.params, plan.nodes, store, verify_hits=verify)
            times[verify].append(time.perf_counter() - t)
            assert ran.computed == 0, "the bench needs every node cached"
            hits = ran.cache_hits
    found = store.lookup(plan.kind.name, plan.nodes)
    mb = sum(found["output_length"].to_pylist()) / 1e6
    off, on = statistics.median(times[False]), statistics.median(times[True])
    return {"hits": hits, "output_mb": mb, "off_s": off, "on_s": on,
            "per_hit_ms": (on - off) / hits * 1e3,
            "mb_per_s": mb / (on - off) if on > off else None,
            "times": {"off": times[False], "on": times[True]}}  # fmt: skip


def markdown(result: dict) -> str:
    noop, eng = result["noop"], result["engine"]
    rows = [
        ("no-op re-run, whole CLI (wall s)", f"{noop['off']['wall_s']:.2f}",
         f"{noop['on']['wall_s']:.2f}", f"{noop['on']['wall_s'] / noop['off']['wall_s']:.3f}"),
        ("no-op re-run, features phase (s)", f"{noop['off']['features_s']:.3f}",
         f"{noop['on']['features_s']:.3f}",
         f"{noop['on']['features_s'] / noop['off']['features_s']:.2f}"),
        (f"engine alone: {eng['hits']} hits, {eng['output_mb']:.1f} MB of outputs (s)",
         f"{eng['off_s']:.3f}", f"{eng['on_s']:.3f}", f"{eng['on_s'] / eng['off_s']:.2f}"),
    ]  # fmt: skip
    table = markdown_table(["what", "check off", "check on (default)", "on / off"], rows)
    spread = {n: f"{min(v['walls']):.1f}-{max(v['walls']):.1f} s" for n, v in noop.items()}
    return (
        "# Checking every cache hit: cost\n\n"
        f"{stamp_line(result)}\n\n"
        f"The embedded defaults, cold once ({result['cold_wall_s']:.1f} s), then no-op re-runs "
        f"of the real CLI alternating `verify_hits` off and on, median of {result['repeat']} "
        "each; the engine's lookup and check alone in one process, median of 5.\n\n"
        f"{table}\n\n"
        f"Per hit: {eng['per_hit_ms']:.2f} ms to read and sha256 its output "
        f"({eng['output_mb'] / eng['hits']:.2f} MB a hit"
        + (f", {eng['mb_per_s']:.0f} MB/s" if eng["mb_per_s"] else "")
        + "). The whole command's walls ranged "
        f"{spread['off']} (off) and {spread['on']} (on): where that spread is larger than the "
        "check's cost, the engine's and the features phase's rows are the measurement.\n"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--work", type=Path)
    parser.add_argument("--results", type=Path)
    parser.add_argument("--render", type=Path, help="print the table of a saved result JSON")
    args = parser.parse_args()
    if args.render:
        print(markdown(json.loads(args.render.read_text())))
        return
    work = args.work or Path(tempfile.mkdtemp(prefix="cache-check-"))
    home = work / "home"
    work.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_API")}
    try:
        cold = run_once(home, {}, env)
        runs: dict[str, list[dict]] = {"off": [], "on": []}
        for _ in range(args.repeat):
            for name, verify in (("off", False), ("on", True)):
                r = run_once(home, {"verify_hits": verify}, env)
                assert r["computed"] == 0 and r["model_cached"], r
                runs[name].append(r)
        alone = engine_alone(home)
    finally:
        stop_api(home, env)

    def med(name: str, key: str) -> float:
        values = [r["phases"].get(key, 0.0) if key != "wall_s" else r["wall_s"]
                  for r in runs[name]]  # fmt: skip
        return statistics.median(values)

    result = {
        **stamp(),
        "repeat": args.repeat,
        "cold_wall_s": cold["wall_s"],
        "noop": {
            n: {
                "wall_s": med(n, "wall_s"),
                "features_s": med(n, "features"),
                "walls": [r["wall_s"] for r in runs[n]],
            }
            for n in runs
        },  # fmt: skip
        "engine": alone,
    }
    text = markdown(result)
    print(text)
    write("cache-check", result, text, args.results or Path(__file__).parent / "results")


if __name__ == "__main__":
    main()
