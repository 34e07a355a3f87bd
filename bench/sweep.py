"""K models trained as one stack, against the ways a sweep runs them today.

    python bench/sweep.py --params bench/params/research-h200.json --out OUT   # the H200
    python bench/sweep.py --params bench/params/research-h200.json --out OUT \
        --ks 1,4 --steps 20 --procs 2 --check 2 --tiny                           # CPU rehearsal

The research run's training days and shape (bench/train_alone.py `research_days`). K
settings of a sweep: seed k, a learning rate and a weight decay from small grids, all on
the same fold. Parts (--parts; each saved as it ends, in this order, those left when
--deadline seconds have passed skipped and said so):

- stacked: the K models as one stack (profiling/stacked.py) with every switch that runs
  here (StackConfig.top: on a GPU compile, bf16, packing, FlexAttention and its tuned
  blocks, the flat-buffer AdamW, handed-over gradients, the whole step one CUDA graph;
  --stack-set SWITCH=0|1 changes one for an A/B, gemm_bias_grad for one):
  aggregate samples/s (all models), step time, peak memory, GPU busy; the first K's
  compiled kernels are stored in a compile-cache store (the warm-up part loads them);
- breakdown: GPU time per step by kernel class (GEMMs, attention, norms + elementwise,
  optimizer) for K = --breakdown-k, before (the stack as committed at 22786f5: compile,
  bf16, packing, FlexAttention; a per-parameter compiled update; no graph) and after
  (--breakdown-stacks picks);
- solo: one model at the ladder's top rung (rungs 1-13: profiling/loop.Training, as
  profiling/trainer.train_prepared steps it): K models in sequence give its samples/s,
  each paying its own warm-up;
- procs: K top-rung trainings in K processes sharing the GPU (how a sweep tool runs
  trials). Each warms up (compile, capture), waits until all have, then all run their
  steady steps together: the aggregate is all their samples over the wall time from the
  first start to the last end of those steps;
- warmup: a stack of --probe-k in a fresh process with empty Inductor and Triton caches
  and the compile-cache store the stacked part filled: seconds to its first steady step
  (the cold figure: the stacked part's own warm-up, which compiled);
- large: the top rung of one model at --large-batch (the issue's capture failure at
  4,096), in a fresh process under CUDA's "global" capture mode (PyTorch's default) and
  under "thread_local" (profiling/cudagraph.CAPTURE_ERROR_MODE);
- check: for K = --check, every member of the stack against the same model trained alone
  with the same switches (a stack of one: what stacking alone moves), against the plain
  fp32 loop (tasks/research/training.py), the control (alone with the switches against
  the plain loop: what the switches' precision moves, as the ladder checks its top rung),
  and the rounding floor (alone with its initial weights moved by one bf16 rounding error,
  profiling/evaluation.UNIT_ROUNDOFF, against alone): the loss curve, the held-out day's
  predictions and its out-of-sample mark-out, under the ladder's tolerance for the
  stack's precision (profiling/config.py). A member over the tolerance whose deviation is
  within CONTROL_FACTOR x its rounding floor is said to be so: at that setting no check at
  that tolerance can tell a rounding change from a defect (the ladder never widens a
  tolerance for it, nor does this).

Inductor's settings from the environment (TORCHINDUCTOR_*, e.g. its coordinate-descent
tuning for an A/B) are recorded in the result and named under its table.

Writes OUT/<name>.json and .md (machine, date, commit) after each part.
"""

from __future__ import annotations

