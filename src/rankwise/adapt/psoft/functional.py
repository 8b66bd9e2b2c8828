"""PSOFT's math, no model needed: the skew-symmetric core, the Cayley transform and the principal factors."""

from __future__ import annotations

import warnings

import torch

from rankwise.adapt.psoft.config import RANK_RTOL, SIDES, _pos_int
from rankwise.core.errors import NumericalError


# ------------------------------------------------------------------------------------------------
# the math
# ------------------------------------------------------------------------------------------------

def skew_from_params(q: torch.Tensor, r: int) -> torch.Tensor:
    """Skew-symmetric ``Q = L - L^T`` (``r x r``) from the ``r(r-1)/2`` entries ``q``.

    ``L`` is strictly lower triangular with ``L[j, i] = q[k]`` where ``(i, j)`` is the k-th pair of
    ``torch.triu_indices(r, r, 1)`` (row-major upper triangle), the order of PEFT's PSOFT parameters.
    """
    if q.ndim != 1 or q.numel() != r * (r - 1) // 2:
        raise ValueError(f"q must hold r(r-1)/2 = {r * (r - 1) // 2} entries for r={r}, got shape {tuple(q.shape)}")
    rows, cols = torch.triu_indices(r, r, 1, device=q.device)
    L = torch.zeros(r, r, dtype=q.dtype, device=q.device).index_put((cols, rows), q)
    return L - L.T


def cayley(Q: torch.Tensor, terms: int | None = 5, eps: float | None = None, *, check: bool = True) -> torch.Tensor:
    """``R = (I - Q)(I + Q)^{-1}`` exactly (``terms=None``) or by the truncated Neumann series with ``terms`` terms.

    ``R_t = I + 2 sum_{k=1..t} (-Q)^k + (-Q)^{t+1}``; its error from the exact map is ``O(||Q||^{t+1})``
    for ``||Q|| < 1``. For skew ``Q`` the exact ``R`` is orthogonal. With ``eps`` (Neumann only), ``Q``
    is first rescaled to Frobenius norm ``eps`` when it is larger (decided on the device: no host sync).
    ``check=False`` skips the exact solve's singularity check, which reads a result back to the host
    (``I + Q`` is never singular for a skew ``Q``, so the layers' forward passes skip it).
    """
    r = Q.shape[-1]
    eye = torch.eye(r, dtype=Q.dtype, device=Q.device)
    if terms is None:
        if check:
            return torch.linalg.solve(eye + Q, eye - Q, left=False)
        return torch.linalg.solve_ex(eye + Q, eye - Q, left=False, check_errors=False)[0]
    if eps is not None:
        norm = torch.linalg.matrix_norm(Q, "fro")
        # Q * 1 is Q exactly, so the branch-free form gives the same values (and gradients) as an if
        big = torch.isfinite(norm) & (norm.to(torch.float64) > eps)
        Q = Q * torch.where(big, eps / (norm + 1e-12), torch.ones_like(norm))
    R = eye.clone()
    P = eye
    for _ in range(terms):
        P = P @ (-Q)
        R = R + 2.0 * P
    return R + P @ (-Q)


def principal_factors(W: torch.Tensor, r: int, side: str = "output", *, name: str | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Top-``r`` SVD split of ``W (d_out, d_in)`` in float64: returns ``B (d_out, r)``, ``A (r, d_in)``, ``S (r,)``.

    ``side="output"``: ``B = U_r S_r``, ``A = V_r^T``; ``side="input"``: ``B = U_r``, ``A = S_r V_r^T``.
    Non-finite weights raise NumericalError; singular values below ``RANK_RTOL * sigma_1`` inside the
    top ``r`` give a warning (the subspace is then partly arbitrary).
    """
    where = f"layer {name!r}" if name else "PSOFT"
    if side not in SIDES:
        raise ValueError(f"side must be one of {SIDES}, got {side!r}")
    W = W.detach().to(torch.float64)
    if not bool(torch.isfinite(W).all()):
        raise NumericalError(f"{where}: the weight holds NaN or inf; cannot compute its SVD")
    d_out, d_in = W.shape
    if not _pos_int(r) or r > min(d_out, d_in):
        raise ValueError(f"PSOFT r={r!r} for {where} must be in [1, min(d_in={d_in}, d_out={d_out}) = "
                         f"{min(d_in, d_out)}]")
    U, S, Vh = torch.linalg.svd(W, full_matrices=False)
    U, S, Vh = U[:, :r], S[:r], Vh[:r]
    tiny = int((S <= RANK_RTOL * S[0]).sum()) if float(S[0]) > 0 else r
    if tiny:
        warnings.warn(f"{where}: {tiny} of the top-{r} singular values of the weight are (numerically) zero; "
                      "the principal subspace is partly arbitrary there", stacklevel=3)
    if side == "output":
        return U * S, Vh, S
    return U, S[:, None] * Vh, S
