"""Attention that reads the STAR-KV latent cache (CPU reference of the paper's kernels).

The cache of a folded layer holds, per token, the K latent ``z_K = B_K x`` (``sum_h r_h`` numbers) and the
V latent ``z_V = B_V x`` (``r_V``). Keys are rebuilt per head, ``K_h = U_h z_{K,h}`` (+ bias), then rotated
(RoPE sits after the projection, so ``U_h`` cannot be folded into the query); values are never rebuilt:
``softmax(q K^T) V_h = U_{V,h} (softmax(q K^T) z_V)`` (+ bias, since the probabilities sum to 1), so the
joint ``U_V`` is applied once per query head after the probabilities. :func:`latent_attention` equals the
model's own attention over the reconstructed K / V (tested).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from rankwise.compress.star_kv.layers import LatentProj

Tensor = torch.Tensor

__all__ = ["LatentKVCache", "latent_attention"]


def _rotate_half(x: Tensor) -> Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


def _rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """``x``: ``(B, H, T, d)``; ``cos``/``sin``: ``(B, T, d)``."""
    return x * cos.unsqueeze(1) + _rotate_half(x) * sin.unsqueeze(1)


class LatentKVCache:
    """Per-layer K / V latents of the tokens seen so far (batch-first ``(B, T, r)``).

    Beam search and cache reordering are not supported (:meth:`reorder_cache` raises): the latents are
    meant for greedy or sampled decoding of one sequence per row.
    """

    def __init__(self) -> None:
        self.k: dict[int, Tensor] = {}
        self.v: dict[int, Tensor] = {}

    def length(self, layer: int) -> int:
        return 0 if layer not in self.k else self.k[layer].shape[1]

    def update(self, layer: int, zk: Tensor, zv: Tensor) -> tuple[Tensor, Tensor]:
        """Append the new tokens' latents; return every cached latent of the layer."""
        if layer in self.k:
            zk, zv = torch.cat([self.k[layer], zk], 1), torch.cat([self.v[layer], zv], 1)
        self.k[layer], self.v[layer] = zk, zv
        return zk, zv

    def elements(self) -> int:
        """Cached numbers (all layers, batch rows and tokens)."""
        return sum(t.numel() for t in self.k.values()) + sum(t.numel() for t in self.v.values())

    def reorder_cache(self, beam_idx: Any) -> None:
        raise NotImplementedError("STAR-KV's latent cache does not support beam search or cache reordering")


def latent_attention(attn: nn.Module, hidden_states: Tensor, rotary_emb: nn.Module, *,
                     cache: LatentKVCache | None = None, layer: int | None = None) -> Tensor:
    """The output of a Llama-style attention module ``attn`` whose ``k_proj`` / ``v_proj`` are
    :class:`LatentProj`, computed from latents (causal; ``hidden_states``: ``(B, T, D)``).

    ``rotary_emb``: the model's rotary embedding (``model.model.rotary_emb``). With ``cache``, the new
    tokens follow the ``cache.length(layer)`` cached ones (positions continue) and their latents are
    appended. Returns ``(B, T, D)`` after ``o_proj``.
    """
    k_proj, v_proj = attn.k_proj, attn.v_proj
    if not (isinstance(k_proj, LatentProj) and isinstance(v_proj, LatentProj)):
        raise TypeError("latent_attention needs folded STAR-KV projections (star_kv_freeze first)")
    if any(hasattr(attn, n) for n in ("q_norm", "k_norm")):
        raise NotImplementedError("latent_attention supports attention without query/key norms (Llama, Qwen2, "
                                  "Mistral)")
    layer = attn.layer_idx if layer is None else layer
    B, T, _ = hidden_states.shape
    d = attn.head_dim
    past = 0 if cache is None else cache.length(layer)
    zk, zv = k_proj.latent(hidden_states), v_proj.latent(hidden_states)
    if cache is not None:
        zk, zv = cache.update(layer, zk, zv)
    S = zk.shape[1]
    pos = torch.arange(S, device=hidden_states.device).expand(B, S)
    cos, sin = rotary_emb(hidden_states, pos)
    q = attn.q_proj(hidden_states).view(B, T, -1, d).transpose(1, 2)
    q = _rope(q, cos[:, past:], sin[:, past:])
    k = k_proj.reconstruct(zk).view(B, S, -1, d).transpose(1, 2)  # (B, Hkv, S, d)
    k = _rope(k, cos, sin)
    hq, hkv = q.shape[1], k.shape[1]
    rep = hq // hkv
    k = k.repeat_interleave(rep, dim=1)
    scores = (q @ k.transpose(-1, -2)) * attn.scaling
    causal = torch.ones(T, S, dtype=torch.bool, device=q.device).tril(past)
    probs = F.softmax(scores.masked_fill(~causal, float("-inf")).float(), -1).to(q.dtype)
    y = probs @ zv.unsqueeze(1)  # (B, Hq, T, r_V): the values' latent, mixed
    Uv = v_proj.up_weight().view(hkv, d, -1).repeat_interleave(rep, dim=0)  # (Hq, d, r_V)
    out = torch.einsum("bhtr,hdr->bhtd", y, Uv)
    if v_proj.factors.up.bias is not None:
        out = out + v_proj.factors.up.bias.view(hkv, 1, d).repeat_interleave(rep, dim=0)
    return attn.o_proj(out.transpose(1, 2).reshape(B, T, hq * d))
