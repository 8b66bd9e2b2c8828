"""ULD-Net's polynomial operators (PolyNorm, PolyAct) and the post-hoc baseline's fitted operators.

Every module here is a polynomial in its input at inference (given the constants it stores), which
is what CKKS can evaluate: :func:`rankwise.science.uldnet.export_ckks` compiles a chain of them.
"""

from __future__ import annotations

import math
import warnings
from typing import Sequence

import numpy as np
import torch
from torch import Tensor, nn

from rankwise.science.uldnet.config import ULDConfig, g_coefficients

__all__ = ["ChebNorm", "PolyAct", "PolyFitAct", "PolyNorm", "PolyNormRangeWarning", "cheb_eval"]


class PolyNormRangeWarning(UserWarning):
    """A sample's ``mu * v`` left ``(0, k mu)`` at inference: g no longer suppresses, accuracy may collapse."""


def _reduce_dims(x: Tensor, shape: tuple[int, ...], axis: str) -> tuple[int, ...]:
    if axis == "per_sample":
        return tuple(range(1, x.dim()))
    lead = x.dim() - len(shape)  # batch axis: every dim except the features of ``shape`` of size > 1
    return tuple(range(lead)) + tuple(lead + i for i, s in enumerate(shape) if s == 1)


class PolyNorm(nn.Module):
    """Polynomial normalisation (spec "PolyNorm")::

        PolyNorm[x] = (x - E[x]) * g(mu v) * sqrt(mu / Vbar) * gamma + beta,   v = Var[x] / Vbar

    ``E``/``Var`` over every axis but the batch (``axis="per_sample"``) or, for the ablation, over the
    batch (``axis="batch"``: running mean/variance at inference, like BatchNorm). ``Vbar`` is the
    ``running_var`` buffer (cumulative average, then momentum). ``normalized_shape``: the trailing
    shape of ``gamma``/``beta`` (``(D,)`` for an MLP, ``(C, 1, 1)`` for a CNN). ``mix`` (a buffer)
    blends the exact normalisation ``(x - E) / sqrt(Var + eps)`` (0, warm-up) into PolyNorm (1).
    In training, ``last_v`` holds each sample's ``v`` (with gradient) for the variance penalties.
    """

    def __init__(self, normalized_shape: Sequence[int] | int, config: ULDConfig | None = None,
                 affine: bool = True) -> None:
        super().__init__()
        self.config = config or ULDConfig()
        shape = (int(normalized_shape),) if isinstance(normalized_shape, int) else tuple(int(s) for s in normalized_shape)
        if not shape or any(s < 1 for s in shape):
            raise ValueError(f"PolyNorm.normalized_shape must be a non-empty shape of sizes >= 1, got {normalized_shape!r}")
        self.normalized_shape = shape
        self.axis = self.config.axis
        self.weight = nn.Parameter(torch.ones(shape)) if affine else None
        self.bias = nn.Parameter(torch.zeros(shape)) if affine else None
        stat = () if self.axis == "per_sample" else shape
        self.register_buffer("running_var", torch.ones(stat))
        self.register_buffer("running_mean", torch.zeros(stat))
        self.register_buffer("num_batches_tracked", torch.zeros((), dtype=torch.long))
        self.register_buffer("mix", torch.ones(()))
        self.last_v: Tensor | None = None

    @property
    def estimated(self) -> bool:
        """Whether ``Vbar`` has been estimated (at least one training batch)."""
        return int(self.num_batches_tracked) > 0

    def _update(self, mean: Tensor, var: Tensor) -> None:
        n = int(self.num_batches_tracked)
        f = max(1.0 / (n + 1), self.config.momentum)
        with torch.no_grad():
            if self.axis == "per_sample":
                self.running_var.mul_(1 - f).add_(f * var.detach().mean())
            else:
                self.running_var.mul_(1 - f).add_(f * var.detach().reshape(self.normalized_shape))
                self.running_mean.mul_(1 - f).add_(f * mean.detach().reshape(self.normalized_shape))
            self.num_batches_tracked += 1

    def forward(self, x: Tensor) -> Tensor:
        dims = _reduce_dims(x, self.normalized_shape, self.axis)
        if self.axis == "batch" and not self.training:
            mean = self.running_mean.reshape((1,) * (x.dim() - len(self.normalized_shape)) + self.normalized_shape)
            var = self.running_var.reshape(mean.shape)
        else:
            mean = x.mean(dims, keepdim=True)
            var = x.var(dims, unbiased=False, keepdim=True)
        if self.training:
            self._update(mean, var)
        d = x - mean
        mix = float(self.mix)
        out = torch.zeros_like(d)
        if mix < 1.0:
            out = out + (1.0 - mix) * d / torch.sqrt(var + self.config.eps)
        if mix > 0.0:
            vbar = self.running_var if self.axis == "per_sample" else self.running_var.reshape(var.shape)
            v = var / vbar
            a, b, c = g_coefficients(self.config.k, self.config.mu)
            mu = self.config.mu
            g = a * (mu * v - b) ** 2 + c
            out = out + mix * d * g * torch.sqrt(mu / vbar)
            if self.training:
                self.last_v = v.reshape(-1)
            elif self.axis == "per_sample":
                mv = mu * v.detach().reshape(-1)
                bad = int(((mv <= 0) | (mv >= b)).sum())
                if bad:
                    warnings.warn(f"PolyNorm: {bad} sample(s) with mu*v outside (0, k*mu) = (0, {b:g}) "
                                  f"(max mu*v {float(mv.max()):.3g}); g no longer suppresses the variance",
                                  PolyNormRangeWarning, stacklevel=2)
        if self.weight is not None:
            out = out * self.weight + self.bias
        return out

    def extra_repr(self) -> str:
        return (f"{self.normalized_shape}, axis={self.axis}, k={self.config.k}, mu={self.config.mu}, "
                f"affine={self.weight is not None}")


