"""Rung 5: one fused kernel for the step's elementwise tail: AdamW + gradient norms.

What is left after compiling the model is the optimizer and the norm logging: PyTorch's
foreach AdamW reads and writes every parameter, gradient and both moments in about a dozen
multi-tensor kernels per step, and the norms read every gradient once more. Here all
parameters live in one flat float32 buffer (each parameter starting on a CHUNK boundary,
`p.data` and `p.grad` are views into it), and one Triton program per CHUNK reads p, g, m,
v once, writes p, m, v once, and writes the chunk's sum of g**2 into the metric ring's
current row (the host adds the chunks of a parameter and takes the square root).

The step count (float64: see bias_correction) and the ring slot live in device memory,
so the kernel is capturable in a CUDA graph. `adamw_reference` is the same arithmetic in
PyTorch ops: the CPU path and the kernel's test oracle.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import nn

CHUNK = 1024

try:  # Triton ships with CUDA builds of PyTorch; CPU builds and CI have none
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None

if triton is not None:

    @triton.jit
    def _adamw_norm_kernel(
        p_ptr, g_ptr, m_ptr, v_ptr, coef_ptr, ring_ptr, slot_ptr,
        ring_stride, col0, beta1, beta2, eps, decay,
        CHUNK: tl.constexpr,
    ):  # fmt: skip
        pid = tl.program_id(0)
        offs = pid * CHUNK + tl.arange(0, CHUNK)
        p = tl.load(p_ptr + offs)
        g = tl.load(g_ptr + offs)
        m = tl.load(m_ptr + offs)
        v = tl.load(v_ptr + offs)
        step_size = tl.load(coef_ptr)  # lr / (1 - beta1^t), from float64
        bc2_sqrt = tl.load(coef_ptr + 1)  # sqrt(1 - beta2^t), from float64
        p = p * decay
        m = m + (1.0 - beta1) * (g - m)  # torch's lerp for a weight < 0.5
        v = v * beta2 + (1.0 - beta2) * g * g
        denom = tl.div_rn(tl.sqrt_rn(v), bc2_sqrt) + eps
        p = p - step_size * tl.div_rn(m, denom)
        tl.store(p_ptr + offs, p)
        tl.store(m_ptr + offs, m)
        tl.store(v_ptr + offs, v)
        slot = tl.load(slot_ptr)
        tl.store(ring_ptr + slot * ring_stride + col0 + pid, tl.sum(g * g, axis=0))


def bias_correction(step: torch.Tensor, *, lr: float, betas: tuple[float, float]) -> torch.Tensor:
    """[lr / (1 - beta1^t), sqrt(1 - beta2^t)] as float32, computed in float64 on the device.

    In float32, 1 - 0.999^t loses ~1e-5 of relative precision at t = 1 (0.999 is not a
    float32 number): PyTorch's non-capturable AdamW does this in Python floats, so do we.
    `step` is a float64 scalar tensor; no host sync, so it can be captured.
    """
    beta1, beta2 = betas
    bc1 = 1.0 - torch.pow(beta1, step)
    bc2 = 1.0 - torch.pow(beta2, step)
    return torch.stack((lr / bc1, bc2.sqrt())).float()


def adamw_reference(
    p: torch.Tensor,
    g: torch.Tensor,
    m: torch.Tensor,
    v: torch.Tensor,
    coef: torch.Tensor,
    *,
    lr: float,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
) -> torch.Tensor:
    """In place on flat p, m, v (numel a multiple of CHUNK), with coef = bias_correction(t);
    returns [numel/CHUNK] sum of g**2 per chunk. Same operations as torch.optim.AdamW."""
    beta1, beta2 = betas
    p.mul_(1.0 - lr * weight_decay)
    m.lerp_(g, 1.0 - beta1)
    v.mul_(beta2).addcmul_(g, g, value=1.0 - beta2)
    denom = (v.sqrt() / coef[1]).add_(eps)
    p.sub_(coef[0] * (m / denom))
    return (g * g).view(-1, CHUNK).sum(1)


class FusedAdamW:
    """AdamW (PyTorch's semantics, weight decay on every parameter) over a flat buffer."""

    def __init__(
        self,
        model: nn.Module,
        *,
        lr: float,
        weight_decay: float,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        use_triton: bool | None = None,
        handoff: bool = False,
    ) -> None:
        """handoff (rung 10, flat_grads): backward hands each gradient over as a fresh tensor
        (zero_grad sets p.grad to None) and step() copies them into the flat buffer with one
        multi-tensor copy, instead of backward accumulating into views of the flat buffer
        (one add kernel per parameter, after a memset)."""
        params = list(model.parameters())
        self.params, self.handoff = params, handoff
        device = params[0].device
        self.use_triton = (
            (device.type == "cuda" and triton is not None) if use_triton is None else use_triton
        )
        if self.use_triton and triton is None:
            raise ValueError("use_triton=True but triton is not installed")
        self.lr, self.weight_decay, self.betas, self.eps = lr, weight_decay, betas, eps
        spans = [math.ceil(p.numel() / CHUNK) * CHUNK for p in params]
        total = sum(spans)
        self.param = torch.zeros(total, device=device)
        self.grad = torch.zeros(total, device=device)
        self.exp_avg = torch.zeros(total, device=device)
        self.exp_avg_sq = torch.zeros(total, device=device)
        offset = 0
        self.grad_views: list[torch.Tensor] = []
        for p, span in zip(params, spans, strict=True):
            n = p.numel()
            self.param[offset : offset + n].copy_(p.detach().reshape(-1))
            p.data = self.param[offset : offset + n].view_as(p)
            self.grad_views.append(self.grad[offset : offset + n].view_as(p))
            p.grad = self.grad_views[-1]  # backward accumulates in place (without handoff)
            offset += span
        self.chunk_owner = np.repeat(np.arange(len(params)), np.asarray(spans) // CHUNK)
        self.n_chunks = total // CHUNK
        self.step_count = torch.zeros((), dtype=torch.float64, device=device)
        self._ring: torch.Tensor | None = None
        self._slot: torch.Tensor | None = None
        self._col0 = 0

    def log_into(self, ring: torch.Tensor, slot: torch.Tensor, col0: int) -> None:
        """Write each step's per-chunk sum of g**2 to ring[slot, col0 : col0 + n_chunks]."""
        if ring.shape[1] < col0 + self.n_chunks or not ring.is_contiguous():
            raise ValueError(f"ring {tuple(ring.shape)} has no room for {self.n_chunks} chunks")
        self._ring, self._slot, self._col0 = ring, slot, col0

    def zero_grad(self, set_to_none: bool = False) -> None:
        if self.handoff:
            for p in self.params:
                p.grad = None  # AccumulateGrad then keeps backward's tensor: no add kernel
        else:
            self.grad.zero_()  # one memset; the views stay the parameters' .grad

    def step(self) -> torch.Tensor | None:
        if self.handoff:
            # a parameter backward did not reach has no gradient: zero, as accumulation gives
            grads = [g if (g := p.grad) is not None else torch.zeros_like(p) for p in self.params]
            torch._foreach_copy_(self.grad_views, grads)
        self.step_count.add_(1)
        beta1, beta2 = self.betas
        coef = bias_correction(self.step_count, lr=self.lr, betas=self.betas)
        if self.use_triton:
            if self._ring is None:
                raise RuntimeError("call log_into() before step() on the Triton path")
            _adamw_norm_kernel[(self.n_chunks,)](
                self.param, self.grad, self.exp_avg, self.exp_avg_sq, coef,
                self._ring, self._slot, self._ring.stride(0), self._col0,
                beta1, beta2, self.eps, 1.0 - self.lr * self.weight_decay,
                CHUNK=CHUNK, num_warps=4,
            )  # fmt: skip
            return None
        sumsq = adamw_reference(
            self.param, self.grad, self.exp_avg, self.exp_avg_sq, coef,
            lr=self.lr, betas=self.betas, eps=self.eps, weight_decay=self.weight_decay,
        )  # fmt: skip
        if self._ring is not None:
            self._ring[:, self._col0 : self._col0 + self.n_chunks].index_copy_(
                0, self._slot, sumsq.unsqueeze(0)
            )
        return sumsq


def check_kernel(
    device: torch.device, sizes: tuple[int, ...] = (1, 1000, 70_000), steps: int = 3
) -> float:
    """Max relative error of the Triton path against the reference, fresh random inputs.

    Returns the largest ||out - ref|| / ||ref|| over sizes, steps and outputs (the
    parameters, the second moment and the per-chunk sums of squares); inf on a NaN, and
    the ring starts poisoned with NaN, so an unwritten chunk fails.
    """
    worst = 0.0
    for n in sizes:
        torch.manual_seed(n)
        model = nn.Linear(n, 1, bias=True).to(device)
        twin = nn.Linear(n, 1, bias=True).to(device)
        twin.load_state_dict(model.state_dict())
        fused = FusedAdamW(model, lr=1e-3, weight_decay=1e-2, use_triton=True)
        ref = FusedAdamW(twin, lr=1e-3, weight_decay=1e-2, use_triton=False)
        ring = torch.full((2, fused.n_chunks), float("nan"), device=device)  # poisoned
        slot = torch.ones(1, dtype=torch.long, device=device)
        fused.log_into(ring, slot, 0)
        for _ in range(steps):
            g = torch.randn(fused.grad.shape, device=device)
            fused.grad.copy_(g)
            ref.grad.copy_(g)
            fused.step()
            sumsq = ref.step()
            torch.cuda.synchronize(device)
            for a, b in (
                (fused.param, ref.param),
                (fused.exp_avg_sq, ref.exp_avg_sq),
                (ring[1], sumsq),
            ):
                if not torch.isfinite(a).all():
                    return float("inf")
                worst = max(worst, float((a - b).norm() / b.norm().clamp(min=1e-30)))
    return worst
