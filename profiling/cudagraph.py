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

from collections.abc import Callable

import torch

from quantloop.profiling.streams import Layout


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
                with torch.cuda.graph(self.graph):
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