class PolyAct(nn.Module):
    """``PolyAct(x) = Dropout(sum_{i=0}^{n} alpha_i c_i x^i)``: ``alpha`` trainable (initialised to the
    identity, ``alpha_1 = 1 / c_1``), ``c`` fixed per-coefficient scales (``ULDConfig.act_scales``)."""

    def __init__(self, config: ULDConfig | None = None) -> None:
        super().__init__()
        self.config = config or ULDConfig()
        n = self.config.act_degree
        self.register_buffer("scales", torch.tensor(self.config.scales, dtype=torch.float32))
        alpha = torch.zeros(n + 1)
        alpha[1] = 1.0 / self.config.scales[1]
        self.alpha = nn.Parameter(alpha)
        self.dropout = nn.Dropout(self.config.act_dropout)

    @property
    def degree(self) -> int:
        return int(self.alpha.numel()) - 1

    def coefficients(self) -> Tensor:
        """``alpha_i c_i``, lowest degree first."""
        return self.alpha * self.scales

    def forward(self, x: Tensor) -> Tensor:
        coef = self.coefficients()
        y = torch.zeros_like(x) + coef[-1]
        for c in coef.flip(0)[1:]:  # Horner
            y = y * x + c
        return self.dropout(y)


class PolyFitAct(nn.Module):
    """A fixed polynomial activation (the post-hoc baseline: a least-squares fit of ReLU).

    ``coefficients``: power basis, lowest degree first."""

    def __init__(self, coefficients: Sequence[float], source: str = "ReLU") -> None:
        super().__init__()
        self.register_buffer("coef", torch.tensor([float(c) for c in coefficients], dtype=torch.float64))
        self.source = source

    def coefficients(self) -> Tensor:
        return self.coef

    @property
    def degree(self) -> int:
        return int(self.coef.numel()) - 1

    def forward(self, x: Tensor) -> Tensor:
        y = torch.zeros_like(x, dtype=torch.float64) + self.coef[-1]
        for c in self.coef.flip(0)[1:]:
            y = y * x.double() + c
        return y.to(x.dtype)

    def extra_repr(self) -> str:
        return f"degree={self.degree}, fit of {self.source}"


