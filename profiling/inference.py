"""Bulk prediction at GPU speed: every event of a feature table through the trained model,
with the training run's rungs that apply to a forward pass.

tasks.training.predict runs the model eagerly in float32 on padded [batch, window] windows.
Here, on a GPU, for a model trained with packing (and whatever else of bf16, compile,
CUDA graph, FlexAttention it was trained with):
  - the windows are packed end to end into rows of `window` events, in order (next-fit:
    consecutive windows have similar lengths, and it is one pass over the table), cut
    into groups of `batch` windows; every group has the same [rows, window] shape;
  - the feature matrix lives on the device; a group's batch is its index arrays (a few
    hundred KB), copied into static buffers;
  - the forward (gather, PackedNet, bf16 autocast, compiled) is captured once as a CUDA
    graph and replayed per group.
Anywhere else (a CPU, or a model trained without packing) it is tasks.training.predict.
`Predictor` keeps the count and the time of what it predicted (simulate's MLflow run).
"""

from __future__ import annotations

import functools
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import torch

from quantloop.profiling.compile import apply_compile
from quantloop.profiling.packing import FlexMask, PackedNet, flex_layout
from quantloop.profiling.precision import autocast
from quantloop.profiling.workload import pack_fields
from quantloop.tasks.engine.keys import code_fingerprint
from quantloop.tasks.research.predictions import PredictionStore, model_key, table_key
from quantloop.tasks.research.training import TrainResult, column_matrix, predict, window_starts
from quantloop.tasks.runtime import overlap

# The rungs that change a forward pass (the others are about the backward and optimizer).
FORWARD_RUNGS = ("compile", "bf16", "cudagraph", "packing", "flex_attention", "flex_blocks")
BATCH = 4096  # windows per group (per graph replay)


def inference_rungs(result: TrainResult, device: torch.device) -> tuple[str, ...]:
    """What the fast path applies for this model on `device`: () means the eager path."""
    return forward_rungs(result.rungs, device)


def forward_rungs(trained_with: Sequence[str], device: torch.device) -> tuple[str, ...]:
    """inference_rungs of a model trained with the rungs `trained_with`."""
    if device.type != "cuda" or "packing" not in trained_with:
        return ()
    return tuple(r for r in FORWARD_RUNGS if r in trained_with)


def mode_name(rungs: Sequence[str]) -> str:
    """InferenceStats.mode: "eager", or the rungs applied, comma-separated."""
    return ",".join(rungs) or "eager"


def pack_groups(
    lengths: np.ndarray, T: int, rows: int, batch: int
) -> tuple[np.ndarray, np.ndarray, list[int]]:
    """Windows in order, next-fit into rows of T events, cut into groups of at most `batch`
    windows and `rows` rows: each window's (row within its group, offset), and the groups'
    first windows (with the end appended)."""
    row, off = np.empty(len(lengths), np.int64), np.empty(len(lengths), np.int64)
    bounds, r, used, count = [0], 0, 0, 0
    for i, n in enumerate(lengths.tolist()):  # one iteration per window: plain ints
        if used + n > T:
            r, used = r + 1, 0
        if r == rows or count == batch:
            bounds.append(i)
            r = used = count = 0
        row[i], off[i] = r, used
        used += n
        count += 1
    return row, off, [*bounds, len(lengths)]


def rows_for(lengths: np.ndarray, T: int, batch: int) -> int:
    """Rows that hold any group of `batch` consecutive windows, next-fit, with 25% to spare:
    one static shape for this table and tables like it."""
    row, _, bounds = pack_groups(lengths, T, len(lengths) + 1, batch)
    need = max(row[b - 1] + 1 for b in bounds[1:]) if len(lengths) else 1
    return int(np.ceil(need * 1.25))


