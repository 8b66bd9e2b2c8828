"""Intrinsic training dynamics: when a gradient flow on theta is a closed flow on z = phi(theta).

Paper: "Intrinsic training dynamics of deep neural networks" (Marcotte, Peyre, Gribonval),
arXiv 2508.07370, ICLR 2026. Spec: ``shared/methods/intrinsic_dynamics.md``.

The gradient flow ``theta' = -grad_theta l(phi(theta))`` moves the lifted variable as
``z' = J theta' = -J J^T grad l(z) = -M(theta) grad l(z)`` with ``J = d phi / d theta`` and the metric
``M(theta) = J J^T``. The flow of ``z`` is *intrinsic* when ``M(theta) = F(phi(theta), h(theta_0))`` for
conserved quantities ``h``. This module gives

* lifted systems with their conservation laws and, where one exists, the closed-form intrinsic
  velocity ``z' = -F(z, h) grad l(z)``: :class:`LinearFactorization` (``Z = U V^T``, lambda-balanced
  formula), :class:`DeepLinear` (balanced, Arora et al. 2018), :class:`ReLUNet` (one hidden layer,
  path-lifting ``z_j = a_j w_j``), :class:`DeepReLUPathLift` (criterion only), :class:`LinearODE`
  (``Z = prod (I + A_k/N)``, balanced; with its ``N -> infinity`` limit), :class:`CustomLift` (any
  ``phi`` given as a torch function);
* :func:`simulate_flow` (RK4 on the parameter flow: the ground truth) and :func:`intrinsic_flow`
  (RK4 on the lifted flow), :func:`euclidean_flow` (the naive ``z' = -grad l(z)`` baseline);
* :func:`check_criterion` (the kernel inclusion ``ker d phi ∩ ker d h ⊂ ker dM``, tested by ranks),
  :func:`level_set_counterexample` (two parameters with the same ``z`` and the same ``h`` but different
  metrics, found when the criterion fails) and :func:`conservation_law_count` (number of independent
  conservation laws of any ``phi`` from the rank of the Lie algebra its gradient fields generate).

Everything is float64 torch. Parameters are flat 1-D tensors ``theta`` (each system documents
its layout and has ``split``); ``z`` keeps its natural shape.
"""

from __future__ import annotations

import math
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

import numpy as np
import torch
from torch import Tensor

from rankwise.core.errors import NumericalError, RankwiseError
from rankwise.core.registry import register
from rankwise.core.validate import check_int

__all__ = [
    "IntrinsicConfig",
    "FlowResult",
    "CriterionReport",
    "NotIntrinsicError",
    "LiftedSystem",
    "LinearFactorization",
    "DeepLinear",
    "ReLUNet",
    "ReLUPathLift",
    "DeepReLUPathLift",
    "LinearODE",
    "CustomLift",
    "FrobeniusLoss",
    "LeastSquaresLoss",
    "ReLURegressionLoss",
    "CallableLoss",
    "simulate_flow",
    "intrinsic_flow",
    "euclidean_flow",
    "compare",
    "check_criterion",
    "level_set_counterexample",
    "conservation_law_count",
    "psd_power",
    "run_comparison",
]

DTYPE = torch.float64
# Eigenvalues of a PSD matrix below EIG_FLOOR_REL * (largest eigenvalue) are set to exactly 0
# before fractional powers: rounding noise of size 1e-16 would otherwise become 1e-16^(1/N).
EIG_FLOOR_REL = 1e-13
# Relative tolerance of the rank tests of the kernel-inclusion criterion (spec: SVD, 1e-8).
CRITERION_TOL = 1e-8


class NotIntrinsicError(RankwiseError, ValueError):
    """The state is outside the set where the lifted flow is intrinsic (e.g. a ReLU neuron with a_j = 0)."""


def _t(x: Any, name: str = "tensor") -> Tensor:
    t = torch.as_tensor(x, dtype=DTYPE).detach().clone() if not isinstance(x, Tensor) else x.detach().to(DTYPE)
    if not torch.isfinite(t).all():
        raise ValueError(f"{name} holds non-finite values")
    return t


def _gen(seed: int | torch.Generator | None) -> torch.Generator:
    if isinstance(seed, torch.Generator):
        return seed
    return torch.Generator().manual_seed(0 if seed is None else int(seed))


def _randn(g: torch.Generator, *shape: int) -> Tensor:
    return torch.randn(*shape, generator=g, dtype=DTYPE)


def _orthonormal_columns(g: torch.Generator, n: int, k: int) -> Tensor:
    q, r = torch.linalg.qr(_randn(g, n, k))
    return q * torch.sign(torch.diagonal(r)).where(torch.diagonal(r) != 0, torch.ones(k, dtype=DTYPE))


def _eigh(S: Tensor) -> tuple[Tensor, Tensor]:
    """Symmetric eigendecomposition (numpy LAPACK: far less per-call overhead than torch for the small
    matrices of these flows; no gradient is ever taken through it)."""
    lam, V = np.linalg.eigh(0.5 * (S + S.mT).detach().numpy())
    return torch.from_numpy(lam), torch.from_numpy(V)


def _jacobian(f: Callable[[Tensor], Tensor], x: Tensor) -> Tensor:
    """``(P, D)`` Jacobian of ``f: R^D -> R^P`` by reverse-mode autograd, one backward pass per output.

    (Plain autograd rather than ``torch.func``: the first ``torch.func`` call costs seconds of set-up.)"""
    x = x.detach().requires_grad_(True)
    y = f(x).reshape(-1)
    rows = []
    for i in range(y.numel()):
        (gi,) = torch.autograd.grad(y[i], x, retain_graph=True, allow_unused=True)
        rows.append(torch.zeros_like(x) if gi is None else gi)
    return torch.stack(rows) if rows else torch.zeros(0, x.numel(), dtype=DTYPE)


def _jacobian_and_hessians(f: Callable[[Tensor], Tensor], x: Tensor) -> tuple[Tensor, Tensor]:
    """``J (P, D)`` and ``H (P, D, D)``, ``H[p] = Hessian of f_p``, by double backward."""
    x = x.detach().requires_grad_(True)
    y = f(x).reshape(-1)
    P, D = y.numel(), x.numel()
    J = torch.zeros(P, D, dtype=DTYPE)
    H = torch.zeros(P, D, D, dtype=DTYPE)
    for p in range(P):
        (gp,) = torch.autograd.grad(y[p], x, retain_graph=True, create_graph=True, allow_unused=True)
        if gp is None:
            continue
        J[p] = gp.detach()
        if not gp.requires_grad:
            continue
        for d in range(D):
            (hd,) = torch.autograd.grad(gp[d], x, retain_graph=True, allow_unused=True)
            if hd is not None:
                H[p, d] = hd
    return J, H


def psd_power(S: Tensor, p: float) -> Tensor:
    """``S^p`` of a symmetric PSD matrix via ``eigh``; ``p = 0`` gives the identity (also on the kernel).

    Eigenvalues below ``EIG_FLOOR_REL * lambda_max`` are set to 0 (documented floor)."""
    lam, V = _eigh(S)
    lam = _floor_eigs(lam)
    if p == 0:
        return torch.eye(S.shape[-1], dtype=S.dtype)
    return (V * lam.pow(p)) @ V.mT


def _floor_eigs(lam: Tensor) -> Tensor:
    top = lam.abs().max().clamp_min(1e-300)
    return torch.where(lam > EIG_FLOOR_REL * top, lam, torch.zeros_like(lam))


def _sqrtm_shift(S: Tensor, c: float) -> Tensor:
    """``(S + c I)^{1/2}`` for symmetric PSD ``S`` and ``c >= 0``; eigenvalues of ``S`` below
    ``EIG_FLOOR_REL * lambda_max`` count as 0 (the square root would turn 1e-17 rounding into 3e-9)."""
    lam, V = _eigh(S)
    return (V * (_floor_eigs(lam) + c).sqrt()) @ V.mT


# --------------------------------------------------------------------------------------------------
# Losses (functions of z). grad(z) is dl/dz; pattern(z) returns the activation pattern or None.


class Loss:
    """A differentiable loss of the lifted variable. Subclasses give ``value`` and ``grad``.

    Piecewise-smooth losses (ReLU) also give ``pattern(z)``; inside ``with loss.freeze(p):`` their value
    and gradient use the pattern ``p`` instead of the one of ``z`` (the smooth extension of one piece),
    which the integrator uses so that every RK4 stage of a step sees the same piece.
    """

    _frozen: Tensor | None = None

    @contextmanager
    def freeze(self, pattern: Tensor | None) -> Iterator[None]:
        old, self._frozen = self._frozen, pattern
        try:
            yield
        finally:
            self._frozen = old

    def value(self, z: Tensor) -> Tensor:  # pragma: no cover - interface
        raise NotImplementedError

    def grad(self, z: Tensor) -> Tensor:
        zz = z.detach().clone().requires_grad_(True)
        (g,) = torch.autograd.grad(self.value(zz), zz)
        return g

    def pattern(self, z: Tensor) -> Tensor | None:
        return None

    def __call__(self, z: Tensor) -> Tensor:
        return self.value(z)


