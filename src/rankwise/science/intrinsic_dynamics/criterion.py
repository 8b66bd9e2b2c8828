"""The kernel-inclusion criterion for intrinsic dynamics, level-set counterexamples and the count of
conservation laws.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import Tensor

from rankwise.science.intrinsic_dynamics.common import (
    CRITERION_TOL,
    DTYPE,
    _gen,
    _jacobian,
    _jacobian_and_hessians,
    _randn,
    _t,
)
from rankwise.science.intrinsic_dynamics.systems import LiftedSystem


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
