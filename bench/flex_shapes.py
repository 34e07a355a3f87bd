"""Which FlexAttention layouts compile and compute the right thing, by row length and head
dimension: the table packing.flex_layout is written from.

    python bench/flex_shapes.py --out DIR [--commit C]

bench/gpu_shapes.py found research-run shapes whose training failed in Inductor's
FlexAttention lowering: head dimension 8 ("must be at least 16"), and "no choices" for
some others. Here each layout (sparse block, tiles) is tried on its own, forward and
backward, for rows of T events and heads of dimension D, on packed random windows; its
output and gradients are compared with a dense float32 attention over the same windows.
Writes <out>/flex-shapes.json (machine, date, commit) and prints a table.
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

import numpy as np  # noqa: E402
import torch  # noqa: E402
from torch.nn.attention.flex_attention import flex_attention  # noqa: E402

from quantloop.profiling.packing import FLEX_TILES, FlexMask  # noqa: E402
from quantloop.profiling.workload import window_block_lists  # noqa: E402

ROWS, HEADS = 8, 2
LAYOUTS = {"128, defaults": (128, None), "64, FLEX_TILES": (64, FLEX_TILES),
           "64, defaults": (64, None)}  # fmt: skip


def packed_seg(T: int, rng: np.random.Generator) -> np.ndarray:
    """[ROWS, T] window ids: random windows of 1..T events end to end, a padding tail."""
    seg = np.empty((ROWS, T), np.int64)
    wid = 0
    for r in range(ROWS):
        pos = 0
        while pos < T:
            n = int(rng.integers(1, max(2, T // 2)))
            if pos + n > T or rng.random() < 0.1:
                seg[r, pos:] = 10_000  # padding
                break
            seg[r, pos : pos + n] = wid
            wid, pos = wid + 1, pos + n
    return seg


def check(T: int, D: int, block: int, tiles, rng) -> dict:
    torch._dynamo.reset()
    dev = torch.device("cuda")
    seg_np = packed_seg(T, rng)
    seg = torch.from_numpy(seg_np).to(dev)
    mask = FlexMask(ROWS, T, dev, block=block)
    lists = [torch.from_numpy(a).to(dev) for a in window_block_lists(seg_np, block)]
    bm = mask.update(seg, *lists)
    q, k, v, g = (torch.randn(ROWS, HEADS, T, D, device=dev) for _ in range(4))
    leaves = [t.to(torch.bfloat16).requires_grad_() for t in (q, k, v)]
    attend = torch.compile(flex_attention, dynamic=False)
    out = attend(*leaves, block_mask=bm, kernel_options=tiles)
    grads = torch.autograd.grad(out, leaves, g.to(torch.bfloat16))
    ref_leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    dense = seg[:, None, :, None] == seg[:, None, None, :]
    ref = torch.nn.functional.scaled_dot_product_attention(*ref_leaves, attn_mask=dense)
    ref_grads = torch.autograd.grad(ref, ref_leaves, g)
    errs = [
        float((a.float() - b).norm() / b.norm())
        for a, b in zip((out, *grads), (ref, *ref_grads), strict=True)
    ]
    return {"max_rel_err": max(errs)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--commit", default=os.environ.get("QUANTLOOP_GIT_COMMIT", ""))
    ap.add_argument("--rows", default="32,64,100,128,200,256")
    ap.add_argument("--dims", default="16,32,64,128")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    rows = []
    for T in (int(t) for t in args.rows.split(",")):
        for D in (int(d) for d in args.dims.split(",")):
            for name, (block, tiles) in LAYOUTS.items():
                row = {"T": T, "head_dim": D, "layout": name}
                try:
                    row |= check(T, D, block, tiles, rng)
                    row["ok"] = row["max_rel_err"] < 2e-2  # bf16 against float32
                except Exception as exc:  # noqa: BLE001 - a layout that fails is the finding
                    first = (str(exc).strip().splitlines() or [""])[0]
                    row |= {"ok": False, "error": f"{type(exc).__name__}: {first[-160:]}"}
                rows.append(row)
                print(row, flush=True)
    print("\n| T | head dim | " + " | ".join(LAYOUTS) + " |")
    print("|---:|---:|" + "---|" * len(LAYOUTS))
    for T in sorted({r["T"] for r in rows}):
        for D in sorted({r["head_dim"] for r in rows}):
            cells = []
            for name in LAYOUTS:
                r = next(x for x in rows if (x["T"], x["head_dim"], x["layout"]) == (T, D, name))
                cells.append(
                    f"ok ({r['max_rel_err']:.1e})" if r["ok"] else
                    r.get("error", f"wrong ({r.get('max_rel_err', 0):.1e})")[:60]
                )  # fmt: skip
            print(f"| {T} | {D} | " + " | ".join(cells) + " |")
    result = {
        "machine": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "date": stamp()["date"],
        "commit": args.commit or commit(),
        "rows": rows,
    }
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        Path(args.out, "flex-shapes.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
