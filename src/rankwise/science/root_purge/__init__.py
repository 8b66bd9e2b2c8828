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

Layout of the package: :mod:`.config` (the configs and constants), :mod:`.data` (input validation and
windowing), :mod:`.linear` (the closed forms: OLS, RRR, DWRR, rank selection; characteristic roots),
:mod:`.model` (forecaster modules: Linear, frequency-domain linear, DLinear; the Root Purge loss;
training of one model or a vectorised ensemble of linear models) and this module (the
:class:`Forecaster` estimator with ``fit``/``predict``, the statsmodels AR peer, registration); every
public name is importable from ``rankwise.science.root_purge``.

Shapes: a series is ``(T,)`` or ``(T, C)``; windows are ``X (N, L, C)`` and ``Y (N, H, C)``;
the closed forms take channel-independent rows ``X (N, L)`` / ``Y (N, H)`` (or ``(N, L, C)``,
which they stack channel by channel). All closed forms run in float64.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch
from torch import Tensor, nn

from rankwise.core.errors import ArtifactError
from rankwise.core.registry import register
from rankwise.core.validate import check_choice, check_int
from rankwise.science.root_purge.config import (
    RCOND,
    _BACKBONES,
    _CHANNEL_MODES,
    _METHODS,
    ArrayLike,
    Method,
    RootPurgeConfig,
    TrainConfig,
)
from rankwise.science.root_purge.data import (
    _as_tensor,
    _check_finite,
    _rows,
    as_series,
    instance_normalize,
    make_windows,
)
from rankwise.science.root_purge.linear import (
    RankSelection,
    RRRPath,
    _check_rank,
    ar_roots,
    characteristic_roots,
    default_ranks,
    dwrr,
    effective_weight,
    fit_ols,
    predict_linear,
    reduced_rank_regression,
    root_distance,
    rrr_path,
    select_rank,
    singular_values,
    tail_singular_sum,
)
from rankwise.science.root_purge.model import (
    DLinearForecaster,
    FrequencyLinearForecaster,
    LinearForecaster,
    RootPurgeLoss,
    TrainResult,
    adapt_length,
    fit_linear_ensemble,
    train_forecaster,
)

log = logging.getLogger(__name__)

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
