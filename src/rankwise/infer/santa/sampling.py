"""The torch reference of SANTA / S²ANTA: sampled value rows instead of a dense ``p^T V``.

Notation of the spec (one head, one decode step): ``s = q K^T * scale``, ``p = softmax(s)``, exact output
``o = p^T V``. The estimators draw integer counts ``c`` with ``E[c_i] = S_t p_i / P_t`` inside each tile
``t`` (one tile when untiled) and return ``o_hat = sum_t (P_t / S_t) sum_{i in t} c_i V_i``, which is
unbiased (spec §1-§4). Only rows with ``c_i > 0`` are gathered from the value cache.

Randomness is counter-based: every uniform is a splitmix64 hash of (seed, step, row, tile, sample), so a
head's draw does not depend on the batch it is computed in, and the Triton kernel can be fed exactly
the offsets of this reference.

Shapes: ``q [B, H, d]``, ``k_cache`` / ``v_cache`` ``[B, n, H_kv, d]`` (GQA: ``H = G * H_kv``; query head
``h`` reads KV head ``h // G``), optional ``mask [B, n]`` (True = a valid row). Internally queries carry
an extra query-position axis ``Q`` (a patched model's teacher-forced window) and are flattened to
``R = B * Q * H`` sampling rows.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from rankwise.core.validate import check_choice, check_int
from rankwise.infer.santa.config import BUDGETS, SCHEMES

_MASK64 = (1 << 64) - 1


def _signed(c: int) -> int:
    c &= _MASK64
    return c - (1 << 64) if c >= (1 << 63) else c


_GOLDEN = _signed(0x9E3779B97F4A7C15)
_M1 = _signed(0xBF58476D1CE4E5B9)
_M2 = _signed(0x94D049BB133111EB)


def _srl(z: torch.Tensor, k: int) -> torch.Tensor:
    # logical right shift of int64 (torch's >> is arithmetic)
    return (z >> k) & ((1 << (64 - k)) - 1)


def splitmix64(z: torch.Tensor) -> torch.Tensor:
    """splitmix64 finaliser on int64 tensors (two's-complement wrap-around arithmetic)."""
    z = z + _GOLDEN
    z = (z ^ _srl(z, 30)) * _M1
    z = (z ^ _srl(z, 27)) * _M2
    return z ^ _srl(z, 31)


def hashed_uniforms(seed: int, step: int, rows: torch.Tensor, tiles: torch.Tensor,
                    samples: torch.Tensor) -> torch.Tensor:
    """Uniforms in [0, 1) (float64), one per broadcast element of ``rows x tiles x samples`` (int64).

    ``u = splitmix64(... splitmix64(splitmix64(seed) ^ step) ^ row ...)`` with 53 mantissa bits: the
    stream of (seed, step, row, tile, sample) is fixed, whatever else is computed alongside.
    """
    dev = rows.device
    z = splitmix64(torch.tensor(_signed(seed), dtype=torch.int64, device=dev))
    z = splitmix64(z ^ _signed(step))
    z = splitmix64(z ^ rows)
    z = splitmix64(z ^ tiles)
    z = splitmix64(z ^ samples)
    return _srl(z, 11).to(torch.float64) * (2.0 ** -53)


@dataclass
class SampleCounts:
    """What :func:`sample_counts` draws for ``R`` rows over ``n`` keys in ``T`` tiles.

    ``counts [R, n]`` (int64; sum over a tile = its budget), ``weights [R, n]`` (float32: the factor
    ``P_t / S_t`` of each row's tile; 0 where a tile has no budget), ``budgets [R, T]`` (int64 S_t),
    ``tile_mass [R, T]`` (float32 P_t).
    """

    counts: torch.Tensor
    weights: torch.Tensor
    budgets: torch.Tensor
    tile_mass: torch.Tensor


def tile_budgets(tile_mass: torch.Tensor, num_samples: int, budget: str) -> torch.Tensor:
    """Per-tile budgets S_t ``[R, T]`` (int64) from the tile masses ``P_t`` ``[R, T]`` (rows sum to 1).

    ``"fixed"``: ceil(S / T) for every tile with mass (the official "flash" kernel gives S / T; the
    ceiling keeps every tile sampled, so the estimator stays unbiased when T does not divide S).
    ``"proportional"``: largest-remainder rounding of ``S * P_t`` (sums to S), then at least 1 for any
    tile with ``P_t > 0`` (spec §4: otherwise the estimator is biased), so the total may exceed S by
    at most the number of such tiles. Tiles without mass get 0.
    """
    check_choice("budget", budget, BUDGETS)
    has = tile_mass > 0
    T = tile_mass.shape[-1]
    if budget == "fixed":
        return torch.where(has, -(-num_samples // T), 0).to(torch.int64)
    x = tile_mass.double() * num_samples
    base = torch.floor(x)
    short = (num_samples - base.sum(-1, keepdim=True)).round().to(torch.int64)  # rows still to hand out
    frac = x - base
    order = torch.argsort(frac, dim=-1, descending=True, stable=True)
    rank = torch.empty_like(order).scatter_(-1, order, torch.arange(T, device=order.device).expand_as(order))
    extra = (rank < short).to(torch.int64)
    out = base.to(torch.int64) + extra
    return torch.where(has, out.clamp_min(1), 0)


def sample_counts(p: torch.Tensor, num_samples: int, scheme: str = "systematic", tile_size: int | None = None,
                  budget: str = "fixed", seed: int = 0, step: int = 0,
                  row_ids: torch.Tensor | None = None) -> SampleCounts:
    """Integer counts ``c [R, n]`` for the rows of ``p [R, n]`` (each a probability vector).

    Inside tile t with budget S_t and conditional distribution ``p_i / P_t``:
    systematic: one offset ``a_t``, ``c_i = floor(a_t + S_t F_i) - floor(a_t + S_t F_{i-1})`` (F the
    in-tile CDF; spec §3-§4); stratified: ``u_s = (s + xi_s) / S_t`` with i.i.d. ``xi_s``; iid: ``u_s =
    xi_s``; both by inverse CDF (``searchsorted``). ``row_ids`` ``[R]`` names the hash stream of each row
    (default ``arange(R)``).
    """
    check_int("num_samples", num_samples, 1)
    check_choice("scheme", scheme, SCHEMES)
    check_int("tile_size", tile_size, 1, allow_none=True)
    if p.dim() != 2 or p.shape[-1] < 1:
        raise ValueError(f"p must be [R, n] with n >= 1, got shape {tuple(p.shape)}")
    R, n = p.shape
    dev = p.device
    L = n if tile_size is None else min(int(tile_size), n)
    T = -(-n // L)
    pp = p.double()
    if T * L != n:
        pp = torch.nn.functional.pad(pp, (0, T * L - n))
    pt = pp.view(R, T, L)
    mass = pt.sum(-1)  # [R, T]
    if T == 1:
        mass = torch.where(mass > 0, torch.ones_like(mass), mass)  # one tile holds all the mass
        budgets = torch.where(mass > 0, num_samples, 0).to(torch.int64)
    else:
        budgets = tile_budgets(mass / mass.sum(-1, keepdim=True), num_samples, budget)
    cdf = pt.cumsum(-1)
    last = cdf[..., -1:]
    cdf = torch.where(last > 0, cdf / torch.where(last > 0, last, 1.0), 0.0)
    cdf[..., -1] = torch.where(last[..., 0] > 0, 1.0, 0.0)  # exactly 1 at the end: sum of counts = S_t
    rows = (torch.arange(R, device=dev) if row_ids is None else row_ids.to(dev)).view(R, 1, 1)
    tiles = torch.arange(T, device=dev).view(1, T, 1)
    St = budgets.unsqueeze(-1).double()  # [R, T, 1]
    if scheme == "systematic":
        a = hashed_uniforms(seed, step, rows, tiles, torch.zeros(1, 1, 1, dtype=torch.int64, device=dev))
        hi = torch.floor(a + St * cdf)
        lo = torch.cat([torch.floor(a), hi[..., :-1]], dim=-1)
        counts = (hi - lo).to(torch.int64)
    else:
        smax = int(budgets.max()) if budgets.numel() else 0
        s = torch.arange(max(smax, 1), device=dev).view(1, 1, -1)
        xi = hashed_uniforms(seed, step, rows, tiles, s)
        u = (s + xi) / St.clamp_min(1.0) if scheme == "stratified" else xi
        idx = torch.searchsorted(cdf.contiguous(), u.contiguous(), right=True).clamp_max(L - 1)
        valid = (s < St).to(torch.int64)
        counts = torch.zeros(R, T, L, dtype=torch.int64, device=dev).scatter_add_(-1, idx, valid.expand_as(idx).contiguous())
    mass_f = (mass / mass.sum(-1, keepdim=True)).float()
    w = torch.where(budgets > 0, mass_f / budgets.clamp_min(1).float(), 0.0)  # [R, T]
    weights = w.unsqueeze(-1).expand(R, T, L).reshape(R, T * L)[:, :n]
    return SampleCounts(counts.view(R, T * L)[:, :n], weights.contiguous(), budgets, mass_f)


# --------------------------------------------------------------------------------------------------
# inputs, scores


def check_decode_inputs(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        mask: torch.Tensor | None = None, generator: torch.Generator | None = None,
                        who: str = "santa_decode") -> tuple[int, int, int, int, int]:
    """Shapes ``(B, H, H_kv, n, d)`` of a decode call, or a one-line ``ValueError``."""
    if q.dim() != 3:
        raise ValueError(f"{who}: q must be [B, H, d], got shape {tuple(q.shape)}")
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError(f"{who}: k_cache and v_cache must both be [B, n, H_kv, d], got {tuple(k_cache.shape)} "
                         f"and {tuple(v_cache.shape)}")
    B, H, d = q.shape
    Bk, n, Hkv, dk = k_cache.shape
    if Bk != B or dk != d:
        raise ValueError(f"{who}: q {tuple(q.shape)} and k_cache {tuple(k_cache.shape)} disagree on batch or head dim")
    if Hkv < 1 or H % Hkv:
        raise ValueError(f"{who}: H={H} query heads are not a multiple of H_kv={Hkv} KV heads (q {tuple(q.shape)}, "
                         f"k_cache {tuple(k_cache.shape)})")
    if n == 0:
        raise ValueError(f"{who}: the KV cache is empty (n = 0): nothing to attend to")
    if not (q.is_floating_point() and k_cache.is_floating_point() and v_cache.is_floating_point()):
        raise ValueError(f"{who}: q, k_cache and v_cache must be floating point")
    if not (q.device == k_cache.device == v_cache.device):
        raise ValueError(f"{who}: q, k_cache, v_cache are on different devices ({q.device}, {k_cache.device}, "
                         f"{v_cache.device})")
    if mask is not None and (mask.shape != (B, n) or mask.dtype != torch.bool):
        raise ValueError(f"{who}: mask must be a bool [B, n] = {(B, n)} tensor, got {mask.dtype} {tuple(mask.shape)}")
    if generator is not None and torch.device(generator.device).type != q.device.type:
        raise ValueError(f"{who}: the generator is on {generator.device} but the tensors are on {q.device}")
    if not torch.isfinite(q).all():
        raise ValueError(f"{who}: q holds NaN or Inf")
    return B, H, Hkv, n, d


def resolve_seed(seed: int | None, generator: torch.Generator | None) -> int:
    """The base seed of a call: ``seed``, else one draw from ``generator`` (else torch's global RNG)."""
    if seed is not None:
        return check_int("seed", seed, 0)
    return int(torch.randint(0, 2 ** 62, (1,), generator=generator, device=generator.device if generator else "cpu"))


def scores(q: torch.Tensor, k_cache: torch.Tensor, scale: float, valid: torch.Tensor | None) -> torch.Tensor:
    """fp32 scores ``[B, Q, H, n]`` of ``q [B, Q, H, d]`` against ``k_cache [B, n, H_kv, d]``; -inf where not valid.

    ``valid``: bool ``[B, Q, n]`` or None. Raises ``ValueError`` if a valid score is NaN/Inf (NaN/Inf
    in K) or a query has no valid row.
    """
    B, Q, H, d = q.shape
    Hkv = k_cache.shape[2]
    G = H // Hkv
    s = torch.einsum("bqkgd,bnkd->bqkgn", q.float().view(B, Q, Hkv, G, d), k_cache.float()) * scale
    s = s.reshape(B, Q, H, -1)
    if valid is not None:
        if not valid.any(-1).all():
            raise ValueError("santa_decode: a query has no valid (unmasked) cache row")
        vm = valid.unsqueeze(2)
        if not torch.isfinite(s[vm.expand_as(s)]).all():
            raise ValueError("santa_decode: k_cache (or q) holds NaN or Inf in a valid row")
        s = s.masked_fill(~vm, float("-inf"))
    elif not torch.isfinite(s).all():
        raise ValueError("santa_decode: k_cache (or q) holds NaN or Inf")
    return s


def gather_rows(v_cache: torch.Tensor, idx: torch.Tensor, H: int) -> torch.Tensor:
    """Value rows ``[B, Q, H, m, d]`` (fp32) at cache positions ``idx [B, Q, H, m]``; head h reads KV head h // G."""
    B, n, Hkv, d = v_cache.shape
    G = H // Hkv
    Bq, Q, Hh, m = idx.shape
    b = torch.arange(B, device=idx.device).view(B, 1, 1, 1)
    kvh = (torch.arange(H, device=idx.device) // G).view(1, 1, H, 1)
    flat = ((b * n + idx) * Hkv + kvh).reshape(-1)
    return v_cache.reshape(B * n * Hkv, d).index_select(0, flat).view(B, Q, H, m, d).float()


def ternary_query(q: torch.Tensor, tau: float | torch.Tensor | None = None, seed: int = 0, step: int = 0,
                  row_ids: torch.Tensor | None = None) -> torch.Tensor:
    """The Bernoulli ternary query (spec §5): ``q~_j = sign(q_j) tau Bernoulli(pi_j)``, ``pi_j = min(1, |q_j| / tau)``.

    Where ``pi_j = 1`` the coordinate is kept exactly, so ``E[q~] = q`` and every entry is in
    ``{-tau, 0, tau} U {q_j}``. ``tau``: a positive number, or None for each vector's own max ``|q_j|``
    (a choice; the paper states no rule), which keeps the largest coordinate exactly. ``q`` is ``[..., d]``;
    the uniforms are hashed from (seed, step, vector index, coordinate).
    """
    qf = q.float()
    if tau is None:
        t = qf.abs().amax(-1, keepdim=True)
    else:
        if isinstance(tau, (int, float)) and not (math.isfinite(tau) and tau > 0):
            raise ValueError(f"tau must be a positive finite number or None, got {tau}")
        t = torch.as_tensor(tau, dtype=torch.float32, device=q.device)
    t = torch.where(t > 0, t, torch.ones_like(t))
    pi = (qf.abs() / t).clamp_max(1.0)
    flat = qf.reshape(-1, qf.shape[-1])
    rows = (torch.arange(flat.shape[0], device=q.device) if row_ids is None else row_ids).view(-1, 1)
    cols = torch.arange(flat.shape[1], device=q.device).view(1, -1)
    u = hashed_uniforms(seed ^ 0x5A17A, step, rows, cols, torch.zeros(1, 1, dtype=torch.int64, device=q.device))
    keep = (u.float().view_as(qf) < pi)
    out = torch.where(keep, torch.sign(qf) * t, torch.zeros_like(qf))
    out = torch.where(pi >= 1.0, qf, out)
    return out.to(q.dtype)
