"""CDKA's math, no model needed: Van Loan rearrangement, alignment scores, candidate shapes,
gradient initialisation and the Kronecker products (see :mod:`rankwise.adapt.cdka`)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from rankwise.core.errors import NumericalError
from rankwise.core.linalg import kron_rearrange
from rankwise.adapt.cdka.config import TIE_RTOL, _pos_int


# ------------------------------------------------------------------------------------------------
# the math (no model needed)
# ------------------------------------------------------------------------------------------------

def divisors(n: int) -> list[int]:
    """Positive divisors of ``n`` in increasing order."""
    if not _pos_int(n):
        raise ValueError(f"divisors: n must be an int >= 1, got {n!r}")
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


def check_shape(d_out: int, d_in: int, r1: int, r2: int, r: int, name: str | None = None) -> None:
    """Raise ValueError unless ``r1 | d_out``, ``r2 | d_in`` and ``1 <= r <= min(m1 n1, m2 n2)``."""
    where = f" for layer {name!r}" if name else ""
    for field, v in (("r1", r1), ("r2", r2), ("r", r)):
        if not _pos_int(v):
            raise ValueError(f"CDKA {field} must be an int >= 1{where}, got {v!r}")
    if d_out % r1:
        raise ValueError(f"CDKA r1={r1} does not divide d_out={d_out}{where}; valid r1: {divisors(d_out)}")
    if d_in % r2:
        raise ValueError(f"CDKA r2={r2} does not divide d_in={d_in}{where}; valid r2: {divisors(d_in)}")
    limit = min((d_out // r1) * r2, r1 * (d_in // r2))
    if r > limit:
        raise ValueError(f"CDKA r={r} components{where} exceed the Kronecker rank of shape (r1={r1}, r2={r2}), "
                         f"min((d_out/r1)*r2, r1*(d_in/r2)) = {limit}; choose r in [1, {limit}]")


def num_parameters(d_out: int, d_in: int, r1: int, r2: int, r: int) -> int:
    """``P = r ((d_out/r1) r2 + r1 (d_in/r2))``, the trainable parameters of one adapted matrix."""
    return r * ((d_out // r1) * r2 + r1 * (d_in // r2))


def rearrange(M: torch.Tensor, r1: int, r2: int) -> torch.Tensor:
    """Van Loan rearrangement ``R(M)``, shape ``((d_out/r1) r2, r1 (d_in/r2))``: ``R(B ⊗ A) = vec(B) vec(A)^T``.

    Row ``p * r2 + q`` of ``R(M)`` is block ``(p, q)`` of ``M`` (size ``r1 x d_in/r2``) flattened row-major.
    """
    if M.ndim != 2:
        raise ValueError(f"rearrange takes a matrix (d_out, d_in), got shape {tuple(M.shape)}")
    d_out, d_in = M.shape
    check_shape(d_out, d_in, r1, r2, 1)
    return kron_rearrange(M, (d_out // r1, r2), (r1, d_in // r2))


def _energy(G: torch.Tensor, what: str) -> torch.Tensor:
    G = G.detach().to(torch.float64)
    if not bool(torch.isfinite(G).all()):
        raise NumericalError(f"{what}: the gradient holds NaN or inf; alignment is undefined")
    total = G.square().sum()
    if float(total) == 0.0:
        raise ValueError(f"{what}: the gradient is exactly zero, so the alignment score is undefined; "
                         "check that the calibration loss depends on this layer")
    return total


def alignment_curve(G: torch.Tensor, r1: int, r2: int, max_r: int | None = None, *,
                    name: str | None = None) -> torch.Tensor:
    """``align(r1, r2, r)`` for ``r = 1..max_r`` (float64 vector, non-decreasing, in [0, 1]).

    ``sum_{k<=r} sigma_k(R(G))^2 / ||G||_F^2`` in float64 (:func:`squared_singular_values`).
    ``max_r`` defaults to the rank bound ``min(m1 n1, m2 n2)``.
    """
    what = f"layer {name!r}" if name else "CDKA alignment"
    total = _energy(G, what)
    R = rearrange(G.detach().to(torch.float64), r1, r2)
    limit = min(R.shape)
    max_r = limit if max_r is None else max_r
    if not _pos_int(max_r) or max_r > limit:
        raise ValueError(f"{what}: max_r must be in [1, {limit}] for r1={r1}, r2={r2}, got {max_r!r}")
    return (torch.cumsum(squared_singular_values(R)[:max_r], 0) / total).clamp(0.0, 1.0)


def squared_singular_values(R: torch.Tensor) -> torch.Tensor:
    """``sigma_k(R)^2`` in decreasing order, float64, from the eigenvalues of the smaller Gram matrix.

    ``R R^T`` (or ``R^T R``) costs ``p^2 q`` instead of an SVD; the leading eigenvalues, which the
    alignment scores use, are accurate to ``~eps * sigma_1^2`` (negative rounding is clipped to 0).
    """
    R = R.to(torch.float64)
    C = R @ R.T if R.shape[0] <= R.shape[1] else R.T @ R
    return torch.linalg.eigvalsh(C).flip(0).clamp_min(0.0)


def alignment(G: torch.Tensor, r1: int, r2: int, r: int, *, name: str | None = None) -> float:
    """The alignment score ``align(r1, r2, r)`` of gradient ``G`` (see the module docstring)."""
    return float(alignment_curve(G, r1, r2, r, name=name)[r - 1])


def candidates(d_out: int, d_in: int, budget: int, tolerance: float = 0.10, *,
               name: str | None = None) -> list[tuple[int, int, int, int]]:
    """Every ``(r1, r2, r, P)`` with ``r1 | d_out``, ``r2 | d_in``, ``r <= min(m1 n1, m2 n2)`` and
    ``|P - budget| <= tolerance * budget``; ValueError (with the feasible counts nearby) when none.
    """
    where = f" for layer {name!r} ({d_out}x{d_in})" if name else f" for a {d_out}x{d_in} layer"
    lo, hi = budget * (1.0 - tolerance), budget * (1.0 + tolerance)
    out: list[tuple[int, int, int, int]] = []
    cheapest: tuple[int, int, int] | None = None
    near_below, near_above = 0, None
    for r1 in divisors(d_out):
        for r2 in divisors(d_in):
            per = num_parameters(d_out, d_in, r1, r2, 1)
            limit = min((d_out // r1) * r2, r1 * (d_in // r2))
            if cheapest is None or per < cheapest[2]:
                cheapest = (r1, r2, per)
            for r in range(max(1, math.ceil(lo / per)), min(limit, math.floor(hi / per)) + 1):
                out.append((r1, r2, r, r * per))
            for r in range(1, limit + 1):  # nearest feasible counts, for the error message
                p = r * per
                if p < lo:
                    near_below = max(near_below, p)
                elif p > hi:
                    near_above = p if near_above is None else min(near_above, p)
                    break
    if not out:
        assert cheapest is not None
        if hi < cheapest[2]:
            raise ValueError(f"CDKA budget {budget}{where} is smaller than the cheapest configuration "
                             f"(r1={cheapest[0]}, r2={cheapest[1]}, r=1: {cheapest[2]} parameters); the minimum "
                             f"feasible budget is {cheapest[2]}")
        raise ValueError(f"no CDKA configuration has a parameter count within {tolerance:.0%} of the budget "
                         f"{budget}{where}; the nearest feasible counts are {near_below or None} and "
                         f"{near_above}; change the budget or budget_tolerance")
    return out


@dataclass(frozen=True)
class CDKAChoice:
    """The configuration of one adapted layer: shapes, parameter count and alignment (None if unknown)."""

    r1: int
    r2: int
    r: int
    params: int
    align: float | None


def choose_configuration(G: torch.Tensor, budget: int, tolerance: float = 0.10, *,
                         name: str | None = None) -> CDKAChoice:
    """The ``(r1, r2, r)`` of largest alignment among :func:`candidates` (budget-aware design, step 2).

    Ties (within :data:`TIE_RTOL`): more components ``r``, then ``P`` closest to the budget, then
    the smallest ``(r1, r2)``. One SVD of ``R(G)`` per ``(r1, r2)`` pair with a feasible ``r``.
    """
    if G.ndim != 2:
        raise ValueError(f"choose_configuration: G must be (d_out, d_in), got shape {tuple(G.shape)}")
    d_out, d_in = G.shape
    cands = candidates(d_out, d_in, budget, tolerance, name=name)
    by_pair: dict[tuple[int, int], list[tuple[int, int]]] = {}
    for r1, r2, r, p in cands:
        by_pair.setdefault((r1, r2), []).append((r, p))
    scored: list[tuple[float, int, int, int, int]] = []
    for (r1, r2), rs in by_pair.items():
        curve = alignment_curve(G, r1, r2, max(r for r, _ in rs), name=name)
        scored.extend((float(curve[r - 1]), r, p, r1, r2) for r, p in rs)
    best = max(s[0] for s in scored)
    tied = [s for s in scored if s[0] >= best - TIE_RTOL * max(abs(best), 1e-300)]
    a, r, p, r1, r2 = min(tied, key=lambda s: (-s[1], abs(s[2] - budget), s[3], s[4]))
    return CDKAChoice(r1=r1, r2=r2, r=r, params=p, align=a)


def gradient_init(G: torch.Tensor, r1: int, r2: int, r: int, scale: float = 1.0 / 32.0
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradient-aligned factors (stabilised initialisation, step 3), float64.

    Top-``r`` singular triplets of ``R(-G)``: ``B_k = c sqrt(sigma_k/sigma_1) unvec(u_k)`` of shape
    ``(d_out/r1, r2)`` and ``A_k = c sqrt(sigma_k/sigma_1) unvec(v_k)`` of shape ``(r1, d_in/r2)``.
    Returns ``B (r, d_out/r1, r2)``, ``A (r, r1, d_in/r2)``.
    """
    d_out, d_in = G.shape
    check_shape(d_out, d_in, r1, r2, r)
    _energy(G, "gradient_init")
    R = rearrange(-G.detach().to(torch.float64), r1, r2)
    U, S, Vh = torch.linalg.svd(R, full_matrices=False)
    w = scale * torch.sqrt(S[:r] / S[0])
    B = (U[:, :r] * w).T.reshape(r, d_out // r1, r2)
    A = (Vh[:r] * w[:, None]).reshape(r, r1, d_in // r2)
    return B, A


def kron_delta(B: torch.Tensor, A: torch.Tensor) -> torch.Tensor:
    """Dense ``sum_k B_k ⊗ A_k`` of shape ``(d_out, d_in)`` from stacks ``B (r, m1, n1)``, ``A (r, m2, n2)``."""
    r, m1, n1 = B.shape
    r_, m2, n2 = A.shape
    if r != r_:
        raise ValueError(f"B and A must hold equally many components, got {r} and {r_}")
    return torch.einsum("kpq,kmn->pmqn", B, A).reshape(m1 * m2, n1 * n2)


def kron_apply(B: torch.Tensor, A: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``x @ (sum_k B_k ⊗ A_k)^T`` without forming the product.

    ``y_k = vec(B_k X A_k^T)`` with ``X = x.reshape(r2, d_in/r2)`` (row-major).

    ``B (r, d_out/r1, r2)``, ``A (r, r1, d_in/r2)``, ``x (..., d_in)`` -> ``(..., d_out)``. Two batched
    matmuls: ``T = X A^T`` over all components, then ``B`` contracted over (component, r2).
    """
    r, m1, r2 = B.shape
    _, r1, n2 = A.shape
    lead = x.shape[:-1]
    X = x.reshape(-1, r2, n2)                                          # (N, r2, n2)
    T = X @ A.reshape(r * r1, n2).T                                    # (N, r2, r*r1)  [q, (k, m)]
    T = T.reshape(-1, r2, r, r1).transpose(1, 2).reshape(-1, r * r2, r1)  # (N, (k, q), m)
    Y = B.transpose(0, 1).reshape(m1, r * r2) @ T                      # (N, m1, r1)
    return Y.reshape(*lead, m1 * r1)


def to_official_layout(B: torch.Tensor, A: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Stacks -> the official code's matrices: ``B (d_out/r1, r*r2)`` with component ``i`` in columns
    ``i::r`` and ``A (r*r1, d_in/r2)`` with component ``i`` in rows ``i::r``."""
    r, m1, r2 = B.shape
    _, r1, n2 = A.shape
    return B.permute(1, 2, 0).reshape(m1, r2 * r), A.permute(1, 0, 2).reshape(r1 * r, n2)


def from_official_layout(B: torch.Tensor, A: torch.Tensor, r: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of :func:`to_official_layout` for ``r`` components."""
    if B.ndim != 2 or A.ndim != 2 or B.shape[1] % r or A.shape[0] % r:
        raise ValueError(f"official-layout B {tuple(B.shape)} / A {tuple(A.shape)} do not hold {r} components")
    m1, r2 = B.shape[0], B.shape[1] // r
    r1, n2 = A.shape[0] // r, A.shape[1]
    return B.reshape(m1, r2, r).permute(2, 0, 1).contiguous(), A.reshape(r1, r, n2).permute(1, 0, 2).contiguous()