class FrobeniusLoss(Loss):
    """``l(Z) = 0.5 ||Z - Y||_F^2``; ``grad = Z - Y``."""

    def __init__(self, Y: Any) -> None:
        self.Y = _t(Y, "Y")

    def _check(self, z: Tensor) -> None:
        if z.shape != self.Y.shape:
            raise ValueError(f"Y has shape {tuple(self.Y.shape)} but z has shape {tuple(z.shape)}")

    def value(self, z: Tensor) -> Tensor:
        self._check(z)
        return 0.5 * (z - self.Y).pow(2).sum()

    def grad(self, z: Tensor) -> Tensor:
        self._check(z)
        return z - self.Y


class LeastSquaresLoss(Loss):
    """``l(Z) = 0.5 ||Z X - Y||_F^2`` with ``X (m, N)``, ``Y (n, N)``; ``grad = (Z X - Y) X^T``."""

    def __init__(self, X: Any, Y: Any) -> None:
        self.X, self.Y = _t(X, "X"), _t(Y, "Y")
        if self.X.ndim != 2 or self.Y.ndim != 2 or self.X.shape[1] != self.Y.shape[1]:
            raise ValueError(f"X (m, N) and Y (n, N) must share N; got {tuple(self.X.shape)} and {tuple(self.Y.shape)}")

    def _check(self, z: Tensor) -> None:
        if z.ndim != 2 or z.shape != (self.Y.shape[0], self.X.shape[0]):
            raise ValueError(f"Z must have shape {(self.Y.shape[0], self.X.shape[0])}, got {tuple(z.shape)}")

    def value(self, z: Tensor) -> Tensor:
        self._check(z)
        return 0.5 * (z @ self.X - self.Y).pow(2).sum()

    def grad(self, z: Tensor) -> Tensor:
        self._check(z)
        return (z @ self.X - self.Y) @ self.X.mT


class ReLURegressionLoss(Loss):
    """Mean squared error of the one-hidden-layer ReLU net written in its path-lifting ``z (k, d)``.

    ``f(x) = sum_j a_j relu(w_j . x) = sum_j s_j relu(s_j z_j . x)`` with ``s_j = sign(a_j)``, constant along
    the flow while ``z_j != 0``; ``l(z) = 0.5 mean_i (f(x_i) - y_i)^2``. ``pattern(z)`` is the activation
    pattern ``s_j z_j . x_i > 0`` of shape ``(k, N)``. ``X (N, d)``, ``y (N,)``.
    """

    def __init__(self, X: Any, y: Any, signs: Any) -> None:
        self.X, self.y, self.s = _t(X, "X"), _t(y, "y"), _t(signs, "signs")
        if self.X.ndim != 2 or self.y.shape != (self.X.shape[0],):
            raise ValueError(f"X must be (N, d) and y (N,); got {tuple(self.X.shape)} and {tuple(self.y.shape)}")
        if self.s.ndim != 1 or not torch.all(self.s.abs() == 1):
            raise ValueError("signs must be a 1-D tensor of +1/-1 (the signs of the output weights a_j)")

    def _check(self, z: Tensor) -> None:
        if z.ndim != 2 or z.shape != (self.s.shape[0], self.X.shape[1]):
            raise ValueError(f"z must have shape (k, d) = {(self.s.shape[0], self.X.shape[1])}, got {tuple(z.shape)}")

    def pattern(self, z: Tensor) -> Tensor:
        self._check(z)
        return (self.s[:, None] * (z @ self.X.mT)) > 0

    def _mask(self, z: Tensor) -> Tensor:
        return (self._frozen if self._frozen is not None else self.pattern(z)).to(DTYPE)

    def predict(self, z: Tensor) -> Tensor:
        """``f(x_i) = sum_j m_ij z_j . x_i`` with the activation mask ``m`` (``s_j^2 = 1``), shape ``(N,)``."""
        self._check(z)
        return (self._mask(z) * (z @ self.X.mT)).sum(0)

    def value(self, z: Tensor) -> Tensor:
        return 0.5 * (self.predict(z) - self.y).pow(2).mean()

    def grad(self, z: Tensor) -> Tensor:
        r = (self.predict(z) - self.y) / self.y.shape[0]  # (N,)
        return (self._mask(z) * r[None, :]) @ self.X  # (k, d)


class CallableLoss(Loss):
    """Wrap any torch function ``fn(z) -> scalar`` (gradient by autograd)."""

    def __init__(self, fn: Callable[[Tensor], Tensor]) -> None:
        if not callable(fn):
            raise TypeError("CallableLoss needs a callable fn(z) -> scalar tensor")
        self.fn = fn

    def value(self, z: Tensor) -> Tensor:
        v = self.fn(z)
        if not isinstance(v, Tensor) or v.numel() != 1:
            raise ValueError("the loss function must return a scalar tensor")
        return v.reshape(())


# --------------------------------------------------------------------------------------------------
# Lifted systems


class LiftedSystem:
    """Base class: ``phi(theta)``, conserved ``invariants(theta)``, and optionally a closed-form
    ``intrinsic_velocity(z, h, g) = -F(z, h) g``.

    ``theta`` is a flat float64 vector of length ``dim_theta``.
    """

    dim_theta: int = 0

    def phi(self, theta: Tensor) -> Tensor:  # pragma: no cover - interface
        raise NotImplementedError

    def invariants(self, theta: Tensor) -> Tensor:
        """Conserved quantities as a flat vector (empty when none are known)."""
        return torch.zeros(0, dtype=DTYPE)

    def intrinsic_velocity(self, z: Tensor, h: Tensor, g: Tensor) -> Tensor:
        raise NotImplementedError(f"{type(self).__name__} has no closed-form intrinsic metric; use simulate_flow "
                                  "(parameter flow) and check_criterion")

    def param_velocity(self, theta: Tensor, g: Tensor) -> Tensor | None:
        """Closed-form ``-J(theta)^T g`` (the parameter flow), or None to use autograd (a VJP)."""
        return None

    def velocity_for(self, h: Tensor) -> Callable[[Tensor, Tensor], Tensor]:
        """``(z, g) -> z'`` with the conserved quantities ``h`` fixed (systems may precompute from ``h``)."""
        return lambda z, g: self.intrinsic_velocity(z, h, g)

    def param_pattern(self, theta: Tensor) -> Tensor | None:
        """A discrete state that must not change along a smooth flow (ReLU: signs of a_j), or None."""
        return None

    def metric(self, theta: Tensor) -> Tensor:
        """``M(theta) = J J^T``, ``(P, P)`` with ``P = z.numel()`` (row-major ``vec``), by autograd."""
        J = _jacobian_phi(self, theta)
        return J @ J.mT

    def check_theta(self, theta: Any) -> Tensor:
        th = _t(theta, "theta")
        if th.ndim != 1 or th.numel() != self.dim_theta:
            raise ValueError(f"theta must be a flat vector of length {self.dim_theta} for {type(self).__name__}, "
                             f"got shape {tuple(th.shape)}")
        return th


def _jacobian_phi(system: LiftedSystem, theta: Tensor) -> Tensor:
    return _jacobian(lambda th: system.phi(th).reshape(-1), theta)


