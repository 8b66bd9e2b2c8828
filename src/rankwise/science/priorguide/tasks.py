"""Simulators with reference posteriors (spec "Reproduction at small scale"), and the metrics.

* Gaussian linear: ``x = theta + N(0, noise^2 I)``; under a Gaussian-mixture prior the posterior is a
  Gaussian mixture in closed form (:func:`gaussian_linear_posterior`).
* Two moons (the standard SBI benchmark version, ``theta`` in R^2): the likelihood is known in closed
  form; reference posteriors under any prior come from a grid that follows the likelihood's arc
  (:func:`two_moons_reference`), or from rejection where the prior covers the observation
  (:func:`two_moons_rejection`).
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

__all__ = ["c2st", "gaussian_linear", "gaussian_linear_posterior", "grid_reference", "mean_rmse", "mmd2", "sir",
           "sir_curve", "sir_log_likelihood", "sir_reference", "two_moons",
           "two_moons_log_likelihood", "two_moons_reference", "two_moons_rejection"]


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


TWO_MOONS_R = (0.1, 0.01)  # the radius of the moon: mean and std of ``r`` in :func:`two_moons`


def _two_moons_theta(x: Tensor, r: Tensor, a: Tensor, branch: Tensor) -> tuple[Tensor, Tensor]:
    """``theta`` [N, 2] that puts the moon point at radius ``r``, angle ``a`` onto ``x`` on branch ``branch``
    (the sign of ``t1 + t2``), and whether that point exists (``|t1 + t2| >= 0``)."""
    off1 = x[0] - (r * torch.cos(a) + 0.25)
    off2 = x[1] - r * torch.sin(a)
    s = branch * (-math.sqrt(2.0) * off1)  # |t1 + t2| = -sqrt(2) off1: needs off1 <= 0
    d = math.sqrt(2.0) * off2  # t2 - t1
    return torch.stack([(s - d) / 2, (s + d) / 2], -1), off1 <= 0


def two_moons_reference(x_obs: Tensor, prior: object, n: int, *, seed: int = 0, box: BoxUniform | None = None,
                        cells: tuple[int, int] = (200, 2000)) -> Tensor:
    """Samples of the two-moons posterior ``prop. to p(x_obs | theta) prior(theta)`` (restricted to ``box`` if
    given) on a grid that follows the likelihood, so they do not depend on where ``prior`` puts its mass.

    Given ``x_obs``, every ``theta`` with non-zero likelihood is the image of a moon point (radius ``r``,
    angle ``a`` in (-pi/2, pi/2)) and a branch (the sign of ``t1 + t2``): ``theta`` is linear in the point
    with unit Jacobian on each branch, and the point's density in polar coordinates is ``N(r; 0.1, 0.01) /
    (pi r)`` times ``r``. So the posterior in ``(r, a, branch)`` is ``prop. to prior(theta(r, a, branch))
    N(r; 0.1, 0.01)``: evaluated on a ``cells[0] x cells[1]`` grid per branch over ``r`` in 0.1 +- 8 x 0.01 and
    ``a`` in (-pi/2, pi/2), cells drawn by their mass, a uniform point inside each drawn cell (the cell size,
    8e-4 in ``r`` and 1.6e-3 rad in ``a`` by default, bounds the error), mapped to ``theta``. Jittered
    points that leave the valid set (the ``|t1 + t2| >= 0`` edge, the box) are replaced by new draws.
    :func:`two_moons_rejection` is the exact sampler where the prior covers the likelihood (a test checks
    that the two agree)."""
    check_int("two_moons_reference.n", n, lo=1)
    nr, na = (check_int("two_moons_reference.cells", c, lo=2) for c in cells)
    from rankwise.science.priorguide.priors import _log_prob

    x = torch.as_tensor(x_obs, dtype=torch.float64).reshape(-1)
    if x.numel() != 2 or not torch.isfinite(x).all():
        raise ValueError(f"two_moons_reference takes a finite x_obs of 2 values, got {x_obs!r}")
    mr, sr = TWO_MOONS_R
    r_lo, dr, da = mr - 8 * sr, 16 * sr / nr, math.pi / na
    rc = r_lo + dr * (torch.arange(nr, dtype=torch.float64) + 0.5)
    ac = -math.pi / 2 + da * (torch.arange(na, dtype=torch.float64) + 0.5)
    gr, ga = torch.meshgrid(rc, ac, indexing="ij")
    gr, ga = gr.reshape(-1).repeat(2), ga.reshape(-1).repeat(2)
    gb = torch.cat([torch.ones(nr * na, dtype=torch.float64), -torch.ones(nr * na, dtype=torch.float64)])

    def log_target(r: Tensor, a: Tensor, b: Tensor) -> tuple[Tensor, Tensor]:
        th, ok = _two_moons_theta(x, r, a, b)
        if box is not None:
            ok = ok & box.contains(th)
        lp = torch.full_like(r, -math.inf)
        if ok.any():
            lp[ok] = _log_prob(prior, th[ok]) - 0.5 * ((r[ok] - mr) / sr) ** 2
        return lp, th

    logw, _ = log_target(gr, ga, gb)
    finite = torch.isfinite(logw)
    if not finite.any():
        raise ValueError("two_moons_reference: no theta (in the box) can produce x_obs")
    w = torch.softmax(torch.where(finite, logw, torch.tensor(-math.inf, dtype=torch.float64)), 0)
    gen = torch.Generator().manual_seed(seed)
    out, got = [], 0
    for _ in range(100):
        idx = torch.multinomial(w, 2 * n, replacement=True, generator=gen)
        u = torch.rand(2 * n, 2, generator=gen, dtype=torch.float64) - 0.5
        lp, th = log_target(gr[idx] + u[:, 0] * dr, ga[idx] + u[:, 1] * da, gb[idx])
        keep = torch.isfinite(lp)
        out.append(th[keep])
        got += int(keep.sum())
        if got >= n:
            break
    if got < n:
        raise ValueError("two_moons_reference: the posterior's cells are too coarse for its support; raise cells")
    return torch.cat(out)[:n].to(torch.float32)


def two_moons_rejection(x_obs: Tensor, prior: object, n: int, *, seed: int = 0, box: BoxUniform | None = None,
                        batch: int = 200_000, max_batches: int = 200) -> Tensor:
    """Exact samples of the two-moons posterior under ``prior`` (restricted to ``box`` if given) by rejection
    from the prior (bound: the likelihood's maximum over the radius, ``max_r N(r; 0.1, 0.01) / (pi r)``).
    It accepts about ``p(x_obs)`` per draw: fine where the prior covers the observation, hopeless in its
    tail (use :func:`two_moons_reference` there)."""
    check_int("two_moons_rejection.n", n, lo=1)
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
        if box is not None:
            keep = keep & box.contains(th)
        out.append(th[keep])
        got += int(keep.sum())
        if got >= n:
            break
    if got < n:
        raise ValueError(f"two_moons_rejection: only {got} of {n} samples accepted; the prior misses x_obs "
                         "(two_moons_reference does not depend on it)")
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


# ---- SIR epidemic (spec "Reproduction at small scale" (c)) -----------------------------------------------

#: Observation times (weeks) and noise of :func:`sir`; the initial state is ``(S, I, R) = (0.99, 0.01, 0)``.
SIR_TIMES = tuple(float(t) for t in range(1, 11))
SIR_NOISE = 0.02
SIR_I0 = 0.01


def sir_curve(theta: Tensor, times: tuple[float, ...] = SIR_TIMES, dt: float = 0.05) -> Tensor:
    """The infected fraction ``I(t)`` [N, len(times)] of the SIR ODE ``S' = -b S I``, ``I' = b S I - g I``
    for ``theta = (b, g)`` [N, 2] (rates per week), by fixed-step RK4 (float64, vectorised over N)."""
    th = torch.as_tensor(theta, dtype=torch.float64)
    if th.ndim != 2 or th.shape[1] != 2:
        raise ValueError(f"sir takes theta [N, 2] = (infection rate, recovery rate), got {tuple(th.shape)}")
    check_number("sir_curve.dt", dt, lo=0.0, low_open=True)
    b, g = th[:, 0], th[:, 1]
    s = torch.full_like(b, 1.0 - SIR_I0)
    i = torch.full_like(b, SIR_I0)

    def f(s: Tensor, i: Tensor) -> tuple[Tensor, Tensor]:
        inf = b * s * i
        return -inf, inf - g * i

    out, t = [], 0.0
    for target in times:
        n = max(1, int(round((target - t) / dt)))
        h = (target - t) / n
        for _ in range(n):
            k1 = f(s, i)
            k2 = f(s + 0.5 * h * k1[0], i + 0.5 * h * k1[1])
            k3 = f(s + 0.5 * h * k2[0], i + 0.5 * h * k2[1])
            k4 = f(s + h * k3[0], i + h * k3[1])
            s = s + h / 6 * (k1[0] + 2 * k2[0] + 2 * k3[0] + k4[0])
            i = i + h / 6 * (k1[1] + 2 * k2[1] + 2 * k3[1] + k4[1])
        t = target
        out.append(i)
    return torch.stack(out, -1)


def sir(theta: Tensor, generator: torch.Generator | None = None, noise: float = SIR_NOISE) -> Tensor:
    """The SIR simulator: 10 weekly observations of the infected fraction plus ``N(0, noise^2)``; [N, 10]."""
    curve = sir_curve(theta)
    return (curve + noise * torch.randn(curve.shape, generator=generator, dtype=torch.float64)).to(theta.dtype)


def sir_log_likelihood(theta: Tensor, x_obs: Tensor, noise: float = SIR_NOISE) -> Tensor:
    """``log p(x_obs | theta)`` [N] of :func:`sir` (Gaussian observation noise)."""
    x = torch.as_tensor(x_obs, dtype=torch.float64).reshape(-1)
    r = sir_curve(theta) - x[None]
    return -0.5 * (r**2).sum(-1) / noise**2 - x.numel() * math.log(noise * math.sqrt(2 * math.pi))


def grid_reference(log_lik, x_obs: Tensor, prior: object, box: BoxUniform, n: int, *, cells: int = 300,
                   seed: int = 0) -> Tensor:
    """Exact-up-to-discretisation samples of a 2-D posterior ``prop. to p(x_obs | theta) prior(theta)`` on
    ``box``: the unnormalised density on a ``cells x cells`` grid, cells drawn by their mass, a uniform
    point inside each drawn cell (the cell size bounds the error). ``log_lik(theta, x_obs) -> [N]``."""
    check_int("grid_reference.n", n, lo=1)
    check_int("grid_reference.cells", cells, lo=2)
    if box.low.numel() != 2:
        raise ValueError("grid_reference works in 2 dimensions")
    from rankwise.science.priorguide.priors import _log_prob

    lo, hi = box.low, box.high
    width = (hi - lo) / cells
    ax = [lo[d] + width[d] * (torch.arange(cells, dtype=torch.float64) + 0.5) for d in range(2)]
    g0, g1 = torch.meshgrid(ax[0], ax[1], indexing="ij")
    pts = torch.stack([g0.reshape(-1), g1.reshape(-1)], -1)
    logp = log_lik(pts, x_obs) + _log_prob(prior, pts)
    if not torch.isfinite(logp).any():
        raise ValueError("grid_reference: the posterior has no mass on the grid")
    w = torch.softmax(torch.where(torch.isfinite(logp), logp, torch.tensor(-math.inf, dtype=torch.float64)), 0)
    gen = torch.Generator().manual_seed(seed)
    idx = torch.multinomial(w, n, replacement=True, generator=gen)
    jitter = (torch.rand(n, 2, generator=gen, dtype=torch.float64) - 0.5) * width
    return (pts[idx] + jitter).to(torch.float32)


def sir_reference(x_obs: Tensor, prior: object, box: BoxUniform, n: int, *, seed: int = 0, cells: int = 300) -> Tensor:
    """Reference samples of the SIR posterior under ``prior`` restricted to ``box`` (:func:`grid_reference`)."""
    return grid_reference(sir_log_likelihood, x_obs, prior, box, n, cells=cells, seed=seed)


# ---- MMD ----------------------------------------------------------------------------------------------------

def mmd2(a: Tensor, b: Tensor, scale: float | None = None) -> float:
    """Unbiased squared maximum mean discrepancy between samples ``a`` [N, D] and ``b`` [M, D] with a
    Gaussian kernel ``exp(-|u - v|^2 / (2 scale^2))``; ``scale=None`` takes the median pairwise distance
    of the pooled samples (the same estimator and heuristic as ``sbi.utils.metrics.unbiased_mmd_squared``).
    0 in expectation for equal distributions (it can be slightly negative)."""
    xa = torch.as_tensor(a, dtype=torch.float64)
    xb = torch.as_tensor(b, dtype=torch.float64)
    if xa.ndim != 2 or xb.ndim != 2 or xa.shape[1] != xb.shape[1] or len(xa) < 2 or len(xb) < 2:
        raise ValueError(f"mmd2 needs two [N >= 2, D] sample sets of one dimension, got {tuple(xa.shape)} and "
                         f"{tuple(xb.shape)}")
    daa, dbb, dab = torch.cdist(xa, xa) ** 2, torch.cdist(xb, xb) ** 2, torch.cdist(xa, xb) ** 2
    ia = torch.tril_indices(len(xa), len(xa), -1)
    ib = torch.tril_indices(len(xb), len(xb), -1)
    laa, lbb = daa[ia[0], ia[1]], dbb[ib[0], ib[1]]
    if scale is None:
        scale = float(torch.median(torch.sqrt(torch.cat([laa, dab.reshape(-1), lbb]))))
    c = -0.5 / max(float(scale), 1e-8) ** 2
    kaa = torch.exp(c * laa).mean()
    kbb = torch.exp(c * lbb).mean()
    kab = torch.exp(c * dab).mean()
    return float(kaa + kbb - 2 * kab)
