"""How the order-book model is trained: the config of tasks/research/training.py, in a module of
its own that imports no torch, so parameters are checked (the CLI's, the UI form's) in
the time it takes to read them, not torch's 1-2 s import."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

_DEVICE = re.compile(r"^(auto|cpu|cuda(:\d+)?|mps)$")

# The optimization ladder's switches a training run can apply, in rung order. What each
# does, and the proof that it keeps the answer, live in profiling/ (rungs.py, proof.py);
# tests/test_train_rungs.py checks that the two lists agree.
OPTIMIZATIONS = (
    "compile", "bf16", "device_metrics", "fused_kernel", "streams", "cudagraph", "packing",
    "flex_attention", "flat_grads", "combo_kernels", "loader_mask",
    "flex_blocks", "autotune",
)  # fmt: skip


@dataclass(kw_only=True, slots=True, frozen=True)
class TrainConfig:
    seed: int = 0
    window: int = 32  # events per window, the anchor (current event) included
    stride: int = 4  # one anchor every `stride` events
    batch_size: int = 256
    steps: int = 300
    lr: float = 2e-3
    weight_decay: float = 1e-4
    device: str = "auto"  # "auto" = cuda if available else cpu
    log_every: int = 10  # one loss-curve point (mean loss) per this many steps
    # torch intra-op CPU threads inside train/predict (restored after; 0 = leave torch's
    # setting). 1 by default: this model's ops are too small to gain from more, and spinning
    # OpenMP threads collapse when the cores are shared (measured on a busy 2-core box:
    # 43 ms/step with 1 thread, ~1 s/step with 2)
    num_threads: int = 1
    # clock-time windows: the events of the last window_s seconds, at most `window` of them
    # (so window lengths vary); None: always the last `window` events
    window_s: float | None = None
    # the model's size (models.orderbook.ModelConfig)
    d_model: int = 32
    n_layers: int = 2
    n_heads: int = 4
    ff_mult: int = 2
    # the ladder's optimizations to train with: "auto" (those the latest recorded ladder result
    # proved equivalent on this kind of device and that run here), "none" (eager float32, the
    # plain loop below), or a list of OPTIMIZATIONS names
    optimizations: str | tuple[str, ...] = "auto"

    def __post_init__(self) -> None:
        for name in (
            "window", "stride", "batch_size", "steps", "log_every", "d_model", "n_layers",
            "n_heads", "ff_mult",
        ):  # fmt: skip
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if not isinstance(self.seed, int):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        if not self.lr > 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")
        if not self.weight_decay >= 0:
            raise ValueError(f"weight_decay must be >= 0, got {self.weight_decay}")
        if self.num_threads < 0:
            raise ValueError(f"num_threads must be >= 0, got {self.num_threads}")
        if not _DEVICE.match(self.device):
            raise ValueError(f"device {self.device!r} is not auto, cpu, cuda, cuda:N or mps")
        if self.window_s is not None and not self.window_s > 0:
            raise ValueError(f"window_s must be > 0 (or None), got {self.window_s}")
        if self.d_model % self.n_heads:
            raise ValueError(
                f"d_model ({self.d_model}) must be divisible by n_heads ({self.n_heads})"
            )
        # frozen: the canonical form is set once here, so equal choices compare (and key) equal
        object.__setattr__(self, "optimizations", canonical_optimizations(self.optimizations))

    @property
    def model_size(self) -> dict[str, int]:
        return {k: getattr(self, k) for k in ("d_model", "n_layers", "n_heads", "ff_mult")}

    @property
    def head_dim(self) -> int:
        """Width of one attention head (FlexAttention needs 16 or more)."""
        return self.d_model // self.n_heads


def canonical_optimizations(value: str | Sequence[str]) -> str | tuple[str, ...]:
    """ "auto", "none", or the named optimizations once each, in rung order ([] is "none")."""
    if isinstance(value, str):
        if value in ("auto", "none"):
            return value
        raise ValueError(
            f"optimizations must be 'auto', 'none' or a list of names from {OPTIMIZATIONS}, "
            f"got {value!r}"
        )
    names = list(value)
    unknown = [n for n in names if n not in OPTIMIZATIONS]
    if unknown:
        raise ValueError(f"optimizations: unknown {unknown}; known: {', '.join(OPTIMIZATIONS)}")
    return tuple(n for n in OPTIMIZATIONS if n in names) or "none"
