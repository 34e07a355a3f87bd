"""One rung's row of a ladder result, as a typed record.

The JSON a ladder run writes (bench/results/ladder-h200.json, <out>/ladder.json) keeps its
rows as plain dicts with these keys; to_dict() and from_dict() convert, so results written
before this record existed load unchanged. A rung this machine cannot run is a row with
`skipped` set and nothing measured; its JSON has only number, name, predicted, skipped
and equivalent (None).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

from quantloop.profiling.config import Tolerance

# The keys of a skipped rung's row: its identity, the reason, and "not judged".
SKIPPED_KEYS = ("number", "name", "predicted", "skipped", "equivalent")
# Measured fields a machine may be unable to measure (None then even for a rung that ran):
# trace counts need CUDA events, utilisation needs NVML, peak memory and the roofline need
# CUDA, the trace needs an output folder.
MAY_BE_NONE = (
    "kernels_per_step", "gpu_kernels_per_step", "syncs_per_step", "memcpys_per_step",
    "gpu_util", "gpu_busy", "peak_mem_gb", "trace", "floor_ms", "roofline_fraction", "bound",
)  # fmt: skip


@dataclass(kw_only=True, slots=True, frozen=True)
class RungResult:
    number: int
    name: str
    predicted: str  # the gain expected before measuring, and why (profiling.rungs)
    skipped: str | None = None  # why this machine could not run it; then nothing is measured
    switches: dict[str, bool] | None = None  # profiling.rungs.Switches as run
    # --- speed: per step over the timed steps
    samples_per_s: float | None = None
    step_ms: float | None = None  # device timeline (CUDA events; perf_counter on a CPU)
    host_step_ms: float | None = None  # host wall clock
    warmup_s: float | None = None  # the warm-up steps (compile, capture), apart from the timing
    # --- from the profiler trace of the profiled steps (training thread only)
    kernels_per_step: float | None = None  # host-side kernel and graph launches
    gpu_kernels_per_step: float | None = None  # kernels the GPU ran (graph kernels included)
    syncs_per_step: float | None = None  # cuda*Synchronize calls
    memcpys_per_step: float | None = None  # cudaMemcpy* calls
    gpu_util: float | None = None  # mean NVML busy fraction over the timed steps
    gpu_busy: float | None = None  # kernel+copy time union / wall time, from the trace
    peak_mem_gb: float | None = None  # GiB allocated at most, warm-up and timed steps
    # --- work per step (profiling.measure's FLOP and byte model)
    flops_per_step: float | None = None  # executed matmul FLOPs, padding included
    useful_flops_per_step: float | None = None  # the real windows' FLOPs (timed steps' mean)
    bytes_per_step: float | None = None  # lower-bound device traffic estimate
    achieved_tflops: float | None = None  # executed FLOPs / step time
    useful_tflops: float | None = None
    # --- equivalence to the baseline (profiling.equivalence)
    step0_rel: float | None = None
    loss_max_rel_dev: float | None = None
    pred_rel_l2: float | None = None
    markout_delta_bps: float | None = None
    precision: str | None = None  # "fp32" or "bf16": which tolerance applies
    tolerance: Tolerance | None = None  # the limits it was judged by, as stated
    # CONTROL_FACTOR x the rounding control of its precision, per figure
    control_floor: dict[str, float] | None = None
    tolerance_below_floor: list[str] | None = None  # limits a rounding change alone could fail
    # limits another seed (a different model) would pass: such a check has no power
    tolerance_not_below_other_seed: list[str] | None = None
    equivalent: bool | None = None  # None: not judged (skipped)
    failures: list[str] | None = None  # "figure value > limit" per failed check
    # --- what it learned and how it trades the held-out day
    final_loss: float | None = None  # the loss curve's last interval mean
    heldout_loss: float | None = None  # MSE in label-variance units (1.0 = the mean's)
    heldout_corr: list[float] | None = None  # per label
    loss_curve: list[float] | None = None  # mean training loss per log_every steps
    trades: int | None = None
    markout_bps: dict[str, float] | None = None  # mean mark-out per horizon
    markout_se_bps: dict[str, float] | None = None  # its standard error per horizon
    trace: str | None = None  # the Chrome trace's file name, beside the results
    # --- roofline: the padding-free floor against the measured ceilings
    floor_ms: float | None = None
    roofline_fraction: float | None = None  # floor / step time
    bound: str | None = None  # "bf16 matmul" or "memory bandwidth"
    speedup_vs_baseline: float | None = None  # samples/s over rung 1's

    def __post_init__(self) -> None:
        identity = ("number", "name", "predicted", "skipped")
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name in identity:
                continue
            if self.skipped is not None and value is not None:
                raise ValueError(f"{f.name} must be None on a skipped rung ({self.name})")
            if self.skipped is None and value is None and f.name not in MAY_BE_NONE:
                raise ValueError(f"{f.name} is missing from rung {self.number} ({self.name})")

    def to_dict(self) -> dict[str, Any]:
        """The JSON row, keys in the order the ladder has always written them."""
        if self.skipped is not None:
            return {k: getattr(self, k) for k in SKIPPED_KEYS}
        return asdict(self)

    @classmethod
    def from_dict(cls, row: dict[str, Any]) -> RungResult:
        known = {f.name for f in fields(cls)}
        unknown = set(row) - known
        if unknown:
            raise ValueError(f"unknown rung result fields: {sorted(unknown)}")
        values = dict(row)
        if values.get("tolerance") is not None:
            values["tolerance"] = Tolerance(**values["tolerance"])
        return cls(**values)