class LinearFactorization(LiftedSystem):
    """Two-layer linear net ``Z = U V^T``, ``U (n, r)``, ``V (m, r)``; ``theta = [vec U, vec V]`` (row-major).

    Conserved: ``C = U^T U - V^T V`` (``r x r``, returned flattened). Closed-form intrinsic flow for
    ``C = lambda I`` (spec item 1)::

        Z' = -(sqrt(Z Z^T + lambda^2/4 I) + lambda/2 I) G - G (sqrt(Z^T Z + lambda^2/4 I) - lambda/2 I)

    valid for ``lambda = 0`` (any shapes) and ``r = n`` (any lambda); its mirror image covers ``r = m``:
    the ``U U^T`` formula holds for ``lambda <= 0`` or ``n = r``, the ``V V^T`` one for ``lambda >= 0`` or
    ``m = r``; the other factor is then ``Z^T (U U^T)^{-1} Z`` (``n = r``) or ``Z (V V^T)^{-1} Z^T`` (``m = r``).
    Outside (``lambda != 0`` with ``r`` not in ``{n, m}``) or for ``C`` not a multiple of ``I``:
    ``NotImplementedError`` (the parameter flow still works; :func:`check_criterion` tells whether an
    intrinsic dynamic exists at all).
    """

    def __init__(self, n: int, m: int, r: int) -> None:
        self.n, self.m, self.r = check_int("n", n, 1), check_int("m", m, 1), check_int("r", r, 1)
        self.dim_theta = (self.n + self.m) * self.r

    def split(self, theta: Tensor) -> tuple[Tensor, Tensor]:
        nr = self.n * self.r
        return theta[:nr].reshape(self.n, self.r), theta[nr:].reshape(self.m, self.r)

    def join(self, U: Tensor, V: Tensor) -> Tensor:
        if U.shape != (self.n, self.r) or V.shape != (self.m, self.r):
            raise ValueError(f"U must be {(self.n, self.r)} and V {(self.m, self.r)}; got {tuple(U.shape)}, {tuple(V.shape)}")
        return torch.cat([U.reshape(-1), V.reshape(-1)]).to(DTYPE)

    def phi(self, theta: Tensor) -> Tensor:
        U, V = self.split(theta)
        return U @ V.mT

    def invariants(self, theta: Tensor) -> Tensor:
        U, V = self.split(theta)
        return (U.mT @ U - V.mT @ V).reshape(-1)

    def param_velocity(self, theta: Tensor, g: Tensor) -> Tensor:
        """``U' = -G V``, ``V' = -G^T U``."""
        U, V = self.split(theta)
        return -torch.cat([(g @ V).reshape(-1), (g.mT @ U).reshape(-1)])

    def metric_closed_form(self, theta: Tensor) -> Tensor:
        """``M = U U^T (x) I_m + I_n (x) V V^T`` (row-major vec), the spec's correctness reference."""
        U, V = self.split(theta)
        return torch.kron(U @ U.mT, torch.eye(self.m, dtype=DTYPE)) + torch.kron(torch.eye(self.n, dtype=DTYPE), V @ V.mT)

    # ---- initialisations
    def random_init(self, seed: int | torch.Generator | None = 0, scale: float = 1.0) -> Tensor:
        """Gaussian ``U, V`` with entries ``N(0, scale^2 / r)`` (generic, not balanced)."""
        g = _gen(seed)
        s = float(scale) / math.sqrt(self.r)
        return self.join(_randn(g, self.n, self.r) * s, _randn(g, self.m, self.r) * s)

    def relaxed_balanced_init(self, lam: float = 0.0, seed: int | torch.Generator | None = 0,
                              scale: float = 1.0) -> Tensor:
        """An init with ``U^T U - V^T V = lam I`` (spec: draw ``V``, set ``U = Q (V^T V + lam I)^{1/2}``,
        ``Q`` with orthonormal columns). Needs ``n >= r`` for ``lam > 0`` and ``m >= r`` for ``lam < 0``
        (mirror construction); ``lam = 0`` with ``r > n, m`` uses a rank ``min(n, m)`` SVD construction."""
        lam = float(lam)
        if not math.isfinite(lam):
            raise ValueError(f"lam must be finite, got {lam}")
        g = _gen(seed)
        n, m, r = self.n, self.m, self.r
        s = float(scale) / math.sqrt(r)
        if lam >= 0 and n >= r:
            V = _randn(g, m, r) * s
            U = _orthonormal_columns(g, n, r) @ _sqrtm_shift(V.mT @ V, lam)
        elif lam <= 0 and m >= r:
            U = _randn(g, n, r) * s
            V = _orthonormal_columns(g, m, r) @ _sqrtm_shift(U.mT @ U, -lam)
        elif lam == 0:
            k = min(n, m)
            A, B = _orthonormal_columns(g, n, k), _orthonormal_columns(g, m, k)
            S = torch.diag((_randn(g, k).abs() + 0.5) * float(scale))
            R = _orthonormal_columns(g, r, k)
            U, V = A @ S.sqrt() @ R.mT, B @ S.sqrt() @ R.mT
        else:
            need = "n >= r" if lam > 0 else "m >= r"
            raise ValueError(f"a lambda-balanced init with lam={lam} needs {need}: U^T U - V^T V = lam I has full "
                             f"rank r={r} (n={n}, m={m})")
        return self.join(U, V)

    def init_with_invariant(self, C: Any, seed: int | torch.Generator | None = 0, scale: float = 1.0) -> Tensor:
        """An init with ``U^T U - V^T V = C`` for a given symmetric ``C (r, r)``: ``U = Q (V^T V + C)^{1/2}``.

        Needs ``n >= r`` and ``V^T V + C`` positive semi-definite (``V`` is redrawn with a growing scale,
        up to 20 times, until it is)."""
        C = _t(C, "C")
        if C.shape != (self.r, self.r) or not torch.allclose(C, C.mT, atol=1e-12):
            raise ValueError(f"C must be a symmetric {(self.r, self.r)} matrix")
        if self.n < self.r:
            raise ValueError(f"init_with_invariant needs n >= r (n={self.n}, r={self.r})")
        g = _gen(seed)
        s = float(scale) / math.sqrt(self.r)
        for _ in range(20):
            V = _randn(g, self.m, self.r) * s
            S = V.mT @ V + C
            if torch.linalg.eigvalsh(S).min() >= 0:
                U = _orthonormal_columns(g, self.n, self.r) @ _sqrtm_shift(S, 0.0)
                return self.join(U, V)
            s *= 1.5
        raise ValueError("could not find V with V^T V + C PSD; C has a large negative part for these sizes")

    # ---- intrinsic velocity
    def balanced_lambda(self, h: Tensor, tol: float = 1e-8) -> float:
        """``lambda`` if ``C = lambda I`` (relative tolerance ``tol``; ``|lambda| <= 1e-12`` counts as 0), else
        ``NotImplementedError``."""
        C = h.reshape(self.r, self.r)
        lam = float(torch.trace(C)) / self.r
        dev = float((C - lam * torch.eye(self.r, dtype=DTYPE)).norm())
        if dev > tol * max(1.0, float(C.norm())):
            raise NotImplementedError(
                f"C = U^T U - V^T V is not a multiple of the identity (distance {dev:.3g}); the closed-form "
                "intrinsic metric is implemented for lambda-balanced inits only. Use simulate_flow for the "
                "parameter flow and check_criterion to test whether an intrinsic dynamic exists.")
        # rounding of a balanced (lambda = 0) init gives |lambda| ~ 1e-17: treat as exactly 0
        return 0.0 if abs(lam) <= 1e-12 * max(1.0, float(C.abs().max())) else lam

    def factor_grams(self, Z: Tensor, lam: float) -> tuple[Tensor, Tensor]:
        """``(U U^T, V V^T)`` as functions of ``Z`` and ``lambda`` (see the class docstring)."""
        n, m, r = self.n, self.m, self.r
        q = lam * lam / 4
        u_ok = lam <= 0 or n == r
        v_ok = lam >= 0 or m == r
        # one full SVD Z = P diag(s) Q^T gives both: Z Z^T = P diag(s^2, 0..) P^T, Z^T Z = Q diag(s^2, 0..) Q^T
        P, sv, Qt = np.linalg.svd(Z.detach().numpy(), full_matrices=True)
        s2n = np.zeros(n)
        s2n[: sv.size] = sv**2
        s2m = np.zeros(m)
        s2m[: sv.size] = sv**2
        UU = torch.from_numpy((P * (np.sqrt(s2n + q) + lam / 2)) @ P.T) if u_ok else None
        VV = torch.from_numpy((Qt.T * (np.sqrt(s2m + q) - lam / 2)) @ Qt) if v_ok else None
        if UU is None and VV is not None and m == r:
            UU = Z @ _guarded_inv(VV, "V V^T") @ Z.mT
        if VV is None and UU is not None and n == r:
            VV = Z.mT @ _guarded_inv(UU, "U U^T") @ Z
        if UU is None or VV is None:
            raise NotImplementedError(
                f"no closed form of the intrinsic metric for lambda={lam:g} with (n, m, r)=({n}, {m}, {r}): "
                "for lambda != 0 the factor Gram matrices are functions of (Z, lambda) only when r = n or r = m "
                "(spec: n = r). The parameter flow (simulate_flow) still works.")
        return UU, VV

    def intrinsic_velocity(self, z: Tensor, h: Tensor, g: Tensor) -> Tensor:
        return self.velocity_for(h)(z, g)

    def velocity_for(self, h: Tensor) -> Callable[[Tensor, Tensor], Tensor]:
        lam = self.balanced_lambda(h)
        if (lam > 0 and self.n < self.r) or (lam < 0 and self.m < self.r):
            side = "n" if lam > 0 else "m"
            raise ValueError(f"no parameters satisfy U^T U - V^T V = {lam:g} I when {side} < r "
                             f"(n, m, r = {self.n}, {self.m}, {self.r}): one side would need rank r")

        def v(z: Tensor, g: Tensor) -> Tensor:
            UU, VV = self.factor_grams(z, lam)
            return -(UU @ g) - g @ VV

        return v


