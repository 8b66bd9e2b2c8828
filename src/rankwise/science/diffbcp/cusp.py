"""Bayesian CP decomposition with a cumulative shrinkage (CUSP) prior on the component weights: one
Gibbs sweep (spec steps 1-7), adaptive truncation and both rank read-outs.

Model (spec "CP model with weights"): ``X = sum_r lambda_r u1_r o ... o uN_r``; factor rows
``u^(n)_{i,:} ~ N(0, I_R)``; ``lambda_r ~ N(0, theta_r)``; noise precision ``tau ~ Gamma(a_tau, b_tau)``;
CUSP (Legramanti, Durante & Dunson 2020): ``theta_r = theta_inf`` when ``z_r <= r`` (spike), else
``InvGamma(a_theta, b_theta)`` (slab); ``P(z_r = l) = omega_l``, stick-breaking ``v_l ~ Beta(1, alpha)``,
``v_R = 1``. An optional fully observed pseudo-measurement ``x`` with precision ``kappa = 1 / rho^2``
(the split-Gibbs coupling of DiffBCP) enters the weight and factor-row updates, never ``tau``.

Everything here runs on float64 torch tensors; randomness comes from one ``numpy.random.Generator``
(normals, gammas, betas, uniforms), so a seed fixes every draw. Tensors are unfolded as
``T.movedim(n, 0).reshape(I_n, -1)``; :func:`khatri_rao` builds the matching design rows.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from rankwise.core.errors import NumericalError
from rankwise.core.validate import check_int, check_number

__all__ = [
    "CPState",
    "CUSPConfig",
    "active_rank",
    "contribution_rank",
    "cp_full",
    "draw_gaussian",
    "init_state",
    "khatri_rao",
    "omega_from_v",
    "row_posterior",
    "sweep",
    "weight_posterior",
]

JITTER0 = 1e-6  # first jitter added to a precision matrix whose Cholesky fails; then x10 up to 10 times


@dataclass(frozen=True)
class CUSPConfig:
    """CP model and CUSP prior hyper-parameters (defaults: the official code's, spec "CUSP prior").

    ``max_rank``: the cap of the adaptive truncation (default ``2 * init_rank``, a choice).
    ``drop_tol``: components with ``|lambda_r|`` below it are dropped at an adaptation step.
    ``contribution_tol``: the contribution rank counts components with ``|lambda_r| prod_n ||u^(n)_r||``
    above this fraction of the largest."""

    init_rank: int = 32
    alpha: float = 2.0
    theta_inf: float = 1e-3
    a_theta: float = 2.0
    b_theta: float = 2.0
    a_tau: float = 1e-3
    b_tau: float = 1e-3
    adapt_b0: float = 1.0
    adapt_b1: float = 0.005
    drop_tol: float = 1e-4
    max_rank: int | None = None
    contribution_tol: float = 0.01
    init_scale: float = 0.1
    adaptive: bool = True
    weight_update: str = "component"

    def __post_init__(self) -> None:
        n = type(self).__name__
        check_int(f"{n}.init_rank", self.init_rank, 1)
        for f in ("alpha", "theta_inf", "a_theta", "b_theta", "a_tau", "b_tau", "init_scale"):
            check_number(f"{n}.{f}", getattr(self, f), 0.0, low_open=True)
        check_number(f"{n}.adapt_b0", self.adapt_b0, 0.0)
        check_number(f"{n}.adapt_b1", self.adapt_b1, 0.0)
        check_number(f"{n}.drop_tol", self.drop_tol, 0.0)
        check_number(f"{n}.contribution_tol", self.contribution_tol, 0.0, 1.0, high_open=True)
        if self.max_rank is not None:
            check_int(f"{n}.max_rank", self.max_rank, self.init_rank)
        if self.weight_update not in ("component", "block"):
            raise ValueError(f"{n}.weight_update must be 'component' or 'block', got {self.weight_update!r}")
        if not isinstance(self.adaptive, bool):
            raise ValueError(f"{n}.adaptive must be a bool, got {self.adaptive!r}")

    @property
    def rank_cap(self) -> int:
        return self.max_rank if self.max_rank is not None else 2 * self.init_rank


@dataclass
class CPState:
    """The sampler's state: factors ``[I_n, R]``, weights ``lam`` [R], ``theta`` [R], ``z`` [R]
    (0-based: component ``r`` is in the spike iff ``z[r] <= r``), ``v`` [R], ``tau``, sweep counter ``t``."""

    factors: list[Tensor]
    lam: Tensor
    theta: Tensor
    z: np.ndarray
    v: np.ndarray
    tau: float
    t: int = 0

    @property
    def rank(self) -> int:
        return int(self.lam.numel())


# ------------------------------------------------------------------------------------- pure math
def omega_from_v(v: np.ndarray) -> np.ndarray:
    """Stick-breaking weights ``omega_l = v_l prod_{m<l} (1 - v_m)``; they sum to 1 when ``v[-1] = 1``."""
    rest = np.concatenate([[1.0], np.cumprod(1.0 - v[:-1])])
    return v * rest


def khatri_rao(factors: list[Tensor], skip: int | None = None, lam: Tensor | None = None) -> Tensor:
    """Rows ``b_j`` (shape [prod_{m != skip} I_m, R]) of the Khatri-Rao product of the factors of every
    mode but ``skip``, in the order of ``T.movedim(skip, 0).reshape(I_skip, -1)``; columns times ``lam``."""
    R = factors[0].shape[1]
    B = torch.ones(1, R, dtype=factors[0].dtype) if lam is None else lam.reshape(1, R).clone()
    for m, U in enumerate(factors):
        if m != skip:
            B = (B[:, None, :] * U[None, :, :]).reshape(-1, R)
    return B


def cp_full(factors: list[Tensor], lam: Tensor) -> Tensor:
    """The full tensor ``sum_r lam_r u1_r o ... o uN_r``."""
    shape = tuple(U.shape[0] for U in factors)
    return (khatri_rao(factors, None, lam).sum(1)).reshape(shape)


def draw_gaussian(prec: Tensor, rhs: Tensor, rng: np.random.Generator | None,
                  what: str = "factor rows") -> Tensor:
    """Draw from ``N(prec^-1 rhs, prec^-1)`` for a batch of precisions [..., R, R] (``rng=None``: the
    mean). The precision is symmetrised; where its Cholesky fails, ``1e-6 * 10^k I`` is added (k = 0..9)."""
    P = 0.5 * (prec + prec.transpose(-1, -2))
    eye = torch.eye(P.shape[-1], dtype=P.dtype)
    L, info = torch.linalg.cholesky_ex(P)
    k = 0
    while bool((info != 0).any()):
        if k >= 10:
            raise NumericalError(f"DiffBCP: the precision of the {what} is not positive definite even with jitter "
                                 f"{JITTER0 * 10 ** (k - 1):g}")
        bad = (info != 0).reshape(*info.shape, 1, 1)
        P = torch.where(bad, P + JITTER0 * 10**k * eye, P)
        L, info = torch.linalg.cholesky_ex(P)
        k += 1
    m = torch.cholesky_solve(rhs.unsqueeze(-1), L).squeeze(-1)
    if rng is None:
        return m
    eps = torch.from_numpy(rng.standard_normal(tuple(rhs.shape))).to(P.dtype).unsqueeze(-1)
    return m + torch.linalg.solve_triangular(L.transpose(-1, -2), eps, upper=True).squeeze(-1)


def row_posterior(Yn: Tensor, Mn: Tensor, B: Tensor, tau: float, Xn: Tensor | None = None,
                  kappa: float = 0.0) -> tuple[Tensor, Tensor]:
    """Precision ``Lambda_i = I + tau sum_{j in Omega_i} b_j b_j^T + kappa sum_j b_j b_j^T`` [I, R, R] and
    right-hand side ``tau sum_{Omega_i} y_ij b_j + kappa sum_j x_ij b_j`` [I, R] of every row of one mode
    (spec step 2); the rows' conditional mean is ``Lambda_i^-1 rhs_i`` (the ridge solution)."""
    R = B.shape[1]
    prec = torch.eye(R, dtype=B.dtype) + tau * torch.einsum("ij,jr,js->irs", Mn, B, B)
    rhs = tau * (Mn * Yn) @ B
    if kappa > 0.0 and Xn is not None:
        prec = prec + kappa * (B.T @ B)
        rhs = rhs + kappa * Xn @ B
    return prec, rhs


def weight_posterior(y: Tensor, m: Tensor, T: Tensor, theta: Tensor, tau: float, x: Tensor | None = None,
                     kappa: float = 0.0) -> tuple[Tensor, Tensor]:
    """Joint precision and right-hand side of the weights ``lambda`` given everything else (spec step 1,
    all components at once): ``diag(1/theta) + tau T_O^T T_O + kappa T^T T``; ``T`` [entries, R] holds
    the unit-weight rank-one tensors as columns, ``y``/``m``/``x`` are flattened."""
    prec = torch.diag(1.0 / theta) + tau * (T * m[:, None]).T @ T
    rhs = tau * T.T @ (m * y)
    if kappa > 0.0 and x is not None:
        prec = prec + kappa * (T.T @ T)
        rhs = rhs + kappa * T.T @ x
    return prec, rhs


def active_rank(z: np.ndarray) -> int:
    """CUSP's active count ``#{r : z_r > r}`` (0-based on both sides)."""
    return int((z > np.arange(len(z))).sum())


def contribution_rank(factors: list[Tensor], lam: Tensor, tol: float = 0.01) -> int:
    """``#{r : |lambda_r| prod_n ||u^(n)_r|| > tol * max}``: robust to the scale shared by weight and columns."""
    c = lam.abs()
    for U in factors:
        c = c * U.norm(dim=0)
    mx = float(c.max()) if c.numel() else 0.0
    return int((c > tol * mx).sum()) if mx > 0 else 0


# -------------------------------------------------------------------------------------- sampler
def _prior_theta(z: np.ndarray, idx: np.ndarray, cfg: CUSPConfig, rng: np.random.Generator) -> np.ndarray:
    slab = 1.0 / rng.gamma(cfg.a_theta, 1.0 / cfg.b_theta, size=len(idx))
    return np.where(z <= idx, cfg.theta_inf, slab)


def _draw_z_prior(omega: np.ndarray, n: int, rng: np.random.Generator) -> np.ndarray:
    cdf = np.cumsum(omega)
    return np.minimum(np.searchsorted(cdf / cdf[-1], rng.random(n), side="right"), len(omega) - 1)


def init_state(shape: tuple[int, ...], cfg: CUSPConfig, rng: np.random.Generator) -> CPState:
    """Spec outer-loop step 1: factors ``N(0, init_scale^2)``, ``lambda_r = 1/R``, ``v``, ``z``, ``theta`` from
    their priors; ``tau`` at its prior mean ``a_tau / b_tau`` (a draw from Gamma(1e-3, 1e-3) is 0.0 in double
    precision most of the time)."""
    R = cfg.init_rank
    factors = [torch.from_numpy(cfg.init_scale * rng.standard_normal((n, R))) for n in shape]
    v = rng.beta(1.0, cfg.alpha, size=R)
    v[-1] = 1.0
    z = _draw_z_prior(omega_from_v(v), R, rng)
    theta = torch.from_numpy(_prior_theta(z, np.arange(R), cfg, rng))
    return CPState(factors, torch.full((R,), 1.0 / R, dtype=torch.float64), theta, z, v, cfg.a_tau / cfg.b_tau)


def _log_spike_slab(lam: np.ndarray, cfg: CUSPConfig) -> tuple[np.ndarray, np.ndarray]:
    spike = -0.5 * math.log(2 * math.pi * cfg.theta_inf) - lam**2 / (2 * cfg.theta_inf)
    nu, s2 = 2 * cfg.a_theta, cfg.b_theta / cfg.a_theta
    slab = (math.lgamma((nu + 1) / 2) - math.lgamma(nu / 2) - 0.5 * math.log(nu * math.pi * s2)
            - (nu + 1) / 2 * np.log1p(lam**2 / (nu * s2)))
    return spike, slab


def _weights_by_component(st: CPState, T: Tensor, y: Tensor, m: Tensor, x: Tensor | None, kappa: float,
                          rng: np.random.Generator) -> Tensor:
    """Spec step 1, component by component: ``P_r = 1/theta_r + tau sum_O T_r^2 + kappa sum T_r^2``,
    mean ``P_r^-1 (tau sum_O T_r (y - X_-r) + kappa sum T_r (x - X_-r))``."""
    lam = st.lam.clone()
    X = T @ lam
    for r in range(lam.numel()):
        t = T[:, r]
        X_r = X - lam[r] * t
        prec = 1.0 / float(st.theta[r]) + st.tau * float((m * t * t).sum())
        num = st.tau * float((m * t * (y - X_r)).sum())
        if kappa > 0.0 and x is not None:
            prec += kappa * float((t * t).sum())
            num += kappa * float((t * (x - X_r)).sum())
        lam[r] = num / prec + rng.standard_normal() / math.sqrt(prec)
        X = X_r + lam[r] * t
    return lam


def sweep(st: CPState, Y: Tensor, M: Tensor, cfg: CUSPConfig, rng: np.random.Generator,
          x: Tensor | None = None, kappa: float = 0.0) -> CPState:
    """One Gibbs sweep (spec steps 1-7) in place; returns ``st``. ``Y``/``M``: data and 0/1 mask (same
    shape, float64), ``x``: the pseudo-measurement (same shape) seen with precision ``kappa``."""
    N = Y.dim()
    y, m = Y.reshape(-1), M.reshape(-1)
    xf = x.reshape(-1) if x is not None else None
    # 1. weights: one component at a time (spec), or jointly (the exact conditional of the block)
    T = khatri_rao(st.factors)
    if cfg.weight_update == "block":
        prec, rhs = weight_posterior(y, m, T, st.theta, st.tau, xf, kappa)
        st.lam = draw_gaussian(prec, rhs, rng, "CP weights")
    else:
        st.lam = _weights_by_component(st, T, y, m, xf, kappa, rng)
    # 2. factor rows, mode by mode
    for n in range(N):
        B = khatri_rao(st.factors, n, st.lam)
        Yn, Mn = Y.movedim(n, 0).reshape(Y.shape[n], -1), M.movedim(n, 0).reshape(Y.shape[n], -1)
        Xn = x.movedim(n, 0).reshape(Y.shape[n], -1) if x is not None else None
        prec, rhs = row_posterior(Yn, Mn, B, st.tau, Xn, kappa)
        st.factors[n] = draw_gaussian(prec, rhs, rng, f"mode-{n} factor rows")
    # 3. noise precision (observations only)
    resid = (m * (y - khatri_rao(st.factors, None, st.lam).sum(1))) ** 2
    st.tau = float(rng.gamma(cfg.a_tau + 0.5 * float(m.sum()), 1.0 / (cfg.b_tau + 0.5 * float(resid.sum()))))
    # 4. CUSP indicators z_r over l = 0..R-1: spike density for l <= r, slab (t) for l > r
    R = st.rank
    lam = st.lam.numpy()
    omega = omega_from_v(st.v)
    spike, slab = _log_spike_slab(lam, cfg)
    idx = np.arange(R)
    with np.errstate(divide="ignore"):
        logp = np.log(omega)[None, :] + np.where(idx[None, :] <= idx[:, None], spike[:, None], slab[:, None])
    p = np.exp(logp - logp.max(1, keepdims=True))
    cdf = np.cumsum(p, 1)
    st.z = np.minimum((cdf < rng.random((R, 1)) * cdf[:, -1:]).sum(1), R - 1)
    # 5. stick-breaking v
    counts = np.bincount(st.z, minlength=R)
    above = counts[::-1].cumsum()[::-1]  # #{z >= l}
    greater = np.concatenate([above[1:], [0]])  # #{z > l}
    st.v = np.concatenate([rng.beta(1.0 + counts[:-1], cfg.alpha + greater[:-1]), [1.0]])
    # 6. theta
    slab_theta = 1.0 / rng.gamma(cfg.a_theta + 0.5, 1.0 / (cfg.b_theta + 0.5 * lam**2))
    st.theta = torch.from_numpy(np.where(st.z <= idx, cfg.theta_inf, slab_theta))
    # 7. adaptive truncation
    st.t += 1
    if cfg.adaptive and rng.random() < math.exp(-(cfg.adapt_b0 + cfg.adapt_b1 * st.t)):
        truncate(st, cfg, rng)
    return st


def truncate(st: CPState, cfg: CUSPConfig, rng: np.random.Generator) -> None:
    """Drop the components with ``|lambda_r| < drop_tol`` (keeping the largest one if none is left) and
    append one fresh component (columns ``N(0, init_scale^2)``, ``lambda = 0``, ``v``, ``z``, ``theta`` from
    the prior) unless the rank is at its cap."""
    keep = (st.lam.abs() >= cfg.drop_tol).numpy()
    if not keep.any():
        keep[int(st.lam.abs().argmax())] = True
    k = np.flatnonzero(keep)
    st.factors = [U[:, k] for U in st.factors]
    st.lam, st.theta = st.lam[k], st.theta[k]
    st.z, st.v = np.minimum(st.z[k], len(k) - 1), st.v[k].copy()
    if len(k) < cfg.rank_cap:
        st.v[-1] = rng.beta(1.0, cfg.alpha)
        st.v = np.concatenate([st.v, [1.0]])
        R = len(k) + 1
        z_new = int(_draw_z_prior(omega_from_v(st.v), 1, rng)[0])
        th_new = float(_prior_theta(np.array([z_new]), np.array([R - 1]), cfg, rng)[0])
        st.factors = [torch.cat([U, torch.from_numpy(cfg.init_scale * rng.standard_normal((U.shape[0], 1)))], 1)
                      for U in st.factors]
        st.lam = torch.cat([st.lam, torch.zeros(1, dtype=st.lam.dtype)])
        st.theta = torch.cat([st.theta, torch.tensor([th_new], dtype=st.theta.dtype)])
        st.z = np.concatenate([st.z, [z_new]])
    else:
        st.v[-1] = 1.0
