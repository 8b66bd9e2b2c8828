"""The next-scale autoregressive transformer (spec §3): block-causal attention over scales.

One tile is a sequence of ``sum_k s_k^2`` positions, scale after scale, raster order inside a scale.
The input at the positions of scale k is ``Down(f_hat_{k-1}, s_k)`` (the reconstruction from the
scales before, brought to scale k's grid; all zeros for k = 1, where the learned position and scale
embeddings act as the start token), projected to the model width. A position of scale k attends to
every position of scales 1..k (block-causal mask), so the logits of scale k depend only on tokens
of scales < k. The head gives, per position, one categorical over the alphabet for each channel;
the symbols beyond a scale's alphabet are masked out (``-inf``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from rankwise.science.arpc.config import ARPCConfig

__all__ = ["NextScaleTransformer", "block_causal_mask"]


def block_causal_mask(scales: tuple[int, ...]) -> Tensor:
    """Boolean ``(L, L)`` mask, True where attention is allowed: position i of scale a may attend to
    position j of scale b iff ``b <= a``."""
    block = torch.cat([torch.full((s * s,), k) for k, s in enumerate(scales)])
    return block[:, None] >= block[None, :]


class _Block(nn.Module):
    def __init__(self, width: int, heads: int, mlp: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.ln2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, mlp * width), nn.GELU(), nn.Linear(mlp * width, width))

    def forward(self, h: Tensor, mask: Tensor) -> Tensor:
        n, L, d = h.shape
        q, k, v = self.qkv(self.ln1(h)).view(n, L, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        h = h + self.proj(a.transpose(1, 2).reshape(n, L, d))
        return h + self.mlp(self.ln2(h))


class NextScaleTransformer(nn.Module):
    """``forward(inputs (N, L', C)) -> logits (N, L', C, V)`` for the first ``L'`` positions (a prefix
    of whole scales, or all ``L``). ``V`` is the largest alphabet; symbols past scale k's alphabet
    get ``-inf`` at scale k's positions."""

    def __init__(self, config: ARPCConfig) -> None:
        super().__init__()
        c = self.config = config
        L, d = c.positions, c.ar_width
        self.inp = nn.Linear(c.channels, d)
        self.pos = nn.Parameter(torch.randn(L, d) * 0.02)
        self.scale_emb = nn.Parameter(torch.randn(c.num_scales, d) * 0.02)
        self.blocks = nn.ModuleList(_Block(d, c.ar_heads, c.ar_mlp) for _ in range(c.ar_layers))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, c.channels * c.max_vocab)
        self.register_buffer("mask", block_causal_mask(c.scales), persistent=False)
        scale_of = torch.cat([torch.full((s * s,), k) for k, s in enumerate(c.scales)])
        self.register_buffer("scale_of", scale_of, persistent=False)
        allowed = torch.stack([torch.arange(c.max_vocab) < c.vocab(k) for k in range(c.num_scales)])
        self.register_buffer("vocab_mask", allowed[scale_of], persistent=False)  # (L, V)

    def prefix_length(self, k: int) -> int:
        """Positions of scales 1..k (1-based count ``k``)."""
        return sum(s * s for s in self.config.scales[:k])

    def forward(self, inputs: Tensor) -> Tensor:
        c = self.config
        n, L, ch = inputs.shape
        if ch != c.channels or L > c.positions:
            raise ValueError(f"inputs must have shape (N, <= {c.positions}, {c.channels}), got {tuple(inputs.shape)}")
        h = self.inp(inputs) + self.pos[:L] + self.scale_emb[self.scale_of[:L]]
        mask = self.mask[:L, :L]
        for blk in self.blocks:
            h = blk(h, mask)
        logits = self.head(self.ln(h)).view(n, L, c.channels, c.max_vocab)
        return logits.masked_fill(~self.vocab_mask[:L, None, :], float("-inf"))
