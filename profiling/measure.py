"""Measurement: CUDA-event timing, profiler traces and their launch/sync counts, NVML
utilisation sampling, the device's ceilings, and the FLOP/byte model of one step.

Trace counts read the exported Chrome trace: host-side launches are the training thread's
cudaLaunchKernel / cuLaunchKernel* / cudaGraphLaunch calls; syncs are its
cuda*Synchronize calls (a blocking `.to(device)` from pageable memory and `.item()` each
show up as one); GPU kernels are the trace's kernel events (graph replays included).
"""

from __future__ import annotations

import bisect
import json
import shutil
import subprocess
import threading
import time
from dataclasses import dataclass

import torch

STEP_LABEL = "ladder.step"  # the record_function around each training step


# ---------------------------------------------------------------- timing


class StepTimer:
    """Elapsed time of a region of steps: CUDA events on a GPU, perf_counter on a CPU."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.device = device

    def start(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)
            self._a = torch.cuda.Event(enable_timing=True)
            self._b = torch.cuda.Event(enable_timing=True)
            self._a.record()
        self._t0 = time.perf_counter()

    def stop(self) -> tuple[float, float]:
        """(device-timeline seconds, host wall seconds), the device synchronised first."""
        if self.cuda:
            self._b.record()
            self._b.synchronize()
            wall = time.perf_counter() - self._t0
            return self._a.elapsed_time(self._b) / 1e3, wall
        wall = time.perf_counter() - self._t0
        return wall, wall


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ---------------------------------------------------------------- GPU utilisation


class UtilSampler:
    """Mean NVML 'GPU busy' percentage over a region, sampled every `period` s in a thread.

    pynvml (nvidia-ml-py) when importable, else `nvidia-smi --query-gpu`; None on a CPU.
    """

    def __init__(self, device: torch.device, period: float = 0.01) -> None:
        self.device, self.period = device, period
        self.samples: list[float] = []
        self._stop = threading.Event()
        self._read = None
        if device.type != "cuda":
            return
        index = device.index or 0
        try:
            import pynvml

            pynvml.nvmlInit()
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            self._read = lambda: float(pynvml.nvmlDeviceGetUtilizationRates(handle).gpu)
        except Exception:  # no pynvml or no NVML library: fall back to the CLI
            if shutil.which("nvidia-smi"):
                cmd = ["nvidia-smi", f"--id={index}", "--query-gpu=utilization.gpu",
                       "--format=csv,noheader,nounits"]  # fmt: skip
                self._read = lambda: float(
                    subprocess.run(cmd, capture_output=True, text=True).stdout
                )
                self.period = max(period, 0.05)

    def __enter__(self) -> UtilSampler:
        if self._read is not None:
            self._thread = threading.Thread(target=self._loop, daemon=True)
            self._thread.start()
        return self

    def _loop(self) -> None:
        while not self._stop.wait(self.period):
            try:
                self.samples.append(self._read())
            except Exception:
                return

    def __exit__(self, *exc) -> None:
        if self._read is not None:
            self._stop.set()
            self._thread.join()

    @property
    def mean(self) -> float | None:
        return sum(self.samples) / len(self.samples) / 100 if self.samples else None


# ---------------------------------------------------------------- trace counts


@dataclass(kw_only=True, slots=True, frozen=True)
class TraceCounts:
    launches: float  # host-side kernel + graph launches per step, training thread
    syncs: float  # host syncs per step, training thread
    memcpys: float  # cudaMemcpy* calls per step, training thread
    gpu_kernels: float  # kernels run on the GPU per step (graph kernels included)
    gpu_busy: float | None  # union of kernel+memcpy time / wall time of the profiled steps


def count_trace(path: str, steps: int) -> TraceCounts | None:
    """Per-step counts from a Chrome trace exported by torch.profiler; None without CUDA events."""
    with open(path) as f:
        events = json.load(f).get("traceEvents", [])
    step_events = [  # the host-side step annotations (the GPU-timeline copies have their own cat)
        e for e in events
        if e.get("name") == STEP_LABEL and e.get("ph") == "X" and e.get("cat") == "user_annotation"
    ]  # fmt: skip
    main_tids = {e.get("tid") for e in step_events}
    spans = sorted((e["ts"], e["ts"] + e["dur"]) for e in step_events)
    starts = [a for a, _ in spans]

    def in_step(ts: float) -> bool:  # calls outside the steps (the profiler's own) don't count
        i = bisect.bisect_right(starts, ts) - 1
        return i >= 0 and ts <= spans[i][1]

    launches = syncs = memcpys = kernels = 0
    intervals = []
    seen_cuda = False
    for e in events:
        if e.get("ph") != "X":
            continue
        cat, name = e.get("cat", ""), e.get("name", "")
        if cat in ("cuda_runtime", "cuda_driver"):
            seen_cuda = True
            if e.get("tid") not in main_tids or not in_step(e["ts"]):
                continue
            if "LaunchKernel" in name or "GraphLaunch" in name:
                launches += 1
            elif "Synchronize" in name:
                syncs += 1
            elif "Memcpy" in name:
                memcpys += 1
        elif cat in ("kernel", "gpu_memcpy", "gpu_memset"):
            if cat == "kernel":
                kernels += 1
            intervals.append((e["ts"], e["ts"] + e.get("dur", 0)))
    if not seen_cuda:
        return None
    busy = None
    if step_events and intervals:
        t0 = min(e["ts"] for e in step_events)
        t1 = max(e["ts"] + e["dur"] for e in step_events)
        covered, end = 0.0, t0
        for a, b in sorted(intervals):  # union of intervals clipped to the profiled steps
            a, b = max(a, end), min(b, t1)
            if b > a:
                covered += b - a
                end = b
        busy = covered / (t1 - t0) if t1 > t0 else None
    return TraceCounts(
        launches=launches / steps,
        syncs=syncs / steps,
        memcpys=memcpys / steps,
        gpu_kernels=kernels / steps,
        gpu_busy=busy,
    )


# ---------------------------------------------------------------- ceilings


def measure_ceilings(device: torch.device, n: int = 8192, copy_gib: float = 2.0) -> dict:
    """bf16 matmul TFLOP/s (n^3, random data, median of 10 after 3 warm-ups) and device copy
    GB/s (bytes read + written, median of 10): the roofline's two ceilings, measured here."""
    if device.type != "cuda":
        return {}
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    src = torch.randn(int(copy_gib * 2**30) // 4, device=device)
    dst = torch.empty_like(src)

    def median_s(fn) -> float:
        for _ in range(3):
            fn()
        times = []
        for _ in range(10):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            fn()
            e.record()
            e.synchronize()
            times.append(s.elapsed_time(e) / 1e3)
        return sorted(times)[len(times) // 2]

    mm = median_s(lambda: a @ b)
    cp = median_s(lambda: dst.copy_(src))
    out = {
        "bf16_matmul_tflops": 2 * n**3 / mm / 1e12,
        "copy_gbps": 2 * src.numel() * 4 / cp / 1e9,
    }
    return out  # the caller's torch.cuda.empty_cache() hands the buffers back


# ---------------------------------------------------------------- the step's FLOPs and bytes


def model_flops(
    lengths: list[int] | None,
    *,
    seq: int,
    n_seq: int,
    d: int,
    layers: int,
    ff: int,
    n_in: int,
    n_out: int,
    batch: int,
) -> float:
    """Matmul FLOPs of one training step (forward + backward = 3x forward).

    Per position: input embedding 2*F*D, per layer 2*(4 + 2*ff)*D^2 (qkv, proj, MLP).
    Attention per sequence of n positions and layer: 4*n^2*D (QK^T and AV).
    Head: 2*2D*out per window. `lengths` = real window lengths (the useful work), or None
    for the executed work of n_seq sequences of `seq` positions (padded or packed rows).
    Elementwise work is left out: it is memory traffic, counted in step_bytes.
    """
    per_pos = 2 * n_in * d + layers * 2 * (4 + 2 * ff) * d * d
    if lengths is None:
        positions, attn = n_seq * seq, n_seq * layers * 4 * seq * seq * d
    else:
        positions = sum(lengths)
        attn = layers * 4 * d * sum(n * n for n in lengths)
    return 3.0 * (positions * per_pos + attn + batch * 2 * 2 * d * n_out)


def step_bytes(
    *, positions: int, d: int, layers: int, ff: int, n_params: int, act_bytes: int, batch_bytes: int
) -> float:
    """A lower-bound estimate of one step's device-memory traffic in bytes.

    Optimizer: read p, g, m, v and write p, m, v (28 B/param) + the gradient write (4 B).
    Activations: the tensors the backward needs, written once and read once: per position
    and layer about (10 + 2*ff)*D values (LN outputs, q, k, v, attention out, MLP hidden
    before/after GELU, residuals) at `act_bytes` each. The input batch is read once.
    """
    return 32.0 * n_params + 2.0 * positions * layers * (10 + 2 * ff) * d * act_bytes + batch_bytes