@dataclass(kw_only=True, slots=True)
class InferenceStats:
    mode: str  # "eager" or the rungs applied, comma-separated
    windows: int = 0  # predicted here (not those read from a store)
    seconds: float = 0.0  # prediction calls, host packing and copies included
    warmup_s: float = 0.0  # the first group's call: compile and capture (inside `seconds`)
    stored_windows: int = 0  # read from a PredictionStore instead of predicted

    @property
    def samples_per_s(self) -> float:
        return self.windows / self.seconds if self.seconds > 0 else float("nan")


@functools.cache
def prediction_code() -> str:
    """The source a prediction depends on: the model, the eager path, this fast path and
    its packing (part of a PredictionStore key)."""
    from quantloop.models import orderbook
    from quantloop.profiling import packing
    from quantloop.tasks.research import training

    return code_fingerprint(orderbook, training.predict, training.window_starts,
                            training.column_matrix, sys.modules[__name__], packing)  # fmt: skip


class Predictor:
    """predict(result, table) for many tables, on the fast path where it applies; with a
    `store`, predictions it holds are read instead of made, and those made are kept."""

    def __init__(
        self,
        result: TrainResult,
        *,
        batch: int = BATCH,
        rungs: tuple[str, ...] | None = None,
        store: PredictionStore | None = None,
    ) -> None:
        """rungs: what to apply instead of inference_rungs() (tests on a CPU: packing)."""
        self.result = result
        self.device = next(result.model.parameters()).device
        self.rungs = inference_rungs(result, self.device) if rungs is None else rungs
        self.batch = batch
        self.stats = InferenceStats(mode=mode_name(self.rungs))
        self.store = store
        self._model_key = (model_key(result, self.stats.mode, self.device, prediction_code())
                           if store else "")  # fmt: skip
        self._graph: _GraphedForward | None = None

    def __call__(self, table: pa.Table) -> np.ndarray:
        key = None
        if self.store is not None:
            r = self.result
            key = table_key(self._model_key, column_matrix(table, r.inputs),
                            window_starts(table, r.train_config))  # fmt: skip
            found = self.store.get(key)
            if found is not None:
                self.stats.stored_windows += table.num_rows
                return found
        t0 = time.perf_counter()
        # not beside a registration's torch.export in another thread (overlap.TRACING:
        # the process's oneDNN and cuDNN are off while it traces, and the rounding changes)
        with overlap.TRACING:
            out = self._fast(table) if self.rungs else predict(self.result, table)
        self.stats.windows += table.num_rows
        self.stats.seconds += time.perf_counter() - t0
        if key is not None:
            self.store.put(key, out)
        return out

    def _fast(self, table: pa.Table) -> np.ndarray:
        r, cfg = self.result, self.result.train_config
        n, T, B = table.num_rows, cfg.window, self.batch
        starts = window_starts(table, cfg)
        lengths = np.arange(n) - starts + 1
        first = self._graph is None
        if first:
            self._graph = _GraphedForward(self.result, self.rungs, rows_for(lengths, T, B), T, B)
        graph = self._graph
        features = r.normalizer.apply_inputs(column_matrix(table, r.inputs))
        graph.load_features(
            np.concatenate([features, np.zeros((1, features.shape[1]), np.float32)])
        )
        row, off, bounds = pack_groups(lengths, T, graph.rows, B)
        out = np.empty((n, r.model_config.n_outputs), np.float32)
        with torch.no_grad():
            for a, b in zip(bounds[:-1], bounds[1:], strict=True):  # one iteration per group
                fields = pack_fields(starts[a:b], lengths[a:b], row[a:b], off[a:b], T,
                                     graph.rows, pad_row=n)  # fmt: skip
                t0 = time.perf_counter()
                out[a:b] = graph(fields)[: b - a]
                if first:  # the first call compiles and captures: the warm-up
                    self.stats.warmup_s += time.perf_counter() - t0
                    first = False
        return r.normalizer.unscale_labels(out)


