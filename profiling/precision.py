"""Rung 3, tensor cores: bf16 autocast for the forward, TF32 for any float32 matmul left.

Parameters, gradients and optimizer state stay float32 (autocast casts matmul operands
only), so the optimizer and the logged norms are unchanged in kind; the loss is taken on
float32 predictions.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


@contextlib.contextmanager
def apply_precision(device: torch.device, *, enabled: bool) -> Iterator[None]:
    """TF32 on for the block (restored after); use `autocast(device, enabled)` per forward."""
    if not enabled or device.type != "cuda":
        yield
        return
    saved = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def autocast(device: torch.device, enabled: bool) -> contextlib.AbstractContextManager:
    if not enabled:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
