"""Root Purge, RRR and DWRR: rank-based denoising of linear time-series forecasters.

Paper: "Characteristic Root Analysis and Regularization for Linear Time Series Forecasting"
(Wang et al., ICLR 2026, arXiv 2509.23597; spec ``shared/methods/root_purge.md``).

A linear forecaster maps a look-back window ``x`` (length ``L``) to the next ``H`` values with a
matrix ``W`` (``L x H``): ``y_hat = (x - m) W + m`` where ``m`` is the window's mean (instance
normalisation, IN). It encodes a linear recurrence whose *characteristic roots* govern its
long-term behaviour. Least squares on noisy data fits extra ("spurious") roots that model the
noise. The paper restores the low-dimensional dynamics by

* **RRR** (reduced-rank regression, closed form): project the OLS weight onto the top-``r`` right
  singular vectors of the fitted training outputs, ``W_rrr = W_ols V_r V_r^T`` (spec §2);
* **DWRR** (direct weight rank reduction): the truncated SVD of any trained ``W`` (spec §3);
* **Root Purge** (training time): add ``lambda * c^k * MSE(f(e), 0)`` to the loss, where ``e`` is the
  detached residual brought to length ``L`` and ``c = max(L/H, 1)`` (spec §5), so that the noise
  lies in the model's null space.

Layout of this module, top to bottom: input validation and windowing; the closed forms (OLS, RRR,
DWRR, rank selection); characteristic roots; forecaster modules (Linear, frequency-domain linear,
DLinear); the Root Purge loss; training (one model, or a vectorised ensemble of linear models);
the :class:`Forecaster` estimator with ``fit``/``predict``; registration.

Shapes: a series is ``(T,)`` or ``(T, C)``; windows are ``X (N, L, C)`` and ``Y (N, H, C)``;
the closed forms take channel-independent rows ``X (N, L)`` / ``Y (N, H)`` (or ``(N, L, C)``,
which they stack channel by channel). All closed forms run in float64.
"""

from __future__ import annotations

import logging
import math
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Literal, Sequence

import numpy as np
import torch
from torch import Tensor, nn

from rankwise.core.errors import ArtifactError, NumericalError
from rankwise.core.registry import register
from rankwise.core.validate import check_choice, check_int, check_number, check_positive, check_unit

log = logging.getLogger(__name__)

ArrayLike = np.ndarray | Tensor | Sequence[float]
Method = Literal["ols", "rrr", "dwrr", "linear", "root_purge"]
_METHODS = ("ols", "rrr", "dwrr", "linear", "root_purge")
_BACKBONES = ("linear", "frequency", "dlinear")
_CHANNEL_MODES = ("independent", "individual")
# Singular values of X below RCOND * s_max are zeroed in the pseudo-inverse (spec §1 uses an
# absolute 1e-9; a relative floor keeps the forecast equivariant to rescaling the series).
RCOND = 1e-9


# --------------------------------------------------------------------------------------------
# configs
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RootPurgeConfig:
    """Root Purge regulariser (spec §5).

    ``lam``: weight lambda of the purge term (official default 0.3; the synthetic study uses 1).
    ``order``: purge order k, how many times the model is applied to the residual.
    ``target``: ``"zero"`` (``f(e) -> 0``) or ``"model_zero"`` (``f(e) -> f(0)``, identical for
    bias-free models).
    """

    lam: float = 0.3
    order: int = 1
    target: Literal["zero", "model_zero"] = "zero"

    def __post_init__(self) -> None:
        check_number("RootPurgeConfig.lam", self.lam, 0.0)
        check_int("RootPurgeConfig.order", self.order, 1)
        check_choice("RootPurgeConfig.target", self.target, ("zero", "model_zero"))


@dataclass(frozen=True)
class TrainConfig:
    """Adam training of a forecaster (spec §6: Adam, no weight decay, batch 64/128).

    ``steps``: optimiser steps; ``lr``: Adam learning rate; ``batch_size``: windows per step
    (drawn from a fresh permutation each epoch); ``weight_decay``: decoupled L2 (AdamW) baseline;
    ``l1``: L1 penalty on the weights added to the loss; ``val_every``: when validation windows
    are given, evaluate every this many steps and keep the weights with the lowest validation
    MSE (the official training loop does this); ``seed``: initialisation and sampling seed.
    """

    steps: int = 5000
    lr: float = 1e-3
    batch_size: int = 64
    weight_decay: float = 0.0
    l1: float = 0.0
    val_every: int = 50
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size", "val_every"):
            check_int(f"TrainConfig.{name}", getattr(self, name), 1)
        check_positive("TrainConfig.lr", self.lr)
        for name in ("weight_decay", "l1"):
            check_number(f"TrainConfig.{name}", getattr(self, name), 0.0)
        check_int("TrainConfig.seed", self.seed)


# --------------------------------------------------------------------------------------------
# validation and windowing
# --------------------------------------------------------------------------------------------


def _as_tensor(a: ArrayLike, name: str, dtype: torch.dtype = torch.float64) -> Tensor:
    if isinstance(a, Tensor):
        t = a.detach().to(dtype)
    elif isinstance(a, np.ndarray):
        if not np.issubdtype(a.dtype, np.number):
            raise TypeError(f"{name} must be numeric, got an array of dtype {a.dtype}")
        t = torch.as_tensor(np.asarray(a, dtype=np.float64)).to(dtype)
    elif isinstance(a, (list, tuple)):
        t = torch.as_tensor(np.asarray(a, dtype=np.float64)).to(dtype)
    else:
        raise TypeError(f"{name} must be a numpy array or torch tensor, got {type(a).__name__}")
    return t


def _check_finite(t: Tensor, name: str) -> None:
    if not bool(torch.isfinite(t).all()):
        bad = int((~torch.isfinite(t)).sum())
        raise ValueError(f"{name} holds {bad} non-finite value(s) (NaN/Inf); fill gaps first, e.g. by "
                         "linear interpolation (pandas.Series.interpolate) as for the co2 series")


