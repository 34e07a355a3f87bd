"""Rung 2: torch.compile of the forward module (forward and backward through AOTAutograd);
rung 11 turns on Inductor's max-autotune for it."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn


def apply_compile(module: nn.Module, *, backend: str, autotune: bool = False) -> nn.Module:
    """Compile with static shapes: every batch of a run has the same shape by construction
    (padded to max_len, or packed into the run's fixed number of rows).

    autotune (rung 11): Inductor benchmarks Triton GEMM templates against cuBLAS for each
    matmul shape and can fuse elementwise epilogues into the chosen template;
    "-no-cudagraphs" because rung 7 captures the whole step itself (profiling.cudagraph).
    """
    return torch.compile(module, backend=backend, dynamic=False, mode=_mode(autotune))


def compile_each(modules: Iterable[nn.Module], *, backend: str, autotune: bool = False) -> None:
    """Compile each module in place (nn.Module.compile), one graph per module."""
    for m in modules:
        m.compile(backend=backend, dynamic=False, mode=_mode(autotune))


def _mode(autotune: bool) -> str | None:
    return "max-autotune-no-cudagraphs" if autotune else None
