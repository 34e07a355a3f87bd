"""A small temporal transformer over a window of order-book events.

Windows are right-aligned: the last position is the current event and shorter
windows (early in a day) are left-padded, with mask False on the padding. Positions
are embedded by their distance from the current event, padded inputs are zeroed and
padded keys are never attended to, so adding or changing left padding leaves the
output of every real window unchanged. Plain modules, no data-dependent Python
control flow: torch.compile, bf16 autocast and CUDA graphs can wrap it as is.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(kw_only=True, slots=True, frozen=True)
class ModelConfig:
    n_features: int
    n_outputs: int
    d_model: int = 32
    n_layers: int = 2
    n_heads: int = 4
    ff_mult: int = 2
    dropout: float = 0.0
    max_len: int = 512  # longest window the positional table covers

    def __post_init__(self) -> None:
        for name in (
            "n_features",
            "n_outputs",
            "d_model",
            "n_layers",
            "n_heads",
            "ff_mult",
            "max_len",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.d_model % self.n_heads:
            raise ValueError(
                f"d_model ({self.d_model}) must be divisible by n_heads ({self.n_heads})"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")

    @property
    def head_dim(self) -> int:
        """Width of one attention head."""
        return self.d_model // self.n_heads


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.dropout = cfg.dropout

    def forward(self, x: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
        # x: [B, T, D]; allowed: [B, 1, T, T] bool, True = query may attend to key
        B, T, D = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.n_heads, D // self.n_heads).unbind(2)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, H, T, Dh]
        y = F.scaled_dot_product_attention(
            q, k, v, attn_mask=allowed, dropout_p=self.dropout if self.training else 0.0
        )
        return self.proj(y.transpose(1, 2).reshape(B, T, D))


class Block(nn.Module):
    """Pre-norm transformer block."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(cfg.d_model)
        self.attn = Attention(cfg)
        self.norm2 = nn.LayerNorm(cfg.d_model)
        self.mlp = nn.Sequential(
            nn.Linear(cfg.d_model, cfg.ff_mult * cfg.d_model),
            nn.GELU(),
            nn.Linear(cfg.ff_mult * cfg.d_model, cfg.d_model),
        )
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
        x = x + self.drop(self.attn(self.norm1(x), allowed))
        return x + self.drop(self.mlp(self.norm2(x)))


class OrderBookNet(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Linear(cfg.n_features, cfg.d_model)
        # row i embeds "i events before the current one", so left padding never shifts it
        self.pos = nn.Embedding(cfg.max_len, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = nn.LayerNorm(cfg.d_model)
        # pooled = [last position, masked mean] -> outputs
        self.head = nn.Linear(2 * cfg.d_model, cfg.n_outputs)
        self.apply(_init_weights)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        # x: [B, T, F] float; mask: [B, T] bool, True = real event, last position real
        B, T, _ = x.shape
        if T > self.cfg.max_len:
            raise ValueError(f"window length {T} exceeds max_len {self.cfg.max_len}")
        if mask is None:
            mask = torch.ones(B, T, dtype=torch.bool, device=x.device)
        m = mask.unsqueeze(-1)  # [B, T, 1]
        # zero padded inputs so NaN/garbage there cannot reach real positions (0 * NaN = NaN)
        x = torch.where(m, x, torch.zeros((), dtype=x.dtype, device=x.device))
        distance = torch.arange(T - 1, -1, -1, device=x.device)  # [T]
        h = self.embed(x) + self.pos(distance)  # [B, T, D]
        # keys must be real; the diagonal is always allowed so padded query rows never see an
        # all-masked row (NaN softmax) -- their outputs are discarded by the pooling anyway
        eye = torch.eye(T, dtype=torch.bool, device=x.device)
        allowed = (mask[:, None, None, :] | eye).expand(B, 1, T, T)  # [B, 1, T, T]
        for block in self.blocks:
            h = block(h, allowed)
        h = self.norm(h)
        last = h[:, -1]  # [B, D]
        zero = torch.zeros((), dtype=h.dtype, device=h.device)
        count = m.sum(1).clamp(min=1).to(h.dtype)  # [B, 1]
        mean = torch.where(m, h, zero).sum(1) / count  # [B, D]
        return self.head(torch.cat([last, mean], dim=-1))  # [B, n_outputs]


def _init_weights(module: nn.Module) -> None:
    # nanoGPT-style: small normal weights, zero biases; driven by torch's global RNG, so
    # torch.manual_seed(seed) before construction gives identical weights
    if isinstance(module, nn.Linear):
        nn.init.normal_(module.weight, std=0.02)
        if module.bias is not None:
            nn.init.zeros_(module.bias)
    elif isinstance(module, nn.Embedding):
        nn.init.normal_(module.weight, std=0.02)
