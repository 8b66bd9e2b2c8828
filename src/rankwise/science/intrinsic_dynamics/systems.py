"""Lifted systems ``z = phi(theta)``: matrix factorisation, deep linear networks, ReLU networks and
path lifts, linear ODEs, custom lifts; each with its invariants and intrinsic velocity.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Sequence

import numpy as np
import torch
from torch import Tensor

from rankwise.core.validate import check_int
from rankwise.science.intrinsic_dynamics.common import (
    DTYPE,
    NotIntrinsicError,
    _eigh,
    _floor_eigs,
    _gen,
    _jacobian,
    _orthonormal_columns,
    _randn,
    _sqrtm_shift,
    _t,
)
from rankwise.science.intrinsic_dynamics.losses import ReLURegressionLoss


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
