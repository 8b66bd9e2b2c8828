"""The PriorGuide guidance term (spec §3-§5), in closed form with log-sum-exp mixture weights.

With the VE forward process ``theta_t = theta_0 + sigma eps`` and a learned score ``s``:

* Tweedie mean ``mu = theta_t + sigma^2 s(theta_t)`` (:func:`tweedie_mean`);
* reverse-kernel covariance ``Sigma_0|t = c^2 sigma^2 / (c^2 + sigma^2) I`` (:func:`reverse_variance`;
  ``c = 1`` is the spec's default ``sigma^2 / (1 + sigma^2)`` for unit-scale parameters);
* prior ratio ``r ~ sum_k w_k N(m_k, C_k)`` gives ``E[r(theta_0)] ~ sum_k w_k nu_k`` with
  ``nu_k = N(mu | m_k, C_k + Sigma_0|t)``; mixture weights ``gamma_k = softmax_k(log w_k + log nu_k)``
  (log-sum-exp, so far-away ``theta_t`` keep finite, normalised weights: sbi's version exponentiates
  ``log nu_k`` directly and its weights underflow to 0 there);
* ``v = sum_k gamma_k (C_k + Sigma_0|t)^{-1} (m_k - mu)`` and the guidance ``g = J_mu^T v`` with
  ``J_mu ~ I`` (default) or the autograd Jacobian of ``mu`` (one vector-Jacobian product);
* norm clip ``||g|| <= clip / sigma`` (a guard, not from the paper; ``clip=None`` disables it).

:func:`guidance_term` returns ``g`` with its ``gamma`` for tests and diagnostics.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from rankwise.core.validate import check_bool, check_int, check_number
from rankwise.science.priorguide.priors import PriorRatio

__all__ = ["GuidanceTerm", "PriorGuide", "guidance_term", "reverse_variance", "tweedie_mean"]


@dataclass(frozen=True)
class PriorGuide:
    """PriorGuide's settings (spec §5-§6).

    ``ratio``: the :class:`PriorRatio` from :func:`prior_ratio`. ``jacobian``: use the autograd
    Jacobian of the Tweedie mean (one extra backward pass per evaluation) instead of ``J = I``.
    ``langevin_steps``: Langevin corrector steps per noise level with the guided score (0: none);
    ``langevin_snr``: the corrector's signal-to-noise ratio (step ``2 (snr ||z|| / ||s||)^2``).
    ``clip``: clip ``||g||`` to ``clip / sigma`` (None: no clip). ``reverse_scale``: ``c`` in
    ``Sigma_0|t = c^2 sigma^2 / (c^2 + sigma^2)`` (1: the spec's default for unit-scale parameters).
    """

    ratio: PriorRatio
    jacobian: bool = False
    langevin_steps: int = 0
    langevin_snr: float = 0.1
    clip: float | None = 10.0
    reverse_scale: float = 1.0

    def __post_init__(self) -> None:
        if not isinstance(self.ratio, PriorRatio):
            raise TypeError(f"PriorGuide.ratio must be a PriorRatio (from prior_ratio), got {type(self.ratio).__name__}")
        check_bool("PriorGuide.jacobian", self.jacobian)
        check_int("PriorGuide.langevin_steps", self.langevin_steps, lo=0)
        check_number("PriorGuide.langevin_snr", self.langevin_snr, lo=0.0, low_open=True)
        check_number("PriorGuide.clip", self.clip, lo=0.0, low_open=True, allow_none=True)
        check_number("PriorGuide.reverse_scale", self.reverse_scale, lo=0.0, low_open=True)


@dataclass
class GuidanceTerm:
    """One evaluation: ``g`` [N, D] (after clipping), ``gamma`` [N, K] (rows sum to 1; None for a
    constant ratio), ``mu`` [N, D] the Tweedie mean, ``clipped`` [N] bool."""

    g: Tensor
    gamma: Tensor | None
    mu: Tensor
    clipped: Tensor


def tweedie_mean(theta_t: Tensor, sigma: Tensor, score: Tensor) -> Tensor:
    """``E[theta_0 | theta_t] = theta_t + sigma^2 s`` (VE), shapes [N, D], [N] or scalar, [N, D]."""
    sig = torch.as_tensor(sigma, dtype=theta_t.dtype).reshape(-1, 1)
    return theta_t + sig**2 * score


def reverse_variance(sigma: Tensor, scale: float = 1.0) -> Tensor:
    """The isotropic ``Sigma_0|t`` variance ``c^2 sigma^2 / (c^2 + sigma^2)`` (spec §3's default for c = 1)."""
    s2 = torch.as_tensor(sigma, dtype=torch.float64) ** 2
    return scale**2 * s2 / (scale**2 + s2)


def _mixture_pull(mu: Tensor, var0: Tensor, ratio: PriorRatio) -> tuple[Tensor, Tensor]:
    """``v = grad_mu log sum_k w_k N(mu | m_k, C_k + var0 I)`` and ``gamma`` ([N, D], [N, K]); float64.

    ``var0`` is [N] (one noise level per row) or a scalar. The Cholesky factor of ``C_k + var0 I`` is
    computed once per distinct noise level (the usual case: one level for all rows).
    """
    mix = ratio.mixture
    assert mix is not None
    mu64 = mu.to(torch.float64)
    n, d = mu64.shape
    eye = torch.eye(d, dtype=torch.float64)
    v0 = torch.as_tensor(var0, dtype=torch.float64).reshape(-1)
    diff = mix.means[None] - mu64[:, None]  # [N, K, D]
    if v0.numel() == 1 or bool((v0 == v0[0]).all()):
        # one noise level for every row: K factorisations, then one batched product for all rows
        chol = torch.linalg.cholesky(mix.covs + float(v0[0]) * eye)  # [K, D, D]
        a_inv = torch.cholesky_inverse(chol)
        sol = torch.einsum("kij,nkj->nki", a_inv, diff)  # (C_k + var0)^{-1} (m_k - mu)
        chol = chol[None]
    else:
        chol = torch.linalg.cholesky(mix.covs[None] + v0[:, None, None, None] * eye)  # [N, K, D, D]
        sol = torch.cholesky_solve(diff[..., None], chol)[..., 0]
    logdet = 2.0 * torch.log(torch.diagonal(chol, dim1=-2, dim2=-1)).sum(-1)  # [1 or N, K]
    log_nu = -0.5 * ((diff * sol).sum(-1) + logdet + d * math.log(2 * math.pi))
    logits = torch.log(mix.weights)[None] + log_nu
    gamma = torch.softmax(logits, dim=-1)  # log-sum-exp normalisation
    return (gamma[..., None] * sol).sum(1), gamma


def guidance_term(guide: PriorGuide, model: Any, theta_t: Tensor, sigma: Tensor, x: Tensor,
                  score: Tensor | None = None) -> GuidanceTerm:
    """The guidance ``g(theta_t)`` (spec §5) for a score model at noise level(s) ``sigma``.

    ``theta_t`` [N, D]; ``sigma`` scalar or [N]; ``x`` [M] or [N, M]; ``score`` the model's score at
    ``theta_t`` when already computed (ignored with ``jacobian=True``, which recomputes it under
    autograd). Returns a :class:`GuidanceTerm`; ``g`` is exactly zero for a constant ratio.
    """
    n, d = theta_t.shape
    sig = torch.as_tensor(sigma, dtype=torch.float64).reshape(-1).expand(n)
    if guide.ratio.constant:
        zero = torch.zeros_like(theta_t)
        mu = theta_t if score is None else tweedie_mean(theta_t, sig.to(theta_t.dtype), score)
        return GuidanceTerm(zero, None, mu, torch.zeros(n, dtype=torch.bool))
    var0 = reverse_variance(sig, guide.reverse_scale)
    if guide.jacobian:
        with torch.enable_grad():
            th = theta_t.detach().requires_grad_(True)
            s = model.score(th, sig, x)
            mu = tweedie_mean(th, sig.to(th.dtype), s)
            v, gamma = _mixture_pull(mu.detach(), var0, guide.ratio)
            (g,) = torch.autograd.grad(mu, th, grad_outputs=v.to(mu.dtype))
        mu = mu.detach()
        g = g.detach().to(torch.float64)
    else:
        if score is None:
            with torch.no_grad():
                score = model.score(theta_t, sig, x)
        mu = tweedie_mean(theta_t, sig.to(theta_t.dtype), score)
        g, gamma = _mixture_pull(mu, var0, guide.ratio)
    clipped = torch.zeros(n, dtype=torch.bool)
    if guide.clip is not None:
        norm = g.norm(dim=-1)
        cap = guide.clip / sig
        clipped = norm > cap
        g = torch.where(clipped[:, None], g * (cap / norm.clamp_min(1e-300))[:, None], g)
    if not torch.isfinite(g).all():
        raise FloatingPointError("PriorGuide: non-finite guidance (check the score model's output for NaN)")
    return GuidanceTerm(g.to(theta_t.dtype), gamma, mu, clipped)
