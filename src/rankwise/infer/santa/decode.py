"""Decode attention: SANTA's sampled estimator, exact SDPA and the top-k baseline, with a rows-read counter."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from rankwise.core.validate import check_bool, check_choice, check_int
from rankwise.infer.santa.config import BUDGETS, SCHEMES, SantaConfig
from rankwise.infer.santa.sampling import (
    check_decode_inputs,
    gather_rows,
    resolve_seed,
    sample_counts,
    scores,
    ternary_query,
)


@dataclass
class SantaInfo:
    """What one decode call read.

    ``rows_read [B, H]``: value rows with a nonzero count per query head (SANTA's "vrows");
    ``kv_rows_read [B, H_kv]``: distinct rows of each KV head read by its group of query heads;
    ``rows_valid [B]``: valid cache rows n; ``key_features_read [B, H]``: key columns the score stage
    reads per row (d, or the nonzeros of the ternary query); ``counts [B, H, n]`` and ``budgets [B, H, T]``
    (None for dense / top-k); ``seed``: the base seed the call used.
    """

    rows_read: torch.Tensor
    kv_rows_read: torch.Tensor
    rows_valid: torch.Tensor
    key_features_read: torch.Tensor
    counts: torch.Tensor | None = None
    budgets: torch.Tensor | None = None
    seed: int | None = None

    def value_bytes(self, head_dim: int, bytes_per_element: int) -> int:
        """Value-cache bytes read (distinct KV rows x head_dim x element size), summed over the batch."""
        return int(self.kv_rows_read.sum()) * head_dim * bytes_per_element


def _valid(mask: torch.Tensor | None, B: int, Q: int, n: int, device: torch.device) -> torch.Tensor | None:
    return None if mask is None else mask.view(B, Q, n)


def santa_core(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, valid: torch.Tensor | None,
               config: SantaConfig, seed: int, step: int, scale: float,
               keep_counts: bool = False) -> tuple[torch.Tensor, SantaInfo]:
    """SANTA for ``q [B, Q, H, d]`` (Q query positions per batch row) and ``valid [B, Q, n]`` (or None).

    Returns ``(out [B, Q, H, d] in q's dtype, info)`` (info's tensors carry the Q axis: ``[B, Q, H]``).
    """
    B, Q, H, d = q.shape
    n, Hkv = k_cache.shape[1], k_cache.shape[2]
    R = B * Q * H
    row_ids = torch.arange(R, device=q.device)
    qs = q
    if config.ternary_query:
        qs = ternary_query(q, config.tau, seed=seed, step=step, row_ids=row_ids.view(B, Q, H))
    feats = (qs != 0).sum(-1) if config.ternary_query else torch.full((B, Q, H), d, device=q.device)
    s = scores(qs, k_cache, scale, valid)  # fp32 [B, Q, H, n], -inf where masked
    if config.scheme == "topk":
        return _topk_core(s, v_cache, config.num_samples, valid, feats, q.dtype)
    p = torch.softmax(s, dim=-1)
    sc = sample_counts(p.view(R, n), config.num_samples, config.scheme, config.tile_size, config.budget,
                       seed=seed, step=step, row_ids=row_ids)
    counts = sc.counts.view(B, Q, H, n)
    nz = counts > 0
    m = max(int(nz.sum(-1).max()), 1)
    order = torch.argsort((~nz).to(torch.int8), dim=-1, stable=True)[..., :m]  # rows with c > 0 first
    cw = (sc.counts.to(torch.float32) * sc.weights).view(B, Q, H, n).gather(-1, order)
    rows = gather_rows(v_cache, order, H)  # [B, Q, H, m, d]: only the sampled rows (padding has weight 0)
    out = (cw.unsqueeze(-1) * rows).sum(-2)
    info = SantaInfo(
        rows_read=nz.sum(-1),
        kv_rows_read=nz.view(B, Q, Hkv, H // Hkv, n).any(3).sum(-1),
        rows_valid=(torch.full((B, Q), n, device=q.device) if valid is None else valid.sum(-1)),
        key_features_read=feats,
        counts=counts if keep_counts else None,
        budgets=sc.budgets.view(B, Q, H, -1) if keep_counts else None,
        seed=seed,
    )
    return out.to(q.dtype), info


def _topk_core(s: torch.Tensor, v_cache: torch.Tensor, k: int, valid: torch.Tensor | None, feats: torch.Tensor,
               dtype: torch.dtype) -> tuple[torch.Tensor, SantaInfo]:
    B, Q, H, n = s.shape
    Hkv = v_cache.shape[2]
    top, idx = s.topk(min(k, n), dim=-1)
    w = torch.softmax(top, dim=-1)  # masked (-inf) entries get weight 0
    out = (w.unsqueeze(-1) * gather_rows(v_cache, idx, H)).sum(-2)
    used = torch.isfinite(top)
    hit = torch.zeros(B, Q, H, n, dtype=torch.bool, device=s.device).scatter_(-1, idx, used)
    info = SantaInfo(rows_read=used.sum(-1), kv_rows_read=hit.view(B, Q, Hkv, H // Hkv, n).any(3).sum(-1),
                     rows_valid=(torch.full((B, Q), n, device=s.device) if valid is None else valid.sum(-1)),
                     key_features_read=feats)
    return out.to(dtype), info


def _squeeze_info(info: SantaInfo) -> SantaInfo:
    f = (lambda t: None if t is None else t[:, 0])
    return SantaInfo(f(info.rows_read), f(info.kv_rows_read), f(info.rows_valid), f(info.key_features_read),
                     f(info.counts), f(info.budgets), info.seed)


def santa_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, num_samples: int = 64,
                 scheme: str = "systematic", tile_size: int | None = None, budget: str = "fixed",
                 generator: torch.Generator | None = None, *, seed: int | None = None, step: int = 0,
                 mask: torch.Tensor | None = None, scale: float | None = None, ternary: bool = False,
                 tau: float | None = None, return_info: bool = False):
    """One decode step of sampled attention: ``o_hat ~ softmax(q K^T * scale) V`` from S value rows.

    ``q [B, H, d]``, ``k_cache`` / ``v_cache [B, n, H_kv, d]`` (GQA: head h reads KV head h // (H / H_kv)),
    ``mask [B, n]`` bool (True = valid row; None = all valid). Scores and softmax in fp32, output in
    q's dtype. ``scheme``, ``tile_size``, ``budget``, ``ternary`` / ``tau``: see :class:`SantaConfig`.
    Seeding: ``seed`` (else one draw from ``generator``, else torch's global RNG) and ``step``; each
    (seed, step, batch row, head, tile) has its own uniform stream. ``num_samples`` > n is allowed
    (at most n rows are read). ``return_info=True`` returns ``(out, SantaInfo)``.
    Raises ``ValueError`` on shape mismatches, H not divisible by H_kv, n = 0, an all-masked row, NaN/Inf
    in q or K, num_samples < 1, and a generator on another device.
    """
    check_int("num_samples", num_samples, 1)
    check_choice("scheme", scheme, SCHEMES)
    check_choice("budget", budget, BUDGETS)
    check_bool("return_info", return_info)
    B, H, Hkv, n, d = check_decode_inputs(q, k_cache, v_cache, mask, generator)
    config = SantaConfig(num_samples=num_samples, scheme=scheme, tile_size=tile_size, budget=budget,
                         ternary_query=ternary, tau=tau)
    s0 = resolve_seed(seed, generator)
    check_int("step", step, 0)
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    out, info = santa_core(q.unsqueeze(1), k_cache, v_cache, _valid(mask, B, 1, n, q.device), config, s0, step,
                           scale, keep_counts=return_info)
    out = out[:, 0]
    return (out, _squeeze_info(info)) if return_info else out


def dense_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, *, mask: torch.Tensor | None = None,
                 scale: float | None = None) -> torch.Tensor:
    """Exact decode attention with ``torch.nn.functional.scaled_dot_product_attention`` (GQA), fp32 inside."""
    B, H, Hkv, n, d = check_decode_inputs(q, k_cache, v_cache, mask, who="dense_decode")
    qq = q.float().unsqueeze(2)  # [B, H, 1, d]
    kk = k_cache.float().transpose(1, 2)  # [B, H_kv, n, d]
    vv = v_cache.float().transpose(1, 2)
    am = None if mask is None else mask.view(B, 1, 1, n)
    out = torch.nn.functional.scaled_dot_product_attention(qq, kk, vv, attn_mask=am, scale=scale,
                                                           enable_gqa=H != Hkv)
    return out[:, :, 0].to(q.dtype)


def topk_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, k: int, *,
                mask: torch.Tensor | None = None, scale: float | None = None, return_info: bool = False):
    """The biased top-k baseline: keep the k largest ``p_i``, renormalise, sum those value rows."""
    check_int("k", k, 1)
    B, H, Hkv, n, d = check_decode_inputs(q, k_cache, v_cache, mask, who="topk_decode")
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    out, info = santa_core(q.unsqueeze(1), k_cache, v_cache, _valid(mask, B, 1, n, q.device),
                           SantaConfig(num_samples=k, scheme="topk"), 0, 0, scale)
    return (out[:, 0], _squeeze_info(info)) if return_info else out[:, 0]


def iid_mse(p: torch.Tensor, v: torch.Tensor, num_samples: int) -> torch.Tensor:
    """Closed-form MSE of i.i.d. SANTA (spec §1): ``(sum_i p_i |v_i|^2 - |o|^2) / S`` for ``p [..., n]``, ``v [..., n, d]``."""
    o = (p.unsqueeze(-1) * v).sum(-2)
    return ((p * (v * v).sum(-1)).sum(-1) - (o * o).sum(-1)) / num_samples
