"""FlexAttention on the ladder's packed batches: the sparse block size and the kernels'
tiles, against what rungs 9-12 run (128-event blocks, Inductor's default tiles).

    python bench/flex_sweep.py --out DIR [--commit C] [--blocks 128,64,32]

Rung 12's trace: attention is 0.33 ms of a 1.59 ms step, its backward 0.24 ms (4 layers x
61 us against 21 us forward). Two things set that cost here: how many blocks each query
block must visit (windows average 67 events; a 128-event block spans ~2-3 of them, so most
of a row's 2 x 2 blocks are visited) and the kernels' tiles for a head dimension of 32.
For each sparse block size this measures, on the ladder's packed batches (steps 0-3):
- density: the share of (query block, key block) pairs the block mask visits;
- the forward + backward kernel time per layer call (torch profiler, kernel durations
  only: the host is not timed), with Inductor's default tiles (128 only: the defaults
  are 128-wide) and with Inductor's max-autotune choosing the tiles (its own table of the
  candidates is in the log).
Predicted before the first run, from the blocks the loader lists on this workload (this
VM, 20 batches): 99% of pairs visited at 128 (nothing skipped), 71% at 64, 56% at 32; at 64
the visits fall 29% and smaller tiles cost some of it back: ~65 us per layer instead of
~82 (4 layers: ~70 us of a 1.59 ms step, 1.05x).
Writes <out>/flex-sweep.json (machine, date, commit) and prints a table; the ratio is
against the default at 128 (rungs 9-12).
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

import torch  # noqa: E402
from torch.nn.attention.flex_attention import flex_attention  # noqa: E402

from quantloop.profiling.config import preset  # noqa: E402
from quantloop.profiling.packing import FlexMask  # noqa: E402
from quantloop.profiling.workload import build_workload, packed_batch  # noqa: E402

ITERS = 20  # profiled forward + backward calls per measurement


def kernel_us(fn, iters: int, trace: str) -> float:
    """Kernel time per call of fn: the CUDA kernels' durations in a profiler trace."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    prof.export_chrome_trace(trace)
    with open(trace) as f:
        events = json.load(f)["traceEvents"]
    return sum(e["dur"] for e in events if e.get("cat") == "kernel") / iters


def measure(work, block: int, mode: str | None, device: torch.device, steps: int, tmp: str) -> dict:
    torch._dynamo.reset()
    R, T = work.pack_rows, work.max_len
    cfg = preset("h200")
    H, Dh = cfg.n_heads, cfg.d_model // cfg.n_heads
    gen = torch.Generator(device=device).manual_seed(0)
    q, k, v, g = (
        torch.randn(R, H, T, Dh, device=device, dtype=torch.bfloat16, generator=gen)
        for _ in range(4)
    )
    for t in (q, k, v):
        t.requires_grad_(True)
    mask = FlexMask(R, T, device, block=block)
    attend = torch.compile(flex_attention, dynamic=False, mode=mode)
    visited, times = [], []
    for step in range(steps):
        b = packed_batch(work, step, mask_block=block)
        lists = [torch.from_numpy(b[n]).to(device) for n in ("kv_num", "kv_idx")]
        bm = mask.update(torch.from_numpy(b["seg"]).to(device), *lists)
        n = T // block
        visited.append(float(b["kv_num"].sum()) / (R * n * n))

        def call(bm=bm):
            out = attend(q, k, v, block_mask=bm)
            torch.autograd.grad(out, (q, k, v), g)

        times.append(kernel_us(call, ITERS, os.path.join(tmp, "trace.json")))
    return {
        "block": block,
        "tiles": "max-autotune" if mode else "default",
        "density": sum(visited) / len(visited),
        "fwd_bwd_us": sum(times) / len(times),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--commit", default=os.environ.get("QUANTLOOP_GIT_COMMIT", ""))
    ap.add_argument("--work", default="/tmp/flex-sweep-work")
    ap.add_argument("--blocks", default="128,64,32")
    ap.add_argument("--steps", type=int, default=4)
    args = ap.parse_args()
    device = torch.device("cuda")
    work = build_workload(preset("h200"), os.path.join(args.work, "store"))
    rows = [measure(work, 128, None, device, args.steps, args.work)]
    for block in (int(b) for b in args.blocks.split(",")):
        try:
            mode = "max-autotune-no-cudagraphs"
            rows.append(measure(work, block, mode, device, args.steps, args.work))
        except Exception as exc:  # noqa: BLE001 - a block size that fails is reported
            first = (str(exc).strip().splitlines() or [""])[0][:200]
            rows.append({"block": block, "tiles": "max-autotune", "failed": first})
    ref = rows[0]["fwd_bwd_us"]
    print("\n| sparse block | tiles | blocks visited | fwd+bwd us per layer | vs rungs 9-12 |")
    print("|---:|---|---:|---:|---:|")
    for r in rows:
        if "failed" in r:
            print(f"| {r['block']} | {r['tiles']} | failed: {r['failed']} | | |")
            continue
        r["ratio_vs_default_128"] = ref / r["fwd_bwd_us"]
        print(
            f"| {r['block']} | {r['tiles']} | {r['density']:.0%} | {r['fwd_bwd_us']:.1f} | "
            f"{r['ratio_vs_default_128']:.2f}x |"
        )
    result = {
        "machine": torch.cuda.get_device_name(device),
        "torch": torch.__version__,
        "date": stamp()["date"],
        "commit": args.commit or commit(),
        "shape": {"rows": work.pack_rows, "T": work.max_len, "heads": preset("h200").n_heads},
        "iters": ITERS,
        "rows": rows,
    }
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "flex-sweep.json"), "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
