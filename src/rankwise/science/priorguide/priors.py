"""Priors and the prior ratio r(theta) = q(theta) / p_train(theta) as a Gaussian mixture (spec §4).

* :class:`GaussianMixture`: weights ``[K]``, means ``[K, D]``, covariances ``[K, D, D]``; validated
  (weights >= 0 summing to 1, symmetric positive-definite covariances, matching dimensions, finite).
* :class:`BoxUniform`: the uniform training prior of most SBI benchmarks.
* :func:`fit_gmm`: weighted EM (k-means++ start, log-sum-exp E step, covariance floor).
* :func:`prior_ratio`: the ratio as a mixture, exact where it can be (identical priors: constant;
  uniform training box: the new prior itself), else weighted EM on samples (choice: proposal = the
  new prior, weights proportional to r / q = 1 / p_train, self-normalised and capped).

Every density here works in float64 internally and takes/returns ``[N, D]`` tensors.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch
from torch import Tensor

from rankwise.core.validate import check_int, check_number

__all__ = [
    "BoxUniform",
    "Density",
    "GaussianMixture",
    "PriorRatio",
    "PriorSupportWarning",
    "fit_gmm",
    "prior_ratio",
]

#: Relative floor added to EM covariances (times the data variance) so that no component collapses.
COV_FLOOR = 1e-6
#: Largest weight one sample may carry in the weighted EM, as a multiple of the mean weight.
MAX_WEIGHT_RATIO = 50.0


class PriorSupportWarning(UserWarning):
    """The new prior puts mass where the training prior has none (the ratio is undefined there)."""


@runtime_checkable
class Density(Protocol):
    """Anything with ``log_prob(theta [N, D]) -> [N]`` and ``sample(n, generator) -> [N, D]``."""

    def log_prob(self, theta: Tensor) -> Tensor: ...


def _as_matrix(name: str, value: Any, dim: int | None = None) -> Tensor:
    t = torch.as_tensor(value, dtype=torch.float64)
    if t.ndim == 1:
        t = t[None]
    if t.ndim != 2:
        raise ValueError(f"{name} must be [N, D], got shape {tuple(t.shape)}")
    if dim is not None and t.shape[1] != dim:
        raise ValueError(f"{name} has dimension {t.shape[1]}, the prior has {dim}")
    if not torch.isfinite(t).all():
        raise ValueError(f"{name} contains NaN or inf")
    return t


def _tensor(value: Any) -> Tensor:
    """float64 tensor from a tensor, an array or a (nested) list that may hold tensors."""
    if isinstance(value, (list, tuple)) and value and all(isinstance(v, Tensor) for v in value):
        return torch.stack([v.to(torch.float64) for v in value])
    return torch.as_tensor(value, dtype=torch.float64)


class GaussianMixture:
    """A Gaussian mixture ``sum_k w_k N(theta | m_k, C_k)``: a new prior, or the fitted prior ratio.

    ``weights`` [K] (>= 0, summing to 1 within 1e-6), ``means`` [K, D], ``covs`` [K, D, D] (symmetric
    positive definite). Raises ``ValueError`` naming the field otherwise.
    """

    def __init__(self, weights: Any, means: Any, covs: Any) -> None:
        w = _tensor(weights).reshape(-1)
        m = _tensor(means)
        c = _tensor(covs)
        if m.ndim == 1:
            m = m[None]
        if c.ndim == 2:
            c = c[None]
        if m.ndim != 2 or c.ndim != 3:
            raise ValueError(f"GaussianMixture.means must be [K, D] and covs [K, D, D], got shapes "
                             f"{tuple(m.shape)} and {tuple(c.shape)}")
        k, d = m.shape
        if w.numel() != k or c.shape != (k, d, d):
            raise ValueError(f"GaussianMixture: weights {tuple(w.shape)}, means {tuple(m.shape)} and covs "
                             f"{tuple(c.shape)} disagree (want [K], [K, D], [K, D, D])")
        for name, t in (("weights", w), ("means", m), ("covs", c)):
            if not torch.isfinite(t).all():
                raise ValueError(f"GaussianMixture.{name} must be finite, got {t.tolist()}")
        if (w < 0).any() or abs(float(w.sum()) - 1.0) > 1e-6:
            raise ValueError(f"GaussianMixture.weights must be >= 0 and sum to 1, got {w.tolist()}")
        if not torch.allclose(c, c.transpose(-1, -2), atol=1e-9, rtol=1e-7):
            raise ValueError("GaussianMixture.covs must be symmetric")
        eig = torch.linalg.eigvalsh(c)
        if (eig <= 0).any():
            bad = int((eig <= 0).any(-1).nonzero()[0])
            raise ValueError(f"GaussianMixture.covs[{bad}] must be positive definite, got eigenvalues "
                             f"{eig[bad].tolist()}")
        self.weights, self.means, self.covs = w, m, c
        self.chol = torch.linalg.cholesky(c)

    @property
    def dim(self) -> int:
        return int(self.means.shape[1])

    @property
    def n_components(self) -> int:
        return int(self.means.shape[0])

    def component_log_prob(self, theta: Tensor) -> Tensor:
        """``log N(theta_n | m_k, C_k)`` as ``[N, K]`` (float64)."""
        x = _as_matrix("theta", theta, self.dim)
        diff = x[:, None, :] - self.means[None]  # [N, K, D]
        z = torch.linalg.solve_triangular(self.chol[None], diff[..., None], upper=False)[..., 0]
        logdet = 2.0 * torch.log(torch.diagonal(self.chol, dim1=-2, dim2=-1)).sum(-1)
        return -0.5 * (z.pow(2).sum(-1) + logdet + self.dim * math.log(2 * math.pi))

    def log_prob(self, theta: Tensor) -> Tensor:
        """``log q(theta)`` as ``[N]`` (float64), by log-sum-exp over components."""
        return torch.logsumexp(self.component_log_prob(theta) + torch.log(self.weights), dim=-1)

    def sample(self, n: int, generator: torch.Generator | None = None) -> Tensor:
        """``n`` samples ``[n, D]`` (float64)."""
        check_int("GaussianMixture.sample.n", n, lo=1)
        k = torch.multinomial(self.weights, n, replacement=True, generator=generator)
        z = torch.randn(n, self.dim, generator=generator, dtype=torch.float64)
        return self.means[k] + (self.chol[k] @ z[..., None])[..., 0]

    def mean(self) -> Tensor:
        return (self.weights[:, None] * self.means).sum(0)

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, GaussianMixture) and other.means.shape == self.means.shape
                and torch.equal(other.weights, self.weights) and torch.equal(other.means, self.means)
                and torch.equal(other.covs, self.covs))

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"GaussianMixture(K={self.n_components}, D={self.dim})"


class BoxUniform:
    """Uniform prior on the box ``[low, high]`` (``low``/``high`` [D], ``low < high``)."""

    def __init__(self, low: Any, high: Any) -> None:
        lo = torch.as_tensor(low, dtype=torch.float64).reshape(-1)
        hi = torch.as_tensor(high, dtype=torch.float64).reshape(-1)
        if lo.shape != hi.shape or not torch.isfinite(lo).all() or not torch.isfinite(hi).all():
            raise ValueError(f"BoxUniform.low and high must be finite vectors of one length, got {lo.tolist()} "
                             f"and {hi.tolist()}")
        if not (lo < hi).all():
            raise ValueError(f"BoxUniform.low must be < high in every dimension, got {lo.tolist()} and {hi.tolist()}")
        self.low, self.high = lo, hi

    @property
    def dim(self) -> int:
        return int(self.low.numel())

    def contains(self, theta: Tensor) -> Tensor:
        x = _as_matrix("theta", theta, self.dim)
        return ((x >= self.low) & (x <= self.high)).all(-1)

    def log_prob(self, theta: Tensor) -> Tensor:
        inside = self.contains(theta)
        val = -torch.log(self.high - self.low).sum()
        return torch.where(inside, val, torch.tensor(-math.inf, dtype=torch.float64))

    def sample(self, n: int, generator: torch.Generator | None = None) -> Tensor:
        check_int("BoxUniform.sample.n", n, lo=1)
        u = torch.rand(n, self.dim, generator=generator, dtype=torch.float64)
        return self.low + u * (self.high - self.low)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, BoxUniform) and torch.equal(other.low, self.low) and torch.equal(other.high, self.high)

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"BoxUniform(low={self.low.tolist()}, high={self.high.tolist()})"


def _log_prob(prior: Any, theta: Tensor) -> Tensor:
    """``prior.log_prob`` for ours or a ``torch.distributions`` one (float64 ``[N]``)."""
    if isinstance(prior, (GaussianMixture, BoxUniform)):
        return prior.log_prob(theta)
    lp = prior.log_prob(theta.to(torch.float32) if theta.dtype != torch.float32 else theta)
    return lp.to(torch.float64).reshape(theta.shape[0], -1).sum(-1)


def _sample(prior: Any, n: int, generator: torch.Generator) -> Tensor:
    if isinstance(prior, (GaussianMixture, BoxUniform)):
        return prior.sample(n, generator)
    # torch.distributions take no generator: draw under a fork of the global RNG seeded from ours
    seed = int(torch.randint(0, 2**62, (1,), generator=generator))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return prior.sample((n,)).to(torch.float64).reshape(n, -1)


@dataclass
class PriorRatio:
    """The prior ratio ``r(theta) ~ c * sum_k w_k N(theta | m_k, C_k)`` (the constant c is irrelevant).

    ``mixture`` is None exactly when the ratio is constant (``q == p_train``): guidance is then zero.
    ``method``: ``"constant"``, ``"box-exact"`` (uniform training prior: r is q on the box),
    ``"weighted-em"``. ``info`` holds diagnostics (effective sample size of the EM weights, mass of
    q outside the training support, EM iterations and log-likelihood).
    """

    mixture: GaussianMixture | None
    method: str
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def constant(self) -> bool:
        return self.mixture is None

    def log_ratio(self, theta: Tensor) -> Tensor:
        """``log r(theta)`` up to a constant, ``[N]`` (zeros for a constant ratio)."""
        if self.mixture is None:
            return torch.zeros(theta.shape[0], dtype=torch.float64)
        return self.mixture.log_prob(theta)


def _kmeanspp(x: Tensor, w: Tensor, k: int, gen: torch.Generator) -> Tensor:
    idx = [int(torch.multinomial(w, 1, generator=gen))]
    d2 = (x - x[idx[0]]).pow(2).sum(-1)
    for _ in range(1, k):
        p = w * d2
        p = p / p.sum() if float(p.sum()) > 0 else w
        idx.append(int(torch.multinomial(p, 1, generator=gen)))
        d2 = torch.minimum(d2, (x - x[idx[-1]]).pow(2).sum(-1))
    return x[idx].clone()


@dataclass
class EMResult:
    mixture: GaussianMixture
    iterations: int
    log_likelihood: float
    converged: bool


def fit_gmm(samples: Tensor, weights: Tensor | None = None, n_components: int = 2, *, iters: int = 200,
            tol: float = 1e-7, seed: int = 0) -> EMResult:
    """Weighted EM for a ``K``-component full-covariance Gaussian mixture.

    ``samples`` [N, D]; ``weights`` [N] >= 0 (None: uniform), normalised internally. The E step uses
    log-sum-exp; covariances get ``COV_FLOOR * mean data variance`` on the diagonal. Deterministic
    given ``seed`` (k-means++ start). Stops when the mean weighted log-likelihood improves by < tol.
    """
    x = _as_matrix("samples", samples)
    n, d = x.shape
    k = check_int("fit_gmm.n_components", n_components, lo=1)
    check_int("fit_gmm.iters", iters, lo=1)
    if n < k:
        raise ValueError(f"fit_gmm needs at least n_components={k} samples, got {n}")
    w = torch.ones(n, dtype=torch.float64) if weights is None else torch.as_tensor(weights, dtype=torch.float64)
    if w.shape != (n,) or not torch.isfinite(w).all() or (w < 0).any() or float(w.sum()) <= 0:
        raise ValueError("fit_gmm.weights must be [N], finite, >= 0 and not all zero")
    w = w / w.sum()
    gen = torch.Generator().manual_seed(seed)
    mu = _kmeanspp(x, w, k, gen)
    var = float((w[:, None] * (x - (w[:, None] * x).sum(0)).pow(2)).sum(0).mean())
    floor = COV_FLOOR * max(var, 1e-12) * torch.eye(d, dtype=torch.float64)
    cov = torch.stack([var * torch.eye(d, dtype=torch.float64)] * k)
    pi = torch.full((k,), 1.0 / k, dtype=torch.float64)
    prev, ll, it, converged = -math.inf, -math.inf, 0, False
    for it in range(1, iters + 1):
        gm = GaussianMixture(pi, mu, cov)
        logp = gm.component_log_prob(x) + torch.log(pi)  # [N, K]
        lse = torch.logsumexp(logp, -1, keepdim=True)
        resp = torch.exp(logp - lse) * w[:, None]  # weighted responsibilities
        ll = float((w * lse[:, 0]).sum())
        nk = resp.sum(0).clamp_min(1e-300)
        pi = nk / nk.sum()
        mu = (resp.T @ x) / nk[:, None]
        diff = x[None] - mu[:, None]  # [K, N, D]
        cov = torch.einsum("kn,kni,knj->kij", resp.T, diff, diff) / nk[:, None, None] + floor
        cov = 0.5 * (cov + cov.transpose(-1, -2))
        if ll - prev < tol * max(1.0, abs(ll)):
            converged = True
            break
        prev = ll
    return EMResult(GaussianMixture(pi, mu, cov), it, ll, converged)


def _support_mass(new_prior: Any, train_prior: Any, n: int, gen: torch.Generator) -> float:
    th = _sample(new_prior, n, gen)
    lp = _log_prob(train_prior, th)
    return float((~torch.isfinite(lp)).double().mean())


def prior_ratio(new_prior: Any, train_prior: Any, *, n_components: int = 4, n_samples: int = 20_000,
                seed: int = 0, em_iters: int = 200, support_tol: float = 1e-3) -> PriorRatio:
    """The prior ratio ``r = q / p_train`` as a Gaussian mixture (spec §4).

    * ``new_prior == train_prior``: constant ratio (``mixture=None``; guidance is exactly zero);
    * ``train_prior`` a :class:`BoxUniform` and ``new_prior`` a :class:`GaussianMixture`: r is q on the
      box, so the mixture is q itself (``"box-exact"``);
    * otherwise (any priors with ``log_prob`` and ``sample``, ``torch.distributions`` included):
      weighted EM with ``n_components`` on ``n_samples`` draws from q, weights ``1 / p_train``
      (self-normalised, capped at ``MAX_WEIGHT_RATIO`` times the mean) (``"weighted-em"``).

    Warns :class:`PriorSupportWarning` when more than ``support_tol`` of q's mass lies outside the
    training prior's support (the ratio is undefined there; those draws are dropped).
    """
    check_int("prior_ratio.n_samples", n_samples, lo=10)
    check_number("prior_ratio.support_tol", support_tol, lo=0.0, hi=1.0)
    d_new = getattr(new_prior, "dim", None)
    d_train = getattr(train_prior, "dim", None)
    if d_new is not None and d_train is not None and d_new != d_train:
        raise ValueError(f"prior_ratio: the new prior has dimension {d_new}, the training prior {d_train}")
    if new_prior is train_prior or (isinstance(new_prior, (GaussianMixture, BoxUniform)) and new_prior == train_prior):
        return PriorRatio(None, "constant", {"reason": "the new prior equals the training prior"})
    gen = torch.Generator().manual_seed(seed)
    outside = _support_mass(new_prior, train_prior, min(n_samples, 20_000), gen)
    if outside > support_tol:
        warnings.warn(f"{outside:.1%} of the new prior's mass lies outside the training prior's support, "
                      "where the prior ratio is undefined; the adapted posterior cannot put mass there",
                      PriorSupportWarning, stacklevel=2)
    info: dict[str, Any] = {"mass_outside_training_support": outside}
    if isinstance(train_prior, BoxUniform) and isinstance(new_prior, GaussianMixture):
        return PriorRatio(new_prior, "box-exact", info)
    th = _sample(new_prior, n_samples, gen)
    lp = _log_prob(train_prior, th)
    keep = torch.isfinite(lp)
    th, lp = th[keep], lp[keep]
    if th.shape[0] < max(10, n_components):
        raise ValueError("prior_ratio: too few draws of the new prior fall inside the training prior's support")
    logw = -lp - torch.logsumexp(-lp, 0)
    w = torch.exp(logw)
    w = torch.minimum(w, torch.full_like(w, MAX_WEIGHT_RATIO / w.numel()))
    w = w / w.sum()
    res = fit_gmm(th, w, n_components, iters=em_iters, seed=seed)
    info.update({"ess": float(1.0 / w.pow(2).sum()), "em_iterations": res.iterations,
                 "em_log_likelihood": res.log_likelihood, "em_converged": res.converged})
    return PriorRatio(res.mixture, "weighted-em", info)
