"""ULD-Net's configuration and PolyNorm's quadratic replacement of ``1/sqrt(s)``.

``g(s) = a (s - b)^2 + c`` matches ``f(s) = s^{-1/2}`` in value and slope at the anchor ``mu``, with its
vertex at ``b = k mu`` (spec, "PolyNorm"):

    a = 1 / (4 (k - 1) mu^{5/2}),   b = k mu,   c = (5 - k) / (4 mu^{1/2}),   k in (1, 5).

``k`` in ``[2.438, 5)`` also keeps ``g <= f`` on ``(0, k mu)`` (numerical suppression).
"""

from __future__ import annotations

import dataclasses
import math

from rankwise.core.validate import check_bool, check_choice, check_int, check_number

__all__ = ["K_SUPPRESS", "ULDConfig", "g_coefficients", "g_value"]

#: The smallest ``k`` with ``g <= f`` on ``(0, k mu)`` (spec: numerical-suppression constraint).
K_SUPPRESS = 2.438

AXES = ("per_sample", "batch")
NORMS = ("polynorm", "exact")


def g_coefficients(k: float = 4.0, mu: float = 2.0) -> tuple[float, float, float]:
    """``(a, b, c)`` of ``g(s) = a (s - b)^2 + c`` for vertex factor ``k`` in (1, 5) and anchor ``mu`` > 0."""
    k = check_number("ULDConfig.k", k, 1.0, 5.0, low_open=True, high_open=True)
    mu = check_number("ULDConfig.mu", mu, 0.0, low_open=True)
    a = 1.0 / (4.0 * (k - 1.0) * mu**2.5)
    return a, k * mu, (5.0 - k) / (4.0 * math.sqrt(mu))


def g_value(s, k: float = 4.0, mu: float = 2.0):
    """``g(s)`` elementwise (floats, numpy arrays or tensors)."""
    a, b, c = g_coefficients(k, mu)
    return a * (s - b) ** 2 + c


@dataclasses.dataclass(frozen=True)
class ULDConfig:
    """How :func:`~rankwise.science.uldnet.convert` and :func:`~rankwise.science.uldnet.train` build a
    ULD-Net (spec defaults).

    ``act_degree``: PolyAct degree n <= 3 (2 for ResNet-18 in the paper); ``act_scales``: the fixed
    per-coefficient scales c_i (padded with 1.0 / cut to ``act_degree + 1``); ``act_dropout``: dropout
    after PolyAct. ``norm``: ``"polynorm"`` or ``"exact"`` (per-sample exact normalisation, the warm-up
    form kept for ever). ``k``, ``mu``: PolyNorm's vertex factor and anchor. ``axis``: ``"per_sample"``
    (the paper) or ``"batch"`` (the ablation: batch statistics, running mean/variance at inference).
    ``lam1``, ``lam2``: the L1/L2 variance penalties. ``warmup_frac``: fraction of epochs trained with
    exact normalisation; ``blend_frac``: fraction of epochs of the linear blend to PolyNorm after it
    (0 = hard switch). ``momentum``: V-bar's update (cumulative average until ``1/momentum`` batches).
    """

    act_degree: int = 2
    act_scales: tuple[float, ...] = (0.1, 1.0, 0.1)
    act_dropout: float = 0.2
    norm: str = "polynorm"
    k: float = 4.0
    mu: float = 2.0
    axis: str = "per_sample"
    lam1: float = 1e-3
    lam2: float = 1e-2
    warmup_frac: float = 0.2
    blend_frac: float = 0.1
    momentum: float = 0.1
    eps: float = 1e-5
    maxpool_to_avgpool: bool = True

    def __post_init__(self) -> None:
        check_int("ULDConfig.act_degree", self.act_degree, 1, 3)
        if not isinstance(self.act_scales, tuple) or not self.act_scales:
            raise ValueError(f"ULDConfig.act_scales must be a non-empty tuple of numbers, got {self.act_scales!r}")
        for s in self.act_scales:
            check_number("ULDConfig.act_scales", s, 0.0, low_open=True)
        check_number("ULDConfig.act_dropout", self.act_dropout, 0.0, 1.0, high_open=True)
        check_choice("ULDConfig.norm", self.norm, NORMS)
        g_coefficients(self.k, self.mu)
        check_choice("ULDConfig.axis", self.axis, AXES)
        check_number("ULDConfig.lam1", self.lam1, 0.0)
        check_number("ULDConfig.lam2", self.lam2, 0.0)
        check_number("ULDConfig.warmup_frac", self.warmup_frac, 0.0, 1.0)
        check_number("ULDConfig.blend_frac", self.blend_frac, 0.0, 1.0)
        if self.warmup_frac + self.blend_frac > 1.0:
            raise ValueError(f"ULDConfig.warmup_frac + blend_frac must be <= 1, got {self.warmup_frac + self.blend_frac}")
        check_number("ULDConfig.momentum", self.momentum, 0.0, 1.0, low_open=True)
        check_number("ULDConfig.eps", self.eps, 0.0, low_open=True)
        check_bool("ULDConfig.maxpool_to_avgpool", self.maxpool_to_avgpool)

    @property
    def scales(self) -> tuple[float, ...]:
        """The c_i of PolyAct, one per coefficient (``act_degree + 1``)."""
        s = tuple(float(v) for v in self.act_scales[: self.act_degree + 1])
        return s + (1.0,) * (self.act_degree + 1 - len(s))
