"""K models trained as one stack (profiling/stacked.py) are each the model trained alone."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from quantloop.models import stacked as stacked_model
from quantloop.models.orderbook import ModelConfig, OrderBookNet
from quantloop.profiling import compile_cache
from quantloop.profiling.compile_cache import precompile_supported
from quantloop.profiling.config import FP32
from quantloop.profiling.equivalence import max_rel_dev, rel_l2
from quantloop.profiling.stacked import (
    FlatAdamW,
    Member,
    StackConfig,
    kernel_class,
    train_stacked,
)
from quantloop.tasks.research.train_config import TrainConfig
from quantloop.tasks.research.training import predict, prepare, train_plain
from tests.test_training import SMALL, learnable_table

INPUTS, LABELS = ["a", "b"], ["label_4"]
FOLD_A = [learnable_table(600, 0), learnable_table(500, 1)]
FOLD_B = [learnable_table(500, 1), learnable_table(550, 2)]  # another fold: other days
HELD_OUT = learnable_table(400, 9)
# Settings a sweep varies: seed, learning rate, weight decay; and the data (two folds).
SETTINGS = [(0, 2e-3, 1e-4, "a"), (1, 1e-3, 0.0, "a"), (2, 5e-3, 1e-2, "b"), (0, 2e-3, 1e-4, "b")]


def members(**changes):
    base = TrainConfig(**SMALL, optimizations="none", **changes)
    out = []
    datas = {}
    for seed, lr, wd, fold in SETTINGS:
        cfg = dataclasses.replace(base, seed=seed, lr=lr, weight_decay=wd)
        tables = FOLD_A if fold == "a" else FOLD_B
        # members of one fold and seed share their data object, as a sweep's do
        key = (fold, seed)
        if key not in datas:
            datas[key] = prepare(tables, INPUTS, LABELS, cfg)
        out.append(Member(data=datas[key], config=cfg))
    return out


def solo_and_stacked(stack: StackConfig):
    ms = members()
    solo = [train_plain(m.data, m.config) for m in ms]
    stacked, timing = train_stacked(ms, stack)
    return solo, stacked, timing


@pytest.mark.parametrize(
    "stack",
    [
        StackConfig(),
        StackConfig(compile=True, compile_backend="aot_eager"),
        StackConfig(packing=True),
        StackConfig(packing=True, compile=True, compile_backend="aot_eager"),
        # the top rung's step: flat buffers and one AdamW pass over every model (per-model
        # lr and decay gathered per element), gradients handed over, the step index on
        # the device (what the CUDA graph replays; no graph on a CPU)
        StackConfig(packing=True, fused_kernel=True),
        StackConfig(
            packing=True,
            fused_kernel=True,
            flat_grads=True,
            compile=True,
            compile_backend="aot_eager",
        ),  # fmt: skip
        StackConfig(fused_kernel=True, flat_grads=True),
        StackConfig(
            packing=True,
            fused_kernel=True,
            flat_grads=True,
            compile=True,
            compile_backend="aot_eager",
            gemm_bias_grad=True,
        ),  # fmt: skip
        # flex_attention: "FlexAttention does not support backward on CPU" (torch 2.13);
        # bench/sweep.py checks it on the H200
    ],
    ids=[
        "padded",
        "padded-compiled",
        "packed",
        "packed-compiled",
        "packed-fused",
        "packed-fused-flat-compiled",
        "padded-fused-flat",
        "packed-fused-flat-compiled-gemm-bias-grad",
    ],
)
def test_each_model_of_a_stack_is_the_model_trained_alone(stack):
    """Fixed seeds: the loss curve, the weights and the held-out predictions of every
    member within the ladder's fp32 tolerance of its solo run; and the members differ from
    each other (a stack that trained one model K times would pass the first check)."""
    solo, stacked, timing = solo_and_stacked(stack)
    assert timing.k == len(solo) and timing.samples_per_s > 0
    for alone, together in zip(solo, stacked, strict=True):
        assert max_rel_dev(together.loss_curve, alone.loss_curve) <= FP32.loss_rel
        w_alone = torch.cat([p.flatten() for p in alone.model.parameters()]).detach()
        w_together = torch.cat([p.flatten() for p in together.model.parameters()]).detach()
        # Adam divides by sqrt(v): where a gradient is near zero, an ulp of difference in it
        # moves the update by up to lr, so weights drift more than the loss (1.4e-4 seen
        # after 20 steps at lr 5e-3); another seed gives weights 0.42 apart (relative; measured).
        assert float((w_alone - w_together).norm() / w_alone.norm()) < 1e-3
        assert rel_l2(predict(together, HELD_OUT), predict(alone, HELD_OUT)) <= FP32.pred_rel_l2
    curves = [tuple(r.loss_curve) for r in stacked]
    assert len(set(curves)) == len(curves)  # seed, lr, wd and fold each change the model
    # the same seed on other data is another model; on the same data, the same start
    assert stacked[0].model_digest != stacked[3].model_digest


def three_models(train: bool = False):
    """Three small OrderBookNets of seeds 0-2 (eval mode unless `train`), and a batch for
    them: x [3, 5, 7, 3] and a mask with left padding on some windows."""
    cfg = ModelConfig(n_features=3, n_outputs=2, d_model=16, n_layers=2, n_heads=4)
    models = []
    for seed in range(3):
        torch.manual_seed(seed)
        models.append(OrderBookNet(cfg).train(train))
    x = torch.randn(3, 5, 7, 3)
    mask = torch.ones(3, 5, 7, dtype=torch.bool)
    mask[:, :2, :3] = False  # left padding on some windows
    return cfg, models, x, mask


def test_the_stacked_forward_is_each_models_forward():
    cfg, models, x, mask = three_models()
    params, _ = torch.func.stack_module_state(models)
    x[~mask] = float("nan")  # padding must never reach a real position
    with torch.no_grad():
        got = stacked_model.forward(params, cfg, x, mask)
        want = torch.stack([m(x[i], mask[i]) for i, m in enumerate(models)])
    assert torch.isfinite(got).all()
    np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("gemm_bias_grad", [False, True])
def test_under_bf16_autocast_the_stack_computes_in_the_dtypes_of_the_model_alone(
    monkeypatch, gemm_bias_grad
):
    """nn.Linear under autocast gives bf16 (its bias cast too): the stack's Linears must as
    well, or bf16 + a float32 bias makes q, k and v float32 and the stack's attention runs
    in another precision than the model alone's (it did, until 2026-12-07)."""
    cfg, models, x, mask = three_models()
    params, _ = torch.func.stack_module_state(models)
    seen = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def spy(q, k, v, **kwargs):
        seen.append((q.dtype, k.dtype, v.dtype))
        return sdpa(q, k, v, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        alone = torch.stack([m(x[i], mask[i]) for i, m in enumerate(models)])
        solo_seen, seen[:] = list(seen), []
        together = stacked_model.forward(params, cfg, x, mask, gemm_bias_grad)
    assert solo_seen and set(solo_seen) == {(torch.bfloat16,) * 3}
    assert set(seen) == {(torch.bfloat16,) * 3} and len(seen) == cfg.n_layers
    assert together.dtype == alone.dtype == torch.bfloat16
    assert rel_l2(together.float().numpy(), alone.float().numpy()) <= 2e-2


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_bias_gradients_summed_by_a_gemm_are_the_reductions(bf16):
    """gemm_bias_grad: the same loss and every parameter's gradient as the plain sums (to
    float rounding; in bf16, the bf16 sum's), the wide Linears' bias sums done by batched
    GEMMs (two more `bmm` a block in the backward, the q/k/v's and the first MLP's)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Bmms(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Bmms.count += func is torch.ops.aten.bmm.default
            return func(*args, **(kwargs or {}))

    cfg, models, x, mask = three_models(train=True)
    results, bmms = [], []
    for gemm in (False, True):
        params, _ = torch.func.stack_module_state(models)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = stacked_model.forward(params, cfg, x, mask, gemm).float().square().sum()
        Bmms.count = 0
        with Bmms():
            loss.backward()
        bmms.append(Bmms.count)
        results.append((loss.detach(), {n: p.grad for n, p in params.items()}))
    (loss0, g0), (loss1, g1) = results
    assert torch.equal(loss0, loss1)  # the forward is the same ops
    # bf16: the GEMM's bias sums are rounded to bf16 (2^-8 relative), as a Linear's alone
    tol = 2**-7 if bf16 else 1e-5  # of the largest gradient of that parameter
    for name, grad in g0.items():
        assert grad is not None and torch.isfinite(grad).all(), name
        worst = float((g1[name] - grad).abs().max() / grad.abs().max())
        assert worst <= tol, (name, worst)
    assert bmms[1] - bmms[0] == 2 * cfg.n_layers


def test_members_of_other_shapes_are_refused_by_name():
    ms = members()
    other = dataclasses.replace(ms[1].config, batch_size=32)
    with pytest.raises(ValueError, match="member 1 differs from member 0 in batch_size"):
        train_stacked([ms[0], Member(data=ms[1].data, config=other)])
    with pytest.raises(ValueError, match="at least one member"):
        train_stacked([])


def test_the_flat_update_is_torch_adamw_per_model():
    """FlatAdamW over two stacked models with their own lr and weight decay: each model's
    slice after 5 steps equals torch.optim.AdamW on that model alone, to float32 rounding
    (the same operations in the same order; bias corrections in float64 as AdamW's)."""
    torch.manual_seed(0)
    K, shapes = 2, {"w": (3, 5), "b": (7,)}
    start = {n: torch.randn(K, *s) for n, s in shapes.items()}
    grads = [{n: torch.randn(K, *s) for n, s in shapes.items()} for _ in range(5)]
    lr, wd = torch.tensor([1e-2, 3e-3]), torch.tensor([1e-2, 0.0])
    for handoff in (False, True):
        opt = FlatAdamW({n: t.clone() for n, t in start.items()}, lr, wd, handoff=handoff)
        for g in grads:
            opt.zero_grad()
            for n, leaf in opt.leaves.items():
                if handoff:
                    leaf.grad = g[n].clone()
                else:
                    leaf.grad.add_(g[n])
            opt.step()
        for k in range(K):
            ref = {n: torch.nn.Parameter(t[k].clone()) for n, t in start.items()}
            adamw = torch.optim.AdamW(ref.values(), lr=float(lr[k]), weight_decay=float(wd[k]))
            for g in grads:
                for n, p in ref.items():
                    p.grad = g[n][k].clone()
                adamw.step()
            for n, p in ref.items():
                got = opt.leaves[n][k].detach()
                np.testing.assert_allclose(got.numpy(), p.detach().numpy(), rtol=1e-6, atol=1e-7)
        # the models moved apart: per-model hyperparameters reached their slices
        assert not torch.equal(opt.leaves["w"][0], start["w"][0])


def test_the_top_stack_on_a_cpu_and_its_switches():
    top = StackConfig.top(torch.device("cpu"), head_dim=32)
    assert top.switches() == ("packing", "fused_kernel", "flat_grads")
    gpu = StackConfig.top(torch.device("cuda"), head_dim=32)
    assert {"cudagraph", "flex_blocks", "fused_kernel", "flat_grads"} <= set(gpu.switches())
    assert "gemm_bias_grad" not in gpu.switches()  # an A/B switch: no gain on bf16 Linears
    assert "flex_attention" not in StackConfig.top(torch.device("cuda"), head_dim=8).switches()
    with pytest.raises(ValueError, match="flat_grads needs fused_kernel"):
        StackConfig(flat_grads=True)
    with pytest.raises(ValueError, match="cudagraph needs fused_kernel"):
        StackConfig(cudagraph=True, warmup_steps=10)
    with pytest.raises(ValueError, match="warmup_steps >= 4"):
        StackConfig(cudagraph=True, fused_kernel=True, warmup_steps=3)
    with pytest.raises(ValueError, match="cudagraph needs a CUDA device"):
        train_stacked(members(), StackConfig(cudagraph=True, fused_kernel=True, warmup_steps=4))


def test_kernel_classes_by_name_and_phase():
    assert kernel_class("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n", "forward") == "gemm"
    assert kernel_class("nvjet_hsh_128x64_64x4_1x2_h_bz_coopA_NTN", "backward") == "gemm"
    assert kernel_class("triton_tem_fused_flex_attention_0", "forward") == "attention"
    assert kernel_class("void splitKreduce_kernel<32, 16, int, float>", "backward") == "gemm"
    assert kernel_class("triton_per_fused_native_layer_norm_3", "forward") == "norms_elementwise"
    assert kernel_class("triton_poi_fused_add_mul_0", "optimizer") == "optimizer"


def test_stacks_of_one_shape_reuse_the_compiled_loss():
    """reuse_compiled: a second stack of the same shape and switches trains the same models
    without Dynamo compiling anything again (how bench/sweep.py's check trains its many
    stacks of one); the default starts from a fresh Dynamo state."""
    from torch._dynamo.utils import counters

    ms = members()[:2]
    stack = StackConfig(packing=True, fused_kernel=True, flat_grads=True, compile=True,
                        compile_backend="aot_eager")  # fmt: skip
    fresh, _ = train_stacked(ms, stack)
    compiled = counters["stats"]["unique_graphs"]
    assert compiled > 0
    again, _ = train_stacked(ms, stack, reuse_compiled=True)
    assert counters["stats"]["unique_graphs"] == compiled  # nothing traced again
    assert [r.model_digest for r in again] == [r.model_digest for r in fresh]


@pytest.mark.skipif(not precompile_supported(), reason="this torch keeps no Dynamo packages")
def test_with_precompile_the_stack_wraps_its_functions_after_loading_the_store(
    tmp_path, monkeypatch
):
    """StackConfig.precompile: the loss and the flat update are wrapped by torch.compile at
    their first call, inside the store's block, so torch finds their Dynamo packages the
    store just loaded (wrapped when the step is built, before the load, it found none).
    aot_eager's graphs are not serializable, so here they are compiled again; with
    Inductor nothing is traced (tests/test_compile_cache.py)."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor-1"))
    ms = members()[:2]
    stack = StackConfig(packing=True, fused_kernel=True, flat_grads=True, compile=True,
                        compile_backend="aot_eager", precompile=True)  # fmt: skip
    store = str(tmp_path / "store")
    before = compile_cache.counts()
    first, timing = train_stacked(ms, stack, compile_cache=store)
    assert timing.compile_cache == "missing"
    assert compile_cache.counts()["dynamo_misses"] - before["dynamo_misses"] == 2
    # another machine's Inductor folder: only the store can hold the packages there
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor-2"))
    before = compile_cache.counts()
    again, timing = train_stacked(ms, stack, compile_cache=store)
    assert timing.compile_cache == "loaded"
    assert compile_cache.counts()["dynamo_hits"] - before["dynamo_hits"] == 2
    assert [r.model_digest for r in again] == [r.model_digest for r in first]
