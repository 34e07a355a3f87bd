"""K order-book models of one shape as one: models/orderbook.py's forward, written over
parameters stacked along a leading model dimension.

Every weight is [K, ...] (torch.func.stack_module_state of K OrderBookNets, same names),
the batch is [K, B, T, F] (each model its own windows), and each op is the batched form
of the one OrderBookNet runs: a Linear is one `bmm` over the K models, then its bias; a
LayerNorm normalizes without its affine part and then scales by each model's own weight; the
attention, which has no weights, runs once over K * B windows. Why not `torch.func.vmap`
over OrderBookNet itself: it gives the same numbers, but PyTorch has no batching rule for
the fused attention kernels (`_scaled_dot_product_flash_attention_for_cpu` fell back to a
Python loop over the K models here, with a warning), which is the launch-bound stream a
stack exists to remove.

Same masking rules as OrderBookNet (padded inputs zeroed, padded keys never attended to,
the diagonal always allowed), so each model's output equals its OrderBookNet's up to the
order of float sums (tests/test_stacked.py).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F

from quantloop.models.orderbook import ModelConfig

Params = dict[str, torch.Tensor]  # OrderBookNet's parameter names -> [K, ...]
LAYER_NORM_EPS = 1e-5  # nn.LayerNorm's default, as OrderBookNet uses it


class _AddBiasGemmGrad(torch.autograd.Function):
    """y + bias (y: [K, M, N], bias: [K, N]) whose backward sums the gradient over the M
    rows with a batched GEMM, ones [K, 1, M] @ g, instead of a reduction kernel.

    Why: Inductor fuses a bias gradient's column sum with the pointwise kernel that makes
    the gradient, recomputing it from that kernel's inputs; for the first MLP Linear
    that kernel (GELU's backward with the bias sum, reading two [K, M, 4D] tensors) took
    1.53 ms of a 22.4 ms K = 16 step on an H100, about twice what its bytes need, and the
    coordinate-descent tuner left it at 1.41 (bench/results/sweep-h200-notes.md, call 3).
    The GEMM reads the gradient the weight's GEMMs read anyway, once, in their dtype (bf16
    under autocast, as the model alone's Linear sums its bias gradient).

    Off in every stack (profiling/stacked.StackConfig): with the Linears' outputs in bf16
    it gained nothing on an H100 (20.59 against 20.58 ms a step at K = 16), and a custom
    autograd Function makes AOTAutograd's cache bypass the graph (torch 2.13 on this
    CPU: `autograd_cache_bypass` in each fresh compile, where the same graph without it
    hits), so a process loading the compile-cache store traces the joint graph again. (So
    is a graph that enters autocast inside the compiled function, as the stack's losses
    did with bf16 until autocast moved around the compiled call: sweep-h200-notes.md,
    after call 5.)"""

    @staticmethod
    def forward(ctx, y: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        ctx.dtypes = (y.dtype, bias.dtype)
        return y + bias.to(y.dtype).unsqueeze(1)

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y_dtype, bias_dtype = ctx.dtypes
        g = g.to(y_dtype)
        ones = torch.ones(g.shape[0], 1, g.shape[1], dtype=y_dtype, device=g.device)
        return g, torch.bmm(ones, g).squeeze(1).to(bias_dtype)


def linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, gemm_bias_grad: bool = False
) -> torch.Tensor:
    """K Linears at once. x: [K, ..., in]; weight: [K, out, in]; bias: [K, out].

    A `bmm` and the bias added after it, not `baddbmm(bias, ...)`: cuBLAS's batched GEMM
    has no bias epilogue, so ATen's baddbmm first copies the bias broadcast to the whole
    [K, M, out] output (a strided elementwise kernel) and the GEMM then reads it back
    (beta = 1). On the H200 at K = 16 that copy was the step's largest kernel, 3.1 ms of
    20.3 (bench/results/sweep-h200.json, top kernels); added after, Inductor fuses the bias
    into the kernel that reads the GEMM's output.

    The bias is added in the GEMM's output dtype, as nn.Linear under autocast adds its bf16
    bias: bf16 + the float32 parameter would promote the output to float32, so the stack
    ran its attention and its MLP's GELU in float32 where the model alone runs them in
    bf16 (found 2026-12-07; before, the stack's q, k and v were float32 under autocast).
    gemm_bias_grad: the bias's gradient summed by a GEMM (_AddBiasGemmGrad), the same
    value up to the order of the sum."""
    k, n_in = x.shape[0], x.shape[-1]
    y = torch.bmm(x.reshape(k, -1, n_in), weight.transpose(1, 2))
    if gemm_bias_grad:
        y = _AddBiasGemmGrad.apply(y, bias)
    else:
        y = y + bias.to(y.dtype).unsqueeze(1)
    return y.view(*x.shape[:-1], weight.shape[1])


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """K LayerNorms at once. x: [K, ..., D]; weight, bias: [K, D]."""
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (x.shape[-1],)
    y = F.layer_norm(x, x.shape[-1:], eps=LAYER_NORM_EPS)
    return torch.addcmul(bias.view(shape), y, weight.view(shape))


def forward(
    p: Params, cfg: ModelConfig, x: torch.Tensor, mask: torch.Tensor, gemm_bias_grad: bool = False
) -> torch.Tensor:
    """Outputs of K models: [K, B, n_outputs].

    x: [K, B, T, F] float; mask: [K, B, T] bool, True = real event, last position real.
    gemm_bias_grad: the wide Linears' bias gradients (q/k/v's and the first MLP Linear's,
    whose [K, M, 3D] and [K, M, ff * D] gradients the weights' GEMMs read in bf16 anyway)
    summed by a GEMM (`linear`); the others' sums Inductor fuses with the residual stream's
    and the norms' reductions.
    """
    lin = functools.partial(linear, gemm_bias_grad=gemm_bias_grad)
    K, B, T, _ = x.shape
    if T > cfg.max_len:
        raise ValueError(f"window length {T} exceeds max_len {cfg.max_len}")
    H, D = cfg.n_heads, cfg.d_model
    m = mask.unsqueeze(-1)  # [K, B, T, 1]
    x = torch.where(m, x, torch.zeros((), dtype=x.dtype, device=x.device))
    distance = torch.arange(T - 1, -1, -1, device=x.device)  # [T]
    h = linear(x, p["embed.weight"], p["embed.bias"]) + p["pos.weight"][:, distance].unsqueeze(1)
    eye = torch.eye(T, dtype=torch.bool, device=x.device)
    allowed = (mask.view(K * B, 1, 1, T) | eye).expand(K * B, 1, T, T)  # [K*B, 1, T, T]
    for i in range(cfg.n_layers):
        b = f"blocks.{i}."
        a = layer_norm(h, p[b + "norm1.weight"], p[b + "norm1.bias"])
        qkv = lin(a, p[b + "attn.qkv.weight"], p[b + "attn.qkv.bias"])  # [K, B, T, 3D]
        q, k, v = qkv.view(K * B, T, 3, H, D // H).unbind(2)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [K*B, H, T, Dh]
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)
        y = y.transpose(1, 2).reshape(K, B, T, D)
        h = h + linear(y, p[b + "attn.proj.weight"], p[b + "attn.proj.bias"])
        a = layer_norm(h, p[b + "norm2.weight"], p[b + "norm2.bias"])
        a = F.gelu(lin(a, p[b + "mlp.0.weight"], p[b + "mlp.0.bias"]))
        h = h + linear(a, p[b + "mlp.2.weight"], p[b + "mlp.2.bias"])
    h = layer_norm(h, p["norm.weight"], p["norm.bias"])
    last = h[:, :, -1]  # [K, B, D]
    zero = torch.zeros((), dtype=h.dtype, device=h.device)
    count = m.sum(2).clamp(min=1).to(h.dtype)  # [K, B, 1]
    mean = torch.where(m, h, zero).sum(2) / count  # [K, B, D]
    return linear(torch.cat([last, mean], dim=-1), p["head.weight"], p["head.bias"])


def forward_packed(
    p: Params,
    cfg: ModelConfig,
    x: torch.Tensor,
    pos: torch.Tensor,
    seg: torch.Tensor,
    last: torch.Tensor,
    count: torch.Tensor,
    attend: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
    gemm_bias_grad: bool = False,
) -> torch.Tensor:
    """Outputs of K models on packed windows (profiling/packing.py's layout, one pack per
    model): [K, B, n_outputs].

    x: [K, R, T, F]; pos, seg: [K, R, T] long (seg: the window's slot in its model's batch,
    B on padding; pos: events before the window's anchor); last: [K, B], each anchor's flat
    index in its model's R * T positions; count: [K, B] window lengths. `attend(q, k, v)`
    on [K * R, H, T, Dh] attends within each window only (a dense block-diagonal mask, or
    FlexAttention's block mask: profiling/stacked.py picks). gemm_bias_grad: as `forward`.
    """
    lin = functools.partial(linear, gemm_bias_grad=gemm_bias_grad)
    K, R, T, _ = x.shape
    B = last.shape[1]
    H, D = cfg.n_heads, cfg.d_model
    real = (seg < B).unsqueeze(-1)  # [K, R, T, 1]
    x = torch.where(real, x, torch.zeros((), dtype=x.dtype, device=x.device))
    model = torch.arange(K, device=x.device).view(K, 1, 1)
    h = linear(x, p["embed.weight"], p["embed.bias"]) + p["pos.weight"][model, pos]
    for i in range(cfg.n_layers):
        b = f"blocks.{i}."
        a = layer_norm(h, p[b + "norm1.weight"], p[b + "norm1.bias"])
        qkv = lin(a, p[b + "attn.qkv.weight"], p[b + "attn.qkv.bias"])  # [K, R, T, 3D]
        q, k, v = qkv.view(K * R, T, 3, H, D // H).unbind(2)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [K*R, H, T, Dh]
        y = attend(q, k, v).transpose(1, 2).reshape(K, R, T, D)
        h = h + linear(y, p[b + "attn.proj.weight"], p[b + "attn.proj.bias"])
        a = layer_norm(h, p[b + "norm2.weight"], p[b + "norm2.bias"])
        a = F.gelu(lin(a, p[b + "mlp.0.weight"], p[b + "mlp.0.bias"]))
        h = h + linear(a, p[b + "mlp.2.weight"], p[b + "mlp.2.bias"])
    h = layer_norm(h, p["norm.weight"], p["norm.bias"]).reshape(K, R * T, D)
    last_h = torch.gather(h, 1, last.unsqueeze(-1).expand(K, B, D))  # [K, B, D]
    # each model's windows sum into buckets of their own: model k's slot s -> k * (B + 1) + s
    # (slot B of each model collects its padding)
    bucket = (seg.reshape(K, R * T) + (B + 1) * model.view(K, 1)).reshape(-1)
    sums = torch.zeros(K * (B + 1), D, dtype=h.dtype, device=h.device)
    sums = sums.index_add(0, bucket, h.reshape(K * R * T, D)).view(K, B + 1, D)
    mean = sums[:, :B] / count.to(h.dtype).unsqueeze(-1)
    return linear(torch.cat([last_h, mean], dim=-1), p["head.weight"], p["head.bias"])


def dense_window_attention(seg: torch.Tensor) -> Callable:
    """attend() for forward_packed with SDPA and a dense [K*R, 1, T, T] mask: a position
    attends to its own window (padding forms a window of its own, so no row is all masked)."""
    rows = seg.reshape(-1, seg.shape[-1])  # [K*R, T]
    allowed = rows[:, None, :, None] == rows[:, None, None, :]

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)

    return attend