import argparse
import contextlib
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
from bench.train_alone import research_days  # noqa: E402
from quantloop.profiling import compile_cache, measure  # noqa: E402
from quantloop.profiling.config import BF16, FP32  # noqa: E402
from quantloop.profiling.equivalence import markout_delta, max_rel_dev, rel_l2  # noqa: E402
from quantloop.profiling.evaluation import CONTROL_FACTOR, UNIT_ROUNDOFF  # noqa: E402
from quantloop.profiling.loop import StepSettings, Training, seeded_model  # noqa: E402
from quantloop.profiling.precision import apply_precision  # noqa: E402
from quantloop.profiling.proof import plan_rungs  # noqa: E402
from quantloop.profiling.rungs import Switches  # noqa: E402
from quantloop.profiling.stacked import (  # noqa: E402
    SWITCHES,
    Member,
    StackConfig,
    kernel_breakdown,
    reseeded,
    train_stacked,
)
from quantloop.profiling.trainer import (  # noqa: E402
    GIL_SWITCH_S,
    gil_switch,
    training_set,
    warmup_steps,
)
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
# The ladder's top rung (rungs 1-13, autotune left out as `auto` leaves it out)
TOP_RUNGS = ("compile", "bf16", "device_metrics", "fused_kernel", "streams", "cudagraph",
             "packing", "flex_attention", "flat_grads", "combo_kernels", "loader_mask",
             "flex_blocks")  # fmt: skip
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
    changes = dict(steps=args.steps, log_every=max(1, args.steps // 20))
    if args.tiny:
        changes |= TINY
    if args.batch:
        changes["batch_size"] = args.batch
    cfg = dataclasses.replace(cfg, **changes)
    synth = SyntheticConfig(**params["data"]["synthetic"])
    held_day = business_days(dt.date(2026, 3, 2), params["data"]["n_dates"])[-1]
    held_out = compute_features(generate_day("SYNA", held_day, synth), FeatureParams())
    return tables, fs, cfg, held_out


def settings(cfg, k: int):
    return [
        dataclasses.replace(cfg, seed=i, lr=LRS[i % len(LRS)], weight_decay=WDS[i // len(LRS) % 2])
        for i in range(k)
    ]


def device_of() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def top_stack(device: torch.device, cfg, steps: int) -> StackConfig:
    """Every switch the stack has that runs here (StackConfig.top), the clock after a
    quarter of the run (at most 10 steps: compile, 3 eager steps, the capture)."""
    warm = min(10, max(4 if device.type == "cuda" else 1, steps // 4))
    return StackConfig.top(device, cfg.head_dim, warmup_steps=warm)


def with_set(stack: StackConfig, items: list[str]) -> StackConfig:
    """`stack` with --stack-set's switches (SWITCH=0|1) set: the rungs, and precompile
    (where the compiled functions come from, not which)."""
    settable = (*SWITCHES, "precompile")
    for item in items:
        name, _, value = item.partition("=")
        if name not in settable or value not in ("0", "1"):
            raise SystemExit(f"--stack-set {item!r}: expected SWITCH=0|1, SWITCH one of {settable}")
        stack = dataclasses.replace(stack, **{name: value == "1"})
    return stack


def before_stack(device: torch.device, steps: int) -> StackConfig:
    """The stack as committed at 22786f5 (bench/results/sweep-h200-packed.md)."""
    cuda = device.type == "cuda"
    return StackConfig(compile=cuda, bf16=cuda, warmup_steps=min(10, max(1, steps // 4)),
                       packing=True, flex_attention=cuda)  # fmt: skip


def trading(result, tables, held_out, product="SYNA") -> dict:
    """Out-of-sample mark-out of a model: the held-out day traded at the threshold its
    predictions on the training days give (as profiling/evaluation.py does)."""
    sim = SimConfig()
    threshold = thresholds_from(predict(result, tables[-1]), sim)
    pred = predict(result, held_out)
    trades = simulate(held_out, pred, threshold, sim)
    total = summarize({product: markout(trades, held_out, sim)})["total"]
    return {"pred": pred, "markout": dict(total["mean_bps"])}


# ---------------------------------------------------------------- one model, top rung


def timed_solo(data, cfg, rungs, device, ready: str | None = None, go: str | None = None) -> dict:
    """One model at `rungs` (profiling/loop.Training, stepped as profiling/trainer.py's
    train_prepared steps it): the warm-up (compile, capture), then, after `ready` is
    touched and `go` exists (the K-processes barrier), the steady steps on the clock."""
    plan = plan_rungs(list(rungs), device, head_dim=cfg.head_dim)
    sw = Switches.of(plan.rungs)
    work = training_set(data, sw.packing)
    W = warmup_steps(cfg.steps)
    s = StepSettings(batch_size=cfg.batch_size, steps=cfg.steps, lr=cfg.lr,
                     weight_decay=cfg.weight_decay, log_every=cfg.log_every, eager_steps=W - 1,
                     compile_backend=plan.compile_backend)  # fmt: skip
    torch._dynamo.reset()
    t0 = time.perf_counter()
    model = seeded_model(data.model_config, cfg.seed, device)
    training = Training(model, sw, work, s, device, plain_logger="loss")
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    out: dict = {"rungs": list(plan.rungs), "batch": cfg.batch_size, "pack_rows": work.pack_rows}
    try:
        with apply_precision(device, enabled=sw.bf16), \
                gil_switch(GIL_SWITCH_S if device.type == "cuda" else None):  # fmt: skip
            for step in range(W):
                training.step(step)
            measure.sync(device)
            out["warmup_s"] = time.perf_counter() - t0
            if ready:
                Path(ready).touch()
                while not Path(go).exists():
                    time.sleep(0.005)
            sampler = measure.UtilSampler(device)
            timer = measure.StepTimer(device)
            out["start"] = time.time()
            timer.start()
            with sampler:
                for step in range(W, cfg.steps):
                    training.step(step)
                device_s, wall = timer.stop()
            out["end"] = time.time()
    except Exception as exc:  # noqa: BLE001 - recorded: the large part's capture failure
        # the loader thread's own failure, if it put one in its queue (rung 6)
        queued = list(training.loader.ready.queue) if hasattr(training.loader, "ready") else []
        loader = [e for e in queued if isinstance(e, BaseException)]
        out["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
        if exc.__cause__ is not None or exc.__context__ is not None:
            inner = exc.__cause__ or exc.__context__
            out["error_cause"] = f"{type(inner).__name__}: {str(inner).splitlines()[0][:300]}"
        if loader:
            out["loader_error"] = f"{type(loader[0]).__name__}: {str(loader[0])[:300]}"
        return out
    finally:
        training.close()
    n = cfg.steps - W
    out |= {
        "steps": n,
        "samples": n * cfg.batch_size,
        "steady_samples_per_s": n * cfg.batch_size / wall,
        "step_ms": wall / n * 1e3,
        "device_step_ms": device_s / n * 1e3,
        "gpu_util": sampler.mean,
        "peak_mem_gb": torch.cuda.max_memory_allocated(device) / 2**30
        if device.type == "cuda" else None,
    }  # fmt: skip
    return out


def solo_worker(args) -> None:
    """One top-rung training in this process (the K-processes way, or the large part)."""
    tables, fs, cfg, _ = setup(args)
    cfg = settings(cfg, args.seed + 1)[args.seed]
    data = prepare(tables, fs.inputs, fs.labels, cfg)
    out = timed_solo(data, cfg, TOP_RUNGS, device_of(), args.ready, args.go)
    print(json.dumps(out))


def warmup_probe(args) -> None:
    """A stack of --probe-k in this (fresh) process: seconds to its first steady step."""
    t_start = time.perf_counter()
    tables, fs, cfg, _ = setup(args)
    device = device_of()
    data = prepare(tables, fs.inputs, fs.labels, cfg)
    # the stacked part's stack of this K (same members and steps: the same packed rows, so
    # the same shapes), its clock started right after the capture
    members = [Member(data=reseeded(data, c), config=c) for c in settings(cfg, args.probe_k)]
    warm = 4 if device.type == "cuda" else 1
    # the stacked part's stack, --stack-set included: another would be another store key
    stack = with_set(top_stack(device, cfg, args.steps), args.stack_set)
    stack = dataclasses.replace(stack, warmup_steps=warm)
    t0 = time.perf_counter()
    _, timing = train_stacked(members, stack, compile_cache=args.store)
    print(json.dumps({"warmup_s": timing.warmup_s, "setup_s": timing.setup_s,
                      "warmup_steps_s": timing.warmup_steps_s,
                      "cache_load_s": timing.cache_load_s,
                      "compile_cache": timing.compile_cache, "counters": compile_cache.counts(),
                      "compile_times": compile_cache.compile_times(),
                      "process_to_first_step_s": t0 - t_start + timing.setup_s + timing.warmup_s,
                      "total_s": time.perf_counter() - t0}))  # fmt: skip


def run_in_process(args, *extra: str, env: dict | None = None) -> subprocess.Popen:
    argv = [sys.executable, __file__, "--params", args.params, "--steps", str(args.steps),
            "--out", args.out, *(["--tiny"] if args.tiny else []), *extra]  # fmt: skip
    return subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, env=env or os.environ)


def last_json(proc: subprocess.Popen, timeout: float) -> dict:
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        raise RuntimeError(f"worker ran past {timeout:.0f} s: {out[-300:]}") from None
    lines = [line for line in out.splitlines() if line.startswith("{")]
    if proc.returncode or not lines:
        raise RuntimeError(f"worker exited {proc.returncode}: {out[-500:]}")
    return json.loads(lines[-1])


def k_processes(args, k: int, timeout: float) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        go = Path(tmp) / "go"
        procs = []
        for i in range(k):
            ready = Path(tmp) / f"ready-{i}"
            argv = ("--worker", "--seed", str(i), "--ready", str(ready), "--go", str(go))
            # the kernels are in the machine's Inductor cache (the solo part compiled the
            # same shapes): no pool of compile workers in each of the K processes
            env = {**os.environ, "TORCHINDUCTOR_COMPILE_THREADS": "1"}
            procs.append((ready, run_in_process(args, *argv, env=env)))
        t0 = time.time()
        while not all(r.exists() or p.poll() is not None for r, p in procs):
            if time.time() - t0 > timeout:
                break
            time.sleep(0.05)
        go.touch()  # all warmed up (or failed): the steady steps start together
        got = [last_json(p, max(30.0, timeout - (time.time() - t0))) for _, p in procs]
    wall = max(g["end"] for g in got) - min(g["start"] for g in got)
    samples = sum(g["samples"] for g in got)
    return {
        "k": k,
        "samples_per_s": samples / wall,
        "sum_of_rates": sum(g["steady_samples_per_s"] for g in got),
        "step_ms_mean": float(np.mean([g["step_ms"] for g in got])),
        "warmup_s_max": max(g["warmup_s"] for g in got),
        "wall_s": wall,
        "start_spread_s": max(g["start"] for g in got) - min(g["start"] for g in got),
    }


# ---------------------------------------------------------------- the bench


PARTS = ("stacked", "breakdown", "solo", "procs", "warmup", "large", "check")


def parse_parts(text: str) -> list[str]:
    """--parts as a list: "stacked:64,4,procs:4" -> ["stacked:64,4", "procs:4"] (a bare K
    belongs to the stacked or procs part before it). An unknown part is refused before
    any work: it was skipped without a word (2026-12-07, "stacked:64,4" ran K = 64 only)."""
    parts: list[str] = []
    for token in (t.strip() for t in text.split(",") if t.strip()):
        if token.isdigit() and parts and parts[-1].partition(":")[0] in ("stacked", "procs"):
            head, _, ks = parts[-1].partition(":")
            parts[-1] = f"{head}:{ks + ',' if ks else ''}{token}"
            continue
        name, _, ks = token.partition(":")
        if name not in PARTS or (ks and not all(k.isdigit() for k in ks.split(","))):
            raise SystemExit(f"--parts: {token!r} is not a part ({', '.join(PARTS)}; "
                             "stacked:K and procs:K name their K)")  # fmt: skip
        parts.append(token)
    return parts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--name", default="sweep-h200")
    ap.add_argument("--ks", default="1,4,16,64", help="K of the stacked part, in this order")
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--batch", type=int, default=0, help="batch per model (0: the params')")
    ap.add_argument("--procs", default="16,4", help="K of the K-processes way ('' for none)")
    ap.add_argument("--check", type=int, default=16, help="K whose members are checked")
    ap.add_argument("--breakdown-k", type=int, default=16)
    ap.add_argument(
        "--breakdown-stacks",
        default="after,before",
        help="which stacks the breakdown part breaks down (after: the top stack)",
    )
    ap.add_argument(
        "--stack-set",
        action="append",
        default=[],
        metavar="SWITCH=0|1",
        help="a StackConfig switch of the top stack set (an A/B of one switch)",
    )
    ap.add_argument("--probe-k", type=int, default=16)
    ap.add_argument("--large-batch", type=int, default=4096)
    ap.add_argument(
        "--parts",
        default="stacked:16,breakdown,solo,procs:16,stacked:1,warmup,large,check,stacked:64,"
        "stacked:4,procs:4",
        help="parts in order; stacked:K,K and procs:K,K name their K",
    )
    ap.add_argument("--deadline", type=float, default=1e9, help="seconds; later parts skipped")
    ap.add_argument("--tiny", action="store_true", help="a CPU rehearsal's small shape")
    ap.add_argument("--worker", action="store_true")
    ap.add_argument("--probe", action="store_true")
    ap.add_argument("--store", help="(probe) the compile-cache store")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--ready")
    ap.add_argument("--go")
    args = ap.parse_args()
    if args.worker:
        return solo_worker(args)
    if args.probe:
        return warmup_probe(args)

    t_start = time.perf_counter()
    parts = parse_parts(args.parts)
    tables, fs, cfg, held_out = setup(args)
    device = device_of()
    data = prepare(tables, fs.inputs, fs.labels, cfg)
    stack = with_set(top_stack(device, cfg, args.steps), args.stack_set)
    if not set(args.breakdown_stacks.split(",")) <= {"after", "before"}:
        raise SystemExit(f"--breakdown-stacks {args.breakdown_stacks!r}: after and/or before")
    store = tempfile.mkdtemp(prefix="sweep-store-")
    result: dict = {
        "params": args.params, "steps": args.steps, "batch_size": cfg.batch_size,
        "stack": dataclasses.asdict(stack), "switches": list(stack.switches()),
        "windows": len(data.windows), "stacked": [], "breakdown": {}, "procs": [],
        "solo": None, "check": None, "warmup": None, "large": [], "skipped": [],
        "part_s": {},
        # Inductor's settings from the environment (an A/B of its tuning sets them)
        "inductor_env": {k: v for k, v in os.environ.items() if k.startswith("TORCHINDUCTOR_")},
    }  # fmt: skip
    out = Path(args.out)

    def save() -> None:
        result.update(stamp())
        write(args.name, result, report(result), out)

    def left() -> float:  # seconds to the deadline (a subprocess's timeout: 30 min at most)
        return min(1800.0, args.deadline - (time.perf_counter() - t_start))

    kept: dict[int, list] = {}  # K -> the stack's results (the check reuses them)
    for spec in parts:
        # "part" or "part:K,K" (stacked and procs: those K instead of --ks / --procs)
        part, _, ks = spec.partition(":")
        if left() <= 0:
            result["skipped"].append(spec)
            print(f"skipped {spec}: past the deadline", flush=True)
            save()
            continue
        t0 = time.perf_counter()
        if part == "stacked":
            for k in (int(x) for x in (ks or args.ks).split(",")):
                first = not result["stacked"]  # the first stack fills the compile-cache store
                if left() <= 0:
                    result["skipped"].append(f"stacked K={k}")
                    continue
                members = [Member(data=reseeded(data, c), config=c) for c in settings(cfg, k)]
                for attempt in (stack, dataclasses.replace(stack, cudagraph=False)):
                    try:
                        res, t = train_stacked(members, attempt,
                                               compile_cache=store if first else None)  # fmt: skip
                        row = dataclasses.asdict(t)
                        if k == args.check:
                            kept[k] = res
                    except torch.OutOfMemoryError as exc:
                        row = {"k": k, "error": f"out of memory: {str(exc).splitlines()[0]}"}
                    except Exception as exc:  # noqa: BLE001 - recorded, the next K still runs
                        why = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
                        row = {"k": k, "error": why}
                    row["switches"] = list(attempt.switches())
                    result["stacked"].append(row)
                    print("stacked", row, flush=True)
                    save()
                    if "error" not in row or not attempt.cudagraph:
                        break  # a failed graphed stack is tried once more without the graph
                if first:
                    result["store_k"] = k
                del members
                if device.type == "cuda":
                    torch.cuda.empty_cache()
        elif part == "breakdown":
            k = args.breakdown_k
            members = [Member(data=reseeded(data, c), config=c) for c in settings(cfg, k)]
            # after first: the stacked part's compiled loss of this K, kept (no compile)
            stacks = {"after": lambda: stack, "before": lambda: before_stack(device, args.steps)}
            for name in args.breakdown_stacks.split(","):
                s = stacks[name]()
                reuse = name == "after"
                try:
                    result["breakdown"][name] = {
                        "switches": list(s.switches()),
                        **kernel_breakdown(members, s, reuse_compiled=reuse),
                    }
                except Exception as exc:  # noqa: BLE001 - recorded
                    result["breakdown"][name] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
                print("breakdown", name, result["breakdown"][name], flush=True)
                save()
        elif part == "solo":
            result["solo"] = timed_solo(reseeded(data, cfg), cfg, TOP_RUNGS, device)
            print("solo", result["solo"], flush=True)
        elif part == "procs":
            for k in [int(x) for x in (ks or args.procs).split(",") if x]:
                if left() <= 0:
                    result["skipped"].append(f"procs K={k}")
                    continue
                try:
                    row = k_processes(args, k, timeout=max(60.0, left()))
                except (RuntimeError, subprocess.TimeoutExpired, ValueError) as exc:
                    row = {"k": k, "error": str(exc)[:300]}
                result["procs"].append(row)
                print("procs", row, flush=True)
                save()
        elif part == "warmup":
            result["warmup"] = warmup(args, store, result)
            print("warmup", result["warmup"], flush=True)
        elif part == "large":
            for mode in ("global", "thread_local"):
                env = {**os.environ, "QUANTLOOP_CAPTURE_ERROR_MODE": mode}
                argv = ("--worker", "--batch", str(args.large_batch), "--steps", "60")
                try:
                    row = last_json(run_in_process(args, *argv, env=env), max(60.0, left()))
                except RuntimeError as exc:
                    row = {"error": str(exc)[:500]}
                row.pop("start", None), row.pop("end", None)
                result["large"].append({"capture_mode": mode, **row})
                print("large", mode, row, flush=True)
                save()
        elif part == "check":
            try:
                result["check"] = check(data, cfg, args.check, stack, tables, held_out,
                                        kept.get(args.check), deadline=left, save=save,
                                        result=result)  # fmt: skip
            except Exception as exc:  # noqa: BLE001 - recorded with the members done
                why = f"{type(exc).__name__}: {exc}"[:300]
                result["check"] = {**(result["check"] or {}), "error": why}
        result["part_s"][spec] = time.perf_counter() - t0
        save()
    print(report(result))


def warmup(args, store: str, result: dict) -> dict:
    """The stack's warm-up in a fresh process on an empty machine cache (Inductor's and
    Triton's folders new and empty), with the compile-cache store the stacked part filled."""
    stored = [r for r in result["stacked"] if r.get("k") == result.get("store_k")]
    cold = stored[0] if stored and "error" not in stored[0] else None
    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": f"{tmp}/inductor",
               "TRITON_CACHE_DIR": f"{tmp}/triton"}  # fmt: skip
        probe = ("--probe", "--probe-k", str(args.probe_k), "--store", store,
                 *(f"--stack-set={item}" for item in args.stack_set))  # fmt: skip
        try:
            warm = last_json(run_in_process(args, *probe, env=env), 600)
        except RuntimeError as exc:
            warm = {"error": str(exc)[:500]}
    return {
        "k": args.probe_k,
        "cold_s": cold["warmup_s"] if cold and result.get("store_k") == args.probe_k else None,
        "cold_compile_cache": cold.get("compile_cache") if cold else None,
        "warm": warm,
    }


def check(data, cfg, k: int, stack: StackConfig, tables, held_out, stacked=None, *,
          deadline=lambda: 1e9, save=lambda: None, result=None) -> dict:  # fmt: skip
    """Every member of a K stack against the same model trained alone (module docstring)."""
    tolerance = BF16 if stack.bf16 else FP32
    unit = UNIT_ROUNDOFF["bf16" if stack.bf16 else "fp32"]
    members = [Member(data=reseeded(data, c), config=c) for c in settings(cfg, k)]
    if stacked is None:
        stacked, _ = train_stacked(members, stack)
    rows: list[dict] = []
    out = {"k": k, "tolerance": dataclasses.asdict(tolerance), "perturb": unit,
           "control_factor": CONTROL_FACTOR, "members": rows}  # fmt: skip
    if result is not None:
        result["check"] = out

    def figures(x, y, tx, ty) -> dict:
        f = {
            "loss_max_rel_dev": max_rel_dev(x.loss_curve, y.loss_curve),
            "pred_rel_l2": rel_l2(tx["pred"], ty["pred"]),
            "markout_delta_bps": markout_delta(tx["markout"], ty["markout"]),
        }
        f["within"] = (
            f["loss_max_rel_dev"] <= tolerance.loss_rel
            and f["pred_rel_l2"] <= tolerance.pred_rel_l2
            and f["markout_delta_bps"] <= tolerance.markout_bps
        )
        return f

    for m, together in zip(members, stacked, strict=True):
        if deadline() <= 0:
            out["stopped"] = f"past the deadline after {len(rows)} members"
            break
        # one model alone: a stack of one (compiled once, for the first member)
        (alone,), _ = train_stacked([m], stack, reuse_compiled=bool(rows))
        (moved,), _ = train_stacked([m], stack, perturb=unit, reuse_compiled=True)
        plain = train_plain(m.data, m.config)
        t_together, t_alone, t_moved, t_plain = (
            trading(r, tables, held_out) for r in (together, alone, moved, plain)
        )
        row = {
            "seed": m.config.seed, "lr": m.config.lr, "weight_decay": m.config.weight_decay,
            "vs_alone": figures(together, alone, t_together, t_alone),
            "vs_plain": figures(together, plain, t_together, t_plain),
            "control": figures(alone, plain, t_alone, t_plain),
            "rounding": figures(moved, alone, t_moved, t_alone),
        }  # fmt: skip
        # over the tolerance but within CONTROL_FACTOR x what one rounding error moves
        floor = row["rounding"]
        row["vs_alone"]["within_floor"] = all(
            row["vs_alone"][key] <= CONTROL_FACTOR * floor[key]
            for key in ("loss_max_rel_dev", "pred_rel_l2", "markout_delta_bps")
        )
        rows.append(row)
        print("check", row, flush=True)
        save()
    out["equivalent"] = sum(r["vs_alone"]["within"] for r in rows)
    out["over_but_within_floor"] = sum(
        (not r["vs_alone"]["within"]) and r["vs_alone"]["within_floor"] for r in rows
    )
    return out


# ---------------------------------------------------------------- the report


def fmt(x, spec=",.0f") -> str:
    return "" if x is None else format(x, spec)


def report(r: dict) -> str:
    lines = [
        "# Sweeps: K models trained as one stack",
        "",
        stamp_line(r) if "machine" in r else "",
        "",
        f"Research shape ({r['params']}), {r['steps']} steps, batch {r['batch_size']} "
        f"per model, {r['windows']:,} training windows; the stack's switches: "
        f"{', '.join(r['switches'])}."
        + "".join(
            f" {k}={v}."
            for k, v in sorted(r.get("inductor_env", {}).items())
            if k != "TORCHINDUCTOR_CACHE_DIR"
        ),
        "",
    ]
    solo = (r.get("solo") or {}).get("steady_samples_per_s")
    procs = {p["k"]: p for p in r["procs"]}
    rows = []
    for s in r["stacked"]:
        k = s["k"]
        if "cudagraph" in r["switches"] and "cudagraph" not in s.get("switches", r["switches"]):
            k = f"{k} (no graph)"
        if "error" in s:
            rows.append((k, s["error"], "", "", "", "", "", "", ""))
            continue
        p = procs.get(k, {})
        rows.append((
            k, fmt(s["samples_per_s"]), fmt(s["step_ms"], ".2f"), fmt(s["peak_mem_gb"], ".2f"),
            fmt(s["gpu_util"] and 100 * s["gpu_util"], ".0f"),
            fmt(s["warmup_s"], ".1f"),
            fmt(solo and s["samples_per_s"] / solo, ".2f"),
            fmt(p.get("samples_per_s")),
            fmt(p.get("samples_per_s") and s["samples_per_s"] / p["samples_per_s"], ".2f"),
        ))  # fmt: skip
    lines.append(markdown_table(
        ("K", "stacked samples/s", "step ms", "peak GiB", "GPU busy %", "warm-up s",
         "x one model (top rung)", "K processes samples/s", "x K processes"),
        sorted(rows, key=lambda row: int(str(row[0]).split()[0])),
    ))  # fmt: skip
    if r.get("solo"):
        s = r["solo"]
        if "error" in s:
            lines += ["", f"One model at the top rung: {s['error']}"]
        else:
            lines += [
                "",
                f"One model at the top rung ({', '.join(s['rungs'])}): "
                f"{fmt(s['steady_samples_per_s'])} samples/s, {fmt(s['step_ms'], '.2f')} ms a "
                f"step, warm-up {fmt(s['warmup_s'], '.1f')} s: K models one after another "
                "give these samples/s and K warm-ups.",
            ]
    for p in r["procs"]:
        if "error" in p:
            lines += ["", f"K = {p['k']} processes: {p['error']}"]
        else:
            lines += [
                "",
                f"K = {p['k']} processes at the top rung, steady steps together: "
                f"{fmt(p['samples_per_s'])} samples/s over {p['wall_s']:.2f} s (the sum "
                f"of their own rates {fmt(p['sum_of_rates'])}; starts within "
                f"{p['start_spread_s']:.2f} s; warm-up up to {p['warmup_s_max']:.1f} s).",
            ]
    if r.get("breakdown"):
        classes = ("gemm", "attention", "norms_elementwise", "optimizer")
        rows = []
        for name, b in r["breakdown"].items():
            if "error" in b or not b.get("kernel_ms"):
                rows.append((name, b.get("error", "no CUDA"), "", "", "", "", ""))
                continue
            rows.append((name, *(fmt(b["kernel_ms"][c], ".2f") for c in classes),
                         fmt(b["kernel_total_ms"], ".2f"),
                         " / ".join(fmt(b["phase_wall_ms"][p], ".2f")
                                    for p in ("forward", "backward", "optimizer"))))  # fmt: skip
        k = next(iter(r["breakdown"].values())).get("k")
        lines += [
            "",
            f"GPU time per step by kernel class, K = {k} (ms; eager steps of the "
            "same compiled kernels, the device synchronised between phases):",
            "",
        ]
        lines.append(markdown_table(
            ("stack", "GEMMs", "attention", "norms + elementwise", "optimizer", "kernels",
             "phase wall: fwd / bwd / opt"), rows))  # fmt: skip
    if r.get("warmup"):
        w = r["warmup"]
        warm = w["warm"]
        lines += [
            "",
            f"Warm-up to the first steady step, K = {w['k']} (3 eager steps and the "
            f"capture): {fmt(w['cold_s'], '.1f')} s compiling (the stacked part's); "
            + (
                f"in a fresh process with empty Inductor and Triton caches and the "
                f"compile-cache store filled: {warm['warmup_s']:.1f} s (store "
                f"{warm['compile_cache']}; set-up before it {warm['setup_s']:.1f} s; "
                f"process start to first steady step {warm['process_to_first_step_s']:.1f} s"
                + "".join(f"; {k} {v}" for k, v in sorted(warm.get("counters", {}).items()))
                + ")"
                + (
                    (
                        "; torch.compile in that process {total_s:.1f} s over {frames} frames: "
                        "Dynamo's trace {dynamo_s:.1f} s, AOTAutograd and Inductor "
                        "{backend_s:.1f} s."
                    ).format(**warm["compile_times"])
                    if warm.get("compile_times")
                    else "."
                )
                + (
                    " Its parts: the store read and loaded {:.2f} s, then each warm-up step "
                    "(synchronized) {} s.".format(
                        warm.get("cache_load_s", 0.0),
                        " / ".join(f"{x:.2f}" for x in warm["warmup_steps_s"]),
                    )
                    if warm.get("warmup_steps_s")
                    else ""
                )
                if "error" not in warm
                else f"warm probe failed: {warm['error']}"
            ),
        ]
    for row in r.get("large") or []:
        what = row.get("error") or (
            f"{fmt(row.get('steady_samples_per_s'))} samples/s, {fmt(row.get('step_ms'), '.2f')} "
            f"ms a step, peak {fmt(row.get('peak_mem_gb'), '.1f')} GiB"
        )
        extra = "".join(f"; {k}: {row[k]}" for k in ("error_cause", "loader_error") if k in row)
        lines += [
            "",
            f"One model, top rung, batch {row.get('batch', '?')}, capture mode "
            f"{row['capture_mode']}: {what}{extra}.",
        ]
    if r.get("check") and "members" not in r["check"]:
        lines += ["", f"Equivalence check failed: {r['check'].get('error')}"]
    elif r.get("check"):
        c = r["check"]
        if c.get("error"):
            lines += ["", f"Equivalence check stopped by an error: {c['error']}"]
        lines += [
            "",
            f"Equivalence, K = {c['k']}: {c.get('equivalent', '?')} of {len(c['members'])} "
            f"members within the tolerance of the stack's precision {c['tolerance']} of the "
            "same model trained alone with the same switches; "
            f"{c.get('over_but_within_floor', '?')} more over it but within "
            f"{c['control_factor']:g}x their rounding floor (alone, initial weights moved by "
            f"{c['perturb']:.2g}, against alone). Beside it: each against the plain fp32 "
            "loop, and the control (alone with the switches against the plain loop).",
            "",
        ]

        def cell(f: dict) -> str:
            over = "" if f["within"] else " (over)"
            return (
                f"{f['loss_max_rel_dev']:.1e} / {f['pred_rel_l2']:.1e} / "
                f"{f['markout_delta_bps']:.3f}{over}"
            )

        lines.append(markdown_table(
            ("seed", "lr", "wd", "vs alone, same switches: loss / pred / mark-out bps",
             "rounding floor: moved vs alone", "vs plain fp32", "control: alone vs plain"),
            [(m["seed"], m["lr"], m["weight_decay"],
              cell(m["vs_alone"]) + ("" if m["vs_alone"]["within"] else
                                     (" within floor" if m["vs_alone"]["within_floor"]
                                      else " beyond floor")),
              cell(m["rounding"]), cell(m["vs_plain"]), cell(m["control"]))
             for m in c["members"]],
        ))  # fmt: skip
        if c.get("stopped"):
            lines += ["", f"Check stopped: {c['stopped']}."]
    if r.get("skipped"):
        lines += ["", f"Not run (past the deadline): {', '.join(r['skipped'])}."]
    if r.get("part_s"):
        lines += ["", "Seconds per part: " + ", ".join(f"{k} {v:.0f}" for k, v in
                                                       r["part_s"].items()) + "."]  # fmt: skip
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        main()
