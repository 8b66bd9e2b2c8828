"""Rank allocation: how many singular directions each target layer keeps.

:func:`allocate_ranks` serves every method of the pipeline (``CompressConfig.allocation``):

* ``"uniform"``: ``k = floor(rho m n / (m + n))`` for every layer (``rho`` the kept-parameter fraction);
* ``"dynamic"``: Swift-SVD's block-influence allocation (below), exact per-type budgets;
* ``"method"``: the method's own ``rank_for(m, n)``;
* ``{layer name: rank}``: explicit ranks (layers not listed get the uniform rank).

**Dynamic allocation** (Swift-SVD, ICML 2026, from the official code; per module type ``t``, e.g.
query, key, value, attention output, FFN in, FFN out; here: the layer's name relative to its block):

1. block influence ``I_l = mean_tokens (1 - cos(h_l, h_{l+1}))`` (``h_l`` enters block ``l``,
   ``h_{l+1}`` leaves it; padding excluded), normalised ``I~_l = (I_l - min I)/(max I - min I + 1e-6) + 1``;
2. local loss proxy ``eps_{l,t} = sqrt(sum_i sigma_i^2) = ||Y||_F``;
3. score ``s_{l,t} = I~_l^alpha * log(1 + eps_{l,t})^(1 - alpha)``, ``alpha = 2.5``;
4. type budget ``R_t = L * k_u(t)`` with the uniform rank ``k_u = floor(rho m n / (m + n))``; base rank
   ``max(1, floor(0.5 k_u))`` per layer;
5. the remaining budget is split proportionally to the scores, floored, clipped to ``min(m, n)``;
   leftover units go one each to the highest scores (and round again while any remain), so the
   ranks of a type sum to ``R_t`` exactly.

Choices (see ``docs/methods/swift_svd.md``): ``log(1 + eps)`` is floored at ``1e-12`` so that a
zero-output layer gets a finite score; scores are computed in log space and normalised by their
maximum (no overflow at ``alpha = 2.5``); the base rank is at least 1 so that no layer is removed.
"""

from __future__ import annotations

import math
from typing import Mapping, Sequence

import torch
from torch import nn

from rankwise.compress.base import LayerMethod, check_ratio, uniform_rank
from rankwise.compress.config import CompressConfig
from rankwise.compress.targets import block_of
from rankwise.core.errors import NumericalError
from rankwise.core.layers import validate_rank
from rankwise.core.stats import CalibrationError, LayerStats
from rankwise.core.validate import check_number, check_unit

Tensor = torch.Tensor

__all__ = ["INFLUENCE_EPS", "LOG_FLOOR", "block_influence", "normalize_influence", "allocation_scores",
           "dynamic_ranks", "layer_energy", "allocate_ranks"]

#: ``1e-6`` in ``I~ = (I - min)/(max - min + 1e-6) + 1`` (official code).
INFLUENCE_EPS = 1e-6
#: Floor of ``log(1 + eps)`` in the score (keeps a zero-output layer's score finite).
LOG_FLOOR = 1e-12


def block_influence(h_in: Tensor, h_out: Tensor, mask: Tensor | None = None) -> tuple[float, int]:
    """Sum over tokens of ``1 - cos(h_in, h_out)`` and the token count (float64; padding excluded by ``mask``).

    ``h_in``/``h_out`` are ``(..., d)`` hidden states entering and leaving a block; ``mask`` has the
    leading shape (non-zero = keep). Divide the sums by the counts over all batches for ``I_l``.
    """
    if h_in.shape != h_out.shape:
        raise ValueError(f"block input {tuple(h_in.shape)} and output {tuple(h_out.shape)} differ in shape")
    a = h_in.detach().reshape(-1, h_in.shape[-1]).to(torch.float64)
    b = h_out.detach().reshape(-1, h_out.shape[-1]).to(torch.float64)
    if mask is not None and mask.numel() == a.shape[0]:
        keep = mask.reshape(-1).to(a.device) != 0
        a, b = a[keep], b[keep]
    cos = (a * b).sum(-1) / (a.norm(dim=-1) * b.norm(dim=-1)).clamp_min(1e-300)
    return float((1.0 - cos).sum()), int(a.shape[0])


def normalize_influence(influence: Sequence[float]) -> list[float]:
    """``I~_l = (I_l - min I) / (max I - min I + 1e-6) + 1`` (in ``[1, 2]``)."""
    vals = [float(v) for v in influence]
    if not vals:
        return []
    if not all(math.isfinite(v) for v in vals):
        raise NumericalError(f"block influence has non-finite values: {vals}")
    lo, hi = min(vals), max(vals)
    return [(v - lo) / (hi - lo + INFLUENCE_EPS) + 1.0 for v in vals]


def allocation_scores(importance: Sequence[float], eps: Sequence[float], alpha: float = 2.5) -> list[float]:
    """``s = I~^alpha * log(1 + eps)^(1 - alpha)``, normalised so that the largest score is 1 (log-space).

    ``importance`` are the normalised influences ``I~ >= 1`` of the layers' blocks, ``eps`` the local
    loss proxies ``||Y||_F`` (``>= 0``). ``log(1 + eps)`` is floored at :data:`LOG_FLOOR`.
    """
    if len(importance) != len(eps):
        raise ValueError(f"{len(importance)} importances but {len(eps)} eps values")
    logs = []
    for i, e in zip(importance, eps):
        if not (math.isfinite(i) and i > 0):
            raise ValueError(f"importance must be finite and > 0, got {i}")
        if not (math.isfinite(e) and e >= 0):
            raise ValueError(f"eps must be finite and >= 0, got {e}")
        logs.append(alpha * math.log(i) + (1.0 - alpha) * math.log(max(math.log1p(e), LOG_FLOOR)))
    top = max(logs) if logs else 0.0
    return [math.exp(v - top) for v in logs]


