"""Rung 2: torch.compile of the forward module (forward and backward through AOTAutograd);
rung 11 turns on Inductor's combo kernels for it, rung 14 its max-autotune."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn


def apply_compile(
    module: nn.Module, *, backend: str, autotune: bool = False, combo: bool = False
) -> nn.Module:
    """Compile with static shapes: every batch of a run has the same shape by construction
    (padded to max_len, or packed into the run's fixed number of rows).

    combo (rung 11): Inductor launches independent small kernels of a graph (the weights'
    bf16 casts, their gradients' float32 casts) as one combo kernel, up to 8 at a time.
    autotune (rung 14): Inductor benchmarks Triton GEMM templates against cuBLAS for each
    matmul shape and can fuse elementwise epilogues into the chosen template; no
    cudagraphs of its own, because rung 7 captures the whole step itself
    (profiling.cudagraph). Both are Inductor's options: other backends ignore them.
    """
    return torch.compile(module, backend=backend, dynamic=False,
                         **_settings(backend, autotune, combo))  # fmt: skip


def compile_each(
    modules: Iterable[nn.Module], *, backend: str, autotune: bool = False, combo: bool = False
) -> None:
    """Compile each module in place (nn.Module.compile), one graph per module."""
    for m in modules:
        m.compile(backend=backend, dynamic=False, **_settings(backend, autotune, combo))


def inductor_options(*, autotune: bool, combo: bool) -> dict[str, bool]:
    """Inductor's config for these switches (torch.compile's `options`)."""
    options: dict[str, bool] = {}
    if autotune:
        # Inductor's import costs 1.5-3 s (sympy among it): only a compile pays it, never a
        # run that finds its model and simulation cached.
        from torch._inductor import list_mode_options

        options |= list_mode_options("max-autotune-no-cudagraphs")
    if combo:
        options |= {"combo_kernels": True}
    return options


def _settings(backend: str, autotune: bool, combo: bool) -> dict:
    options = inductor_options(autotune=autotune, combo=combo)
    return {"options": options} if options and backend == "inductor" else {}