def _guarded_inv(S: Tensor, what: str) -> Tensor:
    lam, V = _eigh(S)
    if float(lam.min()) <= 1e-12 * max(float(lam.max()), 1e-300):
        raise NotIntrinsicError(f"{what} is singular here (smallest eigenvalue {float(lam.min()):.3g}); the other "
                                "factor is not determined by (Z, lambda) at this point")
    return (V / lam) @ V.mT


def _split_matrices(theta: Tensor, shapes: Sequence[tuple[int, int]]) -> list[Tensor]:
    """The consecutive ``(a, b)`` matrices of a flat parameter vector, in the order of ``shapes``."""
    out, i = [], 0
    for a, b in shapes:
        out.append(theta[i:i + a * b].reshape(a, b))
        i += a * b
    return out


class DeepLinear(LiftedSystem):
    """Deep linear net ``Z = W_N ... W_1``, ``W_j (d_j, d_{j-1})``, ``dims = [d_0, ..., d_N]``.

    Conserved: ``W_{j+1}^T W_{j+1} - W_j W_j^T`` for ``j = 1..N-1``. Balanced inits (all zero) have the
    intrinsic flow (Arora et al. 2018; spec item 2)::

        Z' = -sum_{j=1}^N (Z Z^T)^{(N-j)/N} G (Z^T Z)^{(j-1)/N}

    computed in the eigenbases of ``Z Z^T`` and ``Z^T Z`` (one ``eigh`` each). ``velocity_scale`` multiplies
    it (used by :class:`LinearODE`).
    """

    def __init__(self, dims: Sequence[int]) -> None:
        dims = [check_int("dims[i]", d, 1) for d in dims]
        if len(dims) < 2:
            raise ValueError(f"dims must hold at least [d_in, d_out], got {dims}")
        self.dims = dims
        self.N = len(dims) - 1
        self.shapes = [(dims[j + 1], dims[j]) for j in range(self.N)]
        self.dim_theta = sum(a * b for a, b in self.shapes)
        self.velocity_scale = 1.0

    def weights(self, theta: Tensor) -> list[Tensor]:
        return _split_matrices(theta, self.shapes)

    def join(self, Ws: Sequence[Tensor]) -> Tensor:
        return torch.cat([W.reshape(-1) for W in Ws]).to(DTYPE)

    def phi(self, theta: Tensor) -> Tensor:
        Ws = self.weights(theta)
        Z = Ws[0]
        for W in Ws[1:]:
            Z = W @ Z
        return Z

    # d W_j / d theta_j (1 for plain weights; LinearODE parametrises W = I + B / sqrt(N))
    _dW_dtheta = 1.0

    def param_velocity(self, theta: Tensor, g: Tensor) -> Tensor:
        """``W_j' = -(W_N..W_{j+1})^T G (W_{j-1}..W_1)^T`` (times ``dW/dtheta``)."""
        Ws = self.weights(theta)
        pre = [torch.eye(self.dims[0], dtype=DTYPE)]
        for W in Ws:
            pre.append(W @ pre[-1])
        suf = [torch.eye(self.dims[-1], dtype=DTYPE)]
        for W in reversed(Ws):
            suf.append(suf[-1] @ W)
        suf = suf[::-1]  # suf[j] = W_N .. W_(j+1) (0-based: product of Ws[j:])
        out = [(suf[j + 1].mT @ g @ pre[j].mT).reshape(-1) for j in range(self.N)]
        return -self._dW_dtheta * torch.cat(out)

    def invariants(self, theta: Tensor) -> Tensor:
        Ws = self.weights(theta)
        if self.N == 1:
            return torch.zeros(0, dtype=DTYPE)
        return torch.cat([(Ws[j + 1].mT @ Ws[j + 1] - Ws[j] @ Ws[j].mT).reshape(-1) for j in range(self.N - 1)])

    def random_init(self, seed: int | torch.Generator | None = 0, scale: float = 1.0) -> Tensor:
        g = _gen(seed)
        return self.join([_randn(g, a, b) * (float(scale) / math.sqrt(b)) for a, b in self.shapes])

    def balanced_init(self, seed: int | torch.Generator | None = 0, scale: float = 1.0) -> Tensor:
        """A balanced init: ``Z_0 = P S Q^T`` of rank ``k = min(dims)``, ``W_1 = R_1 S^{1/N} Q^T``,
        ``W_j = R_j S^{1/N} R_{j-1}^T``, ``W_N = P S^{1/N} R_{N-1}^T`` with random orthonormal ``R_j``."""
        g = _gen(seed)
        k = min(self.dims)
        P, Q = _orthonormal_columns(g, self.dims[-1], k), _orthonormal_columns(g, self.dims[0], k)
        S = torch.diag((_randn(g, k).abs() + 0.5) * float(scale)).pow(1.0 / self.N)
        Rs = [Q] + [_orthonormal_columns(g, self.dims[j], k) for j in range(1, self.N)] + [P]
        return self.join([Rs[j + 1] @ S @ Rs[j].mT for j in range(self.N)])

    def intrinsic_velocity(self, z: Tensor, h: Tensor, g: Tensor) -> Tensor:
        if h.numel() and float(h.abs().max()) > 1e-8 * max(1.0, float(z.norm()) ** (2.0 / self.N)):
            raise NotImplementedError("the closed-form deep-linear intrinsic flow needs a balanced init "
                                      f"(W_(j+1)^T W_(j+1) = W_j W_j^T); max |h| = {float(h.abs().max()):.3g}")
        mu, P = _eigh(z @ z.mT)
        nu, Q = _eigh(z.mT @ z)
        mu, nu = _floor_eigs(mu), _floor_eigs(nu)
        N = self.N
        j = torch.arange(1, N + 1, dtype=DTYPE)
        # S_ab = sum_j mu_a^((N-j)/N) nu_b^((j-1)/N); 0^0 = 1 keeps the identity terms exact
        S = mu[None, :].pow(((N - j) / N)[:, None]).mT @ nu[None, :].pow(((j - 1) / N)[:, None])
        return -self.velocity_scale * (P @ ((P.mT @ g @ Q) * S) @ Q.mT)


class ReLUNet(LiftedSystem):
    """One-hidden-layer ReLU net ``f(x) = sum_j a_j relu(w_j . x)``; ``theta = [vec W (k, d), a (k)]``.

    Path-lifting ``z_j = a_j w_j`` (``z (k, d)``); conserved ``delta_j = ||w_j||^2 - a_j^2``. The intrinsic
    flow (spec item 3), per neuron, with ``a_j^2 = (-delta_j + sqrt(delta_j^2 + 4 ||z_j||^2)) / 2``::

        z_j' = -(a_j^2 I + z_j z_j^T / a_j^2) g_j

    valid while no activation pattern changes and ``a_j != 0`` (else :class:`NotIntrinsicError`).
    """

    def __init__(self, d: int, k: int) -> None:
        self.d, self.k = check_int("d", d, 1), check_int("k", k, 1)
        self.dim_theta = self.k * self.d + self.k

    def split(self, theta: Tensor) -> tuple[Tensor, Tensor]:
        kd = self.k * self.d
        return theta[:kd].reshape(self.k, self.d), theta[kd:]

    def join(self, W: Tensor, a: Tensor) -> Tensor:
        if W.shape != (self.k, self.d) or a.shape != (self.k,):
            raise ValueError(f"W must be {(self.k, self.d)} and a {(self.k,)}")
        return torch.cat([W.reshape(-1), a]).to(DTYPE)

    def phi(self, theta: Tensor) -> Tensor:
        W, a = self.split(theta)
        return a[:, None] * W

    def invariants(self, theta: Tensor) -> Tensor:
        W, a = self.split(theta)
        return W.pow(2).sum(1) - a.pow(2)

    def param_velocity(self, theta: Tensor, g: Tensor) -> Tensor:
        """``w_j' = -a_j g_j``, ``a_j' = -w_j . g_j`` (``g = dl/dz``)."""
        W, a = self.split(theta)
        return -torch.cat([(a[:, None] * g).reshape(-1), (W * g).sum(1)])

    def signs(self, theta: Tensor) -> Tensor:
        _, a = self.split(theta)
        return torch.sign(a)

    def param_pattern(self, theta: Tensor) -> Tensor:
        return self.signs(theta)

    def random_init(self, seed: int | torch.Generator | None = 0, scale: float = 1.0) -> Tensor:
        """``w_j ~ N(0, scale^2 I / d)``, ``a_j ~ N(0, scale^2 / k)``."""
        g = _gen(seed)
        return self.join(_randn(g, self.k, self.d) * (float(scale) / math.sqrt(self.d)),
                         _randn(g, self.k) * (float(scale) / math.sqrt(self.k)))

    def loss(self, X: Any, y: Any, theta0: Tensor) -> ReLURegressionLoss:
        """The regression loss in path-lifting coordinates, with the output signs of ``theta0``."""
        s = self.signs(theta0)
        if torch.any(s == 0):
            raise NotIntrinsicError(f"neuron(s) {torch.nonzero(s == 0).flatten().tolist()} have a_j = 0: the sign of "
                                    "the output weight, hence the function of z, is undefined")
        return ReLURegressionLoss(X, y, s)

    def a_squared(self, z: Tensor, h: Tensor) -> Tensor:
        """``a_j^2`` from ``(z_j, delta_j)``; raises where it is 0 (``z_j = 0`` with ``delta_j >= 0``)."""
        nz2 = z.pow(2).sum(1)
        a2 = 0.5 * (-h + torch.sqrt(h * h + 4 * nz2))
        # cancellation-free form when delta_j > 0: a^2 = 2 |z|^2 / (delta + sqrt(delta^2 + 4|z|^2))
        a2 = torch.where(h > 0, 2 * nz2 / (h + torch.sqrt(h * h + 4 * nz2)).clamp_min(1e-300), a2)
        bad = a2 <= 1e-300
        if torch.any(bad):
            raise NotIntrinsicError(f"neuron(s) {torch.nonzero(bad).flatten().tolist()} have a_j = 0 (z_j = 0 with "
                                    "delta_j >= 0): w_j is not determined by (z, delta), the flow is not intrinsic there")
        return a2

    def intrinsic_velocity(self, z: Tensor, h: Tensor, g: Tensor) -> Tensor:
        a2 = self.a_squared(z, h)
        zg = (z * g).sum(1)
        return -(a2[:, None] * g + (zg / a2)[:, None] * z)

    def metric_closed_form(self, z: Tensor, h: Tensor) -> Tensor:
        """Block-diagonal ``(k d, k d)`` metric ``diag_j(a_j^2 I + z_j z_j^T / a_j^2)``."""
        a2 = self.a_squared(z, h)
        blocks = [a2[j] * torch.eye(self.d, dtype=DTYPE) + torch.outer(z[j], z[j]) / a2[j] for j in range(self.k)]
        return torch.block_diag(*blocks)


