"""README's first command on a busy machine: `quantloop run` on an empty home beside CPU
hogs that keep the load at 4x the cores (the failure it answers: Prefect's temporary
server gave up after its 20 s default on a loaded machine, 3 runs out of 4 here).

    python bench/busy_machine.py                 # 4 hogs per core, 1 run
    python bench/busy_machine.py --hogs-per-core 4 --runs 2

Each run starts from an empty home, so it starts its own local Prefect API under load.
Writes bench/results/busy-machine.json and .md (machine, date, commit, the load average
measured during each run).
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.report import markdown_table, stamp, stamp_line, write  # noqa: E402


def hog() -> None:
    while True:
        pass


def quantloop() -> list[str]:
    exe = Path(sys.executable).with_name("quantloop")
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "quantloop.cli"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hogs-per-core", type=int, default=4)
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--warm-up-s", type=float, default=20.0, help="hogging before a run")
    parser.add_argument("--name", default="busy-machine")
    args = parser.parse_args()
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    hogs = [
        multiprocessing.Process(target=hog, daemon=True)
        for _ in range(args.hogs_per_core * os.cpu_count())
    ]
    for h in hogs:
        h.start()
    runs = []
    try:
        for i in range(args.runs):
            time.sleep(args.warm_up_s)  # the load average climbs to the hogs' count
            home = Path(tempfile.mkdtemp(prefix="busy-"))
            loads: list[float] = []
            done = threading.Event()

            def sample(loads=loads, done=done) -> None:
                while not done.wait(5):
                    loads.append(os.getloadavg()[0])

            watcher = threading.Thread(target=sample, daemon=True)
            watcher.start()
            t0 = time.perf_counter()
            proc = subprocess.run(
                [
                    *quantloop(),
                    "run",
                    "--home",
                    str(home),
                    "--summary-json",
                    str(home / "summary.json"),
                ],
                env=env,
                capture_output=True,
                text=True,
            )
            wall = time.perf_counter() - t0
            done.set()
            api = [
                line
                for line in proc.stdout.splitlines() + proc.stderr.splitlines()
                if "Prefect API" in line
            ]
            runs.append(
                {
                    "run": i,
                    "exit": proc.returncode,
                    "wall_s": round(wall, 1),
                    "load_at_start": os.getloadavg()[0] if not loads else loads[0],
                    "load_max": max(loads, default=float("nan")),
                    "load_mean": sum(loads) / len(loads) if loads else float("nan"),
                    "api": api[0].strip() if api else "",
                    "error": proc.stderr[-2000:] if proc.returncode else "",
                    # the table the run printed: the same as README's on the same commit
                    "output": proc.stderr[-4000:] if not proc.returncode else "",
                }
            )
            print(runs[-1], flush=True)
            subprocess.run(
                [*quantloop(), "api", "stop", "--home", str(home)], env=env, capture_output=True
            )
    finally:
        for h in hogs:
            h.kill()
    result = {"hogs": len(hogs), "cores": os.cpu_count(), "runs": runs, "stamp": stamp()}
    rows = [
        (
            r["run"],
            r["exit"],
            r["wall_s"],
            f"{r['load_mean']:.1f}",
            f"{r['load_max']:.1f}",
            r["api"],
        )
        for r in runs
    ]
    md = "\n".join(
        [
            "# README's first command on a busy machine",
            "",
            stamp_line(result["stamp"]),
            "",
            f"{len(hogs)} busy-loop processes on {os.cpu_count()} cores; each run on an empty home "
            "(it starts its own local Prefect API under that load).",
            "",
            markdown_table(
                ("run", "exit", "wall s", "load mean", "load max", "Prefect API"),
                rows,
                numeric=[True, True, True, True, True, False],
            ),
            "",
        ]
    )
    write(args.name, result, md)
    print(md)


if __name__ == "__main__":
    main()