def dynamic_ranks(
    shapes: Mapping[str, tuple[int, int]],
    types: Mapping[str, str],
    importance: Mapping[str, float],
    eps: Mapping[str, float],
    ratio: float,
    *,
    alpha: float = 2.5,
    base_fraction: float = 0.5,
) -> dict[str, int]:
    """Swift-SVD's dynamic ranks: per type, ``L * k_u`` units split by score with exact budgets.

    Args:
        shapes: ``{layer: (m, n)}`` (out, in).
        types: ``{layer: type}``; layers of one type share a budget (they must have one shape).
        importance: ``{layer: I~}`` the normalised block influence of the layer's block (1 outside blocks).
        eps: ``{layer: ||Y||_F}`` the local loss proxy.
        ratio: kept-parameter fraction ``rho`` in ``(0, 1]``.
        alpha: score exponent (2.5).
        base_fraction: base rank ``max(1, floor(base_fraction * k_u))`` (0.5).
    Returns:
        ``{layer: rank}`` with ``sum`` per type ``== L * k_u`` and every rank in ``[1, min(m, n)]``.
    """
    rho = check_ratio(ratio)
    check_number("alpha", alpha)
    check_unit("base_fraction", base_fraction)
    missing = [n for n in shapes if n not in types or n not in importance or n not in eps]
    if missing:
        raise ValueError(f"dynamic allocation: no type/importance/eps for layers {missing[:5]}")
    by_type: dict[str, list[str]] = {}
    for n in shapes:
        by_type.setdefault(types[n], []).append(n)
    ranks: dict[str, int] = {}
    for t, names in by_type.items():
        shp = {tuple(shapes[n]) for n in names}
        if len(shp) != 1:
            raise ValueError(f"layers of type {t!r} have different shapes {sorted(shp)}; give them different types")
        m, n = next(iter(shp))
        full = min(m, n)
        k_u = uniform_rank(m, n, rho)
        budget = len(names) * k_u
        base = max(1, math.floor(base_fraction * k_u))
        scores = allocation_scores([importance[x] for x in names], [eps[x] for x in names], alpha)
        remaining = budget - base * len(names)
        total = sum(scores)
        r = {x: min(full, base + math.floor(remaining * s / total)) for x, s in zip(names, scores)}
        left = budget - sum(r.values())
        order = sorted(range(len(names)), key=lambda i: (-scores[i], i))
        while left > 0:
            progressed = False
            for i in order:
                if left == 0:
                    break
                x = names[i]
                if r[x] < full:
                    r[x] += 1
                    left -= 1
                    progressed = True
            if not progressed:  # cannot happen: budget <= L * full
                raise RuntimeError(f"dynamic allocation of type {t!r} cannot place {left} rank unit(s)")
        ranks.update(r)
    return ranks


def layer_energy(name: str, layer: nn.Linear, st: LayerStats) -> float:
    """``||Y||_F^2`` of the layer on the calibration data (bias excluded): ``tr C`` or ``tr(W H W^T)``."""
    if st.yty is not None and not st.output_bias:
        return float(torch.diagonal(st.yty).sum())
    if st.xtx is not None:
        W = layer.weight.detach().to(torch.float64)
        return float(((W @ st.xtx.to(W.device, torch.float64)) * W).sum())
    raise CalibrationError(f"layer {name!r}: the dynamic allocation needs its output or input covariance")


def _layer_type(name: str, path: str | None, n_blocks: int) -> tuple[str, int | None]:
    if path is not None:
        b = block_of(name, path, n_blocks)
        if b is not None:
            return name[len(path) + 1 + len(str(b)) + 1:], b
    return name, None


def allocate_ranks(
    cfg: CompressConfig,
    method: LayerMethod,
    shapes: Mapping[str, tuple[int, int]],
    *,
    influence: Sequence[float] | None = None,
    energy: Mapping[str, float] | None = None,
    block_path: str | None = None,
    n_blocks: int = 0,
) -> dict[str, int]:
    """Ranks of the targets (``shapes = {name: (m, n)}``) under ``cfg.allocation``; each checked to be in ``[1, min(m, n)]``."""
    alloc = cfg.allocation
    ranks: dict[str, int] = {}
    if isinstance(alloc, Mapping):
        unknown = [n for n in alloc if n not in shapes]
        if unknown:
            raise ValueError(f"allocation names layers that are not targets: {unknown[:5]}")
        for n, (m, k) in shapes.items():
            ranks[n] = alloc.get(n, uniform_rank(m, k, cfg.ratio))
    elif alloc == "uniform":
        ranks = {n: uniform_rank(m, k, cfg.ratio) for n, (m, k) in shapes.items()}
    elif alloc == "method":
        for n, (m, k) in shapes.items():
            r = method.rank_for(m, k)
            if r is None:
                raise ValueError(f"allocation='method': method {method.name!r} has no rank rule of its own")
            ranks[n] = r
    else:  # dynamic
        if energy is None:
            raise CalibrationError("the dynamic allocation needs every target's output energy")
        tilde = normalize_influence(influence) if influence else []
        types, importance = {}, {}
        for n in shapes:
            t, b = _layer_type(n, block_path, n_blocks)
            types[n] = t
            importance[n] = tilde[b] if (b is not None and tilde) else 1.0
        eps = {n: math.sqrt(max(energy[n], 0.0)) for n in shapes}
        ranks = dynamic_ranks(shapes, types, importance, eps, cfg.ratio, alpha=cfg.alpha,
                              base_fraction=cfg.base_fraction)
    for n, r in ranks.items():
        m, k = shapes[n]
        validate_rank(r, k, m, n)
    return ranks
