"""Simulators with reference posteriors (spec "Reproduction at small scale"), and the metrics.

* Gaussian linear: ``x = theta + N(0, noise^2 I)``; under a Gaussian-mixture prior the posterior is a
  Gaussian mixture in closed form (:func:`gaussian_linear_posterior`).
* Two moons (the standard SBI benchmark version, ``theta`` in R^2): the likelihood is known in closed
  form, so reference posteriors under any prior come from rejection sampling
  (:func:`two_moons_reference`).
* :func:`c2st`: classifier two-sample test accuracy (scikit-learn random forest, 5-fold CV; 0.5 = same
  distribution); :func:`mean_rmse`: distance between posterior means.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import Tensor

from rankwise.core.validate import check_int, check_number
from rankwise.science.priorguide.priors import BoxUniform, GaussianMixture, _sample

__all__ = ["c2st", "gaussian_linear", "gaussian_linear_posterior", "mean_rmse", "two_moons",
           "two_moons_log_likelihood", "two_moons_reference"]


def gaussian_linear(theta: Tensor, noise: float = 0.1, generator: torch.Generator | None = None) -> Tensor:
    """``x = theta + noise * eps``, ``theta`` [N, D] -> ``x`` [N, D]."""
    check_number("gaussian_linear.noise", noise, lo=0.0, low_open=True)
    return theta + noise * torch.randn(theta.shape, generator=generator, dtype=theta.dtype)


def gaussian_linear_posterior(x_obs: Tensor, prior: GaussianMixture, noise: float = 0.1) -> GaussianMixture:
    """The exact posterior of the Gaussian-linear simulator under a Gaussian-mixture prior.

    Each component is conjugate: ``C' = (C^-1 + I/noise^2)^-1``, ``m' = C' (C^-1 m + x/noise^2)``; the
    weights are re-weighted by the component evidences ``N(x | m, C + noise^2 I)`` (log-sum-exp).
    """
    x = torch.as_tensor(x_obs, dtype=torch.float64).reshape(-1)
    d = prior.dim
    if x.numel() != d:
        raise ValueError(f"x_obs has {x.numel()} values, the prior has dimension {d}")
    eye = torch.eye(d, dtype=torch.float64)
    prec = torch.linalg.inv(prior.covs) + eye / noise**2
    cov = torch.linalg.inv(prec)
    cov = 0.5 * (cov + cov.transpose(-1, -2))
    mean = (cov @ (torch.linalg.solve(prior.covs, prior.means[..., None])[..., 0] + x / noise**2)[..., None])[..., 0]
    ev = GaussianMixture(torch.full((prior.n_components,), 1.0 / prior.n_components, dtype=torch.float64),
                         prior.means, prior.covs + noise**2 * eye).component_log_prob(x[None])[0]
    logw = torch.log(prior.weights) + ev
    w = torch.softmax(logw, 0)
    return GaussianMixture(w / w.sum(), mean, cov)


def gaussian_linear_box_reference(x_obs: Tensor, box: BoxUniform, n: int, noise: float = 0.1,
                                  generator: torch.Generator | None = None) -> Tensor:
    """Exact samples of the Gaussian-linear posterior under a uniform box prior (rejection)."""
    x = torch.as_tensor(x_obs, dtype=torch.float64).reshape(-1)
    out: list[Tensor] = []
    got = 0
    for _ in range(1000):
        th = x + noise * torch.randn(4 * n, x.numel(), generator=generator, dtype=torch.float64)
        th = th[box.contains(th)]
        out.append(th)
        got += th.shape[0]
        if got >= n:
            break
    if got < n:
        raise ValueError("gaussian_linear_box_reference: x_obs lies too far outside the box")
    return torch.cat(out)[:n]


def two_moons(theta: Tensor, generator: torch.Generator | None = None) -> Tensor:
    """The two-moons simulator: ``a ~ U(-pi/2, pi/2)``, ``r ~ N(0.1, 0.01^2)``,
    ``x = (r cos a + 0.25, r sin a) + (-|t1 + t2| / sqrt 2, (-t1 + t2) / sqrt 2)``; ``theta`` [N, 2]."""
    if theta.ndim != 2 or theta.shape[1] != 2:
        raise ValueError(f"two_moons takes theta [N, 2], got {tuple(theta.shape)}")
    n = theta.shape[0]
    a = (torch.rand(n, generator=generator, dtype=theta.dtype) - 0.5) * math.pi
    r = 0.1 + 0.01 * torch.randn(n, generator=generator, dtype=theta.dtype)
    p = torch.stack([r * torch.cos(a) + 0.25, r * torch.sin(a)], -1)
    off = torch.stack([-(theta[:, 0] + theta[:, 1]).abs(), -theta[:, 0] + theta[:, 1]], -1) / math.sqrt(2)
    return p + off


def two_moons_log_likelihood(theta: Tensor, x_obs: Tensor) -> Tensor:
    """``log p(x_obs | theta)`` [N] of :func:`two_moons` (polar change of variables; -inf off the half-plane)."""
    th = torch.as_tensor(theta, dtype=torch.float64)
    x = torch.as_tensor(x_obs, dtype=torch.float64).reshape(-1)
    off = torch.stack([-(th[:, 0] + th[:, 1]).abs(), -th[:, 0] + th[:, 1]], -1) / math.sqrt(2)
    p = x[None] - off
    u, v = p[:, 0] - 0.25, p[:, 1]
    r = torch.sqrt(u**2 + v**2).clamp_min(1e-300)
    log_r = -0.5 * ((r - 0.1) / 0.01) ** 2 - math.log(0.01 * math.sqrt(2 * math.pi))
    ll = log_r - math.log(math.pi) - torch.log(r)
    return torch.where(u > 0, ll, torch.tensor(-math.inf, dtype=torch.float64))


def two_moons_reference(x_obs: Tensor, prior: object, n: int, *, seed: int = 0, batch: int = 200_000,
                        max_batches: int = 200) -> Tensor:
    """Exact samples of the two-moons posterior under ``prior`` by rejection from the prior
    (bound: the likelihood's maximum over the radius, ``max_r N(r; 0.1, 0.01) / (pi r)``)."""
    check_int("two_moons_reference.n", n, lo=1)
    gen = torch.Generator().manual_seed(seed)
    rr = torch.linspace(0.05, 0.15, 10_001, dtype=torch.float64)
    log_bound = float((-0.5 * ((rr - 0.1) / 0.01) ** 2 - math.log(0.01 * math.sqrt(2 * math.pi))
                       - math.log(math.pi) - torch.log(rr)).max()) + 1e-6
    out, got = [], 0
    for _ in range(max_batches):
        th = _sample(prior, batch, gen)
        ll = two_moons_log_likelihood(th, x_obs)
        u = torch.rand(batch, generator=gen, dtype=torch.float64)
        keep = torch.log(u) < ll - log_bound
        out.append(th[keep])
        got += int(keep.sum())
        if got >= n:
            break
    if got < n:
        raise ValueError(f"two_moons_reference: only {got} of {n} samples accepted; the prior misses x_obs")
    return torch.cat(out)[:n].to(torch.float32)


def c2st(a: Tensor, b: Tensor, *, seed: int = 0, folds: int = 5, trees: int = 100) -> float:
    """Classifier two-sample test accuracy between samples ``a`` [N, D] and ``b`` [M, D]: a scikit-learn
    random forest (``trees`` trees, the classifier ``sbi.utils.metrics.c2st`` uses by default) on z-scored pooled
    data, ``folds``-fold stratified CV; 0.5 is chance (same distribution), 1.0 fully separable."""
    from sklearn.ensemble import RandomForestClassifier
    from sklearn.model_selection import StratifiedKFold, cross_val_score

    xa = np.asarray(torch.as_tensor(a, dtype=torch.float64))
    xb = np.asarray(torch.as_tensor(b, dtype=torch.float64))
    if xa.ndim != 2 or xb.ndim != 2 or xa.shape[1] != xb.shape[1]:
        raise ValueError(f"c2st needs two [N, D] sample sets of one dimension, got {xa.shape} and {xb.shape}")
    data = np.concatenate([xa, xb])
    data = (data - data.mean(0)) / data.std(0).clip(1e-12)
    y = np.concatenate([np.zeros(len(xa)), np.ones(len(xb))])
    clf = RandomForestClassifier(n_estimators=trees, random_state=seed)
    cv = StratifiedKFold(n_splits=folds, shuffle=True, random_state=seed)
    return float(np.mean(cross_val_score(clf, data, y, cv=cv, scoring="accuracy")))


def mean_rmse(a: Tensor, b: Tensor) -> float:
    """``||mean(a) - mean(b)|| / sqrt(D)``: the root-mean-square error of a posterior mean."""
    ma = torch.as_tensor(a, dtype=torch.float64).mean(0)
    mb = torch.as_tensor(b, dtype=torch.float64).mean(0)
    return float(torch.sqrt(((ma - mb) ** 2).mean()))
