"""GFWSVD's closed form: the rank-``r`` minimiser of ``||L_Q^T (W - W_r) L_P||_F`` and what it predicts."""

from __future__ import annotations

import math

import torch

from rankwise.core.errors import NumericalError
from rankwise.core.linalg import LowRankFactors, check_finite, damped_cholesky, weighted_lowrank_factors
from rankwise.compress.gfwsvd.fisher import _where

Tensor = torch.Tensor

__all__ = ["gfwsvd_rank", "gfwsvd_factors", "gfwsvd_objective", "kronecker_whiteners", "predicted_loss_increase"]


# ----------------------------------------------------------------------------------------------
# closed form


def gfwsvd_rank(m: int, n: int, param_ratio: float, rank_multiple: int = 1) -> int:
    """Uniform rank ``floor(rho m n / (m + n))`` rounded down to a multiple of ``rank_multiple``, at least 1.

    ``param_ratio`` (``rho``) is the fraction of the layer's parameters KEPT, in ``(0, 1]``.
    """
    if isinstance(param_ratio, bool) or not isinstance(param_ratio, (int, float)) or not 0 < param_ratio <= 1:
        raise ValueError(f"param_ratio={param_ratio!r} must be in (0, 1] (the fraction of parameters kept)")
    if isinstance(rank_multiple, bool) or not isinstance(rank_multiple, int) or rank_multiple < 1:
        raise ValueError(f"rank_multiple must be an int >= 1, got {rank_multiple!r}")
    r = math.floor(param_ratio * m * n / (m + n))
    r = (r // rank_multiple) * rank_multiple
    return max(1, min(r, min(m, n)))


def _chol(M: Tensor, damping: float, retries: int, what: str, name: str | None) -> Tensor:
    try:
        return damped_cholesky(M, damping=damping, retries=retries, dtype=torch.float64, name=name).L
    except NumericalError as exc:
        raise NumericalError(f"GFWSVD: the {what} Kronecker factor{_where(name)} is not positive definite "
                             f"after damping retries: {exc}") from None


def gfwsvd_factors(
    W: Tensor,
    P: Tensor,
    Q: Tensor,
    rank: int,
    *,
    damping: float = 1e-4,
    retries: int = 5,
    name: str | None = None,
) -> LowRankFactors:
    """Closed-form GFWSVD: ``argmin_{rank(W_r) <= r} ||L_Q^T (W - W_r) L_P||_F``.

    Args:
        W: ``(m, n)`` weight. P: ``(n, n)`` input-side factor. Q: ``(m, m)`` output-side factor.
        rank: ``0 < rank <= min(m, n)``.
        damping: relative floor, ``P + damping mean(diag P) I = L_P L_P^T`` (same for ``Q``), x10 per
            failed Cholesky up to ``retries`` times; ``0`` = exact (a singular factor then raises).
    Returns:
        ``LowRankFactors(B, A)`` (float64): ``A = L_Q^{-T} U_r S_r^{1/2}``, ``B = S_r^{1/2} V_r^T L_P^{-1}``.
    """
    W = W.detach().to(torch.float64)
    m, n = W.shape
    if P.shape != (n, n) or Q.shape != (m, m):
        raise ValueError(f"need P {n}x{n} and Q {m}x{m} for W {m}x{n}{_where(name)}, got P {tuple(P.shape)}, "
                         f"Q {tuple(Q.shape)}")
    check_finite(W, "weight W", name)
    L_P = _chol(P.to(W), damping, retries, "input-side (P)", name)
    L_Q = _chol(Q.to(W), damping, retries, "output-side (Q)", name)
    return weighted_lowrank_factors(W, rank, left=L_Q.mT, right=L_P, dtype=torch.float64, name=name)


def gfwsvd_objective(W: Tensor, W_r: Tensor, P: Tensor, Q: Tensor, *, damping: float = 1e-4) -> float:
    """``||L_Q^T (W - W_r) L_P||_F`` with the damped Cholesky factors (the quantity GFWSVD minimises)."""
    L_P = damped_cholesky(P, damping=damping, dtype=torch.float64).L
    L_Q = damped_cholesky(Q, damping=damping, dtype=torch.float64).L
    dW = (W.to(torch.float64) - W_r.to(torch.float64))
    return float(torch.linalg.matrix_norm(L_Q.mT @ dW @ L_P))


def kronecker_whiteners(P: Tensor, Q: Tensor, *, damping: float = 1e-4, retries: int = 5,
                        name: str | None = None) -> tuple[Tensor, Tensor]:
    """The damped Cholesky factors ``(L_P, L_Q)`` with ``P + lam_P I = L_P L_P^T``, ``Q + lam_Q I = L_Q L_Q^T``."""
    return (_chol(P, damping, retries, "input-side (P)", name), _chol(Q, damping, retries, "output-side (Q)", name))


def predicted_loss_increase(dW: Tensor, P: Tensor | None = None, Q: Tensor | None = None, *, damping: float = 1e-4,
                            whiteners: tuple[Tensor, Tensor] | None = None) -> float:
    """Second-order prediction ``1/2 ||L_Q^T dW L_P||_F^2 = 1/2 vec(dW)^T (P_d kron Q_d) vec(dW)``.

    Give ``P`` and ``Q`` (damped Cholesky factors computed here) or ``whiteners=(L_P, L_Q)`` from
    :func:`kronecker_whiteners` to evaluate many ``dW`` of one layer cheaply.
    """
    if whiteners is None:
        if P is None or Q is None:
            raise ValueError("give P and Q, or whiteners=(L_P, L_Q)")
        whiteners = kronecker_whiteners(P.to(torch.float64), Q.to(torch.float64), damping=damping)
    L_P, L_Q = whiteners
    return 0.5 * float((L_Q.mT @ dW.to(torch.float64) @ L_P).square().sum())

