"""K models trained as one stack, against the ways a sweep runs them today.

    python bench/sweep.py --params bench/params/research-h200.json --out OUT   # the H200
    python bench/sweep.py --params bench/params/research-h200.json --out OUT \
        --ks 1,4 --steps 20 --procs 2 --check 4 --tiny                           # CPU rehearsal

The research run's training days and shape (bench/train_alone.py `research_days`). K
settings of a sweep: seed k, a learning rate and a weight decay from small grids, all on
the same fold. For each K:

- stacked: the K models as one stack (profiling/stacked.py) with compile and bf16 on a
  GPU: aggregate samples/s (all models), step time, peak memory, GPU busy;
- one after another: one model at the ladder's top rung (profiling/trainer.py, the rungs
  of bench/train_alone.py): K models in sequence give its samples/s, each paying its own
  warm-up (measured once; K runs of the same model and shape are not repeated);
- K processes: K solo top-rung trainings in K processes sharing the GPU at once (how a
  sweep tool runs trials), started together; the sum of their steady samples/s;
- warm-up: the stack's time to its first steady step in a fresh process, with an empty
  Inductor cache and again with the cache the first filled.

Equivalence: for K = --check, every member of the stack against the same model trained
alone in the plain fp32 loop (tasks/research/training.py), on the ladder's figures and
tolerance for the stack's precision (profiling/equivalence.py, profiling/config.py): the
loss curve, the held-out day's predictions and its out-of-sample mark-out.

Writes OUT/<name>.json and .md (machine, date, commit) after each part.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.checkout import use_checkout  # noqa: E402

use_checkout()

import numpy as np  # noqa: E402
import torch  # noqa: E402

from bench.report import markdown_table, stamp, stamp_line, write  # noqa: E402
from bench.train_alone import RUNGS, research_days  # noqa: E402
from quantloop.profiling.config import BF16, FP32  # noqa: E402
from quantloop.profiling.equivalence import markout_delta, max_rel_dev, rel_l2  # noqa: E402
from quantloop.profiling.proof import plan_rungs  # noqa: E402
from quantloop.profiling.stacked import Member, StackConfig, reseeded, train_stacked  # noqa: E402
from quantloop.profiling.trainer import train_prepared  # noqa: E402
from quantloop.tasks.data.landing import business_days  # noqa: E402
from quantloop.tasks.data.synthetic import SyntheticConfig, generate_day  # noqa: E402
from quantloop.tasks.research.features import FeatureParams, compute_features  # noqa: E402
from quantloop.tasks.research.simulation import (  # noqa: E402
    SimConfig,
    markout,
    simulate,
    summarize,
    thresholds_from,
)
from quantloop.tasks.research.training import predict, prepare, train_plain  # noqa: E402

LRS = (3e-4, 1e-4, 1e-3, 5e-4)  # the sweep's grid: lr fastest, then weight decay
WDS = (1e-4, 0.0)
TINY = dict(
    window=16,
    window_s=None,
    batch_size=32,
    d_model=16,
    n_layers=1,
    n_heads=2,
    ff_mult=2,
    num_threads=1,
)


def setup(args):
    params = json.loads(Path(args.params).read_text())
    if args.tiny:
        params["data"]["synthetic"]["events_per_day"] = 4000
    tables, fs, cfg = research_days(params)
    cfg = dataclasses.replace(
        cfg, steps=args.steps, log_every=max(1, args.steps // 20), **(TINY if args.tiny else {})
    )
    synth = SyntheticConfig(**params["data"]["synthetic"])
    held_day = business_days(dt.date(2026, 3, 2), params["data"]["n_dates"])[-1]
    held_out = compute_features(generate_day("SYNA", held_day, synth), FeatureParams())
    return tables, fs, cfg, held_out


def settings(cfg, k: int):
    return [
        dataclasses.replace(cfg, seed=i, lr=LRS[i % len(LRS)], weight_decay=WDS[i // len(LRS) % 2])
        for i in range(k)
    ]


def stack_config(device: torch.device, steps: int, layout: str = "packed") -> StackConfig:
    """The stack's rungs: packed windows (with FlexAttention, compile and bf16 on a GPU), or
    padded ones (the first version, kept for the comparison)."""
    cuda = device.type == "cuda"
    return StackConfig(
        compile=cuda,
        bf16=cuda,
        warmup_steps=min(10, max(1, steps // 4)),
        packing=layout == "packed",
        flex_attention=cuda and layout == "packed",
    )


def trading(result, tables, held_out, product="SYNA") -> dict:
    """Out-of-sample mark-out of a model: the held-out day traded at the threshold its
    predictions on the training days give (as profiling/evaluation.py does)."""
    sim = SimConfig()
    threshold = thresholds_from(predict(result, tables[-1]), sim)
    pred = predict(result, held_out)
    trades = simulate(held_out, pred, threshold, sim)
    total = summarize({product: markout(trades, held_out, sim)})["total"]
    return {"pred": pred, "markout": dict(total["mean_bps"])}


def solo_worker(args) -> None:
    """One top-rung training in this process (the K-processes way); waits for `--go`."""
    tables, fs, cfg, _ = setup(args)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cfg = settings(cfg, args.seed + 1)[args.seed]
    data = prepare(tables, fs.inputs, fs.labels, cfg)
    plan = plan_rungs(RUNGS, device, head_dim=cfg.head_dim)
    Path(args.ready).touch()
    while not Path(args.go).exists():
        time.sleep(0.01)
    t0 = time.time()
    r = train_prepared(data, cfg, plan)
    print(
        json.dumps(
            {
                "steady_samples_per_s": r.steady_samples_per_s,
                "step_ms": r.step_ms,
                "warmup_s": r.warmup_s,
                "start": t0,
                "end": time.time(),
            }
        )
    )


def warmup_probe(args) -> None:
    """A stack of --probe-k in a fresh process: seconds to its first steady step."""
    tables, fs, cfg, _ = setup(args)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cfg = dataclasses.replace(cfg, steps=6)
    data = prepare(tables, fs.inputs, fs.labels, cfg)
    members = [Member(data=reseeded(data, c), config=c) for c in settings(cfg, args.probe_k)]
    stack = dataclasses.replace(stack_config(device, 6, args.layout), warmup_steps=1)
    t0 = time.perf_counter()
    _, timing = train_stacked(members, stack)
    print(json.dumps({"warmup_s": timing.warmup_s, "total_s": time.perf_counter() - t0}))


def run_in_process(args, *extra: str, env: dict | None = None) -> subprocess.Popen:
    argv = [
        sys.executable,
        __file__,
        "--params",
        args.params,
        "--steps",
        str(args.steps),
        "--out",
        args.out,
        *(["--tiny"] if args.tiny else []),
        *extra,
    ]
    return subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, env=env or os.environ)


def last_json(proc: subprocess.Popen, timeout: float) -> dict:
    out, _ = proc.communicate(timeout=timeout)
    lines = [line for line in out.splitlines() if line.startswith("{")]
    if proc.returncode or not lines:
        raise RuntimeError(f"worker exited {proc.returncode}: {out[-500:]}")
    return json.loads(lines[-1])


def k_processes(args, k: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        go = Path(tmp) / "go"
        procs = []
        for i in range(k):
            ready = Path(tmp) / f"ready-{i}"
            procs.append(
                (
                    ready,
                    run_in_process(
                        args, "--worker", "--seed", str(i), "--ready", str(ready), "--go", str(go)
                    ),
                )
            )
        while not all(r.exists() or p.poll() is not None for r, p in procs):
            time.sleep(0.05)
        go.touch()
        got = [last_json(p, 1800) for _, p in procs]
    wall = max(g["end"] for g in got) - min(g["start"] for g in got)
    return {
        "k": k,
        "samples_per_s": sum(g["steady_samples_per_s"] or 0 for g in got),
        "step_ms_mean": float(np.mean([g["step_ms"] for g in got])),
        "warmup_s_max": max(g["warmup_s"] or 0 for g in got),
        "wall_s": wall,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--name", default="sweep-h200")
    ap.add_argument("--ks", default="1,4,16,64")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--procs", default="4,16", help="K of the K-processes way ('' for none)")
    ap.add_argument("--check", type=int, default=16, help="K whose members are checked")
    ap.add_argument("--probe-k", type=int, default=16)
    ap.add_argument("--layout", default="packed", choices=("packed", "padded"))
    ap.add_argument("--parts", default="stacked,solo,procs,check,warmup")
    ap.add_argument("--tiny", action="store_true", help="a CPU rehearsal's small shape")
    ap.add_argument("--worker", action="store_true")
    ap.add_argument("--probe", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--ready")
    ap.add_argument("--go")
    args = ap.parse_args()
    if args.worker:
        return solo_worker(args)
    if args.probe:
        return warmup_probe(args)

    parts = set(args.parts.split(","))
    tables, fs, cfg, held_out = setup(args)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    data = prepare(tables, fs.inputs, fs.labels, cfg)
    stack = stack_config(device, args.steps, args.layout)
    result: dict = {
        "params": args.params,
        "steps": args.steps,
        "batch_size": cfg.batch_size,
        "stack": dataclasses.asdict(stack),
        "windows": len(data.windows),
        "stacked": [],
        "procs": [],
        "solo": None,
        "check": None,
        "warmup": None,
    }
    out = Path(args.out)

    def save() -> None:
        result.update(stamp())
        write(args.name, result, report(result), out)

    for k in [int(x) for x in args.ks.split(",")] if "stacked" in parts else []:
        members = [Member(data=reseeded(data, c), config=c) for c in settings(cfg, k)]
        try:
            _, t = train_stacked(members, stack)
            row = dataclasses.asdict(t)
        except torch.OutOfMemoryError as exc:
            row = {"k": k, "error": f"out of memory: {str(exc).splitlines()[0]}"}
        except Exception as exc:  # noqa: BLE001 - recorded, and the next K still runs
            row = {"k": k, "error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"}
        del members
        torch.cuda.empty_cache() if device.type == "cuda" else None
        result["stacked"].append(row)
        print("stacked", row, flush=True)
        save()
    if "solo" in parts:
        plan = plan_rungs(RUNGS, device, head_dim=cfg.head_dim)
        r = train_prepared(reseeded(data, cfg), cfg, plan)
        result["solo"] = {
            "rungs": list(plan.rungs),
            "steady_samples_per_s": r.steady_samples_per_s,
            "step_ms": r.step_ms,
            "warmup_s": r.warmup_s,
            "gpu_util": r.gpu_util,
            "peak_mem_gb": r.peak_mem_gb,
        }
        print("solo", result["solo"], flush=True)
        save()
    for k in [int(x) for x in args.procs.split(",") if x] if "procs" in parts else []:
        try:
            row = k_processes(args, k)
        except (RuntimeError, subprocess.TimeoutExpired) as exc:
            row = {"k": k, "error": str(exc)[:300]}
        result["procs"].append(row)
        print("procs", row, flush=True)
        save()
    if "check" in parts:
        result["check"] = check(data, cfg, args.check, stack, tables, held_out)
        save()
    if "warmup" in parts:
        with tempfile.TemporaryDirectory() as cache:
            env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache}
            probe = ("--probe", "--probe-k", str(args.probe_k))
            cold = last_json(run_in_process(args, *probe, env=env), 1800)
            warm = last_json(run_in_process(args, *probe, env=env), 1800)
        result["warmup"] = {
            "k": args.probe_k,
            "cold_s": cold["warmup_s"],
            "warm_s": warm["warmup_s"],
        }
        save()
    print(report(result))


def check(data, cfg, k: int, stack: StackConfig, tables, held_out) -> dict:
    """Every member of a K stack against the same model trained alone: with the same
    rungs (a stack of one: the comparison that isolates stacking), and in the plain fp32
    loop (the ladder's baseline). The control: the model alone with the stack's rungs
    against the plain loop, i.e. what the rungs' precision alone moves."""
    tolerance = BF16 if stack.bf16 else FP32
    members = [Member(data=reseeded(data, c), config=c) for c in settings(cfg, k)]
    stacked, _ = train_stacked(members, stack)
    rows = []

    def figures(x, y, tx, ty) -> dict:
        return {
            "loss_max_rel_dev": max_rel_dev(x.loss_curve, y.loss_curve),
            "pred_rel_l2": rel_l2(tx["pred"], ty["pred"]),
            "markout_delta_bps": markout_delta(tx["markout"], ty["markout"]),
        }

    def within(f: dict) -> bool:
        return (
            f["loss_max_rel_dev"] <= tolerance.loss_rel
            and f["pred_rel_l2"] <= tolerance.pred_rel_l2
            and f["markout_delta_bps"] <= tolerance.markout_bps
        )

    for m, together in zip(members, stacked, strict=True):
        (alone_rungs,), _ = train_stacked([m], stack)
        plain = train_plain(m.data, m.config)
        t_together, t_rungs, t_plain = (
            trading(r, tables, held_out) for r in (together, alone_rungs, plain)
        )
        row = {
            "seed": m.config.seed,
            "lr": m.config.lr,
            "weight_decay": m.config.weight_decay,
            "vs_alone": figures(together, alone_rungs, t_together, t_rungs),
            "vs_plain": figures(together, plain, t_together, t_plain),
            "control": figures(alone_rungs, plain, t_rungs, t_plain),
        }
        for key in ("vs_alone", "vs_plain", "control"):
            row[key]["within"] = within(row[key])
        rows.append(row)
        print("check", row, flush=True)
    return {
        "k": k,
        "tolerance": dataclasses.asdict(tolerance),
        "members": rows,
        "equivalent": sum(r["vs_alone"]["within"] for r in rows),
    }


def fmt(x, spec=",.0f") -> str:
    return "" if x is None else format(x, spec)


def report(r: dict) -> str:
    lines = [
        "# Sweeps: K models trained as one stack",
        "",
        stamp_line(r) if "machine" in r else "",
        "",
        f"Research shape ({r['params']}), {r['steps']} steps, batch {r['batch_size']} "
        f"per model, {r['windows']:,} training windows; stack: {r['stack']}.",
        "",
    ]
    solo = (r.get("solo") or {}).get("steady_samples_per_s")
    procs = {p["k"]: p for p in r["procs"]}
    rows = []
    for s in r["stacked"]:
        k = s["k"]
        if "error" in s:
            rows.append((k, s["error"], "", "", "", "", "", ""))
            continue
        p = procs.get(k, {})
        rows.append(
            (
                k,
                fmt(s["samples_per_s"]),
                fmt(s["step_ms"], ".2f"),
                fmt(s["peak_mem_gb"], ".2f"),
                fmt(s["gpu_util"] and 100 * s["gpu_util"], ".0f"),
                fmt(solo and s["samples_per_s"] / solo, ".2f"),
                fmt(p.get("samples_per_s")),
                fmt(p.get("samples_per_s") and s["samples_per_s"] / p["samples_per_s"], ".2f"),
            )
        )
    lines.append(
        markdown_table(
            (
                "K",
                "stacked samples/s",
                "step ms",
                "peak GiB",
                "GPU busy %",
                "x one model (top rung)",
                "K processes samples/s",
                "x K processes",
            ),
            rows,
        )
    )
    if r.get("solo"):
        s = r["solo"]
        lines += [
            "",
            f"One model at the top rung ({','.join(s['rungs'])}): "
            f"{fmt(s['steady_samples_per_s'])} samples/s, {fmt(s['step_ms'], '.2f')} ms a "
            f"step, warm-up {fmt(s['warmup_s'], '.1f')} s: K models one after another "
            "give these samples/s and K warm-ups.",
        ]
    if r.get("check"):
        c = r["check"]
        lines += [
            "",
            f"Equivalence, K = {c['k']}: {c['equivalent']} of {len(c['members'])} "
            "members within the tolerance of the stack's precision "
            f"{c['tolerance']} of the same model trained alone with the same rungs. "
            "Beside it, each against the plain fp32 loop, and the control: the model "
            "alone with the stack's rungs against the plain loop.",
            "",
        ]

        def cell(f: dict) -> str:
            return (
                f"{f['loss_max_rel_dev']:.1e} / {f['pred_rel_l2']:.1e} / "
                f"{f['markout_delta_bps']:.3f}" + ("" if f["within"] else " (over)")
            )

        lines.append(
            markdown_table(
                (
                    "seed",
                    "lr",
                    "wd",
                    "vs alone, same rungs: loss / pred / mark-out bps",
                    "vs plain fp32",
                    "control: alone vs plain",
                ),
                [
                    (
                        m["seed"],
                        m["lr"],
                        m["weight_decay"],
                        cell(m["vs_alone"]),
                        cell(m["vs_plain"]),
                        cell(m["control"]),
                    )
                    for m in c["members"]
                ],
            )
        )
    if r.get("warmup"):
        w = r["warmup"]
        lines += [
            "",
            f"Warm-up to the first steady step, K = {w['k']}, a fresh process: "
            f"{w['cold_s']:.1f} s with an empty Inductor cache, {w['warm_s']:.1f} s with "
            "the cache the first run filled.",
        ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
