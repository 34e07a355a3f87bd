"""Does starting CUDA in a thread hold the interpreter's lock? The research run starts
CUDA ahead, in a thread (flows/train.py import_inductor_ahead: the plan's device class
asks torch.cuda), while its main thread runs the stages; py-spy on an H100 (call 18,
bench/results/turnaround-h200-ahead-notes.md) showed the main thread stuck in that
thread's `Thread.start` for as long as `torch.cuda.is_available()` ran in it (0.24 s).

Each sample is a fresh interpreter (CUDA starts once a process): its main thread starts
a thread that starts CUDA, then spins on short Python steps until the thread is done,
recording the longest gap between two steps and the sum of gaps over 2 ms. Ways:

- `torch`: the thread calls torch.cuda.is_available() (what the run does);
- `cuinit`: the thread first calls the driver's cuInit(0) through ctypes, which releases
  the lock for a foreign call, then torch.cuda.is_available().

    python bench/cuda_init_gil.py [--repeat 3]   # prints a table; --json for a file
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import report  # noqa: E402

CHILD = r"""
import ctypes, json, sys, threading, time
import torch
way = sys.argv[1]
done = threading.Event()
spent = {}
def start():
    t = time.perf_counter()
    try:
        if way == "cuinit":
            ctypes.CDLL("libcuda.so.1").cuInit(0)
            spent["cuinit_s"] = time.perf_counter() - t
        spent["available"] = torch.cuda.is_available()
    except OSError as exc:  # no driver here: said, not waited for
        spent["error"] = str(exc)
    finally:
        spent["thread_s"] = time.perf_counter() - t
        done.set()
t0 = time.perf_counter()
th = threading.Thread(target=start)
th.start()
started = time.perf_counter() - t0
last, longest, stalled = time.perf_counter(), 0.0, 0.0
while not done.is_set():
    sum(range(200))  # a short step of Python
    now = time.perf_counter()
    gap = now - last
    longest = max(longest, gap)
    stalled += gap if gap > 0.002 else 0.0
    last = now
th.join()
print(json.dumps({"way": way, "start_s": started, "longest_gap_s": longest,
                  "stalled_s": stalled, **spent}))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--json", default=None, help="also write the samples here")
    args = parser.parse_args()
    rows = []
    for _ in range(args.repeat):
        for way in ("torch", "cuinit"):
            done = subprocess.run([sys.executable, "-c", CHILD, way], capture_output=True,
                                  text=True, timeout=120)  # fmt: skip
            if done.returncode:
                sys.exit(f"{way}: {done.stderr[-2000:]}")
            rows.append(json.loads(done.stdout.splitlines()[-1]))
            if "error" in rows[-1] or not rows[-1]["available"]:
                sys.exit(f"{way}: no CUDA here ({rows[-1].get('error', 'torch finds none')})")
    stamp = report.stamp()  # QUANTLOOP_GIT_COMMIT names the commit on the GPU machine
    print(report.stamp_line(stamp))
    median = {
        way: {k: statistics.median(r[k] for r in rows if r["way"] == way)
              for k in ("thread_s", "start_s", "longest_gap_s", "stalled_s")}
        for way in ("torch", "cuinit")
    }  # fmt: skip
    print(report.markdown_table(
        ["way", "thread s", "Thread.start s", "longest gap s", "stalled s", "samples"],
        [[way, *(f"{m[k]:.3f}" for k in ("thread_s", "start_s", "longest_gap_s", "stalled_s")),
          sum(r["way"] == way for r in rows)] for way, m in median.items()],
    ))  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**stamp, "samples": rows}, f, indent=1)


if __name__ == "__main__":
    main()
