"""Rung 8, no padding: the same OrderBookNet evaluated on windows packed into rows.

Padded batches spend the model on [B, max_len] positions of which ~a quarter are real
(measured: mean window 67 events of 256). Packed rows put several windows end to end
(profiling.workload.packed_batch); attention is block-diagonal (a position attends to its
own window only), positions count back from each window's own anchor, and pooling is per
window. Every real position sees exactly the keys and position index it sees padded, so
this is the same function of the same parameters: only float summation order changes.

The module reuses the model's own layers: no weights are copied, the optimizer and the
state dict are the model's, and predict() still runs the padded model.

Rung 9 (flex_attention) keeps the packing and changes only how attention is computed: one
FlexAttention kernel per layer and direction with a block mask built from the packing
(FlexMask), instead of SDPA with a dense [R, 1, T, T] boolean mask: blocks of the row that
no window spans are skipped, and no mask is read from memory.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from quantloop.models.orderbook import Block, OrderBookNet
from quantloop.profiling.workload import PAD_SEG

FLEX_BLOCK = 128  # FlexAttention's default sparse block: any kernel tiling divides it

# Rung 13 (flex_blocks): 64-event sparse blocks and the tiles that suit them, measured by
# bench/flex_sweep.py on the ladder's packed batches (bench/results/flex-sweep-h200.json):
# a 128-event block spans ~2-3 windows of ~67 events, so the mask visited 99% of the
# block pairs; at 64, 71%. Forward + backward per layer: 82.7 us at 128 with Inductor's
# default tiles, 64.5 us at 64 with these (max-autotune's pick; at 64 the forward has one
# valid candidate). Fixed here rather than autotuned in every run: that takes minutes.
FLEX_BLOCKS = 64
FLEX_TILES = {
    "fwd_BLOCK_M": 64, "fwd_BLOCK_N": 64, "fwd_num_stages": 3, "fwd_num_warps": 4,
    "bwd_BLOCK_M1": 32, "bwd_BLOCK_N1": 64, "bwd_BLOCK_M2": 64, "bwd_BLOCK_N2": 32,
    "bwd_num_stages": 4, "bwd_num_warps": 4,
}  # fmt: skip
MIN_HEAD_DIM = 16  # FlexAttention's Triton kernels: "NYI" below it (found with head dim 8)


def flex_layout(T: int, head_dim: int, tuned: bool) -> tuple[int, dict | None]:
    """FlexAttention's sparse block for rows of T events and heads of `head_dim`, and its
    kernels' tiles (None: Inductor's defaults).

    From bench/flex_shapes.py on the H200 (bench/results/flex-shapes-h200.json): 128-event
    blocks with the default tiles compile and match dense attention for every row length
    tried (32, 100, 200, 256: a row shorter than a block, or not a multiple of it, has a
    partial last block) and head dimensions 16-128. 64-event blocks do only for head
    dimensions up to 32 and rows of 200 or 256 (Inductor's backward checks its own default
    tiles, 128 wide from 64 up, against the block before it reads ours; rows of 100 found
    no kernel, and rows of 32 came out wrong). So rung 13's layout applies where that was
    shown, rows a multiple of 64 from 128 up, and everything else keeps rung 9's.
    """
    if tuned and 16 <= head_dim <= 32 and T >= 2 * FLEX_BLOCKS and T % FLEX_BLOCKS == 0:
        return FLEX_BLOCKS, FLEX_TILES
    return FLEX_BLOCK, None


class PackedNet(nn.Module):
    """forward(x [R, T, F], pos [R, T], seg [R, T], last [B], count [B]) -> [B, n_outputs].

    `layers` are the model's blocks (dense mask), or with flex=True each wrapped in a
    FlexBlock; either way modules of their own, so they can be compiled one by one
    (profiling.distributed: a compiled block's backward is one autograd node, and its
    gradients are ready, to be all-reduced, as soon as it has run)."""

    def __init__(
        self, model: OrderBookNet, *, flex: bool = False, tiles: dict | None = None
    ) -> None:
        """tiles: FlexAttention's kernel_options (rung 13's FLEX_TILES; None: Inductor's)."""
        super().__init__()
        self.model = model
        self.flex = flex
        self.layers = (
            nn.ModuleList(FlexBlock(b, tiles) for b in model.blocks) if flex else model.blocks
        )

    def forward(
        self,
        x: torch.Tensor,
        pos: torch.Tensor,
        seg: torch.Tensor,
        last: torch.Tensor,
        count: torch.Tensor,
        block_mask: BlockMask | None = None,
    ) -> torch.Tensor:
        """block_mask: FlexMask.update(seg)'s mask, for a PackedNet made with flex=True."""
        m = self.model
        R, T, _ = x.shape
        B = last.shape[0]
        real = (seg < B).unsqueeze(-1)  # [R, T, 1]; seg == B marks padding
        x = torch.where(real, x, torch.zeros((), dtype=x.dtype, device=x.device))
        h = m.embed(x) + m.pos(pos)  # [R, T, D]
        if self.flex:
            mask = block_mask
        else:  # block-diagonal: same window (padding positions form one block of their own,
            # so no query row is ever fully masked)
            mask = seg[:, None, :, None] == seg[:, None, None, :]  # [R, 1, T, T]
        for layer in self.layers:
            h = layer(h, mask)
        h = m.norm(h).reshape(R * T, -1)  # [R*T, D]
        last_h = h[last]  # [B, D]
        sums = torch.zeros(B + 1, h.shape[1], dtype=h.dtype, device=h.device)
        sums = sums.index_add(0, seg.reshape(-1), h)  # row B collects the padding
        mean = sums[:B] / count.to(h.dtype).unsqueeze(-1)
        return m.head(torch.cat([last_h, mean], dim=-1))


