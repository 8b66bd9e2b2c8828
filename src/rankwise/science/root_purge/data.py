"""Input checks and windowing for Root Purge: series to float64 tensors, look-back / horizon windows,
instance normalisation, weight checks.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from rankwise.core.validate import check_int
from rankwise.science.root_purge.config import ArrayLike


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
