"""Root Purge's closed forms (OLS, reduced-rank regression, DWRR, rank selection) and the characteristic
roots of a linear forecaster.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, Literal, Sequence

import numpy as np
import torch
from torch import Tensor

from rankwise.core.validate import check_int, check_unit
from rankwise.science.root_purge.config import ArrayLike, RCOND
from rankwise.science.root_purge.data import _as_tensor, _check_finite, _check_weight, _rows


# --------------------------------------------------------------------------------------------
# closed forms: OLS, RRR, DWRR, rank selection
# --------------------------------------------------------------------------------------------


def _pinv_solve(x: Tensor, y: Tensor, rcond: float, expected_rank: int) -> Tensor:
    """Minimum-norm least squares ``x^+ y`` via the SVD of ``x``; small singular values zeroed."""
    U, s, Vh = torch.linalg.svd(x, full_matrices=False)
    smax = float(s.max()) if s.numel() else 0.0
    keep = s > rcond * smax if smax > 0 else torch.zeros_like(s, dtype=torch.bool)
    rank = int(keep.sum())
    if rank < expected_rank:
        warnings.warn(f"the look-back matrix has numerical rank {rank} < {expected_rank} (a constant, very "
                      "short or noise-free low-order series); the pseudo-inverse returns the minimum-norm "
                      "solution", 
                      RuntimeWarning, stacklevel=3)
    s_inv = torch.where(keep, 1.0 / torch.where(keep, s, torch.ones_like(s)), torch.zeros_like(s))
    return Vh.T @ (s_inv[:, None] * (U.T @ y))


def fit_ols(X: ArrayLike, Y: ArrayLike, instance_norm: bool = True, rcond: float = RCOND) -> Tensor:
    """OLS forecaster ``W_ols = X^+ Y`` (spec §1), ``(L, H)`` float64.

    ``X``: ``(N, L)`` or ``(N, L, C)`` look-backs; ``Y``: ``(N, H)`` or ``(N, H, C)`` futures (channels
    are stacked as rows: one ``W`` shared by all channels). With ``instance_norm`` each window's
    look-back mean is subtracted from both. The pseudo-inverse zeroes singular values below
    ``rcond * s_max``; IN always removes one direction (the constant), which is expected.
    """
    x, y = _rows(X, Y)
    if instance_norm:
        m = x.mean(1, keepdim=True)
        x, y = x - m, y - m
    expected = min(x.shape[0], x.shape[1] - (1 if instance_norm else 0))
    return _pinv_solve(x, y, rcond, expected)


@dataclass
class RRRPath:
    """All reduced-rank solutions from one SVD (spec §2: changing r needs no refit).

    ``W_ols``: ``(L, H)``; ``V``: ``(H, H')`` right singular vectors of the fitted outputs
    ``X W_ols`` (columns sorted by singular value, ``H' = min(N, H)``); ``singular_values``.
    """

    W_ols: Tensor
    V: Tensor
    singular_values: Tensor

    def weight(self, rank: int) -> Tensor:
        """``W_rrr = W_ols V_r V_r^T`` of rank <= ``rank`` (``(L, H)``)."""
        L, H = self.W_ols.shape
        r = _check_rank(rank, L, H)
        Vr = self.V[:, :r]
        return self.W_ols @ Vr @ Vr.T


def _check_rank(rank: Any, L: int, H: int) -> int:
    """``rank`` as an int in ``[1, min(L, H)]``; the message names L and H."""
    return check_int(f"rank (at most min(L, H), L={L}, H={H})", rank, 1, min(L, H))  # type: ignore[return-value]


def rrr_path(X: ArrayLike, Y: ArrayLike, W: ArrayLike | None = None, instance_norm: bool = True,
             rcond: float = RCOND) -> RRRPath:
    """The SVD behind RRR: ``Y_hat = X W_ols = U S V^T`` on the (IN-normalised) training windows."""
    x, y = _rows(X, Y)
    if instance_norm:
        m = x.mean(1, keepdim=True)
        x, y = x - m, y - m
    if W is None:
        expected = min(x.shape[0], x.shape[1] - (1 if instance_norm else 0))
        w = _pinv_solve(x, y, rcond, expected)
    else:
        w = _check_weight(W, x.shape[1], y.shape[1])
    y_hat = x @ w
    _, s, Vh = torch.linalg.svd(y_hat, full_matrices=False)
    return RRRPath(W_ols=w, V=Vh.T, singular_values=s)


def reduced_rank_regression(X: ArrayLike, Y: ArrayLike, rank: int, W: ArrayLike | None = None,
                            instance_norm: bool = True, rcond: float = RCOND) -> Tensor:
    """Reduced-rank regression (spec §2): ``W_rrr = W_ols V_r V_r^T``, ``(L, H)``.

    ``V_r`` holds the top-``rank`` right singular vectors of the fitted training outputs
    ``X W_ols``. ``W_rrr`` minimises the training squared error over all ``W`` of rank <= ``rank``
    (the Eckart-Young argument on ``X W``). ``W`` may pass a precomputed OLS weight.
    """
    x = _as_tensor(X, "X")
    y = _as_tensor(Y, "Y")
    L = x.shape[1] if x.ndim >= 2 else 0
    H = y.shape[1] if y.ndim >= 2 else 0
    _check_rank(rank, L, H)
    return rrr_path(x, y, W=W, instance_norm=instance_norm, rcond=rcond).weight(rank)


def dwrr(W: ArrayLike, rank: int) -> Tensor:
    """Direct weight rank reduction (spec §3): truncated SVD ``U_r S_r V_r^T`` of any ``(L, H)`` weight."""
    w = _check_weight(W)
    r = _check_rank(rank, *w.shape)
    U, s, Vh = torch.linalg.svd(w, full_matrices=False)
    return (U[:, :r] * s[:r]) @ Vh[:r]


def predict_linear(W: ArrayLike, X: ArrayLike, instance_norm: bool = True) -> Tensor:
    """Forecast of a linear weight: ``(x - m) W + m``. ``X (N, L)`` -> ``(N, H)``; ``(N, L, C)`` -> ``(N, H, C)``."""
    w = _check_weight(W)
    x = _as_tensor(X, "X")
    if x.ndim not in (2, 3) or x.shape[1] != w.shape[0]:
        raise ValueError(f"X must have shape (N, L) or (N, L, C) with L = {w.shape[0]}, got {tuple(x.shape)}")
    _check_finite(x, "X")
    m = x.mean(1, keepdim=True) if instance_norm else torch.zeros_like(x[:, :1])
    if x.ndim == 2:
        return (x - m) @ w + m
    return torch.einsum("nlc,lh->nhc", x - m, w) + m


@dataclass
class RankSelection:
    """Result of :func:`select_rank`: the chosen rank (lowest validation MSE), the curve, the weight."""

    method: str
    rank: int
    ranks: list[int]
    val_mse: list[float]
    weight: Tensor


def default_ranks(L: int, H: int, step: int = 6) -> list[int]:
    """The official sweep ``{6, 12, ..., min(L, H)}`` (plus ``min(L, H)`` itself when not a multiple)."""
    top = min(L, H)
    rs = list(range(step, top + 1, step)) or [top]
    if rs[-1] != top:
        rs.append(top)
    return rs


def select_rank(X: ArrayLike, Y: ArrayLike, X_val: ArrayLike, Y_val: ArrayLike, ranks: Sequence[int] | None = None,
                method: Literal["rrr", "dwrr"] = "rrr", W: ArrayLike | None = None, instance_norm: bool = True,
                rcond: float = RCOND) -> RankSelection:
    """Pick the rank of RRR or DWRR by validation MSE only (spec §4; the test split is never used).

    ``ranks`` defaults to ``{6, 12, ..., min(L, H)}``. ``W`` is the weight to reduce (default: OLS
    on ``X, Y``; for DWRR it may be any trained weight).
    """
    if method not in ("rrr", "dwrr"):
        raise ValueError(f"method must be 'rrr' or 'dwrr', got {method!r}")
    path = rrr_path(X, Y, W=W, instance_norm=instance_norm, rcond=rcond)
    L, H = path.W_ols.shape
    rs = default_ranks(L, H) if ranks is None else [_check_rank(r, L, H) for r in ranks]
    if not rs:
        raise ValueError("ranks is empty")
    xv, yv = _rows(X_val, Y_val, "X_val", "Y_val")
    if xv.shape[1] != L or yv.shape[1] != H:
        raise ValueError(f"validation windows have (L, H) = ({xv.shape[1]}, {yv.shape[1]}), training has ({L}, {H})")
    if method == "dwrr":
        U, s, Vh = torch.linalg.svd(path.W_ols, full_matrices=False)
    curve: list[float] = []
    weights: list[Tensor] = []
    for r in rs:
        w = path.weight(r) if method == "rrr" else (U[:, :r] * s[:r]) @ Vh[:r]
        curve.append(float(((predict_linear(w, xv, instance_norm) - yv) ** 2).mean()))
        weights.append(w)
    best = int(np.argmin(curve))
    return RankSelection(method=method, rank=rs[best], ranks=rs, val_mse=curve, weight=weights[best])


def singular_values(W: ArrayLike) -> np.ndarray:
    """Singular values of a weight, descending (numpy float64)."""
    return torch.linalg.svdvals(_check_weight(W)).numpy()


def tail_singular_sum(W: ArrayLike, fraction: float = 0.8) -> float:
    """Sum of the bottom ``fraction`` of the singular values of ``W`` (spec claim 4's statistic)."""
    check_unit("fraction", fraction, low_open=True)
    s = singular_values(W)
    k = int(round(fraction * len(s)))
    return float(s[len(s) - k:].sum()) if k else 0.0


# --------------------------------------------------------------------------------------------
# characteristic roots
# --------------------------------------------------------------------------------------------


def effective_weight(W: ArrayLike, instance_norm: bool = True) -> Tensor:
    """The plain linear map of a forecaster: with IN, ``y = x (P W + 1 1^T / L)`` with ``P = I - 1 1^T / L``."""
    w = _check_weight(W)
    if not instance_norm:
        return w
    L, H = w.shape
    return w - w.mean(0, keepdim=True) + torch.full((L, H), 1.0 / L, dtype=w.dtype)


def characteristic_roots(W: ArrayLike, step: int = 1, instance_norm: bool = True) -> np.ndarray:
    """Characteristic roots of the recurrence encoded by column ``step`` of a linear forecaster.

    Column ``h`` predicts ``x_{s+L-1+h} = sum_j c_j x_{s+j}`` (``c`` = column ``h`` of the effective
    weight, IN folded in), i.e. the polynomial ``z^{L-1+h} - sum_{j=0}^{L-1} c_j z^j``. For ``h = 1``
    this is ``z^L - sum_i w_i z^{L-i}`` with ``w_i`` the coefficient of lag ``i``: a noise-free AR
    process is reproduced with its own roots among these ``L`` roots. Returns a complex array of
    ``L - 1 + step`` roots sorted by decreasing modulus. With IN, ``z = 1`` is always a root.
    """
    w = effective_weight(W, instance_norm)
    L, H = w.shape
    h = check_int("step", step, 1, H)
    c = w[:, h - 1].numpy()
    coeffs = np.concatenate([[1.0], np.zeros(h - 1), -c[::-1]])
    roots = np.roots(coeffs)
    return roots[np.argsort(-np.abs(roots), kind="stable")]


def root_distance(learned: ArrayLike, true: ArrayLike) -> float:
    """Mean distance of each true root to a distinct learned root (optimal one-to-one matching).

    A root-recovery score in the complex plane (lower is better); the matching is the
    Hungarian assignment (scipy) of true roots to learned roots.
    """
    from scipy.optimize import linear_sum_assignment

    a = np.asarray(learned, dtype=np.complex128).ravel()
    b = np.asarray(true, dtype=np.complex128).ravel()
    if a.size < b.size or b.size == 0:
        raise ValueError(f"need at least as many learned roots ({a.size}) as true roots ({b.size} >= 1)")
    cost = np.abs(b[:, None] - a[None, :])
    rows, cols = linear_sum_assignment(cost)
    return float(cost[rows, cols].mean())


def ar_roots(coefficients: ArrayLike) -> np.ndarray:
    """Roots of ``z^p - sum_{i=1}^p a_i z^{p-i}`` for an AR(p) process ``x_t = sum_i a_i x_{t-i}``."""
    a = np.asarray(coefficients, dtype=np.float64).ravel()
    return np.roots(np.concatenate([[1.0], -a]))
