"""The trained model as it is served and registered: raw feature windows in, mid moves
in basis points out, the training statistics inside.

One tensor in, one out, so MLflow's PyTorch flavour (and torch.export, its default
serialization) can take it as is: a window's padding is its rows of NaN, which is
also what a missing event looks like in a feature table.
"""

from __future__ import annotations

import torch
from torch import nn

from quantloop.models.orderbook import OrderBookNet


class Predictor(nn.Module):
    """x: [B, T, F] raw features, right-aligned windows, padding rows all NaN ->
    [B, L] predicted moves in bps (float32).

    Inputs are standardized with the training statistics and clipped as in training;
    non-finite values of a real row become the mean (0 after standardizing), as there.
    """

    def __init__(
        self,
        net: OrderBookNet,
        input_mean: torch.Tensor,
        input_std: torch.Tensor,
        label_mean: torch.Tensor,
        label_std: torch.Tensor,
        clip: float,
    ) -> None:
        super().__init__()
        self.net = net
        self.register_buffer("input_mean", input_mean.float())
        self.register_buffer("input_std", input_std.float())
        self.register_buffer("label_mean", label_mean.float())
        self.register_buffer("label_std", label_std.float())
        self.clip = clip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mask = ~torch.isnan(x).all(dim=-1)  # [B, T]: a row is padding when all NaN
        z = (x - self.input_mean) / self.input_std
        z = torch.nan_to_num(z, nan=0.0, posinf=0.0, neginf=0.0).clamp(-self.clip, self.clip)
        return self.net(z, mask).float() * self.label_std + self.label_mean