ReLUPathLift = ReLUNet


class DeepReLUPathLift(LiftedSystem):
    """Bias-free deep ReLU net, ``widths = [d_0, ..., d_L]``, weights ``W_l (d_l, d_{l-1})``.

    Path-lifting: the tensor ``z[i_L, ..., i_0] = prod_l W_l[i_l, i_{l-1}]`` of shape ``(d_L, ..., d_0)``
    (one entry per input-output path). Conserved per hidden neuron ``i`` of layer ``l``:
    ``||W_l[i, :]||^2 - ||W_{l+1}[:, i]||^2``. Only the criterion is implemented (spec).
    """

    def __init__(self, widths: Sequence[int]) -> None:
        widths = [check_int("widths[i]", w, 1) for w in widths]
        if len(widths) < 2:
            raise ValueError(f"widths must hold at least [d_in, d_out], got {widths}")
        self.widths = widths
        self.shapes = [(widths[l + 1], widths[l]) for l in range(len(widths) - 1)]
        self.dim_theta = sum(a * b for a, b in self.shapes)

    def weights(self, theta: Tensor) -> list[Tensor]:
        return _split_matrices(theta, self.shapes)

    def phi(self, theta: Tensor) -> Tensor:
        Ws = self.weights(theta)
        z = Ws[0]  # (d1, d0)
        for W in Ws[1:]:
            z = W.reshape(*W.shape, *([1] * (z.ndim - 1))) * z.unsqueeze(0)
        return z

    def invariants(self, theta: Tensor) -> Tensor:
        Ws = self.weights(theta)
        return torch.cat([Ws[l].pow(2).sum(1) - Ws[l + 1].pow(2).sum(0) for l in range(len(Ws) - 1)]) \
            if len(Ws) > 1 else torch.zeros(0, dtype=DTYPE)

    def random_init(self, seed: int | torch.Generator | None = 0, scale: float = 1.0) -> Tensor:
        g = _gen(seed)
        return torch.cat([(_randn(g, a, b) * (float(scale) / math.sqrt(b))).reshape(-1) for a, b in self.shapes])


class LinearODE(DeepLinear):
    """Linear neural ODE ``x'(s) = A(s) x(s)``, ``s in [0, 1]``, ``Z`` = the resolvent at ``s = 1``, discretised
    with ``N`` steps: ``Z = prod_k (I + A_k / N)`` (spec item 4; ``N = 64`` by default).

    ``theta = [vec B_1, ..., vec B_N]`` with ``A_k = sqrt(N) B_k``, so that the plain gradient flow on ``theta``
    is the ``L^2([0,1])`` gradient flow of ``A``: ``A_k' = -N dl/dA_k`` (our choice; with the plain flow on ``A``
    the metric vanishes like ``1/N``). Then ``W_k' = -(1/N) dl/dW_k`` and, for a balanced init (e.g. a constant
    normal ``A(s) = A_0``), the discretised flow is the deep-linear one scaled by ``1/N``; as ``N -> infinity``
    it tends to :meth:`limit_velocity`::

        Z' = -int_0^1 (Z Z^T)^{1-s} G (Z^T Z)^s ds = -P [(P^T G Q) o L] Q^T,  L_ab = (mu_a - nu_b)/(ln mu_a - ln nu_b)

    (logarithmic mean of the eigenvalues ``mu`` of ``Z Z^T`` and ``nu`` of ``Z^T Z``).
    """

    def __init__(self, d: int, N: int = 64) -> None:
        super().__init__([check_int("d", d, 1)] * (check_int("N", N, 1) + 1))
        self.d = d
        self.velocity_scale = 1.0 / N
        self._dW_dtheta = 1.0 / math.sqrt(N)

    def weights(self, theta: Tensor) -> list[Tensor]:
        Bs = super().weights(theta)
        eye = torch.eye(self.d, dtype=DTYPE)
        return [eye + B / math.sqrt(self.N) for B in Bs]

    def theta_from_A(self, As: Sequence[Tensor] | Tensor) -> Tensor:
        return torch.cat([(_t(A, "A") / math.sqrt(self.N)).reshape(-1) for A in As])

    def balanced_init(self, seed: int | torch.Generator | None = 0, scale: float = 1.0) -> Tensor:
        """``A(s) = A_0`` constant and symmetric (``N(0, scale^2/d)`` entries, symmetrised): every
        ``W_k = I + A_0/N`` is normal, hence the init is balanced."""
        g = _gen(seed)
        A0 = _randn(g, self.d, self.d) * (float(scale) / math.sqrt(self.d))
        A0 = 0.5 * (A0 + A0.mT)
        return self.theta_from_A([A0] * self.N)

    @staticmethod
    def limit_velocity(z: Tensor, h: Tensor | None, g: Tensor) -> Tensor:
        """The ``N -> infinity`` intrinsic velocity (balanced init); needs ``Z`` invertible."""
        mu, P = _eigh(z @ z.mT)
        nu, Q = _eigh(z.mT @ z)
        floor = 1e-12 * float(mu.max())
        if float(mu.min()) <= floor or float(nu.min()) <= floor:
            raise NotIntrinsicError("the limit formula needs an invertible Z (the resolvent of a linear ODE is)")
        lm, ln_ = mu.log()[:, None], nu.log()[None, :]
        diff = lm - ln_
        L = torch.where(diff.abs() > 1e-8, (mu[:, None] - nu[None, :]) / torch.where(diff == 0, torch.ones_like(diff), diff),
                        torch.sqrt(mu[:, None] * nu[None, :]) * (1 + diff.pow(2) / 24))
        return -(P @ ((P.mT @ g @ Q) * L) @ Q.mT)


class CustomLift(LiftedSystem):
    """Any lifting given as torch functions of a flat ``theta`` of length ``dim_theta``.

    ``phi(theta) -> z``; optional ``invariants(theta) -> h`` (flat) and
    ``intrinsic_velocity(z, h, g) -> z'``. Use with :func:`simulate_flow`, :func:`check_criterion` and
    :func:`conservation_law_count`.
    """

    def __init__(self, phi: Callable[[Tensor], Tensor], dim_theta: int,
                 invariants: Callable[[Tensor], Tensor] | None = None,
                 intrinsic_velocity: Callable[[Tensor, Tensor, Tensor], Tensor] | None = None) -> None:
        if not callable(phi):
            raise TypeError("phi must be a callable theta -> z")
        self._phi, self._h, self._v = phi, invariants, intrinsic_velocity
        self.dim_theta = check_int("dim_theta", dim_theta, 1)

    def phi(self, theta: Tensor) -> Tensor:
        return self._phi(theta)

    def invariants(self, theta: Tensor) -> Tensor:
        return self._h(theta).reshape(-1) if self._h is not None else torch.zeros(0, dtype=DTYPE)

    def intrinsic_velocity(self, z: Tensor, h: Tensor, g: Tensor) -> Tensor:
        if self._v is None:
            return super().intrinsic_velocity(z, h, g)
        return self._v(z, h, g)


