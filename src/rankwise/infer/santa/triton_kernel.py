"""The tiled systematic SANTA decode as Triton kernels (optional: ``pip install rankwise[gpu]``).

Two kernels in the FlashDecoding split-K layout, one program per (batch row x query head, tile):

* pass 1 (``_scores_kernel``): scores of the tile in fp32, tile max ``m_t``, ``l_t = sum exp(s_i - m_t)``,
  and the stash ``u_i = exp(s_i - m_t)``;
* budgets (torch, a few ops on ``[B*H, T]``): ``P_t = l_t exp(m_t - m*) / Z``, ``S_t`` fixed or
  proportional, and the per-tile offsets ``a_t`` hashed exactly as the torch reference
  (:func:`rankwise.infer.santa.sampling.hashed_uniforms`), so that kernel and reference draw the same counts;
* pass 2 (``_sample_kernel``): ``x_i = u_i S_t / l_t``, its running sum ``C`` (``tl.cumsum``), counts
  ``c_i = floor(a_t + C_i) - floor(a_t + C_i - x_i)``, then a *masked* load of the value rows with
  ``c_i > 0`` (rows with no count are never read) and the partial ``(P_t / S_t) sum_i c_i v_i``.

The partials ``[B*H, T, d]`` are summed in torch (deterministic, instead of the spec's atomic adds).
Triton is imported inside functions; kernels are built on first use. On CPU the kernels run under
``TRITON_INTERPRET=1`` (set before triton's first import), which is how the tests check them.
Written for Triton >= 3.6 (only ``tl.load/store``, ``tl.max/sum/cumsum``, ``tl.exp``, casts); it has
not been run on a GPU in this repository (see docs/methods/santa.md).
"""

from __future__ import annotations

import math
from functools import lru_cache
from typing import Any

import torch

from rankwise.core.validate import check_choice, check_int
from rankwise.infer.santa.config import BUDGETS
from rankwise.infer.santa.sampling import check_decode_inputs, hashed_uniforms, tile_budgets


