"""Data-parallel training (profiling.distributed, bench/ddp.py) on a CPU with gloo: buckets
in backward order over the flat gradient buffer, launched by the hooks while backward runs,
the overlap figure read from a trace, and two processes against one at the same global
batch. The NCCL run on two H200s: bench/results/ladder-h200x2.json."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist

from quantloop.models.orderbook import ModelConfig, OrderBookNet
from quantloop.profiling.distributed import GradBuckets, allreduce_overlap, bucket_spans
from quantloop.profiling.kernels import FusedAdamW
from quantloop.profiling.packing import PackedNet

ROOT = Path(__file__).resolve().parents[1]


def small_model() -> OrderBookNet:
    torch.manual_seed(0)
    return OrderBookNet(ModelConfig(n_features=3, n_outputs=1, d_model=8, n_layers=3, n_heads=2))


def test_buckets_are_the_blocks_in_backward_order():
    model = small_model()
    names = [n for n, _ in model.named_parameters()]
    buckets = [[names[i] for i in b] for b in bucket_spans(model)]
    assert [b[0].split(".")[0] for b in buckets] == ["norm", "blocks", "blocks", "blocks"]
    assert [{n.split(".")[1] for n in b} for b in buckets[1:3]] == [{"2"}, {"1"}]
    assert buckets[-1][-3:] == ["embed.weight", "embed.bias", "pos.weight"]
    assert sorted(sum(buckets, [])) == sorted(names)


@pytest.fixture
def one_process(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0,
                            world_size=1)  # fmt: skip
    yield
    dist.destroy_process_group()


def test_the_hooks_launch_every_bucket_during_backward_in_order(one_process):
    model = small_model()
    twin = small_model()
    opt = FusedAdamW(model, lr=1e-3, weight_decay=0.0, use_triton=False)
    buckets = GradBuckets(model, opt)
    order = []
    launch = buckets._launch
    buckets._launch = lambda: (order.append(buckets.launched), launch())[1]
    x, mask = torch.randn(4, 6, 3), torch.ones(4, 6, dtype=torch.bool)
    for net in (model, twin):
        net(x, mask).square().mean().backward()
    assert buckets.launched == len(buckets.buckets) and order == list(range(len(order)))
    buckets.finish()  # one process: the sum is the gradient itself
    for p, q in zip(model.parameters(), twin.parameters(), strict=True):
        assert torch.allclose(p.grad, q.grad, rtol=1e-6, atol=1e-8)
    # packed, with a block's parameters reached through PackedNet's layers: the same buckets
    assert len(PackedNet(model).layers) == 3


def test_overlap_is_the_share_of_nccl_kernel_time_under_compute(tmp_path):
    def kernel(name: str, ts: float, dur: float) -> dict:
        return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur}

    nccl = "ncclDevKernel_AllReduce_Sum_f32"
    events = [kernel("gemm", 0, 10), kernel("gelu", 10, 5), kernel(nccl, 8, 10),
              kernel(nccl, 30, 4)]  # fmt: skip
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    got = allreduce_overlap(str(path))
    assert got["allreduce_us"] == 14 and got["allreduce_hidden_us"] == 7
    assert got["allreduce_hidden_fraction"] == pytest.approx(0.5)


@pytest.mark.slow
def test_two_processes_train_the_one_process_model(tmp_path):
    """bench/ddp.py as on the GPUs, with gloo on a CPU: one process, then two sharing the
    same global batch; the second writes the result checked against the first."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    for n in (1, 2):
        run = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--standalone",
             f"--nproc-per-node={n}", str(ROOT / "bench" / "ddp.py"), "--preset", "cpu_tiny",
             "--out", str(tmp_path / "out"), "--work", str(tmp_path / "work")],
            env=env, capture_output=True, text=True, timeout=600,
        )  # fmt: skip
        assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads((tmp_path / "out" / "ladder-cpux2.json").read_text())
    assert result["gpus"] == 2 and result["equivalent"], result["equivalence"]
    assert result["equivalence"]["weights_agree_across_ranks"]
    assert result["equivalence"]["loss_max_rel_dev"] < 1e-3
    assert set(result["switches"]) >= {"fused_kernel", "device_metrics", "packing"}
    assert np.isfinite(result["samples_per_s"]) and result["rows"][0]["name"] == "data_parallel"
