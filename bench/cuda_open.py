"""Does the warm process's warm-up open the CUDA driver, and where: run on a GPU machine
before a change to it (quantloop/forkserver.py refuses to serve once a /dev/nvidia*
device is open in it, since a forked child cannot use its parent's CUDA state).

    python bench/cuda_open.py [--trace]

In a fresh interpreter, the warm-up (quantloop/forkserver.warm_up: WARM_MODULES,
WARM_INDUCTOR where a GPU is, WARM_CALLS) as the server makes it, with the server's own
check (forkserver._cuda_opened) after each step. --trace: the first step that leaves a
device open, run again in a fresh interpreter under a profiler that checks after every
return, with the calls and the Python stack at which the device was first found open.
One JSON line per finding; exit 1 if a step opens a device.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

# the warm-up, the server's check after each step
STEPS = r"""
import json, time
from quantloop import forkserver
t0 = time.perf_counter()
steps = []
forkserver.warm_up(after=lambda step: steps.append([step, forkserver._cuda_opened()]))
print("RESULT " + json.dumps({"warm_s": round(time.perf_counter() - t0, 2), "steps": steps}))
"""

# the warm-up, the step argv names under a profiler that checks after every return
TRACE = r"""
import collections, json, sys, threading, traceback
from quantloop import forkserver
target = sys.argv[1]
order = ["modules", *forkserver.WARM_INDUCTOR, *forkserver.WARM_CALLS]
recent = collections.deque(maxlen=40)
found = {}
def prof(frame, event, arg):
    if found:
        return
    if event.startswith("c_"):
        name = getattr(arg, "__qualname__", None) or getattr(arg, "__name__", "?")
    else:
        name = frame.f_code.co_name
    recent.append(f"{event} {name} @ {frame.f_code.co_filename}:{frame.f_lineno}")
    if event in ("c_return", "return"):
        dev = forkserver._cuda_opened()
        if dev:
            found.update(device=dev, last=list(recent), thread=threading.current_thread().name,
                         stack="".join(traceback.format_stack(frame, limit=30)))
def start():
    threading.setprofile(prof)
    sys.setprofile(prof)
def after(step):
    if step == target:
        sys.setprofile(None)
    elif order.index(step) + 1 == order.index(target):
        start()
if target == "modules":
    start()
forkserver.warm_up(after=after)
sys.setprofile(None)
print("RESULT " + json.dumps({"step": target, "open": forkserver._cuda_opened(), **found}))
"""


def fresh(code: str, *args: str) -> dict:
    """`code` run in a fresh interpreter; the JSON of its RESULT line."""
    proc = subprocess.run([sys.executable, "-c", code, *args], capture_output=True,
                          text=True, timeout=600)  # fmt: skip
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    raise RuntimeError(f"probe failed (rc {proc.returncode}): {proc.stderr[-2000:]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", action="store_true",
                    help="the first step that opens a device, again under a profiler")  # fmt: skip
    args = ap.parse_args()
    warm = fresh(STEPS)
    print(json.dumps({"warm": warm}))
    first = next((step for step, dev in warm["steps"] if dev), None)
    if first is not None and args.trace:
        print(json.dumps(fresh(TRACE, first)))
    sys.exit(1 if first is not None else 0)


if __name__ == "__main__":
    main()