def as_series(series: ArrayLike, name: str = "series") -> Tensor:
    """A series as a float64 tensor ``(T, C)`` (a 1-D series becomes one channel); checks finiteness."""
    s = _as_tensor(series, name)
    if s.ndim == 1:
        s = s[:, None]
    if s.ndim != 2:
        raise ValueError(f"{name} must be 1-D (T,) or 2-D (T, C), got shape {tuple(s.shape)}")
    if s.shape[0] == 0 or s.shape[1] == 0:
        raise ValueError(f"{name} is empty (shape {tuple(s.shape)})")
    _check_finite(s, name)
    return s


def make_windows(series: ArrayLike, lookback: int, horizon: int, stride: int = 1) -> tuple[Tensor, Tensor]:
    """Sliding windows of a series.

    ``series``: ``(T,)`` or ``(T, C)``. Returns ``X (N, L, C)`` and ``Y (N, H, C)`` (float64) with
    ``N = (T - L - H) // stride + 1``; window ``i`` starts at ``i * stride``.
    Raises ``ValueError`` when the series is shorter than ``L + H``.
    """
    L = check_int("lookback", lookback, 1)
    H = check_int("horizon", horizon, 1)
    stride = check_int("stride", stride, 1)
    s = as_series(series)
    T = s.shape[0]
    if T < L + H:
        raise ValueError(f"series of length {T} is shorter than lookback + horizon = {L} + {H} = {L + H}; "
                         "use a shorter lookback/horizon or a longer series")
    win = s.unfold(0, L + H, stride)  # (N, C, L+H)
    win = win.permute(0, 2, 1)
    return win[:, :L, :].contiguous(), win[:, L:, :].contiguous()


def _rows(X: ArrayLike, Y: ArrayLike | None, name_x: str = "X", name_y: str = "Y") -> tuple[Tensor, Tensor | None]:
    """Channel-independent rows: ``(N, L[, C])`` -> ``(N*C, L)``; validates shapes and values."""
    x = _as_tensor(X, name_x)
    if x.ndim == 3:
        x = x.permute(0, 2, 1).reshape(-1, x.shape[1])
    if x.ndim != 2:
        raise ValueError(f"{name_x} must have shape (N, L) or (N, L, C), got {tuple(x.shape)}")
    if x.shape[0] < 1 or x.shape[1] < 1:
        raise ValueError(f"{name_x} is empty (shape {tuple(x.shape)}); need N >= 1 windows")
    _check_finite(x, name_x)
    if Y is None:
        return x, None
    y = _as_tensor(Y, name_y)
    if y.ndim == 3:
        y = y.permute(0, 2, 1).reshape(-1, y.shape[1])
    if y.ndim != 2:
        raise ValueError(f"{name_y} must have shape (N, H) or (N, H, C), got {tuple(y.shape)}")
    if y.shape[0] != x.shape[0]:
        raise ValueError(f"{name_x} and {name_y} have different numbers of windows: "
                         f"{name_x} {tuple(x.shape)} vs {name_y} {tuple(y.shape)}")
    if y.shape[1] < 1:
        raise ValueError(f"{name_y} is empty (shape {tuple(y.shape)})")
    _check_finite(y, name_y)
    return x, y


def instance_normalize(x: Tensor, y: Tensor | None = None) -> tuple[Tensor, Tensor | None, Tensor]:
    """Subtract each window's look-back mean (over the time axis 1) from ``x`` and ``y``.

    Returns ``(x - m, y - m, m)`` with ``m`` of shape ``x.mean(1, keepdim=True)``.
    """
    m = x.mean(dim=1, keepdim=True)
    return x - m, (None if y is None else y - m), m


def _check_weight(W: ArrayLike, L: int | None = None, H: int | None = None, name: str = "W") -> Tensor:
    w = _as_tensor(W, name)
    if w.ndim != 2:
        raise ValueError(f"{name} must be a 2-D (L, H) matrix, got shape {tuple(w.shape)}")
    if (L is not None and w.shape[0] != L) or (H is not None and w.shape[1] != H):
        raise ValueError(f"{name} has shape {tuple(w.shape)} but the data need (L, H) = ({L}, {H})")
    _check_finite(w, name)
    return w


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


# --------------------------------------------------------------------------------------------
# forecaster modules
# --------------------------------------------------------------------------------------------


class _LinearBackbone(nn.Module):
    """What the linear backbones share: a bias-free map ``core`` on ``(B, L, C)`` -> ``(B, H, C)``, optional
    instance normalisation around it, 2-D inputs ``(B, L)`` read as one channel, and the map's
    equivalent ``(L, H)`` matrix (:meth:`linear_weight`, computed by applying ``core`` to the identity)."""

    L: int
    H: int
    instance_norm: bool

    def core(self, x: Tensor) -> Tensor:  # pragma: no cover - every backbone defines it
        raise NotImplementedError

    def forward(self, x: Tensor) -> Tensor:
        squeeze = x.ndim == 2
        if squeeze:
            x = x[..., None]
        if self.instance_norm:
            m = x.mean(1, keepdim=True)
            y = self.core(x - m) + m
        else:
            y = self.core(x)
        return y[..., 0] if squeeze else y

    def linear_weight(self) -> Tensor:
        """The ``(L, H)`` matrix of the core map, detached."""
        with torch.no_grad():
            eye = torch.eye(self.L, dtype=next(self.parameters()).dtype)[:, :, None]  # (L batch, L, 1)
            return self.core(eye)[..., 0].detach()