class _GraphedForward:
    """The packed forward of one shape, [rows, T] events and B windows: static device
    buffers, compiled, and captured as a CUDA graph when the model was trained with one.
    A group of b < B windows fills the other slots with empty windows (count 1, anchor 0):
    their outputs are discarded."""

    def __init__(
        self, result: TrainResult, rungs: tuple[str, ...], rows: int, T: int, B: int
    ) -> None:
        device = next(result.model.parameters()).device
        self.device, self.rows, self.B = device, rows, B
        block, tiles = flex_layout(T, result.model_config.head_dim, tuned="flex_blocks" in rungs)
        net = PackedNet(result.model.eval(), flex="flex_attention" in rungs, tiles=tiles)
        if "compile" in rungs:
            net = apply_compile(net, backend="inductor")
        flex = FlexMask(rows, T, device, block=block) if "flex_attention" in rungs else None
        bf16 = "bf16" in rungs
        self.cuda = device.type == "cuda"
        self.host = {
            "src": torch.zeros(rows * T, dtype=torch.long),
            "seg": torch.zeros(rows, T, dtype=torch.long),
            "pos": torch.zeros(rows, T, dtype=torch.long),
            "last": torch.zeros(B, dtype=torch.long),
            "count": torch.ones(B, dtype=torch.float32),
        }
        if self.cuda:
            self.host = {k: v.pin_memory() for k, v in self.host.items()}
        self.static = {k: v.to(device) for k, v in self.host.items()}
        self.feats = torch.zeros(1, len(result.inputs), device=device)
        st = self.static

        def forward() -> torch.Tensor:
            x = self.feats[st["src"]].view(rows, T, -1)  # [R, T, F]
            extra = {"block_mask": flex.update(st["seg"])} if flex is not None else {}
            with autocast(device, bf16):
                return net(x, st["pos"], st["seg"], st["last"], st["count"], **extra).float()

        self.forward = forward
        self.use_graph = "cudagraph" in rungs
        self.graph: torch.cuda.CUDAGraph | None = None
        self.out: torch.Tensor | None = None
        self.compiled = False  # the first forward without a graph compiles

    def load_features(self, features: np.ndarray) -> None:
        """The table's feature matrix into the buffer the graph reads (a larger table
        needs a larger buffer, and the graph is captured again for it)."""
        if features.shape[0] > self.feats.shape[0]:
            self.feats = torch.empty(features.shape, device=self.device)
            self.graph = None
        self.feats[: len(features)].copy_(torch.from_numpy(features))

    def __call__(self, fields: dict[str, np.ndarray]) -> np.ndarray:
        b = len(fields["last"])
        fields["seg"][fields["seg"] == b] = self.B  # padding is seg == B for the model
        for k, v in fields.items():
            if k in ("last", "count"):
                self.host[k].numpy()[b:] = 0 if k == "last" else 1
            self.host[k].numpy().reshape(-1)[: v.size] = v.reshape(-1)
            self.static[k].copy_(self.host[k], non_blocking=True)
        if not self.use_graph:
            if self.compiled:
                out = self.forward().cpu().numpy()
            else:  # the first call compiles: no torch.export beside it (overlap.TRACING)
                with overlap.TRACING:
                    out = self.forward().cpu().numpy()
                self.compiled = True
        else:
            if self.graph is None:
                with overlap.TRACING:  # compiled here: no torch.export beside it
                    side = torch.cuda.Stream(self.device)
                    side.wait_stream(torch.cuda.current_stream(self.device))
                    with torch.cuda.stream(side):
                        for _ in range(3):  # compile and allocate outside the capture
                            self.forward()
                    torch.cuda.current_stream(self.device).wait_stream(side)
                    self.graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(self.graph):
                        self.out = self.forward()
            self.graph.replay()
            out = self.out.cpu().numpy()
        if self.cuda:  # .cpu() waited for the forward; the copies that read host are before it
            torch.cuda.current_stream(self.device).synchronize()
        return out
