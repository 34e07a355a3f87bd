"""Rung 2: torch.compile of the forward module (forward and backward through AOTAutograd)."""

from __future__ import annotations

import torch
from torch import nn

from quantloop.profiling.config import LadderConfig


def apply_compile(module: nn.Module, *, cfg: LadderConfig) -> nn.Module:
    """Compile with static shapes: every batch of a run has the same shape by construction
    (padded to max_len, or packed into the run's fixed number of rows)."""
    return torch.compile(module, backend=cfg.compile_backend, dynamic=False)
