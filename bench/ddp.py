"""Data-parallel training on the GPUs of one host: rung 6's multi-GPU half.

    torchrun --standalone --nproc-per-node 1 bench/ddp.py --out $OUT --work /tmp/ddp
    torchrun --standalone --nproc-per-node 2 bench/ddp.py --out $OUT --work /tmp/ddp

One process per GPU (NCCL; gloo on a CPU), the ladder's workload and model, the top rung's
switches less flat_grads (profiling.distributed reduces in the flat buffer), compiled block
by block so the all-reduce of a block's gradients overlaps the backward of the blocks below.

With one process it trains the global batch on one GPU and writes the reference
(<work>/one_gpu.json, .npz). With N it trains (a) the same global batch split N ways,
checked against the reference under the ladder's tolerances, and (b) the same per-GPU
batch on each GPU (N times the global batch) for throughput, profiled on rank 0 for the
all-reduce's overlap; rank 0 writes <out>/ladder-h200x<N>.json and the trace.
NCCL_NVLS_ENABLE=0 (and the other multicast switches) stay set, also for the workers.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tarfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.checkout import use_checkout  # noqa: E402
from bench.report import commit, stamp  # noqa: E402

use_checkout()

# Multicast off in NCCL, PyTorch and NVSHMEM, before anything initialises them (KINDS.md).
os.environ.update(
    NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1"
)
# Collectives captured in a CUDA graph: no watchdog queries on events under capture
# (PyTorch's CUDA-graphs notes, "Usage with DistributedDataParallel").
os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "0")

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from quantloop.profiling import measure  # noqa: E402
from quantloop.profiling.config import preset  # noqa: E402
from quantloop.profiling.distributed import (  # noqa: E402
    GradBuckets,
    allreduce_overlap,
    bucket_spans,
    nccl_options,
    rank_share,
)
from quantloop.profiling.evaluation import check_rung, heldout_fit, reference  # noqa: E402
from quantloop.profiling.ladder import rung_row, work_figures  # noqa: E402
from quantloop.profiling.loop import (  # noqa: E402
    RungRun,
    StepSettings,
    Training,
    model_config,
    predict,
    seeded_model,
)
from quantloop.profiling.precision import apply_precision  # noqa: E402
from quantloop.profiling.rungs import Rung, Switches, runnable  # noqa: E402
from quantloop.profiling.workload import build_workload  # noqa: E402

RUNG = Rung(
    number=6,
    name="data_parallel",
    switch="",
    cuda_only="",
    predicted="1.9x on 2 GPUs at the same per-GPU batch: the all-reduce of 3.4 MB of "
    "gradients (~30 us over NVLink) runs on NCCL's stream under the backward of the blocks "
    "below; the rest of the step is each GPU's own",
)


def run(
    cfg, sw: Switches, global_batch: int, device, store: str, trace: str | None,
    *, allreduce: bool = True, predicts: bool = True,
) -> dict:  # fmt: skip
    """Train on this rank's share of each step's `global_batch` windows; rank 0 predicts
    the held-out windows (predicts=False: not, for a run that is only timed).
    allreduce=False: each rank steps on its own gradients (a control: the step without
    communication, to time what the all-reduce adds)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    c = dataclasses.replace(cfg, batch_size=global_batch)
    work = build_workload(c, store)
    share = rank_share(work, rank, world, sw.packing)
    torch._dynamo.reset()
    model = seeded_model(model_config(c, work), c.seed, device)
    settings = dataclasses.replace(
        StepSettings.of_ladder(c), batch_size=global_batch // world, compile_per_block=True
    )
    holder: dict = {}  # the buckets hook into the optimizer's buffer, made by Training
    finish = (lambda: holder["b"].finish()) if world > 1 and allreduce else None
    training = Training(model, sw, share, settings, device, after_backward=finish)
    if world > 1:
        dist.broadcast(training.opt.param, 0)  # the same start everywhere (same seed anyway)
    if finish is not None:
        holder["b"] = GradBuckets(model, training.opt)
    W, T = c.warmup_steps, c.timed_steps
    timer, sampler = measure.StepTimer(device), measure.UtilSampler(device)
    prof = None
    cuda = device.type == "cuda"
    acts = [torch.profiler.ProfilerActivity.CPU] + (
        [torch.profiler.ProfilerActivity.CUDA] if cuda else []
    )
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    try:
        with apply_precision(device, enabled=sw.bf16):
            timer.start()
            for step in range(c.steps):
                if step == W:
                    warmup_s = timer.stop()[1]
                    sampler.__enter__()
                    timer.start()
                elif step == W + T:
                    timed, wall = timer.stop()
                    sampler.__exit__(None, None, None)
                    if trace and rank == 0:
                        prof = torch.profiler.profile(activities=acts)
                        prof.__enter__()
                with torch.profiler.record_function(measure.STEP_LABEL):
                    training.step(step)
            measure.sync(device)
            if prof is not None:
                prof.__exit__(None, None, None)
    finally:
        training.close()
    loss, _, norms = training.logger.series()
    # the loss of the global batch: the mean of the ranks' (equal shares)
    loss_t = torch.tensor(np.ascontiguousarray(loss), device=device)  # a column of the ring
    dist.all_reduce(loss_t)
    loss = (loss_t / world).cpu().numpy()
    out = {
        "work": work, "cfg": c, "loss": loss, "norms": norms, "warmup_s": warmup_s,
        "timed_s": timed, "wall_s": wall, "gpu_util": sampler.mean,
        "peak_mem_gb": torch.cuda.max_memory_allocated(device) / 2**30 if cuda else None,
        "batch_bytes": training.layout.nbytes, "pack_rows": share.pack_rows,
    }  # fmt: skip
    if prof is not None:
        prof.export_chrome_trace(trace)
        out["counts"] = measure.count_trace(trace, c.profiled_steps)
    # every rank holds the same weights; rank 0 checks that and predicts
    digest = torch.tensor([float(training.opt.param.double().sum())], device=device)
    same = [torch.zeros_like(digest) for _ in range(world)]
    dist.all_gather(same, digest)
    out["weights_agree"] = len({float(t) for t in same}) == 1
    if rank == 0 and predicts:
        out["pred_test"] = predict(model, work, work.test, c.predict_batch, device)
        out["pred_threshold"] = predict(model, work, work.threshold, c.predict_batch, device)
    return out


