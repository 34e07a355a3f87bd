"""Rung 6 on several GPUs: data-parallel training, the gradient all-reduce bucketed and
overlapped with backward, for any number of processes (one per GPU, torchrun).

Each rank trains the same model on its share of every step's global batch (a contiguous
slice of the seeded order, packed on its own). Gradients live in the fused optimizer's
flat buffer (rung 5), parameter by parameter in model order. `GradBuckets` cuts that buffer
into contiguous buckets in the reverse order backward produces them: the head and final
norm, then one bucket per transformer block, the last one with the embeddings. A
post-accumulate-grad hook counts each bucket's gradients; when a bucket is complete (and
every bucket before it has been launched, so all ranks issue the same collectives in the
same order) its all-reduce is launched asynchronously on NCCL's stream while backward goes
on with the blocks below. Before the optimizer step the compute stream waits for them and
the buffer is divided by the world size: every rank then steps with the gradient of the
global batch's mean loss, which is what one GPU computes on the whole batch.

With torch.compile each block is compiled on its own (StepSettings.compile_per_block): a
whole-model compile makes the backward one autograd node, every gradient ready only at
its end, and nothing left to overlap. The hooks and the launches are host-side Python;
inside the whole-step CUDA graph (rung 7) they run once, at capture, and the graph replays
the collectives where they were issued (NCCL >= 2.9.6 allows capturing them).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from quantloop.models.orderbook import OrderBookNet
from quantloop.profiling.kernels import CHUNK, FusedAdamW
from quantloop.profiling.workload import TrainingSet, plan_packing


def bucket_spans(model: OrderBookNet) -> list[list[int]]:
    """Parameter indices per bucket, in the order backward completes them: head and final
    norm, the blocks from the last to the first, then the first block with the embeddings."""
    names = [n for n, _ in model.named_parameters()]
    index = {n: i for i, n in enumerate(names)}
    blocks = [
        [index[n] for n in names if n.startswith(f"blocks.{b}.")] for b in range(len(model.blocks))
    ]
    stem = [index[n] for n in names if n.startswith(("embed.", "pos."))]
    top = [i for i in range(len(names)) if i not in set(stem).union(*map(set, blocks))]
    buckets = [top, *blocks[::-1]]
    buckets[-1] = blocks[0] + stem if blocks else stem
    return [b for b in buckets if b]


class GradBuckets:
    """All-reduce the flat gradient buffer of `opt` bucket by bucket as backward fills it.

    finish(): launch what is left (a parameter backward did not reach), make the current
    stream wait for every all-reduce, average. Call it between backward and opt.step().
    """

    def __init__(
        self, model: OrderBookNet, opt: FusedAdamW, *, buckets: Sequence[Sequence[int]] = ()
    ) -> None:
        if opt.handoff:
            raise ValueError("GradBuckets reduces in the flat buffer: no flat_grads handoff")
        self.world = dist.get_world_size()
        self.opt = opt
        params = list(model.parameters())
        starts = [0]
        for p in params:  # each parameter starts on a CHUNK boundary of the flat buffer
            starts.append(starts[-1] + -(-p.numel() // CHUNK) * CHUNK)
        self.buckets = [list(b) for b in (buckets or bucket_spans(model))]
        self.views = []
        for b in self.buckets:
            lo, hi = min(starts[i] for i in b), max(starts[i + 1] for i in b)
            if hi - lo != sum(starts[i + 1] - starts[i] for i in b):
                raise ValueError(f"bucket {b} is not a contiguous span of the flat buffer")
            self.views.append(opt.grad[lo:hi])
        self.bucket_of = {i: k for k, b in enumerate(self.buckets) for i in b}
        # On a GPU the collectives run inside a stream of our own, joined back only in
        # finish(). Measured on two H200s (docs/ladder.md, "Two GPUs"): with async_op from
        # the compute stream 8.5% of all-reduce time overlapped compute, with this stream
        # 2.4%; in both the next backward GEMM starts only when the all-reduce's blocks
        # leave the SMs it needs (nccl_options caps them). Kept: one explicit join.
        self.stream = torch.cuda.Stream(opt.grad.device) if opt.grad.is_cuda else None
        self.hooks = [
            p.register_post_accumulate_grad_hook(self._ready(i)) for i, p in enumerate(params)
        ]
        self._reset()

    def _reset(self) -> None:
        self.pending = [len(b) for b in self.buckets]
        self.launched = 0
        self.works: list = []

    def _ready(self, i: int):
        def hook(_: torch.Tensor) -> None:
            self.pending[self.bucket_of[i]] -= 1
            while self.launched < len(self.buckets) and self.pending[self.launched] == 0:
                self._launch()

        return hook

    def _launch(self) -> None:
        view = self.views[self.launched]
        if self.stream is None:  # gloo on a CPU
            self.works.append(dist.all_reduce(view, op=dist.ReduceOp.SUM, async_op=True))
        else:  # the bucket's gradients are complete on the compute stream up to here
            self.stream.wait_stream(torch.cuda.current_stream(view.device))
            with torch.cuda.stream(self.stream):
                dist.all_reduce(view, op=dist.ReduceOp.SUM)
        self.launched += 1

    def finish(self) -> None:
        while self.launched < len(self.buckets):
            self._launch()
        for work in self.works:
            work.wait()
        if self.stream is not None:  # the one join: the optimizer step after every bucket
            torch.cuda.current_stream(self.opt.grad.device).wait_stream(self.stream)
        self.opt.grad.div_(self.world)
        self._reset()

    def remove(self) -> None:
        for h in self.hooks:
            h.remove()


def nccl_options(ctas: int):
    """NCCL process-group options that cap each collective at `ctas` thread blocks (SMs).

    Why: measured on two H200s (docs/ladder.md, "Two GPUs"), NCCL's default for these
    0.8 MB buckets is 24 blocks of 104 KB shared memory each, and while they run the
    backward's next cuBLAS kernel (a 132-block persistent GEMM, 200 KB each) does not start:
    the all-reduce runs alone on the device. With 2 blocks it ran under compute (65% of
    its time) but took 7x longer. 0 keeps NCCL's choice."""
    opts = dist.ProcessGroupNCCL.Options()
    if ctas:
        opts.config.min_ctas = opts.config.max_ctas = ctas
    return opts


