"""Reverse-diffusion sampling with (optional) PriorGuide guidance, and the importance-resampling baseline.

:func:`sample` runs the VE reverse SDE by Euler-Maruyama on a geometric noise grid
``sigma_0 = sigma_max > ... > sigma_S = sigma_min`` (spec §6)::

    theta <- theta + (sigma_i^2 - sigma_{i+1}^2) (s + g) + sqrt(sigma_i^2 - sigma_{i+1}^2) z

followed, when ``langevin_steps > 0``, by Langevin corrector steps at ``sigma_{i+1}`` with the
guided score. The noise is drawn in the same order with and without guidance, so a zero guidance
(``q == p_train``) gives bit-identical samples for the same seed.

:func:`importance_resample` is the SIR baseline: weights ``r = q / p_train`` at samples of the
unadapted posterior, then multinomial resampling.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from rankwise.core.validate import check_int
from rankwise.science.priorguide.diffusion import sigma_grid
from rankwise.science.priorguide.guidance import PriorGuide, guidance_term
from rankwise.science.priorguide.priors import _log_prob

__all__ = ["SIRResult", "SampleResult", "importance_resample", "sample"]


@dataclass
class SampleResult:
    """Posterior samples and what the sampler did.

    ``samples`` [n, D] (float32 on CPU); ``time_s`` wall time; ``cpu_s`` CPU time of this process (the
    robust measure on a shared machine); ``steps`` predictor steps;
    ``score_evals`` score-network evaluations; ``clipped_fraction`` fraction of guidance evaluations
    whose norm was clipped; ``guidance_norm`` mean ``||g||`` per step (empty without guidance).
    """

    samples: Tensor
    time_s: float
    cpu_s: float
    steps: int
    score_evals: int
    clipped_fraction: float = 0.0
    guidance_norm: list[float] = field(default_factory=list)


def _check_x(model: Any, x_obs: Tensor) -> Tensor:
    x = torch.as_tensor(x_obs, dtype=torch.float32).reshape(-1)
    if x.numel() != model.x_dim:
        raise ValueError(f"x_obs has {x.numel()} values, the model expects x_dim={model.x_dim}")
    if not torch.isfinite(x).all():
        raise ValueError("x_obs contains NaN or inf")
    return x


def _guided(model: Any, guide: PriorGuide | None, theta: Tensor, sigma: Tensor, x: Tensor,
            stats: dict[str, Any]) -> Tensor:
    with torch.no_grad():
        s = model.score(theta, sigma, x)
    stats["evals"] += 1
    if guide is None:
        return s
    term = guidance_term(guide, model, theta, sigma, x, score=s)
    if guide.jacobian:
        stats["evals"] += 1
    stats["clipped"] += int(term.clipped.sum())
    stats["guided"] += theta.shape[0]
    stats["norm"].append(float(term.g.norm(dim=-1).mean()))
    return s + term.g


def sample(model: Any, x_obs: Tensor, n: int = 1000, *, guidance: PriorGuide | None = None, steps: int = 100,
           seed: int = 0, sigmas: Tensor | None = None) -> SampleResult:
    """``n`` samples of the (guided) posterior at ``x_obs`` [M] from a score model (:class:`ScoreModel`).

    ``guidance``: a :class:`PriorGuide` (None: the unadapted posterior). ``steps``: Euler-Maruyama
    steps on the geometric grid from the model's ``sigma_max`` to ``sigma_min``; ``sigmas``: a custom
    strictly decreasing grid instead. Deterministic given ``seed``.
    """
    x = _check_x(model, x_obs)
    check_int("sample.n", n, lo=1)
    if sigmas is None:
        grid = sigma_grid(model.sigma_max, model.sigma_min, check_int("sample.steps", steps, lo=1))
    else:
        grid = torch.as_tensor(sigmas, dtype=torch.float64).reshape(-1)
        if grid.numel() < 2 or not torch.isfinite(grid).all() or (grid <= 0).any():
            raise ValueError("sample.sigmas must hold >= 2 finite positive noise levels")
        if not (grid[1:] < grid[:-1]).all():
            raise ValueError("sample.sigmas must be strictly decreasing (a non-monotone schedule)")
    if guidance is not None and not isinstance(guidance, PriorGuide):
        raise TypeError(f"sample.guidance must be a PriorGuide or None, got {type(guidance).__name__}")
    gen = torch.Generator().manual_seed(seed)
    d = model.theta_dim
    theta = model.init_mean + model.init_std * torch.randn(n, d, generator=gen, dtype=torch.float64)
    stats: dict[str, Any] = {"evals": 0, "clipped": 0, "guided": 0, "norm": []}
    lsteps = guidance.langevin_steps if guidance is not None else 0
    t0, c0 = time.perf_counter(), time.process_time()
    for i in range(grid.numel() - 1):
        s_hi, s_lo = grid[i], grid[i + 1]
        dv = s_hi**2 - s_lo**2
        z = torch.randn(n, d, generator=gen, dtype=torch.float64)
        theta = theta + dv * _guided(model, guidance, theta, s_hi, x, stats) + torch.sqrt(dv) * z
        for _ in range(lsteps):
            sc = _guided(model, guidance, theta, s_lo, x, stats)
            zc = torch.randn(n, d, generator=gen, dtype=torch.float64)
            ratio = zc.norm(dim=-1).mean() / sc.norm(dim=-1).mean().clamp_min(1e-12)
            eps = 2.0 * (guidance.langevin_snr * ratio) ** 2  # type: ignore[union-attr]
            theta = theta + eps * sc + torch.sqrt(2.0 * eps) * zc
    if not torch.isfinite(theta).all():
        raise FloatingPointError("sample: non-finite samples (the score model returned NaN/inf)")
    elapsed, cpu = time.perf_counter() - t0, time.process_time() - c0
    clipped = stats["clipped"] / stats["guided"] if stats["guided"] else 0.0
    return SampleResult(theta.to(torch.float32), elapsed, cpu, grid.numel() - 1, stats["evals"], clipped, stats["norm"])


@dataclass
class SIRResult:
    """Importance resampling: ``samples`` [n, D] (resampled with replacement), ``ess`` the effective
    sample size of the normalised weights, ``log_weights`` [P] (normalised) of the proposals."""

    samples: Tensor
    ess: float
    log_weights: Tensor


def importance_resample(proposals: Tensor, new_prior: Any, train_prior: Any, n: int | None = None, *,
                        seed: int = 0) -> SIRResult:
    """Sampling-importance-resampling from unadapted posterior samples ``proposals`` [P, D] with
    weights ``q / p_train`` (exact densities; draws outside the training support get weight 0)."""
    th = torch.as_tensor(proposals, dtype=torch.float64)
    if th.ndim != 2 or th.shape[0] < 1:
        raise ValueError(f"proposals must be [P, D], got {tuple(th.shape)}")
    n = th.shape[0] if n is None else check_int("importance_resample.n", n, lo=1)
    lw = _log_prob(new_prior, th) - _log_prob(train_prior, th)
    lw = torch.where(torch.isfinite(lw), lw, torch.tensor(-math.inf, dtype=torch.float64))
    if not torch.isfinite(lw).any():
        raise ValueError("importance_resample: every proposal has zero weight")
    lw = lw - torch.logsumexp(lw, 0)
    w = torch.exp(lw)
    gen = torch.Generator().manual_seed(seed)
    idx = torch.multinomial(w, n, replacement=True, generator=gen)
    return SIRResult(th[idx].to(torch.float32), float(1.0 / w.pow(2).sum()), lw)
