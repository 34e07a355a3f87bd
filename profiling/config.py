"""The ladder's one config: workload, model, schedule, equivalence tolerances; named presets.

Every rung of one ladder run shares this config: same seed, data, model, batch size and
hyperparameters. Only the switches a rung turns on differ (profiling/rungs.py).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

COMPILE_BACKENDS = ("inductor", "aot_eager", "eager")
TARGETS = ("next_move", "move_bps")


@dataclass(kw_only=True, slots=True, frozen=True)
class Tolerance:
    """Largest deviation from the baseline a rung may show and still be 'equivalent'."""

    step0_rel: float  # first step, same weights and batch: loss and gradient norms
    loss_rel: float  # max |curve - base| / |base| over the logged loss curve
    pred_rel_l2: float  # ||pred - base|| / ||base|| on held-out windows
    markout_bps: float  # max |mean mark-out - base| over horizons, bps

    def __post_init__(self) -> None:
        for name in ("step0_rel", "loss_rel", "pred_rel_l2", "markout_bps"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")


# step0_rel is the sharp test: the first step sees identical weights and batch, so its loss
# and its 55 gradient norms differ only by the rung's arithmetic. fp32 rungs reorder float32
# sums (a few ulps): 1e-4. bf16 rungs round matmul operands to 8 significant bits (~4e-3
# per product, partly averaging out): 2e-2.
# The end-of-training figures (loss curve, held-out predictions, mark-out) carry that
# difference through 300 Adam steps. On this workload training is stable: one fp32 rounding
# error in the initial weights moves the predictions by ~4e-7, one bf16 rounding error by
# ~3e-3, another seed by ~0.17 (H200, docs/ladder.md). A limit must sit above the rounding
# floor of its precision and well below the other-seed control, or it cannot tell a
# different model from a rounding change: fp32 tight, bf16 looser, both below other-seed/2.
# profiling.ladder reports, per rung, any limit that is below 2x its rounding control or
# not below the other-seed control; it never widens a limit.
FP32 = Tolerance(step0_rel=1e-4, loss_rel=1e-3, pred_rel_l2=1e-2, markout_bps=0.1)
BF16 = Tolerance(step0_rel=2e-2, loss_rel=3e-3, pred_rel_l2=5e-2, markout_bps=0.1)


@dataclass(kw_only=True, slots=True, frozen=True)
class LadderConfig:
    # --- workload: synthetic days -> features -> Parquet store -> clock-time windows
    seed: int = 0
    product: str = "SYNA"
    n_days: int = 4  # the last day is held out
    events_per_day: int = 60_000
    window_s: float = 20.0  # a window is the events of the last window_s seconds ...
    max_len: int = 256  # ... capped at max_len events; padded batches are [B, max_len, F]
    stride: int = 1  # one training anchor every `stride` events
    signal: float = 1.0  # tasks.synthetic: how strongly the book foreshadows the next move
    # target "next_move": one label, the direction (+1/-1) of the next change of the mid;
    # "move_bps": the mid's move over each of label_horizons events, in bps (tasks.features)
    target: str = "next_move"
    label_horizons: tuple[int, ...] = (10, 50, 100)  # used by target "move_bps"
    # --- model (OrderBookNet)
    d_model: int = 128
    n_layers: int = 4
    n_heads: int = 4
    ff_mult: int = 4
    # --- optimisation, identical for every rung
    batch_size: int = 256
    lr: float = 3e-4  # 1e-3 made training chaotic (docs/ladder.md, equivalence)
    weight_decay: float = 1e-4
    # --- schedule: warm-up (compile, capture) | timed | profiled; all are training steps
    warmup_steps: int = 25
    timed_steps: int = 250
    profiled_steps: int = 25
    log_every: int = 25  # one host sync per this many steps from rung 4 on
    # --- switches' settings
    compile_backend: str = "inductor"
    prefetch_depth: int = 3  # pinned host / device staging buffers in flight (rung 6)
    # --- evaluation
    predict_batch: int = 4096
    threshold_stride: int = 8  # training rows subsampled for the trade threshold
    fp32_tolerance: Tolerance = FP32
    bf16_tolerance: Tolerance = BF16
    device: str = "auto"  # "auto" = cuda if available else cpu
    num_threads: int = 0  # torch CPU threads (0 = leave torch's setting)

    def __post_init__(self) -> None:
        positive = (
            "n_days", "events_per_day", "max_len", "stride", "d_model", "n_layers", "n_heads",
            "ff_mult", "batch_size", "warmup_steps", "timed_steps", "profiled_steps",
            "log_every", "prefetch_depth", "predict_batch", "threshold_stride",
        )  # fmt: skip
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.n_days < 2:
            raise ValueError(f"n_days must be >= 2 (one is held out), got {self.n_days}")
        if not 0 <= self.signal <= 1:
            raise ValueError(f"signal must be in [0, 1], got {self.signal}")
        if self.target not in TARGETS:
            raise ValueError(f"target must be one of {TARGETS}, got {self.target!r}")
        if not self.label_horizons or any(
            not isinstance(h, int) or h < 1 for h in self.label_horizons
        ):
            raise ValueError(f"label_horizons must be integers >= 1, got {self.label_horizons}")
        if not self.window_s > 0:
            raise ValueError(f"window_s must be > 0, got {self.window_s}")
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model ({self.d_model}) must be divisible by n_heads")
        if self.compile_backend not in COMPILE_BACKENDS:
            raise ValueError(f"compile_backend must be one of {COMPILE_BACKENDS}")
        if self.warmup_steps < 4:
            raise ValueError("warmup_steps must be >= 4: CUDA-graph capture needs 3 eager steps")
        if self.prefetch_depth < 2:
            raise ValueError(f"prefetch_depth must be >= 2, got {self.prefetch_depth}")
        if not self.lr > 0 or self.weight_decay < 0:
            raise ValueError(
                f"lr must be > 0 and weight_decay >= 0 ({self.lr}, {self.weight_decay})"
            )

    @property
    def steps(self) -> int:
        return self.warmup_steps + self.timed_steps + self.profiled_steps

    def to_dict(self) -> dict:
        return asdict(self)


def h200() -> LadderConfig:
    """The measured configuration: one H200, 300 steps of 256 windows of up to 256 events."""
    return LadderConfig()


def cpu_tiny() -> LadderConfig:
    """CI: a tiny model and short days, so the whole ladder's logic runs in seconds on a CPU.

    aot_eager exercises Dynamo and AOTAutograd without Inductor's C++ build (minutes on CPU).
    """
    return replace(
        LadderConfig(),
        n_days=3,
        events_per_day=3_000,
        window_s=60.0,
        max_len=32,
        stride=2,
        d_model=16,
        n_layers=1,
        n_heads=2,
        ff_mult=2,
        batch_size=32,
        warmup_steps=4,
        timed_steps=8,
        profiled_steps=4,
        log_every=4,
        compile_backend="aot_eager",
        predict_batch=512,
        threshold_stride=4,
        num_threads=1,
    )


PRESETS = {"h200": h200, "cpu_tiny": cpu_tiny}


def preset(name: str) -> LadderConfig:
    """A named preset; "auto" = h200 when CUDA is present, else cpu_tiny."""
    if name == "auto":
        import torch

        name = "h200" if torch.cuda.is_available() else "cpu_tiny"
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; known: auto, {', '.join(PRESETS)}")
    return PRESETS[name]()