class LinearForecaster(_LinearBackbone):
    """Bias-free linear forecaster, ``x (B, L, C) -> (B, H, C)`` (spec §7, "Linear").

    ``individual=False`` shares one ``(L, H)`` weight across channels (channel independence, CI);
    ``individual=True`` holds one per channel (``weight`` of shape ``(C, L, H)``). The weight is
    initialised like ``nn.Linear(L, H)`` (uniform in ``+-1/sqrt(L)``). ``instance_norm`` subtracts
    the look-back mean and adds it back. ``core`` is the map without IN (what Root Purge applies
    to residuals). A 2-D input ``(B, L)`` is read as one channel.
    """

    def __init__(self, L: int, H: int, channels: int = 1, individual: bool = False, instance_norm: bool = True,
                 generator: torch.Generator | None = None) -> None:
        super().__init__()
        self.L, self.H = check_int("L", L, 1), check_int("H", H, 1)
        self.channels = check_int("channels", channels, 1)
        self.individual = bool(individual)
        self.instance_norm = bool(instance_norm)
        g = self.channels if self.individual else 1
        bound = 1.0 / math.sqrt(self.L)
        w = torch.rand(g, self.L, self.H, generator=generator) * 2 * bound - bound
        self.weight = nn.Parameter(w)

    @classmethod
    def from_weight(cls, W: ArrayLike, instance_norm: bool = True) -> "LinearForecaster":
        w = _as_tensor(W, "W", torch.float32)
        if w.ndim == 2:
            w = w[None]
        if w.ndim != 3:
            raise ValueError(f"W must be (L, H) or (C, L, H), got {tuple(w.shape)}")
        m = cls(w.shape[1], w.shape[2], channels=w.shape[0], individual=w.shape[0] > 1, instance_norm=instance_norm)
        with torch.no_grad():
            m.weight.copy_(w)
        return m

    def core(self, x: Tensor) -> Tensor:
        """The bias-free linear map on (already normalised) ``x (B, L, C)`` -> ``(B, H, C)``."""
        if self.individual:
            if x.shape[-1] != self.weight.shape[0]:
                raise ValueError(f"individual forecaster has {self.weight.shape[0]} channels, input has {x.shape[-1]}")
            return torch.einsum("blc,clh->bhc", x, self.weight)
        return torch.einsum("blc,lh->bhc", x, self.weight[0])

    def linear_weight(self) -> Tensor:
        """The ``(L, H)`` (or ``(C, L, H)``) matrix of the core map, detached."""
        w = self.weight.detach()
        return w[0] if not self.individual else w


class FrequencyLinearForecaster(_LinearBackbone):
    """Frequency-domain linear backbone (spec §7; FITS with ``cutoff``).

    rFFT of the look-back (``L//2+1`` bins, the lowest ``cutoff`` kept), complex linear map to
    ``(L+H)//2+1`` bins, irFFT to length ``L+H``, times ``(L+H)/L``, keep the last ``H`` steps.
    The map is linear in ``x``; :meth:`linear_weight` returns its equivalent ``(L, H)`` matrix.
    """

    def __init__(self, L: int, H: int, cutoff: int | None = None, instance_norm: bool = True,
                 generator: torch.Generator | None = None) -> None:
        super().__init__()
        self.L, self.H = check_int("L", L, 1), check_int("H", H, 1)
        self.instance_norm = bool(instance_norm)
        nin = self.L // 2 + 1
        self.cutoff = nin if cutoff is None else check_int("cutoff (<= L//2+1)", cutoff, 1, nin)
        self.n_out = (self.L + self.H) // 2 + 1
        k = 1.0 / math.sqrt(self.cutoff)
        re = torch.rand(self.cutoff, self.n_out, generator=generator) * 2 * k - k
        im = torch.rand(self.cutoff, self.n_out, generator=generator) * 2 * k - k
        self.weight_re = nn.Parameter(re)
        self.weight_im = nn.Parameter(im)
        self.individual = False

    def core(self, x: Tensor) -> Tensor:
        spec = torch.fft.rfft(x, dim=1)[:, : self.cutoff, :]  # (B, F, C)
        w = torch.complex(self.weight_re, self.weight_im)
        out = torch.einsum("bfc,fo->boc", spec, w)
        y = torch.fft.irfft(out, n=self.L + self.H, dim=1) * ((self.L + self.H) / self.L)
        return y[:, -self.H:, :]



