"""Merge rules: combine T task tensors stacked as ``(T, ...)`` into one (:func:`merge_tensors`).

Each task's tensor is viewed as one flat vector; the space it lives in (full ``m x n`` deltas, KnOTS'
aligned factors, Core-Space or CtM coordinates) is the caller's business.

* ``"ta"`` — task arithmetic, ``Σ_t X_t`` (Ilharco et al. 2023);
* ``"mean"`` — ``(1/T) Σ_t X_t``;
* ``"ties"`` — TIES (Yadav et al. 2023): keep each task's top ``density`` fraction of entries by
  magnitude, elect a sign per entry (sign of the sum of the trimmed values; entries whose sum is 0
  take the sign of the sum over all entries, + if that is 0 too), average the nonzero entries that
  agree with the elected sign;
* ``"dare"`` — DARE (Yu et al. 2024): drop each entry with probability ``drop_rate``, rescale by
  ``1/(1-drop_rate)``, sum;
* ``"dare_ties"`` — DARE's random drop, then TIES' sign election and disjoint mean;
* ``"iso_c"`` — Iso-C (Marczak et al. 2025): the sum here; the caller flattens the singular values of
  the truncated result (:func:`rankwise.merge.common.flatten_isotropic`).

Tie-breaking (documented, deterministic): TIES keeps the ``k = round(density * numel)`` largest
magnitudes, ties broken by a stable sort (earlier position wins). DARE's mask for a task is drawn
from a generator seeded by that task's own seed (:func:`rankwise.merge.common.adapter_seed`), so the
result does not depend on the order of the adapters.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import Tensor

__all__ = ["RULES", "RULE_ALIASES", "canonical_rule", "merge_tensors", "needs_seeds"]

RULES: tuple[str, ...] = ("ta", "mean", "ties", "dare", "dare_ties", "iso_c")
#: accepted spellings of the rules (lower-cased before the look-up)
RULE_ALIASES: dict[str, str] = {"sum": "ta", "task_arithmetic": "ta", "linear": "ta", "dare_linear": "dare",
                                "iso": "iso_c", "isoc": "iso_c", "iso-c": "iso_c", "dare-ties": "dare_ties"}


def canonical_rule(rule: Any, where: str = "rule") -> str:
    """The canonical rule name (``"sum"`` -> ``"ta"``, ...); ValueError naming ``where`` otherwise."""
    if not isinstance(rule, str):
        raise ValueError(f"{where} must be a string, one of {RULES}, got {rule!r}")
    r = RULE_ALIASES.get(rule.lower(), rule.lower())
    if r not in RULES:
        raise ValueError(f"{where} must be one of {RULES} (aliases {sorted(RULE_ALIASES)}), got {rule!r}")
    return r


def _topk_mask(x: Tensor, density: float) -> Tensor:
    """Per task (dim 0), keep the ``round(density * numel)`` largest |entries| (stable tie-breaking)."""
    T = x.shape[0]
    flat = x.reshape(T, -1)
    n = flat.shape[1]
    k = min(n, max(1, int(round(density * n))))
    if k == n:
        return torch.ones_like(flat, dtype=torch.bool).reshape(x.shape)
    order = torch.argsort(flat.abs(), dim=1, descending=True, stable=True)[:, :k]
    mask = torch.zeros_like(flat, dtype=torch.bool)
    mask.scatter_(1, order, True)
    return mask.reshape(x.shape)


def _elect_and_mean(x: Tensor) -> Tensor:
    """TIES steps 2-3 on trimmed tasks ``x (T, ...)``: elect signs, mean of the agreeing nonzero entries."""
    total = x.sum(0)
    sign = torch.sign(total)
    overall = torch.sign(total.sum())
    sign = torch.where(sign == 0, overall if overall != 0 else torch.ones((), dtype=x.dtype), sign)
    agree = (torch.sign(x) == sign) & (x != 0)
    count = agree.sum(0).clamp_min(1).to(x.dtype)
    return (x * agree).sum(0) / count


def _dare_drop(x: Tensor, drop_rate: float, seeds: Sequence[int]) -> Tensor:
    if drop_rate == 0.0:
        return x
    out = torch.empty_like(x)
    for t in range(x.shape[0]):
        g = torch.Generator().manual_seed(int(seeds[t]))
        keep = torch.rand(x[t].shape, generator=g, dtype=torch.float64) >= drop_rate
        out[t] = x[t] * keep.to(x.dtype) / (1.0 - drop_rate)
    return out


def needs_seeds(rule: str) -> bool:
    """Whether ``rule`` draws random masks (DARE, DARE-TIES): only then :func:`merge_tensors` takes seeds."""
    return canonical_rule(rule) not in ("ta", "iso_c", "mean", "ties")


def merge_tensors(x: Tensor, rule: str, *, density: float = 0.25, drop_rate: float = 0.05,
                  seeds: Sequence[int] | None = None) -> Tensor:
    """Combine task tensors ``x (T, ...)`` (each task's tensor viewed as one flat vector) into one ``(...)``.

    ``rule`` in :data:`RULES`; ``"iso_c"`` returns the plain sum here (the isotropic flattening acts on
    singular values after truncation, :func:`~rankwise.merge.common.flatten_isotropic`). ``seeds``: one
    per task for DARE.
    """
    rule = canonical_rule(rule)
    if x.ndim < 2:
        raise ValueError(f"merge_tensors: x must have shape (T, ...), got {tuple(x.shape)}")
    if rule in ("ta", "iso_c"):
        return x.sum(0)
    if rule == "mean":
        return x.mean(0)
    if rule == "ties":
        return _elect_and_mean(x * _topk_mask(x, density))
    if seeds is None or len(seeds) != x.shape[0]:
        raise ValueError(f"merge_tensors: rule {rule!r} needs one seed per task ({x.shape[0]})")
    dropped = _dare_drop(x, drop_rate, seeds)
    if rule == "dare":
        return dropped.sum(0)
    return _elect_and_mean(dropped)  # dare_ties
