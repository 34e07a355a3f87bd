"""Rung 7: the whole training step (forward, backward, fused AdamW, metric ring) as one
CUDA graph, replayed each step after one device-to-device copy of the batch into its
static input buffer.

Why torch.cuda.graph and not torch.compile(mode="reduce-overhead"): on these machines the
latter failed on the training step with "accessing tensor output of CUDAGraphs that has
been overwritten" even with cudagraph_mark_step_begin(); capturing the whole step by hand
with static inputs and a capturable optimizer works. Nothing in the step syncs with the
host (rungs 4-6 removed every sync), which capture requires.

The first `eager_steps` steps run normally on a side stream (compiling, allocating,
initialising cuBLAS there), the next is captured and replayed: every step of the run is
executed exactly once, so the trajectory is the same as without the graph.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch

from quantloop.profiling.streams import Layout

# What the capture forbids of other threads (torch.cuda.graph's capture_error_mode). CUDA's
# "global" mode, PyTorch's default, makes any thread's potentially unsafe call (an event or
# stream synchronize, a blocking copy) during the capture invalidate it: rung 6's loader
# thread waits on its copy events and copies beside the step, so a capture that begins
# while it is mid-batch fails with "operation failed due to a previous error during
# capture". It is idle at the capture when its batches are quick to make (batch 256:
# the ladder's runs), not when each takes longer than an eager step: the top rung at
# batch 4,096 failed so, the loader thread's own error "operation not permitted when
# stream is capturing" (bench/results/sweep-h200.md, issue 23), and ran under
# "thread_local", which checks the capturing thread only: the loader's calls are on its
# own stream, outside the graph.
# QUANTLOOP_CAPTURE_ERROR_MODE=global restores PyTorch's default (bench/sweep.py's test).
CAPTURE_ERROR_MODE = os.environ.get("QUANTLOOP_CAPTURE_ERROR_MODE", "thread_local")


class GraphedStep:
    def __init__(
        self,
        step_fn: Callable[[dict[str, torch.Tensor]], None],
        layout: Layout,
        device: torch.device,
        eager_steps: int,
    ) -> None:
        if eager_steps < 3:
            raise ValueError(f"eager_steps must be >= 3 before capture, got {eager_steps}")
        self.step_fn = step_fn
        self.device = device
        self.eager_steps = eager_steps
        self.static = torch.empty(layout.nbytes, dtype=torch.uint8, device=device)
        self.inputs = layout.torch_views(self.static)
        self.side = torch.cuda.Stream(device)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.calls = 0

    def __call__(self, batch: torch.Tensor) -> None:
        self.static.copy_(batch, non_blocking=True)
        if self.calls < self.eager_steps:
            main = torch.cuda.current_stream(self.device)
            self.side.wait_stream(main)
            with torch.cuda.stream(self.side):
                self.step_fn(self.inputs)
            main.wait_stream(self.side)
        else:
            if self.graph is None:
                self.graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(self.graph, capture_error_mode=CAPTURE_ERROR_MODE):
                    self.step_fn(self.inputs)
            self.graph.replay()
        self.calls += 1


def apply_cudagraph(
    step_fn: Callable[[dict[str, torch.Tensor]], None],
    layout: Layout,
    *,
    device: torch.device,
    eager_steps: int,
) -> GraphedStep:
    return GraphedStep(step_fn, layout, device, eager_steps)
