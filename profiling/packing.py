"""Rung 8, no padding: the same OrderBookNet evaluated on windows packed into rows.

Padded batches spend the model on [B, max_len] positions of which ~a quarter are real
(measured: mean window 67 events of 256). Packed rows put several windows end to end
(profiling.workload.packed_batch); attention is block-diagonal (a position attends to its
own window only), positions count back from each window's own anchor, and pooling is per
window. Every real position sees exactly the keys and position index it sees padded, so
this is the same function of the same parameters: only float summation order changes.

The module reuses the model's own layers: no weights are copied, the optimizer and the
state dict are the model's, and predict() still runs the padded model.
"""

from __future__ import annotations

import torch
from torch import nn

from quantloop.models.orderbook import OrderBookNet


class PackedNet(nn.Module):
    """forward(x [R, T, F], pos [R, T], seg [R, T], last [B], count [B]) -> [B, n_outputs]."""

    def __init__(self, model: OrderBookNet) -> None:
        super().__init__()
        self.model = model

    def forward(
        self,
        x: torch.Tensor,
        pos: torch.Tensor,
        seg: torch.Tensor,
        last: torch.Tensor,
        count: torch.Tensor,
    ) -> torch.Tensor:
        m = self.model
        R, T, _ = x.shape
        B = last.shape[0]
        real = (seg < B).unsqueeze(-1)  # [R, T, 1]; seg == B marks padding
        x = torch.where(real, x, torch.zeros((), dtype=x.dtype, device=x.device))
        h = m.embed(x) + m.pos(pos)  # [R, T, D]
        # block-diagonal: same window (padding positions form one block of their own, so no
        # query row is ever fully masked)
        allowed = seg[:, None, :, None] == seg[:, None, None, :]  # [R, 1, T, T]
        for block in m.blocks:
            h = block(h, allowed)
        h = m.norm(h).reshape(R * T, -1)  # [R*T, D]
        last_h = h[last]  # [B, D]
        sums = torch.zeros(B + 1, h.shape[1], dtype=h.dtype, device=h.device)
        sums = sums.index_add(0, seg.reshape(-1), h)  # row B collects the padding
        mean = sums[:B] / count.to(h.dtype).unsqueeze(-1)
        return m.head(torch.cat([last_h, mean], dim=-1))


def apply_packing(model: OrderBookNet) -> PackedNet:
    """The forward module of the packed layout; `model` keeps owning the parameters."""
    return PackedNet(model)