class FlexBlock(nn.Module):
    """models.orderbook.Block.forward with its attention in FlexAttention (no dropout); the
    block keeps its parameters."""

    def __init__(self, block: Block, tiles: dict | None = None) -> None:
        super().__init__()
        if block.drop.p:
            raise ValueError("FlexBlock runs without dropout; the model has dropout > 0")
        self.block = block
        self.tiles = tiles

    def forward(self, h: torch.Tensor, block_mask: BlockMask) -> torch.Tensor:
        return flex_block(self.block, h, block_mask, self.tiles)


def flex_block(
    block: Block, h: torch.Tensor, block_mask: BlockMask, tiles: dict | None = None
) -> torch.Tensor:
    a = block.attn
    R, T, D = h.shape
    q, k, v = a.qkv(block.norm1(h)).view(R, T, 3, a.n_heads, D // a.n_heads).unbind(2)
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [R, H, T, Dh]
    y = flex_attention(q, k, v, block_mask=block_mask, kernel_options=tiles)
    h = h + a.proj(y.transpose(1, 2).reshape(R, T, D))
    return h + block.mlp(block.norm2(h))


def window_blocks(seg: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Which key blocks each query block of a packed row needs: kv_num [R, 1, n] and
    kv_indices [R, 1, n, n] (int32) for n = ceil(T / block) blocks.

    Windows are contiguous runs of one seg value (padding, the tail, is one run too), so
    the keys a query block needs run from the start of the window of its first position to
    the end of the window of its last one: one contiguous range of key blocks. A partial
    last block is filled with PAD_SEG, a run of its own.
    """
    n = -(-seg.shape[1] // block)
    seg = torch.nn.functional.pad(seg, (0, n * block - seg.shape[1]), value=PAD_SEG)
    R, T = seg.shape
    pos = torch.arange(T, device=seg.device).expand(R, T)
    change = seg[:, 1:] != seg[:, :-1]  # [R, T-1]
    edge = torch.ones(R, 1, dtype=torch.bool, device=seg.device)
    w_start = torch.where(torch.cat([edge, change], 1), pos, 0).cummax(1).values
    w_end = torch.where(torch.cat([change, edge], 1), pos, T - 1).flip(1).cummin(1).values.flip(1)
    lo = w_start[:, ::block] // block  # [R, n]
    hi = w_end[:, block - 1 :: block] // block
    num = (hi - lo + 1).to(torch.int32).unsqueeze(1)
    idx = (lo.unsqueeze(-1) + torch.arange(n, device=seg.device)).clamp(max=n - 1)
    return num, idx.to(torch.int32).unsqueeze(1)


class FlexMask:
    """The block mask of one packed shape, updated in place each step.

    The BlockMask object and its tensors are made once: a compiled forward that takes it
    sees the same object every step (no recompile), and update() is a few small tensor ops
    with no host sync, so a CUDA graph can capture it. The mask is symmetric (same window),
    so the query-side block lists equal the key-side ones.
    """

    def __init__(self, rows: int, T: int, device: torch.device, block: int = FLEX_BLOCK) -> None:
        """block: the sparse block (flex_layout's); a T that it does not divide leaves each
        row a partial last block, whose positions past T the mask reads as PAD_SEG."""
        self.block, self.T = block, T
        n = -(-T // block)
        self.seg = torch.full((rows, n * block), PAD_SEG, dtype=torch.long, device=device)
        num, idx = window_blocks(self.seg[:, :T], self.block)
        seg = self.seg  # the mask reads this buffer, refilled by update()

        def same_window(b, h, q_idx, kv_idx):
            return seg[b, q_idx] == seg[b, kv_idx]

        self.block_mask = BlockMask.from_kv_blocks(
            num, idx, BLOCK_SIZE=self.block, mask_mod=same_window, seq_lengths=(T, T)
        )

    def update(
        self,
        seg: torch.Tensor,
        kv_num: torch.Tensor | None = None,
        kv_idx: torch.Tensor | None = None,
    ) -> BlockMask:
        """The mask of this batch's packing. kv_num/kv_idx: its block lists made by the
        loader (rung 12, workload.window_block_lists); without them they are computed here,
        on the device (window_blocks: ~17 small kernels a step on an H200)."""
        self.seg[:, : self.T].copy_(seg)
        if kv_num is None or kv_idx is None:
            num, idx = window_blocks(seg, self.block)
        else:
            num, idx = kv_num, kv_idx
        bm = self.block_mask
        for dst in (bm.kv_num_blocks, bm.q_num_blocks):
            dst.copy_(num)
        for dst in (bm.kv_indices, bm.q_indices):
            dst.copy_(idx)
        return bm


def apply_packing(
    model: OrderBookNet, *, flex: bool = False, tiles: dict | None = None
) -> PackedNet:
    """The forward module of the packed layout; `model` keeps owning the parameters."""
    return PackedNet(model, flex=flex, tiles=tiles)
