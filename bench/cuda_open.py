"""Which import opens the CUDA driver: run on a GPU machine before a change to the warm
process's imports (quantloop/forkserver.py refuses to serve once a /dev/nvidia* device is
open in it, since a forked child cannot use its parent's CUDA state).

    python bench/cuda_open.py [--warm-only | --trace] [MODULE ...]

First the warm process's own warm-up (quantloop/forkserver.warm_up: WARM_MODULES,
WARM_INDUCTOR, WARM_CALLS), as it makes it: open or not after each step. --trace: the
first step that opens a device run again in a fresh interpreter under a profiler, with
the calls and the stack at which it was first found open. Otherwise, for each MODULE
(imported after the warm-up), in a fresh interpreter: the modules it imports in their
order, bisected (each half imported in a fresh interpreter) to the first whose import
leaves the device open, and the Python stacks of the torch.cuda calls made meanwhile.
One JSON line per finding.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

DEFAULT = ("torch._inductor.cudagraph_trees", "torch._inductor.compile_fx")

# run in a fresh interpreter: warm imports, then argv's modules in order; prints JSON
CHILD = r"""
import importlib, json, os, sys, time, traceback
mode, names = sys.argv[1], json.loads(sys.argv[2])
def opened():
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("/dev/nvidia"):
            return target
    return None
from quantloop import forkserver
t0 = time.perf_counter()
steps = []
forkserver.warm_up(after=lambda step: steps.append([step, opened()]))
out = {"warm_s": round(time.perf_counter() - t0, 2), "warm_modules_open": steps[0][1],
       "warm_calls_open": steps[1:]}
import torch
stacks = []
def wrap(owner, name):
    f = getattr(owner, name, None)
    if f is None:
        return
    def w(*a, **k):
        stacks.append([name, "".join(traceback.format_stack(limit=14)[:-1])[-3000:]])
        return f(*a, **k)
    setattr(owner, name, w)
for name in ("is_available", "device_count", "_lazy_init", "get_device_properties",
             "get_device_capability", "current_device", "get_device_name", "mem_get_info"):
    wrap(torch.cuda, name)
wrap(torch._C, "_cuda_getDeviceCount")
before = set(sys.modules)
order = []
for name in names:
    try:
        importlib.import_module(name)
    except Exception as exc:
        out.setdefault("errors", []).append([name, repr(exc)[:200]])
    if mode == "record":
        order.extend(m for m in sys.modules if m not in before and m not in order)
    if opened():
        out["first_open_after"] = name
        break
out.update(open=opened(), order=order, cuda_calls=stacks[:5])
print("RESULT " + json.dumps(out))
"""


# run in a fresh interpreter: the warm process's warm-up, the step argv names under a
# profiler that checks for an open device after every return
TRACE = r"""
import collections, importlib, json, os, sys, threading, traceback
target = sys.argv[1]
def opened():
    for fd in os.listdir("/proc/self/fd"):
        try:
            t = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if t.startswith("/dev/nvidia"):
            return t
    return None
from quantloop import forkserver
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
        dev = opened()
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
print("RESULT " + json.dumps({"call": target, "open": opened(), **found}))
"""


def trace(call: str) -> dict:
    proc = subprocess.run([sys.executable, "-c", TRACE, call], capture_output=True,
                          text=True, timeout=600)  # fmt: skip
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    raise RuntimeError(f"trace failed (rc {proc.returncode}): {proc.stderr[-2000:]}")


def child(mode: str, names: list[str]) -> dict:
    proc = subprocess.run([sys.executable, "-c", CHILD, mode, json.dumps(names)],
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    raise RuntimeError(f"probe failed (rc {proc.returncode}): {proc.stderr[-2000:]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("modules", nargs="*", default=list(DEFAULT))
    ap.add_argument(
        "--warm-only",
        action="store_true",
        help="the warm imports and calls only; exit 1 if they open a device",
    )
    ap.add_argument(
        "--trace",
        action="store_true",
        help="as --warm-only, and the first warm call that opens a device run again "
        "under a profiler: the calls before the device was found open",
    )
    args = ap.parse_args()
    t0 = time.perf_counter()
    base = child("plain", [])
    print(json.dumps({"warm": {k: base[k] for k in
                               ("warm_s", "warm_modules_open", "warm_calls_open")}}))  # fmt: skip
    if args.warm_only or args.trace:
        opened = base["warm_modules_open"] or any(o for _, o in base["warm_calls_open"])
        if opened and args.trace:  # the first warm call that opens one, traced
            first = (
                "modules"
                if base["warm_modules_open"]
                else next(c for c, o in base["warm_calls_open"] if o)
            )
            print(json.dumps(trace(first)))
        sys.exit(1 if opened else 0)
    for module in args.modules:
        rec = child("record", [module])
        finding = {"module": module, "open": rec["open"], "modules": len(rec["order"]),
                   "cuda_calls": rec["cuda_calls"]}  # fmt: skip
        if rec["open"]:
            order = rec["order"]
            lo, hi = 0, len(order)  # the first `hi` modules open it; the first `lo` do not
            while hi - lo > 1:
                mid = (lo + hi) // 2
                if child("plain", order[:mid]).get("open"):
                    hi = mid
                else:
                    lo = mid
            last = child("plain", order[:hi])
            finding.update(first_opening=order[hi - 1], cuda_calls=last["cuda_calls"])
        print(json.dumps(finding))
    print(json.dumps({"seconds": round(time.perf_counter() - t0, 1)}))


if __name__ == "__main__":
    main()