def rank_share(work: TrainingSet, rank: int, world: int, packing: bool) -> TrainingSet:
    """This rank's slice of every step's global batch (contiguous), packed on its own."""
    B = work.order.shape[1]
    if B % world:
        raise ValueError(f"the global batch ({B}) must divide among {world} ranks")
    b = B // world
    order = work.order[:, rank * b : (rank + 1) * b]
    return TrainingSet(
        features=work.features, train=work.train, labels=work.labels, order=order,
        max_len=work.max_len, **plan_packing(work.train.lengths, order, work.max_len, packing),
    )  # fmt: skip


def allreduce_overlap(trace_path: str) -> dict:
    """From a Chrome trace: NCCL kernel time, and the share of it that overlaps other
    kernels (compute) on the GPU timeline; the all-reduce is hidden where that share is 1."""
    import json

    with open(trace_path) as f:
        events = json.load(f).get("traceEvents", [])
    kernels = [e for e in events if e.get("ph") == "X" and e.get("cat") == "kernel"]
    comm = sorted(
        (e["ts"], e["ts"] + e["dur"]) for e in kernels if "nccl" in e.get("name", "").lower()
    )
    comp = _union(
        sorted(
            (e["ts"], e["ts"] + e["dur"])
            for e in kernels
            if "nccl" not in e.get("name", "").lower()
        )
    )
    total = sum(b - a for a, b in comm)
    hidden = 0.0
    for a, b in comm:  # overlap of each NCCL kernel with the union of compute kernels
        for c, d in comp:
            if d <= a:
                continue
            if c >= b:
                break
            hidden += min(b, d) - max(a, c)
    return {
        "allreduce_kernels": len(comm),
        "allreduce_us": total,
        "allreduce_hidden_us": hidden,
        "allreduce_hidden_fraction": hidden / total if total > 0 else None,
    }


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for a, b in intervals:
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out