class DLinearForecaster(_LinearBackbone):
    """DLinear baseline: moving-average trend (kernel 25, edge-replicated) + seasonal, two linear heads.

    Linear in ``x`` overall; :meth:`linear_weight` returns the equivalent ``(L, H)`` matrix.
    """

    def __init__(self, L: int, H: int, kernel: int = 25, instance_norm: bool = False,
                 generator: torch.Generator | None = None) -> None:
        super().__init__()
        self.L, self.H = check_int("L", L, 1), check_int("H", H, 1)
        self.kernel = check_int("kernel", kernel, 1)
        self.instance_norm = bool(instance_norm)
        self.individual = False
        bound = 1.0 / math.sqrt(self.L)
        self.w_trend = nn.Parameter(torch.rand(self.L, self.H, generator=generator) * 2 * bound - bound)
        self.w_season = nn.Parameter(torch.rand(self.L, self.H, generator=generator) * 2 * bound - bound)

    def _trend(self, x: Tensor) -> Tensor:
        k = self.kernel
        front = x[:, :1, :].expand(-1, (k - 1) // 2, -1)
        back = x[:, -1:, :].expand(-1, k // 2, -1)
        xp = torch.cat([front, x, back], dim=1)  # (B, L + k - 1, C)
        return xp.unfold(1, k, 1).mean(-1)

    def core(self, x: Tensor) -> Tensor:
        trend = self._trend(x)
        season = x - trend
        return torch.einsum("blc,lh->bhc", trend, self.w_trend) + torch.einsum("blc,lh->bhc", season, self.w_season)



# --------------------------------------------------------------------------------------------
# Root Purge loss
# --------------------------------------------------------------------------------------------


def adapt_length(e: Tensor, L: int, generator: torch.Generator | None = None, offsets: Tensor | None = None) -> Tensor:
    """Bring a residual ``e (B, H, C)`` to the input length ``L`` (spec §5).

    ``L == H``: unchanged. ``L < H``: the first ``L`` steps. ``L > H``: zero-pad by ``L - H`` on both
    sides (length ``2L - H``) and take one random contiguous length-``L`` window per (sample,
    channel); the window starts are drawn uniformly from ``[0, L - H]`` with ``generator`` (or
    passed as ``offsets (B, C)``).
    """
    B, H, C = e.shape
    if L == H:
        return e
    if L < H:
        return e[:, :L, :]
    pad = L - H
    ep = torch.nn.functional.pad(e.permute(0, 2, 1), (pad, pad))  # (B, C, 2L-H)
    if offsets is None:
        offsets = torch.randint(0, pad + 1, (B, C), generator=generator)
    idx = offsets.to(e.device)[:, :, None] + torch.arange(L, device=e.device)  # (B, C, L)
    return torch.gather(ep, 2, idx).permute(0, 2, 1)


def _core_and_norm(model: nn.Module, instance_norm: bool | None) -> tuple[Callable[[Tensor], Tensor], bool]:
    core = getattr(model, "core", None)
    model_in = getattr(model, "instance_norm", None)
    if callable(core) and isinstance(model_in, bool):
        # rankwise forecasters: IN handled here, the purge applies the bias-free core (as the official wrapper)
        return core, model_in if instance_norm is None else bool(instance_norm)
    return model, bool(instance_norm)


class RootPurgeLoss(nn.Module):
    """Root Purge training loss, a drop-in wrapper around any forecaster module (spec §5).

    ``loss = MSE(f(x), y) + lam * c^k * MSE(f^k(e), target)`` with ``e = stopgrad(y - f(x))`` brought
    to length ``L`` before each application of ``f``, ``c = max(L/H, 1)``, ``k = order``.

    ``model`` maps ``(B, L, C) -> (B, H, C)``. For rankwise forecasters (they expose ``core`` and
    ``instance_norm``) the loss normalises the windows itself and applies ``core``, exactly as the
    official wrapper. Any other module is applied as is; pass ``instance_norm=True`` to have the
    loss normalise ``x``/``y`` for it (the module must then also be fed normalised inputs at
    inference). The wrapper changes only the training loss, never inference.

    Returns ``dict(loss=, fit=, purge=)`` (scalars; ``purge`` is the unweighted purge MSE).
    """

    def __init__(self, lam: float = 0.3, order: int = 1, target: Literal["zero", "model_zero"] = "zero",
                 instance_norm: bool | None = None, generator: torch.Generator | None = None) -> None:
        super().__init__()
        self.config = RootPurgeConfig(lam=lam, order=order, target=target)
        self.instance_norm = instance_norm
        self.generator = generator

    @classmethod
    def from_config(cls, config: RootPurgeConfig, **kw: Any) -> "RootPurgeLoss":
        return cls(lam=config.lam, order=config.order, target=config.target, **kw)

    def forward(self, model: nn.Module, x: Tensor, y: Tensor) -> dict[str, Tensor]:
        squeeze = x.ndim == 2
        if squeeze:
            x, y = x[..., None], y[..., None]
        if x.ndim != 3 or y.ndim != 3 or x.shape[0] != y.shape[0] or x.shape[2] != y.shape[2]:
            raise ValueError(f"x must be (B, L, C) and y (B, H, C) with the same B and C; got {tuple(x.shape)}, "
                             f"{tuple(y.shape)}")
        f, use_in = _core_and_norm(model, self.instance_norm)
        if use_in:
            m = x.mean(1, keepdim=True)
            x, y = x - m, y - m
        L, H = x.shape[1], y.shape[1]
        y_hat = f(x)
        fit = torch.nn.functional.mse_loss(y_hat, y)
        cfg = self.config
        if cfg.lam == 0:
            zero = fit.new_zeros(())
            return {"loss": fit, "fit": fit, "purge": zero}
        r = (y - y_hat).detach()
        for _ in range(cfg.order):
            r = f(adapt_length(r, L, self.generator))
        if cfg.target == "zero":
            tgt = torch.zeros_like(r)
        else:
            tgt = f(torch.zeros_like(x)).detach()
        purge = torch.nn.functional.mse_loss(r, tgt)
        c = max(L / H, 1.0)
        return {"loss": fit + cfg.lam * c ** cfg.order * purge, "fit": fit, "purge": purge}


# --------------------------------------------------------------------------------------------
# training
# --------------------------------------------------------------------------------------------


@dataclass
class TrainResult:
    """What :func:`train_forecaster` returns.

    ``history``: per logged step ``{"step", "loss", "fit", "purge"[, "val_mse"]}``; ``best_step``:
    step of the kept weights (the last step without validation data); ``best_val_mse``.
    """

    history: list[dict[str, float]] = field(default_factory=list)
    best_step: int = 0
    best_val_mse: float = float("nan")


def _window_batches(N: int, batch: int, steps: int, g: torch.Generator):
    """Indices of each step's batch: consecutive chunks of a fresh permutation per epoch (drop last)."""
    b = min(batch, N)
    perm = torch.randperm(N, generator=g)
    pos = 0
    for _ in range(steps):
        if pos + b > N:
            perm = torch.randperm(N, generator=g)
            pos = 0
        yield perm[pos: pos + b]
        pos += b


def _as_windows(X: ArrayLike, name: str) -> Tensor:
    x = _as_tensor(X, name, torch.float32)
    if x.ndim == 2:
        x = x[..., None]
    if x.ndim != 3 or x.shape[0] < 1:
        raise ValueError(f"{name} must be (N, T) or (N, T, C) with N >= 1, got {tuple(x.shape)}")
    _check_finite(x, name)
    return x


def train_forecaster(model: nn.Module, X: ArrayLike, Y: ArrayLike, train: TrainConfig = TrainConfig(),
                     purge: RootPurgeConfig | None = None, X_val: ArrayLike | None = None,
                     Y_val: ArrayLike | None = None) -> TrainResult:
    """Train any forecaster module in place with Adam on windows ``X (N, L, C)``, ``Y (N, H, C)``.

    ``purge=None`` trains with plain MSE ("Linear" baseline); a :class:`RootPurgeConfig` adds the
    Root Purge term. ``train.weight_decay`` switches to AdamW (decoupled L2), ``train.l1`` adds
    ``l1 * sum |theta|``. With validation windows, the weights with the lowest validation MSE
    (checked every ``train.val_every`` steps and at the end) are restored at the end.
    Raises :class:`NumericalError` if the loss becomes non-finite.
    """
    x, y = _as_windows(X, "X"), _as_windows(Y, "Y")
    if x.shape[0] != y.shape[0] or x.shape[2] != y.shape[2]:
        raise ValueError(f"X and Y must have the same N and C; got {tuple(x.shape)} and {tuple(y.shape)}")
    has_val = X_val is not None and Y_val is not None
    if has_val:
        xv, yv = _as_windows(X_val, "X_val"), _as_windows(Y_val, "Y_val")
    g = torch.Generator().manual_seed(train.seed)
    crit = RootPurgeLoss.from_config(purge or RootPurgeConfig(lam=0.0), generator=g)
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ValueError("model has no trainable parameters")
    if train.weight_decay > 0:
        opt: torch.optim.Optimizer = torch.optim.AdamW(params, lr=train.lr, weight_decay=train.weight_decay)
    else:
        opt = torch.optim.Adam(params, lr=train.lr)
    res = TrainResult()
    best_state: dict[str, Tensor] | None = None
    was_training = model.training
    model.train()

    def val_mse() -> float:
        model.eval()
        with torch.no_grad():
            v = float(((model(xv) - yv) ** 2).mean())
        model.train()
        return v

    for step, idx in enumerate(_window_batches(x.shape[0], train.batch_size, train.steps, g), start=1):
        out = crit(model, x[idx], y[idx])
        loss = out["loss"]
        if train.l1 > 0:
            loss = loss + train.l1 * sum(p.abs().sum() for p in params)
        if not torch.isfinite(loss):
            raise NumericalError(f"training loss became non-finite at step {step} (lr={train.lr}); lower the lr")
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if step % train.val_every == 0 or step == train.steps:
            rec = {"step": float(step), "loss": float(loss.detach()), "fit": float(out["fit"].detach()),
                   "purge": float(out["purge"].detach())}
            if has_val:
                v = val_mse()
                rec["val_mse"] = v
                if not (v >= res.best_val_mse):  # also true while best is NaN
                    res.best_val_mse, res.best_step = v, step
                    best_state = {k: t.detach().clone() for k, t in model.state_dict().items()}
            res.history.append(rec)
    if best_state is not None:
        model.load_state_dict(best_state)
    elif not has_val:
        res.best_step = train.steps
    model.train(was_training)
    return res


def fit_linear_ensemble(X: Tensor, Y: Tensor, lams: Sequence[float] | Tensor, train: TrainConfig = TrainConfig(),
                        order: int = 1, X_val: Tensor | None = None, Y_val: Tensor | None = None,
                        instance_norm: bool = True,
                        weight_decays: Sequence[float] | None = None) -> tuple[Tensor, Tensor]:
    """Train ``S`` independent bias-free linear forecasters at once (vectorised sweeps).

    ``X (S, N, L)``, ``Y (S, N, H)``: member ``s`` trains on its own windows (one channel) with its
    own Root Purge weight ``lams[s]`` (0 = plain MSE), by Adam with the same hyper-parameters.
    Each member's gradient is exactly that of training it alone (losses are summed); the batch
    indices are shared across members. With ``S = 1`` the result equals
    :func:`train_forecaster` on a :class:`LinearForecaster` with the same seed (same draws).
    ``weight_decays`` (one per member, default ``train.weight_decay`` for all) applies AdamW's
    decoupled decay ``W <- W (1 - lr * wd)`` before each Adam update, member by member.
    Returns ``(W (S, L, H), best_val_mse (S,))`` (validation selection per member as in
    :func:`train_forecaster`).
    """
    x = _as_tensor(X, "X", torch.float32)
    y = _as_tensor(Y, "Y", torch.float32)
    if x.ndim != 3 or y.ndim != 3 or x.shape[:2] != y.shape[:2]:
        raise ValueError(f"X must be (S, N, L) and Y (S, N, H) with the same S, N; got {tuple(x.shape)}, {tuple(y.shape)}")
    _check_finite(x, "X")
    _check_finite(y, "Y")
    S, N, L = x.shape
    H = y.shape[2]
    lam = torch.as_tensor(lams, dtype=torch.float32).reshape(-1)
    if lam.numel() != S or bool((lam < 0).any()) or not bool(torch.isfinite(lam).all()):
        raise ValueError(f"lams must hold {S} finite values >= 0, got {lam.tolist()}")
    check_int("order", order, 1)
    g_init = torch.Generator().manual_seed(train.seed)
    bound = 1.0 / math.sqrt(L)
    # same initial draws as S LinearForecaster(L, H, generator=g_init) built one after another
    W = nn.Parameter(torch.stack([torch.rand(1, L, H, generator=g_init)[0] * 2 * bound - bound for _ in range(S)]))
    g = torch.Generator().manual_seed(train.seed)
    wd = torch.as_tensor([train.weight_decay] * S if weight_decays is None else list(weight_decays),
                         dtype=torch.float32).reshape(-1)
    if wd.numel() != S or bool((wd < 0).any()) or not bool(torch.isfinite(wd).all()):
        raise ValueError(f"weight_decays must hold {S} finite values >= 0, got {wd.tolist()}")
    decay = (1.0 - train.lr * wd)[:, None, None]
    opt = torch.optim.Adam([W], lr=train.lr)
    has_val = X_val is not None and Y_val is not None
    if has_val:
        xv = _as_tensor(X_val, "X_val", torch.float32)
        yv = _as_tensor(Y_val, "Y_val", torch.float32)
        if instance_norm:
            mv = xv.mean(2, keepdim=True)
            xv, yv = xv - mv, yv - mv
    best = torch.full((S,), float("inf"))
    best_W = W.detach().clone()
    c = max(L / H, 1.0)
    for step, idx in enumerate(_window_batches(N, train.batch_size, train.steps, g), start=1):
        xb, yb = x[:, idx], y[:, idx]  # (S, B, L)
        if instance_norm:
            m = xb.mean(2, keepdim=True)
            xb, yb = xb - m, yb - m
        yh = torch.bmm(xb, W)
        fit = ((yh - yb) ** 2).mean(dim=(1, 2))  # (S,)
        loss_s = fit
        if bool((lam > 0).any()):
            r = (yb - yh).detach()
            for _ in range(order):
                # adapt_length works on (B, H, C): members play the role of channels
                r = adapt_length(r.permute(1, 2, 0), L, g).permute(2, 0, 1)
                r = torch.bmm(r, W)
            loss_s = loss_s + lam * c ** order * (r ** 2).mean(dim=(1, 2))
        loss = loss_s.sum()
        if train.l1 > 0:
            loss = loss + train.l1 * W.abs().sum()
        if not torch.isfinite(loss):
            raise NumericalError(f"ensemble training loss became non-finite at step {step} (lr={train.lr})")
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if bool((wd > 0).any()):
            with torch.no_grad():
                W.mul_(decay)
        opt.step()
        if has_val and (step % train.val_every == 0 or step == train.steps):
            with torch.no_grad():
                v = ((torch.bmm(xv, W) - yv) ** 2).mean(dim=(1, 2))
            better = v < best
            best = torch.where(better, v, best)
            best_W[better] = W.detach()[better]
    if not has_val:
        return W.detach().clone(), torch.full((S,), float("nan"))
    return best_W, best


# --------------------------------------------------------------------------------------------
# the estimator
# --------------------------------------------------------------------------------------------


@dataclass
class ForecasterFit:
    """What :meth:`Forecaster.fit` learned, beside the weight.

    ``method``; ``rank`` (RRR/DWRR, else None); ``selection`` (rank sweep on validation data);
    ``train`` (per-channel :class:`TrainResult` for trained methods); ``n_windows``: training
    windows per channel; ``train_mse``: on the training windows.
    """

    method: str
    rank: int | None
    selection: list[RankSelection]
    train: list[TrainResult]
    n_windows: int
    train_mse: float


class Forecaster:
    """Fit/predict linear forecaster: OLS, RRR, DWRR (closed forms), Linear or Root Purge (Adam).

    ``Forecaster(lookback, horizon, method="root_purge", purge=RootPurgeConfig(lam=1.0))``,
    then ``fit(series, val_series=None)`` on a ``(T,)`` or ``(T, C)`` numpy array or tensor, and
    ``predict(windows)`` on look-backs ``(B, L)`` / ``(B, L, C)`` or ``forecast(series)`` for the
    next ``H`` values after a series. ``channel_mode="independent"`` fits one weight on all channels
    (CI, the paper's default), ``"individual"`` one weight per channel. For RRR/DWRR without a
    fixed ``rank`` the rank is chosen on ``val_series`` (``ranks`` default ``{6, 12, ..., min(L, H)}``).
    ``backbone`` (trained methods only): ``"linear"``, ``"frequency"`` or ``"dlinear"``.
    """

    def __init__(self, lookback: int, horizon: int, method: Method = "root_purge", *, rank: int | None = None,
                 ranks: Sequence[int] | None = None, purge: RootPurgeConfig | None = None,
                 train: TrainConfig | None = None, backbone: str = "linear",
                 channel_mode: str = "independent", instance_norm: bool = True, rcond: float = RCOND) -> None:
        self.L = check_int("lookback", lookback, 1)
        self.H = check_int("horizon", horizon, 1)
        check_choice("method", method, _METHODS)
        check_choice("backbone", backbone, _BACKBONES)
        check_choice("channel_mode", channel_mode, _CHANNEL_MODES)
        if rank is not None:
            _check_rank(rank, self.L, self.H)
        if ranks is not None:
            ranks = [_check_rank(r, self.L, self.H) for r in ranks]
        if not (isinstance(rcond, float) and 0 <= rcond < 1):
            raise ValueError(f"rcond must be a float in [0, 1), got {rcond!r}")
        self.method, self.rank, self.ranks = method, rank, ranks
        self.purge = purge if purge is not None else (RootPurgeConfig() if method == "root_purge" else None)
        if method == "linear":
            self.purge = None
        self.train_config = train or TrainConfig()
        self.backbone, self.channel_mode = backbone, channel_mode
        self.instance_norm, self.rcond = bool(instance_norm), rcond
        self.weight_: Tensor | None = None  # (G, L, H) float64, G = 1 or C
        self.fit_: ForecasterFit | None = None

    # -- fitting ----------------------------------------------------------------------------
    def fit(self, series: ArrayLike, val_series: ArrayLike | None = None) -> "Forecaster":
        """Fit on a series ``(T,)``/``(T, C)`` (windows of stride 1); ``val_series`` for rank/checkpoint selection."""
        X, Y = make_windows(series, self.L, self.H)
        Xv = Yv = None
        if val_series is not None:
            Xv, Yv = make_windows(val_series, self.L, self.H)
            if Xv.shape[2] != X.shape[2]:
                raise ValueError(f"val_series has {Xv.shape[2]} channels, series has {X.shape[2]}")
        return self.fit_windows(X, Y, Xv, Yv)

    def fit_windows(self, X: ArrayLike, Y: ArrayLike, X_val: ArrayLike | None = None,
                    Y_val: ArrayLike | None = None) -> "Forecaster":
        """Fit on windows ``X (N, L[, C])``, ``Y (N, H[, C])`` (validation windows optional)."""
        x, y = _as_tensor(X, "X"), _as_tensor(Y, "Y")
        if x.ndim == 2:
            x, y = x[..., None], (y[..., None] if y.ndim == 2 else y)
        if x.ndim != 3 or y.ndim != 3 or x.shape[1] != self.L or y.shape[1] != self.H:
            raise ValueError(f"windows must be X (N, L={self.L}, C) and Y (N, H={self.H}, C); got "
                             f"{tuple(x.shape)}, {tuple(y.shape)}")
        _rows(x, y)  # validates N, finiteness
        xv = yv = None
        if X_val is not None and Y_val is not None:
            xv, yv = _as_tensor(X_val, "X_val"), _as_tensor(Y_val, "Y_val")
            if xv.ndim == 2:
                xv, yv = xv[..., None], yv[..., None]
            _rows(xv, yv, "X_val", "Y_val")
        needs_val = self.method in ("rrr", "dwrr") and self.rank is None
        if needs_val and xv is None:
            raise ValueError(f"method {self.method!r} without a fixed rank selects the rank on validation data: "
                             "pass val_series (or rank=...)")
        C = x.shape[2]
        groups = [slice(None)] if self.channel_mode == "independent" else [slice(c, c + 1) for c in range(C)]
        weights, sels, trs = [], [], []
        for gsl in groups:
            xg, yg = x[:, :, gsl], y[:, :, gsl]
            xvg = None if xv is None else xv[:, :, gsl]
            yvg = None if yv is None else yv[:, :, gsl]
            w, sel, tr = self._fit_group(xg, yg, xvg, yvg)
            weights.append(w)
            if sel is not None:
                sels.append(sel)
            if tr is not None:
                trs.append(tr)
        self.weight_ = torch.stack(weights)
        pred = self._predict_t(x)
        rank = None
        if self.method in ("rrr", "dwrr"):
            rank = self.rank if self.rank is not None else sels[0].rank
        self.fit_ = ForecasterFit(method=self.method, rank=rank, selection=sels, train=trs, n_windows=x.shape[0],
                                  train_mse=float(((pred - y) ** 2).mean()))
        return self

    def _fit_group(self, x: Tensor, y: Tensor, xv: Tensor | None, yv: Tensor | None):
        if self.method in ("ols", "rrr", "dwrr"):
            w_ols = fit_ols(x, y, self.instance_norm, self.rcond)
            if self.method == "ols":
                return w_ols, None, None
            if self.rank is not None:
                if self.method == "rrr":
                    return reduced_rank_regression(x, y, self.rank, W=w_ols, instance_norm=self.instance_norm), None, None
                return dwrr(w_ols, self.rank), None, None
            sel = select_rank(x, y, xv, yv, self.ranks, method=self.method, W=w_ols, instance_norm=self.instance_norm)
            return sel.weight, sel, None
        g = torch.Generator().manual_seed(self.train_config.seed)
        if self.backbone == "linear":
            model: nn.Module = LinearForecaster(self.L, self.H, instance_norm=self.instance_norm, generator=g)
        elif self.backbone == "frequency":
            model = FrequencyLinearForecaster(self.L, self.H, instance_norm=self.instance_norm, generator=g)
        else:
            model = DLinearForecaster(self.L, self.H, instance_norm=self.instance_norm, generator=g)
        tr = train_forecaster(model, x, y, self.train_config, self.purge, xv, yv)
        w = model.linear_weight().to(torch.float64)
        return w, None, tr

    # -- prediction -------------------------------------------------------------------------
    def _check_fitted(self) -> Tensor:
        if self.weight_ is None:
            raise RuntimeError("Forecaster is not fitted; call fit(series) first")
        return self.weight_

    def _predict_t(self, x: Tensor) -> Tensor:
        w = self._check_fitted()
        m = x.mean(1, keepdim=True) if self.instance_norm else torch.zeros_like(x[:, :1])
        if w.shape[0] == 1:
            return torch.einsum("nlc,lh->nhc", x - m, w[0]) + m
        if x.shape[2] != w.shape[0]:
            raise ValueError(f"this forecaster was fitted per channel on {w.shape[0]} channels, input has {x.shape[2]}")
        return torch.einsum("nlc,clh->nhc", x - m, w) + m

    def predict(self, windows: ArrayLike) -> np.ndarray | Tensor:
        """Forecasts for look-backs ``(B, L)`` -> ``(B, H)`` or ``(B, L, C)`` -> ``(B, H, C)``.

        Returns the input's type (numpy in, numpy out; tensor in, float64 tensor out).
        """
        x = _as_tensor(windows, "windows")
        squeeze = x.ndim == 2
        if squeeze:
            x = x[..., None]
        if x.ndim != 3 or x.shape[1] != self.L:
            raise ValueError(f"windows must be (B, L) or (B, L, C) with L = {self.L}, got {tuple(x.shape)}")
        _check_finite(x, "windows")
        out = self._predict_t(x)
        out = out[..., 0] if squeeze else out
        return out if isinstance(windows, Tensor) else out.numpy()

    def forecast(self, series: ArrayLike) -> np.ndarray | Tensor:
        """The next ``H`` values after a series ``(T,)`` -> ``(H,)`` or ``(T, C)`` -> ``(H, C)`` (T >= L)."""
        s = as_series(series)
        if s.shape[0] < self.L:
            raise ValueError(f"series of length {s.shape[0]} is shorter than the look-back L = {self.L}")
        out = self._predict_t(s[None, -self.L:, :])[0]
        if isinstance(series, (Tensor, np.ndarray)) and series.ndim == 1:
            out = out[:, 0]
        return out if isinstance(series, Tensor) else out.numpy()

    @property
    def weight(self) -> np.ndarray:
        """The learned ``(L, H)`` weight (``(C, L, H)`` per channel), numpy float64."""
        w = self._check_fitted()
        return (w[0] if w.shape[0] == 1 else w).numpy()

    def roots(self, step: int = 1, channel: int = 0) -> np.ndarray:
        """Characteristic roots of the learned recurrence (see :func:`characteristic_roots`)."""
        w = self._check_fitted()
        if not 0 <= channel < w.shape[0]:
            raise ValueError(f"channel must be in [0, {w.shape[0] - 1}], got {channel}")
        return characteristic_roots(w[channel], step=step, instance_norm=self.instance_norm)

    # -- persistence -------------------------------------------------------------------------
    def save(self, path: str | Path) -> Path:
        """Write the weight and settings as one safetensors file (JSON metadata), atomically."""
        from rankwise.core.io import save_tensors

        w = self._check_fitted()
        meta = {"rankwise": "root_purge", "lookback": self.L, "horizon": self.H, "method": self.method,
                "instance_norm": self.instance_norm, "channel_mode": self.channel_mode,
                "rank": self.fit_.rank if self.fit_ else None}
        return save_tensors(path, {"weight": w}, meta)

    @classmethod
    def load(cls, path: str | Path) -> "Forecaster":
        """Load a forecaster written by :meth:`save` (prediction and roots; no training state)."""
        from rankwise.core.io import load_tensors

        tensors, meta = load_tensors(path, {"weight": ((None, None, None), torch.float64)})
        if meta.get("rankwise") != "root_purge":
            raise ArtifactError(f"{path}: not a rankwise root_purge forecaster (metadata {meta})")
        try:
            L, H = int(meta["lookback"]), int(meta["horizon"])
            self = cls(L, H, meta["method"], channel_mode=meta["channel_mode"],
                       instance_norm=bool(meta["instance_norm"]))
        except (KeyError, ValueError, TypeError) as e:
            raise ArtifactError(f"{path}: bad metadata {meta}: {e}") from e
        w = tensors["weight"]
        if tuple(w.shape[1:]) != (L, H):
            raise ArtifactError(f"{path}: weight has shape {tuple(w.shape)}, expected (G, {L}, {H})")
        self.weight_ = w
        self.fit_ = ForecasterFit(meta["method"], meta.get("rank"), [], [], 0, float("nan"))
        return self


def fit_forecaster(series: ArrayLike, lookback: int, horizon: int, method: Method = "root_purge",
                   val_series: ArrayLike | None = None, **kwargs: Any) -> Forecaster:
    """Entry point: ``Forecaster(lookback, horizon, method, **kwargs).fit(series, val_series)``."""
    return Forecaster(lookback, horizon, method, **kwargs).fit(series, val_series)


# --------------------------------------------------------------------------------------------
# statsmodels peer (imported lazily)
# --------------------------------------------------------------------------------------------


@dataclass
class ARBaseline:
    """A statsmodels ``AutoReg`` fitted on a training series (order by AIC), used to forecast windows.

    ``params``: ``[const, a_1, ..., a_p]``; ``order``: p. :meth:`predict` forecasts ``H`` steps
    recursively from each look-back (only its last ``p`` values are used).
    """

    params: np.ndarray
    order: int

    @classmethod
    def fit(cls, series: ArrayLike, maxlag: int, ic: str = "aic") -> "ARBaseline":
        from statsmodels.tsa.ar_model import AutoReg, ar_select_order

        s = as_series(series).numpy()
        if s.shape[1] != 1:
            raise ValueError("ARBaseline is univariate; pass one channel")
        s = s[:, 0]
        maxlag = check_int("maxlag", maxlag, 1)
        sel = ar_select_order(s, maxlag=maxlag, ic=ic, trend="c")
        lags = sel.ar_lags
        p = int(max(lags)) if lags else 0
        res = AutoReg(s, lags=p, trend="c").fit()
        return cls(params=np.asarray(res.params, dtype=np.float64), order=p)

    def predict(self, X: ArrayLike, horizon: int) -> np.ndarray:
        """``X (N, L)`` look-backs -> ``(N, H)`` recursive forecasts."""
        x = _as_tensor(X, "X").numpy()
        p = self.order
        if x.ndim != 2 or x.shape[1] < p:
            raise ValueError(f"X must be (N, L) with L >= order {p}, got {x.shape}")
        hist = x[:, x.shape[1] - p:].copy() if p else np.zeros((x.shape[0], 0))
        out = np.empty((x.shape[0], horizon))
        a = self.params[1:]
        for h in range(horizon):
            nxt = self.params[0] + (hist[:, ::-1] @ a if p else 0.0)
            out[:, h] = nxt
            if p:
                hist = np.concatenate([hist[:, 1:], nxt[:, None]], axis=1)
        return out


register("root_purge", config=RootPurgeConfig, entry=fit_forecaster,
         solvers={"ols": fit_ols, "rrr": reduced_rank_regression, "dwrr": dwrr, "select_rank": select_rank,
                  "roots": characteristic_roots, "loss": RootPurgeLoss, "estimator": Forecaster})

__all__ = [
    "RootPurgeConfig", "TrainConfig", "make_windows", "as_series", "instance_normalize", "fit_ols", "RRRPath",
    "rrr_path", "reduced_rank_regression", "dwrr", "predict_linear", "RankSelection", "select_rank",
    "default_ranks", "singular_values", "tail_singular_sum", "effective_weight", "characteristic_roots",
    "root_distance", "ar_roots", "LinearForecaster", "FrequencyLinearForecaster", "DLinearForecaster",
    "adapt_length", "RootPurgeLoss", "TrainResult", "train_forecaster", "fit_linear_ensemble", "ForecasterFit",
    "Forecaster", "fit_forecaster", "ARBaseline",
]
