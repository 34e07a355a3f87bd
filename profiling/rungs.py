"""The ladder's rungs: what each turns on, what it was predicted to gain, what it needs.

Rung k turns on the switches of rungs 1..k (those this machine cannot run are skipped with
their reason and left off the later rungs too). The predictions were written before the
first device run; docs/ladder.md sets them against the measurements.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from quantloop.profiling import kernels


@dataclass(kw_only=True, slots=True, frozen=True)
class Rung:
    number: int
    name: str
    switch: str  # the Switches field this rung turns on ("" for the baseline)
    cuda_only: str  # why a CPU cannot run it ("" = runs anywhere)
    predicted: str  # the gain expected before measuring, and why


RUNGS: tuple[Rung, ...] = (
    Rung(
        number=1,
        name="baseline",
        switch="",
        cuda_only="",
        predicted="reference: eager fp32 on padded [256, 256] windows; ~40 .item() syncs "
        "and 3 blocking pageable copies per step",
    ),
    Rung(
        number=2,
        name="compile",
        switch="compile",
        cuda_only="",
        predicted="1.2x: Inductor fuses LayerNorm/GELU/residual/mask elementwise work "
        "(~15% of an fp32 step); the fp32 matmuls and attention stay as they are",
    ),
    Rung(
        number=3,
        name="bf16_tf32",
        switch="bf16",
        cuda_only="",
        predicted="3x: matmuls and attention move from fp32 CUDA cores to bf16 tensor "
        "cores (~10x on that part); the host gather, copies and syncs then dominate",
    ),
    Rung(
        number=4,
        name="device_metrics",
        switch="device_metrics",
        cuda_only="",
        predicted="1.3x: ~38 of ~41 host syncs per step go (loss, 3 accuracies, 34 norms); "
        "the 3 blocking copies still sync",
    ),
    Rung(
        number=5,
        name="fused_kernel",
        switch="fused_kernel",
        cuda_only="the fused AdamW + norm kernel is Triton, which needs a CUDA GPU",
        predicted="1.05x: one pass over 0.8M parameters instead of ~15 foreach kernels "
        "and a norm pass; small next to the model",
    ),
    Rung(
        number=6,
        name="streams",
        switch="streams",
        cuda_only="pinned memory and a copy stream need a CUDA GPU",
        predicted="1.7x: the host gather (~1 ms) and the 3.7 MB copy leave the critical path; "
        "the last per-step syncs go",
    ),
    Rung(
        number=7,
        name="cuda_graph",
        switch="cudagraph",
        cuda_only="CUDA graphs need a CUDA GPU",
        predicted="1.3x: ~400 kernel launches per step become one replay; matters once the "
        "GPU step is a few ms",
    ),
    Rung(
        number=8,
        name="no_padding",
        switch="packing",
        cuda_only="",
        predicted="2.7x: 74 packed rows instead of 256 padded windows (3.5x fewer positions "
        "and attention FLOPs), less the packing slack",
    ),
)


@dataclass(kw_only=True, slots=True, frozen=True)
class Switches:
    """The optimizations one training run turns on: one field per rung's `switch`."""

    compile: bool = False
    bf16: bool = False
    device_metrics: bool = False
    fused_kernel: bool = False
    streams: bool = False
    cudagraph: bool = False
    packing: bool = False

    @classmethod
    def upto(cls, number: int, available: set[str]) -> Switches:
        """Rungs 1..number cumulatively, leaving out switches this machine cannot run."""
        on = {r.switch for r in RUNGS if r.number <= number and r.switch in available}
        return cls(**{f.name: f.name in on for f in fields(cls)})


def skip_reason(rung: Rung, device: torch.device) -> str | None:
    """Why this machine cannot run `rung` (the row's `skipped` text), or None."""
    if rung.cuda_only and device.type != "cuda":
        return f"skipped: no CUDA device ({rung.cuda_only})"
    if rung.switch == "fused_kernel" and kernels.triton is None:
        return "skipped: triton is not installed"
    return None