def cheb_eval(w: Tensor, coef: Tensor) -> Tensor:
    """Chebyshev series ``sum_k coef_k T_k(w)`` (Clenshaw), float64."""
    w = w.double()
    b1 = torch.zeros_like(w)
    b2 = torch.zeros_like(w)
    for c in coef.flip(0)[:-1]:
        b1, b2 = 2 * w * b1 - b2 + c, b1
    return w * b1 - b2 + coef[0]


class ChebNorm(nn.Module):
    """Per-sample normalisation with ``1/sqrt(Var + eps)`` replaced by a Chebyshev series in
    ``w = alpha Var + beta0`` (``[lo, hi]`` mapped to ``[-1, 1]``): the post-hoc baseline's LayerNorm.

    Built from a trained ``nn.LayerNorm`` by :func:`~rankwise.science.uldnet.posthoc`."""

    def __init__(self, normalized_shape: Sequence[int], coef: Sequence[float], lo: float, hi: float,
                 eps: float = 1e-5) -> None:
        super().__init__()
        if not 0.0 <= lo < hi:
            raise ValueError(f"ChebNorm range must satisfy 0 <= lo < hi, got [{lo}, {hi}]")
        self.normalized_shape = tuple(int(s) for s in normalized_shape)
        self.weight = nn.Parameter(torch.ones(self.normalized_shape))
        self.bias = nn.Parameter(torch.zeros(self.normalized_shape))
        self.register_buffer("coef", torch.tensor([float(c) for c in coef], dtype=torch.float64))
        self.lo, self.hi, self.eps = float(lo), float(hi), float(eps)

    @property
    def alpha(self) -> float:
        return 2.0 / (self.hi - self.lo)

    @property
    def beta0(self) -> float:
        return -(self.hi + self.lo) / (self.hi - self.lo)

    @property
    def degree(self) -> int:
        return int(self.coef.numel()) - 1

    def forward(self, x: Tensor) -> Tensor:
        dims = tuple(range(1, x.dim()))
        d = x - x.mean(dims, keepdim=True)
        var = d.pow(2).mean(dims, keepdim=True)
        r = cheb_eval(self.alpha * var + self.beta0, self.coef).to(x.dtype)
        return d * r * self.weight + self.bias

    def extra_repr(self) -> str:
        return f"{self.normalized_shape}, degree={self.degree}, var range=[{self.lo:.3g}, {self.hi:.3g}]"


def fit_inv_sqrt(lo: float, hi: float, degree: int = 8, eps: float = 1e-5, points: int = 2000) -> np.ndarray:
    """Chebyshev coefficients (on ``[lo, hi]`` mapped to ``[-1, 1]``) of ``1/sqrt(s + eps)``, a
    least-squares fit on Chebyshev nodes (numpy ``Chebyshev.fit``)."""
    k = np.arange(points)
    s = 0.5 * (lo + hi) + 0.5 * (hi - lo) * np.cos(math.pi * (k + 0.5) / points)
    fit = np.polynomial.Chebyshev.fit(s, 1.0 / np.sqrt(s + eps), degree, domain=[lo, hi])
    return fit.coef


def fit_relu(bound: float = 6.0, degree: int = 7, points: int = 2001) -> np.ndarray:
    """Power-basis coefficients of the least-squares degree-``degree`` fit of ReLU on ``[-bound, bound]``."""
    x = np.linspace(-bound, bound, points)
    fit = np.polynomial.Chebyshev.fit(x, np.maximum(x, 0.0), degree, domain=[-bound, bound])
    return fit.convert(kind=np.polynomial.Polynomial, domain=[-1, 1], window=[-1, 1]).coef