@lru_cache(maxsize=1)
def _kernels() -> tuple[Any, Any]:
    import triton
    import triton.language as tl

    @triton.jit
    def scores_kernel(q_ptr, k_ptr, len_ptr, u_ptr, m_ptr, l_ptr, n, H, Hkv, G, d, T, scale,
                      BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
        r = tl.program_id(0)  # b * H + h
        t = tl.program_id(1)
        b = r // H
        h = r % H
        kvh = h // G
        length = tl.load(len_ptr + b)
        rows = t * BLOCK_N + tl.arange(0, BLOCK_N)
        cols = tl.arange(0, BLOCK_D)
        rmask = rows < length
        cmask = cols < d
        q = tl.load(q_ptr + r * d + cols, mask=cmask, other=0.0).to(tl.float32)
        kp = k_ptr + ((b * n + rows[:, None]) * Hkv + kvh) * d + cols[None, :]
        k = tl.load(kp, mask=rmask[:, None] & cmask[None, :], other=0.0).to(tl.float32)
        s = tl.sum(k * q[None, :], axis=1) * scale
        s = tl.where(rmask, s, float("-inf"))
        m = tl.max(s, axis=0)
        m_safe = tl.where(m == float("-inf"), 0.0, m)
        u = tl.where(rmask, tl.exp(s - m_safe), 0.0)
        tl.store(u_ptr + r * (T * BLOCK_N) + rows, u)
        tl.store(m_ptr + r * T + t, m)
        tl.store(l_ptr + r * T + t, tl.sum(u, axis=0))

    @triton.jit
    def sample_kernel(v_ptr, u_ptr, st_ptr, a_ptr, w_ptr, part_ptr, nread_ptr, n, H, Hkv, G, d, T,
                      BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
        r = tl.program_id(0)
        t = tl.program_id(1)
        b = r // H
        h = r % H
        kvh = h // G
        rows = t * BLOCK_N + tl.arange(0, BLOCK_N)
        cols = tl.arange(0, BLOCK_D)
        cmask = cols < d
        St = tl.load(st_ptr + r * T + t).to(tl.float32)
        a = tl.load(a_ptr + r * T + t)
        w = tl.load(w_ptr + r * T + t)
        u = tl.load(u_ptr + r * (T * BLOCK_N) + rows)
        cum = tl.cumsum(u, axis=0)
        tot = tl.max(cum, axis=0)  # the running sum's last value (u >= 0)
        tot_safe = tl.where(tot > 0, tot, 1.0)
        # C_i = S_t F_i, snapped to exactly S_t from the last row with mass on, so counts sum to S_t
        c_hi = tl.where(cum >= tot, St, cum / tot_safe * St)
        c_lo = tl.where(cum - u >= tot, St, (cum - u) / tot_safe * St)
        c_lo = tl.maximum(c_lo, 0.0)
        cnt = (a + c_hi).to(tl.int32) - (a + c_lo).to(tl.int32)  # floor: both arguments are >= 0
        take = (cnt > 0) & (rows < n)
        vp = v_ptr + ((b * n + rows[:, None]) * Hkv + kvh) * d + cols[None, :]
        v = tl.load(vp, mask=take[:, None] & cmask[None, :], other=0.0).to(tl.float32)
        acc = tl.sum(v * cnt.to(tl.float32)[:, None], axis=0) * w
        tl.store(part_ptr + (r * T + t) * d + cols, acc, mask=cmask)
        tl.store(nread_ptr + r * T + t, tl.sum(take.to(tl.int32), axis=0))

    return scores_kernel, sample_kernel


def santa_decode_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, num_samples: int = 64,
                        tile_size: int = 256, budget: str = "fixed", *, seed: int = 0, step: int = 0,
                        lengths: torch.Tensor | None = None, scale: float | None = None,
                        return_info: bool = False):
    """Tiled systematic SANTA with the Triton kernels; the same arguments as :func:`santa_decode`.

    ``tile_size`` must be a power of two (the kernel's block); ``lengths [B]`` (int) gives the valid
    prefix of each batch row's cache (None: all n rows). The counts equal those of
    ``santa_decode(..., scheme="systematic", tile_size=tile_size, budget=budget, seed=seed, step=step)``
    up to float rounding of the running sums. ``return_info`` adds ``{"rows_read": [B, H]}``.
    """
    import triton

    check_int("num_samples", num_samples, 1)
    check_int("tile_size", tile_size, 1)
    check_choice("budget", budget, BUDGETS)
    if tile_size & (tile_size - 1):
        raise ValueError(f"tile_size must be a power of two for the Triton kernel, got {tile_size}")
    B, H, Hkv, n, d = check_decode_inputs(q, k_cache, v_cache, who="santa_decode_triton")
    dev = q.device
    if lengths is None:
        lengths = torch.full((B,), n, dtype=torch.int32, device=dev)
    lengths = lengths.to(device=dev, dtype=torch.int32)
    if lengths.shape != (B,) or int(lengths.min()) < 1 or int(lengths.max()) > n:
        raise ValueError(f"lengths must be [B] = [{B}] with values in 1..{n}, got {lengths.tolist()}")
    if not torch.isfinite(q).all():
        raise ValueError("santa_decode_triton: q holds NaN or Inf")
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    L = min(tile_size, triton.next_power_of_2(n))
    T = -(-n // L)
    BD = triton.next_power_of_2(d)
    R = B * H
    qc, kc, vc = q.contiguous(), k_cache.contiguous(), v_cache.contiguous()
    u = torch.empty(R, T * L, dtype=torch.float32, device=dev)
    m = torch.empty(R, T, dtype=torch.float32, device=dev)
    lt = torch.empty(R, T, dtype=torch.float32, device=dev)
    scores_kernel, sample_kernel = _kernels()
    warps = 8 if L * BD >= 128 * 64 else 4  # a 256 x 128 tile in registers wants more than 4 warps
    scores_kernel[(R, T)](qc, kc, lengths, u, m, lt, n, H, Hkv, H // Hkv, d, T, scale, BLOCK_N=L, BLOCK_D=BD,
                          num_warps=warps)
    if not (torch.isfinite(lt).all() and torch.isfinite(m[lt > 0]).all()):
        raise ValueError("santa_decode_triton: k_cache (or q) holds NaN or Inf")
    # budgets: global max, tile masses, S_t, offsets (the reference's hash), weights P_t / S_t
    mstar = m.amax(-1, keepdim=True)
    W = torch.where(lt > 0, lt * torch.exp(m - mstar), 0.0)
    P = W / W.sum(-1, keepdim=True)
    if T == 1:
        St = torch.where(P > 0, num_samples, 0).to(torch.int64)
    else:
        St = tile_budgets(P, num_samples, budget)
    rows = torch.arange(R, device=dev).view(R, 1)
    tiles = torch.arange(T, device=dev).view(1, T)
    a = hashed_uniforms(seed, step, rows, tiles, torch.zeros(1, 1, dtype=torch.int64, device=dev)).float()
    w = torch.where(St > 0, P / St.clamp_min(1).float(), 0.0).float().contiguous()
    part = torch.empty(R, T, d, dtype=torch.float32, device=dev)
    nread = torch.empty(R, T, dtype=torch.int32, device=dev)
    sample_kernel[(R, T)](vc, u, St.to(torch.int32).contiguous(), a.contiguous(), w, part, nread, n, H, Hkv,
                          H // Hkv, d, T, BLOCK_N=L, BLOCK_D=BD, num_warps=warps)
    out = part.sum(1).view(B, H, d).to(q.dtype)
    if return_info:
        return out, {"rows_read": nread.sum(-1).view(B, H), "budgets": St.view(B, H, T)}
    return out