# --------------------------------------------------------------------------------------------------
# Config, flows and their result


@dataclass(frozen=True)
class IntrinsicConfig:
    """Integration settings (spec choices): RK4, step ``dt = 1e-3``, horizon ``t_max``.

    ``record_every``: keep ``z`` every this many steps (the final step is always kept).
    ``on_pattern_change``: what to do when the activation pattern of a ReLU loss (or a parameter sign,
    ``sign(a_j)``) changes within a step:

    * ``"stop"`` (spec default): stop; the step that crossed is discarded and its end time reported;
    * ``"locate"``: find the crossing by bisection on the RK4 sub-step (to 1e-13), step onto it and go on with
      the new pattern (the formula holds piecewise; every RK4 stage of a step uses the pattern of the piece
      it starts on, so RK4 keeps its order on each piece). A parameter sign flip,
      or more than 20 crossings in one step (sliding along a kink), still stops the run;
    * ``"ignore"``: plain RK4 through the kinks (loses order at each crossing).
    """

    t_max: float = 1.0
    dt: float = 1e-3
    record_every: int = 1
    on_pattern_change: str = "stop"

    def __post_init__(self) -> None:
        for name in ("t_max", "dt"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(float(v)) or float(v) <= 0:
                raise ValueError(f"IntrinsicConfig.{name} must be a finite number > 0, got {v!r}")
        if self.dt > self.t_max:
            raise ValueError(f"IntrinsicConfig.dt={self.dt} exceeds t_max={self.t_max}")
        if isinstance(self.record_every, bool) or not isinstance(self.record_every, int) or self.record_every < 1:
            raise ValueError(f"IntrinsicConfig.record_every must be an int >= 1, got {self.record_every!r}")
        if self.on_pattern_change not in ("stop", "locate", "ignore"):
            raise ValueError("IntrinsicConfig.on_pattern_change must be 'stop', 'locate' or 'ignore', got "
                             f"{self.on_pattern_change!r}")

    @property
    def n_steps(self) -> int:
        return max(1, int(round(self.t_max / self.dt)))


@dataclass
class FlowResult:
    """A trajectory of the lifted variable.

    Attributes:
        times: ``(T,)`` recorded times. z: ``(T, *z.shape)``. loss: ``(T,)``.
        invariants: ``(T, H)`` conserved quantities along a parameter flow (None for lifted flows).
        theta: ``(T, D)`` parameters along a parameter flow (None otherwise).
        stopped_at: time at which the run stopped early (first pattern change with ``"stop"``; a sign flip or
            sliding with ``"locate"``), or None; ``stop_reason``: ``"pattern"`` (activation pattern), ``"sign"``
            (a parameter sign such as ``sign(a_j)`` flipped: the flow passed through the non-intrinsic set
            ``a_j = 0``) or ``"sliding"``. events: times of the located pattern changes (``"locate"``).
        kind: ``"parameter"``, ``"intrinsic"`` or ``"euclidean"``. wall_time_s: seconds.
    """

    times: np.ndarray
    z: np.ndarray
    loss: np.ndarray
    kind: str
    invariants: np.ndarray | None = None
    theta: np.ndarray | None = None
    stopped_at: float | None = None
    stop_reason: str | None = None
    events: list[float] = field(default_factory=list)
    wall_time_s: float = 0.0

    def conservation_residual(self) -> np.ndarray:
        """``(T,)`` ``max_i |h_i(t) - h_i(0)|`` (parameter flows)."""
        if self.invariants is None:
            raise ValueError("conservation residuals need a parameter flow (simulate_flow)")
        if self.invariants.shape[1] == 0:
            return np.zeros(len(self.times))
        return np.abs(self.invariants - self.invariants[:1]).max(axis=1)

    def relative_error(self, other: "FlowResult") -> np.ndarray:
        """``||z(t) - z_other(t)||_F / ||z(t)||_F`` on the common recorded times (shortest run)."""
        return compare(self, other)


def compare(a: FlowResult, b: FlowResult) -> np.ndarray:
    """Relative Frobenius error ``||z_a - z_b|| / ||z_a||`` at the times both runs recorded."""
    T = min(len(a.times), len(b.times))
    if T == 0 or not np.allclose(a.times[:T], b.times[:T]):
        raise ValueError("the two flows were not recorded at the same times (use the same dt and record_every)")
    za, zb = a.z[:T].reshape(T, -1), b.z[:T].reshape(T, -1)
    return np.linalg.norm(za - zb, axis=1) / np.maximum(np.linalg.norm(za, axis=1), 1e-300)


def _rk4(f: Callable[[Tensor], Tensor], x: Tensor, dt: float) -> Tensor:
    k1 = f(x)
    k2 = f(x + 0.5 * dt * k1)
    k3 = f(x + 0.5 * dt * k2)
    k4 = f(x + dt * k3)
    return x + (dt / 6.0) * (k1 + 2 * k2 + 2 * k3 + k4)


def _cfg(config: IntrinsicConfig | None, t_max: float | None, dt: float | None) -> IntrinsicConfig:
    c = config or IntrinsicConfig()
    if t_max is not None or dt is not None:
        c = IntrinsicConfig(t_max=c.t_max if t_max is None else t_max, dt=c.dt if dt is None else dt,
                            record_every=c.record_every, on_pattern_change=c.on_pattern_change)
    return c


def _check_loss(loss: Any, z0: Tensor) -> None:
    if not isinstance(loss, Loss):
        if callable(loss):
            raise TypeError("loss must be a rankwise Loss; wrap a plain function with CallableLoss(fn)")
        raise TypeError(f"loss must be a Loss, got {type(loss).__name__}")
    v = loss.value(z0)
    if not torch.isfinite(v):
        raise ValueError(f"the loss is not finite at the initial point (got {float(v)})")


class _Stop(Exception):
    pass


def _integrate(state0: Tensor, velocity: Callable[[Tensor], Tensor], to_z: Callable[[Tensor], Tensor],
               loss: Loss, cfg: IntrinsicConfig, kind: str, extra: Callable[[Tensor], Tensor | None] | None = None,
               state_pattern: Callable[[Tensor], Tensor | None] | None = None,
               keep_state: bool = False) -> FlowResult:
    """Fixed-step RK4 on the grid ``k dt`` with activation-pattern handling (see :class:`IntrinsicConfig`)."""
    t0 = time.perf_counter()
    dt, K = cfg.t_max / cfg.n_steps, cfg.n_steps
    x = state0.clone()
    z = to_z(x)

    def patterns(state: Tensor) -> tuple[Tensor | None, Tensor | None]:
        return loss.pattern(to_z(state)), (state_pattern(state) if state_pattern is not None else None)

    def same(a: tuple[Tensor | None, Tensor | None], b: tuple[Tensor | None, Tensor | None]) -> bool:
        return all(u is None or torch.equal(u, v) for u, v in zip(a, b))

    pat = patterns(x)
    track = cfg.on_pattern_change != "ignore" and (pat[0] is not None or pat[1] is not None)
    events: list[float] = []

    def locate(x: Tensor, t: float, pat: tuple[Any, Any]) -> tuple[Tensor, tuple[Any, Any]]:
        """Advance ``x`` by ``dt`` from time ``t``, stepping exactly onto each pattern change (bisection
        on the RK4 sub-step to 1e-13) and continuing with the new pattern, so that RK4 keeps its order."""
        remaining, n_ev = dt, 0
        while remaining > 0:
            with loss.freeze(pat[0]):
                x_try = _rk4(velocity, x, remaining)
                if same(patterns(x_try), pat):
                    return x_try, pat
                lo, hi = 0.0, remaining
                while hi - lo > 1e-13:
                    mid = 0.5 * (lo + hi)
                    if same(patterns(_rk4(velocity, x, mid)), pat):
                        lo = mid
                    else:
                        hi = mid
                x = _rk4(velocity, x, hi)
            new = patterns(x)
            if new[1] is not None and pat[1] is not None and not torch.equal(new[1], pat[1]):
                raise _Stop(t + dt - remaining + hi, "sign")  # a parameter sign flipped: not a kink of the loss
            events.append(t + dt - remaining + hi)
            n_ev += 1
            if n_ev > 20:
                raise _Stop(t + dt - remaining + hi, "sliding")  # the flow slides along a kink (Filippov)
            pat, remaining = new, remaining - hi
        return x, pat

    times, zs, losses, hs, thetas = [0.0], [z.numpy().copy()], [float(loss.value(z))], [], []
    if extra is not None:
        hs.append(extra(x).numpy().copy())
    if keep_state:
        thetas.append(x.numpy().copy())
    stopped, reason = None, None
    for k in range(1, K + 1):
        with loss.freeze(pat[0] if track else None):
            x_new = _rk4(velocity, x, dt)
        if track:
            p = patterns(x_new)
            if not same(p, pat):
                if cfg.on_pattern_change == "stop":
                    stopped = k * dt
                    reason = "sign" if (p[1] is not None and not torch.equal(p[1], pat[1])) else "pattern"
                    break
                try:
                    x_new, p = locate(x, (k - 1) * dt, pat)
                except _Stop as st:
                    stopped, reason = float(st.args[0]), str(st.args[1])
                    break
            pat = p
        if not torch.isfinite(x_new).all():
            raise NumericalError(f"{kind} flow: non-finite state at t={k * dt:.4g} (step dt={dt}); lower dt")
        x = x_new
        if k % cfg.record_every == 0 or k == K:
            z = to_z(x)
            times.append(k * dt)
            zs.append(z.numpy().copy())
            losses.append(float(loss.value(z)))
            if extra is not None:
                hs.append(extra(x).numpy().copy())
            if keep_state:
                thetas.append(x.numpy().copy())
    return FlowResult(times=np.array(times), z=np.stack(zs), loss=np.array(losses), kind=kind,
                      invariants=np.stack(hs) if extra is not None else None,
                      theta=np.stack(thetas) if keep_state else None, stopped_at=stopped,
                      stop_reason=reason, events=events, wall_time_s=time.perf_counter() - t0)


def simulate_flow(system: LiftedSystem, theta0: Any, loss: Loss, config: IntrinsicConfig | None = None, *,
                  t_max: float | None = None, dt: float | None = None, keep_theta: bool = False,
                  use_closed_form: bool = True) -> FlowResult:
    """The parameter gradient flow ``theta' = -J(theta)^T grad l(phi(theta))`` (RK4), recording ``z = phi(theta)``
    and the conserved quantities. The ground truth against which lifted flows are compared.

    The velocity is the system's closed-form ``param_velocity`` when it has one (tests check it against
    autograd) and an autograd vector-Jacobian product otherwise (``use_closed_form=False`` forces autograd).
    """
    if not isinstance(system, LiftedSystem):
        raise TypeError(f"system must be a LiftedSystem, got {type(system).__name__}")
    cfg = _cfg(config, t_max, dt)
    th0 = system.check_theta(theta0)
    _check_loss(loss, system.phi(th0))

    def velocity_autograd(th: Tensor) -> Tensor:
        th = th.detach().requires_grad_(True)
        z = system.phi(th)
        g = loss.grad(z.detach())
        (v,) = torch.autograd.grad(z, th, grad_outputs=g)
        return -v

    closed = system.param_velocity(th0, loss.grad(system.phi(th0).detach())) if use_closed_form else None

    def velocity_closed(th: Tensor) -> Tensor:
        return system.param_velocity(th, loss.grad(system.phi(th)))

    velocity = velocity_closed if closed is not None else velocity_autograd
    return _integrate(th0, velocity, lambda th: system.phi(th).detach(), loss, cfg, "parameter",
                      extra=lambda th: system.invariants(th).detach(), state_pattern=system.param_pattern,
                      keep_state=keep_theta)


VelocityFn = Callable[[Tensor, Tensor, Tensor], Tensor]


def intrinsic_flow(system: LiftedSystem | VelocityFn, z0: Any, invariants: Any, loss: Loss,
                   config: IntrinsicConfig | None = None, *, t_max: float | None = None,
                   dt: float | None = None) -> FlowResult:
    """The lifted flow ``z' = -F(z, h) grad l(z)`` from ``z(0) = z0`` with the conserved ``h`` (RK4).

    ``system`` is a :class:`LiftedSystem` with a closed-form ``intrinsic_velocity`` or any callable
    ``velocity(z, h, g) -> z'``. ``invariants`` is ``system.invariants(theta0)`` (or an assumed value,
    to test a formula outside its domain)."""
    cfg = _cfg(config, t_max, dt)
    z0 = _t(z0, "z0")
    h = _t(invariants, "invariants").reshape(-1)
    if isinstance(system, LiftedSystem):
        vel = system.velocity_for(h)
    elif callable(system):
        fn = system
        vel = lambda z, g: fn(z, h, g)  # noqa: E731
    else:
        raise TypeError("system must be a LiftedSystem or a callable velocity(z, h, g)")
    _check_loss(loss, z0)
    vel(z0, loss.grad(z0))  # raises NotImplementedError / NotIntrinsicError before integrating
    return _integrate(z0, lambda z: vel(z, loss.grad(z)), lambda z: z, loss, cfg, "intrinsic")


def euclidean_flow(z0: Any, loss: Loss, config: IntrinsicConfig | None = None, *, t_max: float | None = None,
                   dt: float | None = None) -> FlowResult:
    """The naive baseline ``z' = -grad l(z)`` that ignores the parametrisation and the initialisation."""
    cfg = _cfg(config, t_max, dt)
    z0 = _t(z0, "z0")
    _check_loss(loss, z0)
    res = _integrate(z0, lambda z: -loss.grad(z), lambda z: z, loss, cfg, "euclidean")
    return res


# --------------------------------------------------------------------------------------------------
# The kernel-inclusion criterion and conservation laws


@dataclass
class CriterionReport:
    """Result of :func:`check_criterion`.

    ``inclusion``: ``ker d phi ∩ ker d h ⊂ ker dM`` holds (necessary condition for an intrinsic flow);
    ``rank_phi_h`` / ``rank_with_M``: ranks of ``[d phi; d h]`` and ``[d phi; d h; d vec M]`` (each block
    scaled to unit spectral norm; singular values above ``tol`` times the norm of ``[d phi; d h]`` count); ``kernel_dim``: ``dim theta - rank_phi_h``;
    ``leakage``: ``||dM K|| / ||dM||`` over an orthonormal basis ``K`` of the joint kernel (0 if empty).
    """

    inclusion: bool
    rank_phi_h: int
    rank_with_M: int
    kernel_dim: int
    leakage: float
    dim_theta: int
    n_invariants: int

    def as_dict(self) -> dict[str, Any]:
        return {"inclusion": self.inclusion, "rank_phi_h": self.rank_phi_h, "rank_with_M": self.rank_with_M,
                "kernel_dim": self.kernel_dim, "leakage": self.leakage}


def _rank(A: Tensor, tol: float, scale: float | None = None) -> int:
    """Numerical rank: singular values above ``tol * scale`` (``scale`` = the largest one by default)."""
    if A.numel() == 0:
        return 0
    s = torch.linalg.svdvals(A)
    ref = float(s.max()) if scale is None else scale
    return int((s > tol * ref).sum()) if ref > 0 else 0


def _unit(A: Tensor) -> Tensor:
    if A.numel() == 0:
        return A
    n = torch.linalg.matrix_norm(A, ord=2)
    return A / n if float(n) > 0 else A


def _criterion_jacobians(system: LiftedSystem, theta: Tensor,
                         invariants: Callable[[Tensor], Tensor] | None) -> tuple[Tensor, Tensor, Tensor]:
    """``d phi (P, D)``, ``d h (H, D)`` and ``d vec M (P*P, D)``, with ``dM = dJ J^T + J dJ^T`` from the
    Hessians of the components of ``phi``."""
    hfun = invariants or system.invariants
    J, Hs = _jacobian_and_hessians(lambda th: system.phi(th).reshape(-1), theta)
    h0 = hfun(theta).reshape(-1)
    Jh = _jacobian(lambda th: hfun(th).reshape(-1), theta) if h0.numel() else torch.zeros(0, theta.numel(), dtype=DTYPE)
    A = torch.einsum("pdk,qd->pqk", Hs, J)
    JM = (A + A.transpose(0, 1)).reshape(-1, theta.numel())
    return J, Jh, JM


def check_criterion(system: LiftedSystem, theta: Any, *, invariants: Callable[[Tensor], Tensor] | None = None,
                    tol: float = CRITERION_TOL) -> CriterionReport:
    """Test the necessary condition ``ker d phi(theta) ∩ ker d h(theta) ⊂ ker dM(theta)`` (spec "Criterion").

    Jacobians and Hessians by autograd (float64); ranks by SVD with relative tolerance ``tol`` after scaling
    each block to unit norm. ``invariants`` overrides ``system.invariants`` (e.g. a subset of laws).
    """
    if not isinstance(system, LiftedSystem):
        raise TypeError(f"system must be a LiftedSystem, got {type(system).__name__}")
    th = system.check_theta(theta)
    if not (isinstance(tol, float) and 0 < tol < 1):
        raise ValueError(f"tol must be a float in (0, 1), got {tol!r}")
    Jphi, Jh, JM = _criterion_jacobians(system, th, invariants)
    A = torch.cat([_unit(Jphi), _unit(Jh)]) if Jh.numel() else _unit(Jphi)
    # one absolute threshold for both ranks, so that adding rows can only add rank (interlacing)
    scale = float(torch.linalg.matrix_norm(A, ord=2))
    r1 = _rank(A, tol, scale)
    r2 = _rank(torch.cat([A, _unit(JM)]), tol, scale)
    # leakage: dM on an orthonormal basis of the joint kernel
    _, s, Vh = torch.linalg.svd(A, full_matrices=True)
    K = Vh[r1:].mT
    leak = 0.0
    if K.shape[1] and float(torch.linalg.matrix_norm(JM, ord=2)) > 0:
        leak = float(torch.linalg.matrix_norm(JM @ K, ord=2) / torch.linalg.matrix_norm(JM, ord=2))
    return CriterionReport(inclusion=(r1 == r2), rank_phi_h=r1, rank_with_M=r2, kernel_dim=th.numel() - r1,
                           leakage=leak, dim_theta=th.numel(), n_invariants=int(Jh.shape[0]))


def level_set_counterexample(system: LiftedSystem, theta: Any, *, step: float = 0.3, tol: float = 1e-12,
                             max_iter: int = 50) -> dict[str, Any]:
    """Find ``theta2`` with ``phi(theta2) = phi(theta)`` and ``h(theta2) = h(theta)`` but ``M(theta2) != M(theta)``.

    Moves by ``step * ||theta||`` along the direction of the joint kernel of ``[d phi; d h]`` that changes
    ``M`` most, then projects back onto the level set by Gauss-Newton (pseudo-inverse). When the
    criterion fails this exhibits two parameters that the lifted state and the conserved quantities cannot
    tell apart but whose velocities ``-M g`` differ: no intrinsic dynamic. Returns ``theta2``, the
    level-set residual, and the relative metric difference.
    """
    th = system.check_theta(theta)
    Jphi, Jh, JM = _criterion_jacobians(system, th, None)
    A = torch.cat([Jphi, Jh])
    _, s, Vh = torch.linalg.svd(A, full_matrices=True)
    r = _rank(A, CRITERION_TOL)
    K = Vh[r:].mT
    if K.shape[1] == 0:
        raise ValueError("the joint kernel is trivial: no direction keeps phi and h fixed")
    _, _, Wh = torch.linalg.svd(JM @ K, full_matrices=False)
    v = K @ Wh[0]
    target = torch.cat([system.phi(th).reshape(-1), system.invariants(th).reshape(-1)])

    def F(t: Tensor) -> Tensor:
        return torch.cat([system.phi(t).reshape(-1), system.invariants(t).reshape(-1)]) - target

    th2 = th + step * float(th.norm()) * v
    res = float(F(th2).norm())
    for _ in range(max_iter):
        J = _jacobian(F, th2)
        th2 = th2 - torch.linalg.lstsq(J, F(th2).unsqueeze(1), driver="gelsd").solution.squeeze(1)
        res = float(F(th2).norm())
        if res < tol * max(1.0, float(target.norm())):
            break
    M1, M2 = system.metric(th), system.metric(th2)
    return {"theta2": th2, "residual": res, "metric_change": float((M2 - M1).norm() / M1.norm()),
            "distance": float((th2 - th).norm() / th.norm())}


def conservation_law_count(phi: Callable[[Tensor], Tensor] | LiftedSystem, theta: Any, *, max_order: int = 4,
                           n_probe: int = 4, seed: int = 0, tol: float = 1e-9) -> dict[str, Any]:
    """Number of independent conservation laws of ``l(phi(theta))`` flows near ``theta``, for any ``phi``.

    A function ``h`` is conserved for every loss iff ``grad h`` is orthogonal to the Lie algebra generated by
    the fields ``X_i = grad phi_i`` (Marcotte, Gribonval, Peyre 2023). We generate it numerically: level 1 =
    the ``X_i``; level ``k+1`` = brackets ``[X_i, Y]`` with ``Y`` of level ``k`` (``[X, Y] = DY X - DX Y`` by
    double-backward Jacobian-vector products), keeping a field only if it is linearly independent of those kept, as functions
    (values stacked at ``theta`` and ``n_probe - 1`` random points). The count is
    ``dim theta - rank`` of the kept fields at ``theta``. ``saturated`` says the algebra stopped growing before
    ``max_order`` (then the count is exact up to the numerical rank); otherwise it is an upper bound.
    """
    fn = phi.phi if isinstance(phi, LiftedSystem) else phi
    if not callable(fn):
        raise TypeError("phi must be a callable theta -> z or a LiftedSystem")
    th = _t(theta, "theta").reshape(-1)
    D = th.numel()
    g = _gen(seed)
    probes = torch.stack([th] + [th + _randn(g, D) * max(float(th.norm()) / math.sqrt(D), 1e-3)
                                 for _ in range(max(0, n_probe - 1))])

    # Fields are functions t -> R^D built with create_graph=True so that they can be differentiated again.
    def grad_field(i: int) -> Callable[[Tensor], Tensor]:
        def f(t: Tensor) -> Tensor:
            if not t.requires_grad:
                t = t.detach().requires_grad_(True)
            (gi,) = torch.autograd.grad(fn(t).reshape(-1)[i], t, create_graph=True, allow_unused=True)
            return torch.zeros_like(t) if gi is None else gi
        return f

    def directional(F: Callable[[Tensor], Tensor], t: Tensor, v: Tensor) -> Tensor:
        """``DF(t) v`` by the double-backward trick, differentiable in ``t``."""
        y = F(t)
        if not y.requires_grad:  # F does not depend on t (e.g. the gradient field of a linear phi)
            return torch.zeros_like(y)
        u = torch.zeros_like(y, requires_grad=True)
        (vjp,) = torch.autograd.grad(y, t, grad_outputs=u, create_graph=True, allow_unused=True)
        if vjp is None:
            return torch.zeros_like(y)
        (jv,) = torch.autograd.grad(vjp, u, grad_outputs=v, create_graph=True, allow_unused=True)
        return torch.zeros_like(y) if jv is None else jv

    def bracket(X: Callable[[Tensor], Tensor], Y: Callable[[Tensor], Tensor]) -> Callable[[Tensor], Tensor]:
        def f(t: Tensor) -> Tensor:
            if not t.requires_grad:
                t = t.detach().requires_grad_(True)
            return directional(Y, t, X(t)) - directional(X, t, Y(t))
        return f

    P = fn(th).numel()
    gens = [grad_field(i) for i in range(P)]
    kept: list[Callable[[Tensor], Tensor]] = []
    basis = torch.zeros(0, probes.numel(), dtype=DTYPE)

    def try_add(f: Callable[[Tensor], Tensor]) -> bool:
        nonlocal basis
        vals = torch.cat([f(p).detach() for p in probes])
        if float(vals.norm()) == 0:
            return False
        cand = torch.cat([basis, vals[None] / vals.norm()])
        if _rank(cand, tol) > basis.shape[0]:
            basis = cand
            kept.append(f)
            return True
        return False

    level = [f for f in gens if try_add(f)]
    order, saturated = 1, False
    while order < max_order:
        new = []
        for X in gens:
            for Y in level:
                f = bracket(X, Y)
                if try_add(f):
                    new.append(f)
                if basis.shape[0] >= D * probes.shape[0]:
                    break
        order += 1
        if not new:
            saturated = True
            break
        level = new
        if _rank(torch.stack([f(th).detach() for f in kept]), tol) == D:
            saturated = True  # the fields already span R^D at theta: no conservation law
            break
    at_theta = torch.stack([f(th).detach() for f in kept]) if kept else torch.zeros(0, D, dtype=DTYPE)
    rank = _rank(at_theta, tol)
    return {"n_laws": D - rank, "lie_rank": rank, "dim_theta": D, "n_fields": len(kept), "orders": order,
            "saturated": saturated}


# --------------------------------------------------------------------------------------------------
# Registry entry point


def run_comparison(system: LiftedSystem, theta0: Any, loss: Loss, config: IntrinsicConfig | None = None
                   ) -> dict[str, Any]:
    """Parameter flow vs intrinsic flow (and the Euclidean guess) from ``theta0``: the registered entry point.

    Returns ``{"parameter": FlowResult, "intrinsic": FlowResult, "euclidean": FlowResult,
    "max_rel_error": float, "euclidean_rel_error": float, "conservation_residual": float,
    "criterion": CriterionReport}``.
    """
    cfg = config or IntrinsicConfig()
    th0 = system.check_theta(theta0)
    p = simulate_flow(system, th0, loss, cfg)
    i = intrinsic_flow(system, system.phi(th0).detach(), system.invariants(th0), loss, cfg)
    e = euclidean_flow(system.phi(th0).detach(), loss, cfg)
    return {"parameter": p, "intrinsic": i, "euclidean": e, "max_rel_error": float(compare(p, i).max()),
            "euclidean_rel_error": float(compare(p, e).max()),
            "conservation_residual": float(p.conservation_residual().max()),
            "criterion": check_criterion(system, th0)}


register("intrinsic_dynamics", config=IntrinsicConfig, entry=run_comparison)
