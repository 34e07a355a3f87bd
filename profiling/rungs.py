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
    requires: tuple[str, ...] = ()  # switches this one cannot run without
    # why `auto` (profiling.proof) leaves this rung out even where the ladder proved it; a
    # research run still applies it when asked for by name ("" = auto applies it)
    not_auto: str = ""


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
        requires=("device_metrics",),  # the kernel writes the gradient norms into the ring
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
        # no host sync in the step, a capturable optimizer, a static flat input buffer
        requires=("device_metrics", "fused_kernel", "streams"),
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
    # Rungs 9-11 were predicted from rung 8's H200 trace (bench/results/ladder-h200.traces):
    # 1.70 ms of kernels per step in 326 kernels; cuDNN's masked flash attention 0.49 ms
    # (29%), matmuls 0.88 ms, Inductor's Triton kernels 0.64 ms, 55 gradient-accumulation
    # adds 0.08 ms; the GPU idle 14% of the step between the graph's kernels.
    Rung(
        number=9,
        name="flex_attention",
        switch="flex_attention",
        cuda_only="FlexAttention has no backward on a CPU (torch raises NotImplementedError)",
        requires=("packing",),
        predicted="1.08x: FlexAttention with a block mask computed from the packing plan "
        "replaces the dense [R, 1, T, T] mask; of the 2x2 128-blocks of a 256-event row "
        "~20% are skipped (no window spans them) and the mask is no longer read: attention "
        "0.49 -> ~0.36 ms of 1.87",
    ),
    Rung(
        number=10,
        name="flat_grads",
        switch="flat_grads",
        cuda_only="",
        requires=("fused_kernel",),
        predicted="1.06x: gradients are handed over (p.grad = None before backward) and "
        "copied into the fused optimizer's flat buffer by one multi-tensor copy, instead of "
        "55 accumulate-add kernels and a memset: ~0.08 ms of kernels and ~55 launch gaps",
    ),
    # Rungs 11-12 were predicted from rung 10's H200 trace (ladder-h200.traces, d83b956):
    # 1.519 ms of kernels per 1.675 ms step in 288 kernels (~0.54 us idle between two);
    # 54 of them are Inductor's casts (weights to bf16, their gradients back to float32),
    # 70 us, 1.3 us each; FlexMask.update builds the block mask in 17 eager kernels, 45 us.
    # Autotune, measured as rung 11 before them (1.03x, 153 s of compile), is now last.
    # Rung 13 was predicted from bench/flex_sweep.py's measurement of attention alone.
    Rung(
        number=11,
        name="combo_kernels",
        switch="combo_kernels",
        cuda_only="Inductor's combo kernels are Triton kernels: CUDA only",
        requires=("compile",),
        predicted="1.05x: Inductor's combo kernels launch up to 8 independent small kernels "
        "as one; the 54 casts become ~7-10 kernels: ~60 us of kernel time and ~45 gaps "
        "(~25 us) go, 1.675 -> ~1.59 ms",
    ),
    Rung(
        number=12,
        name="loader_mask",
        switch="loader_mask",
        cuda_only="",
        requires=("flex_attention",),
        predicted="1.03x: the loader thread lists each query block's key blocks in NumPy "
        "(~50 us a batch, hidden under the step) and they travel in the batch's one copy; "
        "FlexMask.update's 17 kernels (45 us) become 5 copies (~6 us), ~12 gaps go",
    ),
    Rung(
        number=13,
        name="flex_blocks",
        switch="flex_blocks",
        cuda_only="",
        requires=("flex_attention",),
        predicted="1.05x: 64-event sparse blocks instead of 128 (bench/flex_sweep.py on "
        "this workload: block pairs visited 99% -> 71%) with the tiles max-autotune picked "
        "for them, fixed: attention forward + backward 82.7 -> 64.5 us per layer, ~73 us "
        "of a 1.59 ms step",
    ),
    Rung(
        number=14,
        name="autotune",
        switch="autotune",
        cuda_only="Inductor's max-autotune GEMM templates are Triton kernels: CUDA only",
        requires=("compile",),
        not_auto="its compile takes minutes (153 s on an H200, as rung 11) for a few "
        "percent of a research run's training, which lasts seconds",
        predicted="1.1x: Inductor's max-autotune picks Triton GEMM templates for these small "
        "K=128 shapes and fuses bias/GELU/residual epilogues into them (fewer, larger "
        "kernels); cuBLAS's split-K reductions (16 per step) go; compile time grows",
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
    flex_attention: bool = False
    flat_grads: bool = False
    combo_kernels: bool = False
    loader_mask: bool = False
    flex_blocks: bool = False
    autotune: bool = False

    @classmethod
    def upto(cls, number: int, available: set[str]) -> Switches:
        """Rungs 1..number cumulatively, leaving out switches this machine cannot run."""
        on = {r.switch for r in RUNGS if r.number <= number and r.switch in available}
        return cls(**{f.name: f.name in on for f in fields(cls)})

    @classmethod
    def of(cls, names: tuple[str, ...] | list[str]) -> Switches:
        """The named switches on (Rung.switch names), the others off."""
        unknown = set(names) - {f.name for f in fields(cls)}
        if unknown:
            raise ValueError(f"unknown switches {sorted(unknown)}")
        return cls(**{f.name: f.name in names for f in fields(cls)})

    def names(self) -> tuple[str, ...]:
        """The switches on, in rung order."""
        return tuple(r.switch for r in RUNGS if r.switch and getattr(self, r.switch))


BY_SWITCH = {r.switch: r for r in RUNGS if r.switch}


def missing_requirements(names: tuple[str, ...] | list[str] | set[str]) -> dict[str, list[str]]:
    """{switch: the switches it requires that are not in `names`}, for those lacking any."""
    return {
        n: missing
        for n in names
        if (missing := [r for r in BY_SWITCH[n].requires if r not in names])
    }


def skip_reason(rung: Rung, device: torch.device, available: set[str] | None = None) -> str | None:
    """Why this machine cannot run `rung` (the row's `skipped` text), or None. With
    `available` (the switches that can run here), a rung whose requirements cannot is
    skipped too."""
    if rung.cuda_only and device.type != "cuda":
        return f"skipped: no CUDA device ({rung.cuda_only})"
    if rung.switch == "fused_kernel" and kernels.triton is None:
        return "skipped: triton is not installed"
    if available is not None:
        lacking = [r for r in rung.requires if r not in available]
        if lacking:
            return f"skipped: needs {', '.join(lacking)}, which cannot run here"
    return None


def runnable(device: torch.device) -> set[str]:
    """The switches this machine can run, requirements included (in rung order, so a
    rung's requirements are decided before it)."""
    available: set[str] = set()
    for r in RUNGS:
        if r.switch and skip_reason(r, device, available) is None:
            available.add(r.switch)
    return available