def as_rung_run(r: dict) -> RungRun:
    return RungRun(
        loss=r["loss"], grad_norm=r["norms"], pred_test=r["pred_test"],
        pred_threshold=r["pred_threshold"], warmup_s=r["warmup_s"], timed_s=r["timed_s"],
        timed_wall_s=r["wall_s"], gpu_util=r["gpu_util"], peak_mem_gb=r["peak_mem_gb"],
        counts=r.get("counts"), trace=None, batch_bytes=r["batch_bytes"],
    )  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--work", default="/tmp/ddp-work")
    ap.add_argument("--preset", default="auto")
    ap.add_argument("--commit", default="")
    ap.add_argument("--switches", default="", help="comma-separated (default: the top rung's)")
    ap.add_argument("--name", default="", help="file stem (default: ladder-h200x<N>)")
    ap.add_argument(
        "--nccl-ctas", type=int, default=0,
        help="cap NCCL's thread blocks per collective (0: NCCL's choice)",
    )  # fmt: skip
    ap.add_argument(
        "--throughput-only", action="store_true",
        help="N GPUs: only the throughput run (no equivalence), for comparing settings",
    )  # fmt: skip
    ap.add_argument(
        "--no-allreduce", action="store_true",
        help="N GPUs, throughput only, no gradient all-reduce: the step without communication",
    )  # fmt: skip
    args = ap.parse_args()

    cuda = torch.cuda.is_available()
    local = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    if cuda:
        dist.init_process_group("nccl", device_id=device, pg_options=nccl_options(args.nccl_ctas))
    else:
        dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = preset(args.preset)
    if not cuda:
        torch.set_num_threads(1)
    here = runnable(device) | ({"fused_kernel"} if not cuda else set())  # its torch path
    names = args.switches.split(",") if args.switches else [
        n for n in ("compile", "bf16", "device_metrics", "fused_kernel", "streams",
                    "cudagraph", "packing", "flex_attention") if n in here
    ]  # fmt: skip
    sw = Switches.of(names)
    work_dir, out = Path(args.work), Path(args.out)
    work_dir.mkdir(parents=True, exist_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    store = str(work_dir / "store")
    if rank == 0:
        build_workload(cfg, store)  # written once; the other ranks read it
    dist.barrier()
    log = (lambda m: print(f"[rank 0] {m}", flush=True)) if rank == 0 else (lambda m: None)
    log(f"{world} process(es) on {device}; switches {sw.names()}")
    B = cfg.batch_size
    t0 = time.perf_counter()

    if world == 1:
        r = run(cfg, sw, B, device, store, str(work_dir / "trace-1gpu.json"))
        sps = B / (r["timed_s"] / cfg.timed_steps)
        np.savez(work_dir / "one_gpu.npz", loss=r["loss"], pred_test=r["pred_test"],
                 pred_threshold=r["pred_threshold"],
                 **{f"norm:{k}": v for k, v in r["norms"].items()})  # fmt: skip
        (work_dir / "one_gpu.json").write_text(json.dumps({
            "samples_per_s": sps, "step_ms": r["timed_s"] / cfg.timed_steps * 1e3,
            "batch": B, "warmup_s": r["warmup_s"], "gpu_util": r["gpu_util"],
            "peak_mem_gb": r["peak_mem_gb"], "switches": list(sw.names()),
            "pack_rows": r["pack_rows"],
        }))  # fmt: skip
        log(f"one GPU, batch {B}: {sps:,.0f} samples/s, {r['timed_s'] / cfg.timed_steps * 1e3:.3f} "
            f"ms/step, warm-up {r['warmup_s']:.1f} s")  # fmt: skip
        dist.destroy_process_group()
        return

    one = json.loads((work_dir / "one_gpu.json").read_text())
    if args.throughput_only or args.no_allreduce:
        throughput_only(args, cfg, sw, device, store, work_dir, out, one, t0)
        return
    ref = np.load(work_dir / "one_gpu.npz")
    # (a) the same global batch, split: equivalence against one GPU
    eq_run = run(cfg, sw, B, device, store, None)
    log(f"split {B} over {world}: weights agree across ranks {eq_run['weights_agree']}")
    # (b) the same per-GPU batch on every GPU: throughput, and the trace of the overlap
    trace = str(work_dir / f"trace-{world}gpu.json")
    tp = run(cfg, sw, B * world, device, store, trace, predicts=False)  # eq_run predicts
    if rank == 0:
        work, c = eq_run["work"], eq_run["cfg"]
        one_run = RungRun(
            loss=ref["loss"], pred_test=ref["pred_test"], pred_threshold=ref["pred_threshold"],
            grad_norm={k[5:]: ref[k] for k in ref.files if k.startswith("norm:")},
            warmup_s=0.0, timed_s=0.0, timed_wall_s=0.0, gpu_util=None, peak_mem_gb=None,
            counts=None, trace=None, batch_bytes=0,
        )  # fmt: skip
        base = reference(work, one_run, c)
        tol = c.bf16_tolerance if sw.bf16 else c.fp32_tolerance
        eq, summary, curve = check_rung(work, as_rung_run(eq_run), base, c, tol)
        step_s = tp["timed_s"] / cfg.timed_steps
        sps = B * world / step_s
        overlap = comm_figures(trace, out, world, step_s, cfg.profiled_steps)
        # the throughput run's row, judged against one GPU (its "baseline" here)
        tp_cfg = tp["cfg"]
        n_params, useful_flops, useful_positions = work_figures(tp["work"], tp_cfg)
        tp_run = as_rung_run({**tp, "pred_test": eq_run["pred_test"],
                              "pred_threshold": eq_run["pred_threshold"]})  # fmt: skip
        row = rung_row(
            RUNG, sw, tp_run, work=work, cfg=dataclasses.replace(tp_cfg, batch_size=B * world),
            base=base, controls={}, ceilings={}, useful_flops=useful_flops,
            useful_positions=useful_positions, n_params=n_params,
            baseline_samples_per_s=one["samples_per_s"],
        )  # fmt: skip
        result = {
            "gpus": world,
            "gpu": torch.cuda.get_device_name(device) if cuda else "cpu",
            "torch": torch.__version__,
            "nccl": ".".join(map(str, torch.cuda.nccl.version())) if cuda else None,
            "date": stamp()["date"],
            "commit": args.commit or commit(),
            "switches": list(sw.names()),
            "per_gpu_batch": B,
            "samples_per_s": sps,
            "step_ms": step_s * 1e3,
            "one_gpu_samples_per_s": one["samples_per_s"],
            "one_gpu_step_ms": one["step_ms"],
            "speedup_vs_one_gpu": sps / one["samples_per_s"],
            "scaling_efficiency": sps / one["samples_per_s"] / world,
            "equivalent": eq.equivalent and eq_run["weights_agree"],
            "equivalence": {
                "against": f"one GPU, the same global batch ({B})",
                "global_batch": B,
                "loss_max_rel_dev": eq.loss_max_rel_dev,
                "pred_rel_l2": eq.pred_rel_l2,
                "markout_delta_bps": eq.markout_delta_bps,
                "tolerance": dataclasses.asdict(tol),
                "failures": list(eq.failures),
                "weights_agree_across_ranks": eq_run["weights_agree"],
                **heldout_fit(work, eq_run["pred_test"]),
            },
            **overlap,
            "buckets": [len(b) for b in bucket_spans(OrderBookNetOf(work, c))],
            "warmup_s": tp["warmup_s"],
            "gpu_util": tp["gpu_util"],
            "peak_mem_gb": tp["peak_mem_gb"],
            "pack_rows_per_gpu": tp["pack_rows"],
            "nccl_ctas": args.nccl_ctas,
            "env": knobs(),
            "one_gpu": one,
            "rows": [row.to_dict()],
            "wall_s": time.perf_counter() - t0,
        }
        name = args.name or (f"ladder-h200x{world}" if cuda else f"ladder-cpux{world}")
        (out / f"{name}.json").write_text(json.dumps(result, indent=2, default=str))
        with tarfile.open(out / f"{name}.trace.tar.gz", "w:gz") as tar:
            tar.add(trace, arcname=os.path.basename(trace))
        log(json.dumps({k: v for k, v in result.items() if k not in ("rows", "one_gpu")},
                       default=str))  # fmt: skip
    # every rank leaves together: a rank that tore its process group down while rank 0 was
    # still judging and writing aborted now and then on a CPU ("terminate called without
    # an active exception", exit -6), failing the run
    dist.barrier()
    dist.destroy_process_group()


def comm_figures(trace: str, out: Path, world: int, step_s: float, traced_steps: int) -> dict:
    """The all-reduce's share overlapped with compute in the trace, its time per step, and
    (where the no-all-reduce control of the same call ran first, <out>/ddp-x<N>-no-allreduce
    .json) what it adds to the step: the step-time view of hiding."""
    figures = allreduce_overlap(trace)
    figures["allreduce_us_per_step"] = figures["allreduce_us"] / traced_steps
    control = out / f"ddp-x{world}-no-allreduce.json"
    if control.exists():
        base = json.loads(control.read_text())["step_ms"] / 1e3
        figures["no_allreduce_step_ms"] = base * 1e3
        figures["allreduce_exposed_us_per_step"] = (step_s - base) * 1e6
    return figures


def knobs() -> dict[str, str]:
    """The environment that decides how NCCL and the CUDA driver schedule the collectives."""
    keep = ("NCCL_", "CUDA_DEVICE_MAX_CONNECTIONS", "TORCH_NCCL_")
    return {k: v for k, v in sorted(os.environ.items()) if k.startswith(keep)}


def throughput_only(args, cfg, sw, device, store, work_dir, out, one, t0) -> None:
    """The per-GPU batch on every GPU, timed and (with the all-reduce) traced; no
    equivalence run. Rank 0 writes <out>/<name>.json."""
    rank, world = dist.get_rank(), dist.get_world_size()
    B, allreduce = cfg.batch_size, not args.no_allreduce
    trace = str(work_dir / f"trace-{args.name or 'tp'}.json")
    tp = run(cfg, sw, B * world, device, store, trace, allreduce=allreduce, predicts=False)
    if rank == 0:
        step_s = tp["timed_s"] / cfg.timed_steps
        result = {
            "gpus": world, "commit": args.commit or commit(),
            "date": stamp()["date"],
            "allreduce": allreduce, "switches": list(sw.names()), "per_gpu_batch": B,
            "samples_per_s": B * world / step_s, "step_ms": step_s * 1e3,
            "one_gpu_samples_per_s": one["samples_per_s"], "one_gpu_step_ms": one["step_ms"],
            "speedup_vs_one_gpu": B * world / step_s / one["samples_per_s"],
            **(comm_figures(trace, out, world, step_s, cfg.profiled_steps)
               if allreduce else {}),
            "nccl_ctas": args.nccl_ctas,
            "gpu_util": tp["gpu_util"], "env": knobs(), "wall_s": time.perf_counter() - t0,
        }  # fmt: skip
        name = args.name or f"ddp-x{world}-{'tp' if allreduce else 'no-allreduce'}"
        (out / f"{name}.json").write_text(json.dumps(result, indent=2, default=str))
        log = {k: v for k, v in result.items() if k not in ("switches", "env")}
        print(f"[rank 0] {name}: {json.dumps(log, default=str)}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


def OrderBookNetOf(work, cfg):  # noqa: N802 - a model just to name its buckets
    from quantloop.models.orderbook import OrderBookNet

    return OrderBookNet(model_config(cfg, work))


if __name__ == "__main__":
    main()
