"""The four SVD baselines every compression method is compared with: plain SVD, ASVD, FWSVD, SVD-LLM(W).

Notation (PyTorch convention): a linear layer ``y = x W^T + b`` with ``W`` ``m x n`` (out x in);
calibration inputs ``X`` (``N x n``, all tokens stacked). Every method returns a rank-``k`` pair
``(B, A)`` with ``B`` ``k x n`` (applied first) and ``A`` ``m x k``; ``trunc_k(M)`` is the top-``k``
SVD truncation of ``M``. Definitions follow the Swift-SVD spec (``shared/methods/swift_svd.md``,
"Baselines"):

* **Plain SVD**: ``W_k = trunc_k(W)``; ``A = U_k S_k^{1/2}``, ``B = S_k^{1/2} V_k^T``.
* **ASVD** (Yuan et al. 2023): diagonal input scaling ``S = diag(s)``, ``s_j = (mean_t |x_tj|)^a``,
  ``a = 0.5``; ``W_k = trunc_k(W S) S^{-1}``. (ASVD's sensitivity-based rank search is not used:
  ranks come from the pipeline, the same for every method compared.)
* **FWSVD** (Hsu et al. 2022): Fisher row weights ``f_i = sum_j sum_batches (dL/dW_ij)^2`` over the
  calibration set (task loss), ``D = diag(sqrt(f_i))``; ``W_k = D^{-1} trunc_k(D W)``. A row is an
  output neuron (choice of the spec).
* **SVD-LLM(W)** (Wang et al. 2024, truncation-aware whitening, no parameter update):
  ``S S^T = X^T X`` (Cholesky, lower-triangular ``S``; damping ``1e-6 * mean(diag) * I`` added, x10
  per failed attempt); ``U Sigma V^T = svd(W S)``; ``W_k = U_k Sigma_k V_k^T S^{-1}``;
  ``A = U_k Sigma_k^{1/2}``, ``B = Sigma_k^{1/2} V_k^T S^{-1}``. It reaches the same optimum of
  ``||X W^T - X W_k^T||_F`` as Swift-SVD when ``X^T X`` is full rank.

Floors (documented choices): ASVD's scales are floored at ``1e-6 * max_j s_j`` and FWSVD's row weights
at ``1e-6 * max_i sqrt(f_i)``, so that a channel that is never active (or a row that never receives a
gradient) is scaled by a large finite factor instead of an infinite one; the floor has no effect
when every channel/row carries signal. A layer whose scales are all zero raises.

The pure functions (``*_factors``) need no model; the :class:`~rankwise.compress.base.LayerMethod`
classes plug them into :func:`rankwise.compress.compress` under the names ``"svd"``, ``"asvd"``,
``"fwsvd"`` and ``"svd-llm"``, and each has its own config, registered exactly like the papers'
(``compress(model, SVDLLMConfig(param_ratio=0.4), calib=batches)``): :class:`PlainSVDConfig`,
:class:`ASVDConfig`, :class:`FWSVDConfig` (needs ``loss_fn=``), :class:`SVDLLMConfig`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn

from rankwise.compress.base import LayerMethod, PairedStats, check_ratio, register_layer_method
from rankwise.compress.config import MethodConfig, check_dtype
from rankwise.core.errors import NumericalError
from rankwise.core.layers import validate_rank
from rankwise.core.linalg import (
    Balance,
    CholeskyResult,
    LowRankFactors,
    check_finite,
    damped_cholesky,
    factors_from_svd,
    truncated_svd,
    weighted_lowrank_factors,
)
from rankwise.core.select import Selector
from rankwise.core.stats import CalibrationError, LayerStats
from rankwise.core.validate import check_bool, check_choice, check_int, check_number

Tensor = torch.Tensor

__all__ = [
    "SCALE_FLOOR", "plain_svd_factors", "asvd_scales", "asvd_factors", "fwsvd_row_weights", "fwsvd_factors",
    "svd_llm_factors", "PlainSVD", "ASVD", "FWSVD", "SVDLLM", "PlainSVDConfig", "ASVDConfig", "FWSVDConfig",
    "SVDLLMConfig",
]

#: Relative floor of ASVD's channel scales and FWSVD's row weights (see the module docstring).
SCALE_FLOOR = 1e-6


def _weight(W: Tensor | nn.Linear, dtype: torch.dtype | None, name: str | None) -> Tensor:
    if isinstance(W, nn.Linear):
        W = W.weight
    if not isinstance(W, torch.Tensor) or W.ndim != 2:
        raise ValueError(f"weight{_where(name)} must be an (out, in) matrix, got {getattr(W, 'shape', type(W))}")
    W = W.detach()
    W = W.to(dtype) if dtype is not None else (W if W.is_floating_point() else W.to(torch.get_default_dtype()))
    return check_finite(W, "weight", name)


def _where(name: str | None) -> str:
    return f" of layer {name!r}" if name else ""


def _floored(v: Tensor, floor: float, what: str, name: str | None) -> Tensor:
    """``max(v, floor * max(v))``; raises when ``v`` is all zero (nothing to weight by)."""
    check_finite(v, what, name)
    if bool((v < 0).any()):
        raise ValueError(f"{what}{_where(name)} must be >= 0")
    top = float(v.max()) if v.numel() else 0.0
    if top <= 0.0:
        raise NumericalError(f"{what}{_where(name)} are all zero: the calibration data gave no signal "
                             "for this layer (zero inputs or zero gradients)")
    return v.clamp_min(floor * top)


# ----------------------------------------------------------------------------------------------
# pure functions


def plain_svd_factors(W: Tensor | nn.Linear, rank: int, *, balance: Balance = "sqrt",
                      dtype: torch.dtype | None = torch.float64, name: str | None = None) -> LowRankFactors:
    """Plain SVD: ``W_k = trunc_k(W)`` (Eckart-Young optimum of ``||W - W_k||_F``), as ``(B, A)``."""
    W = _weight(W, dtype, name)
    validate_rank(rank, W.shape[1], W.shape[0], name)
    U, S, Vh = truncated_svd(W, rank, dtype=None, name=name)
    return factors_from_svd(U, S, Vh, balance=balance)


def asvd_scales(abs_mean: Tensor, alpha: float = 0.5, *, floor: float = SCALE_FLOOR,
                name: str | None = None) -> Tensor:
    """ASVD's channel scales ``s_j = (mean_t |x_tj|)^alpha`` (``n``), floored at ``floor * max_j s_j``."""
    if not isinstance(abs_mean, torch.Tensor) or abs_mean.ndim != 1:
        raise ValueError(f"abs_mean{_where(name)} must be a vector (n,), got {getattr(abs_mean, 'shape', type(abs_mean))}")
    if not (isinstance(alpha, (int, float)) and math.isfinite(alpha) and alpha >= 0):
        raise ValueError(f"alpha must be a finite number >= 0, got {alpha!r}")
    s = abs_mean.detach().to(torch.float64) ** float(alpha)
    return _floored(s, floor, "ASVD channel scales", name)


def asvd_factors(W: Tensor | nn.Linear, abs_mean: Tensor, rank: int, *, alpha: float = 0.5,
                 floor: float = SCALE_FLOOR, balance: Balance = "sqrt",
                 dtype: torch.dtype | None = torch.float64, name: str | None = None) -> LowRankFactors:
    """ASVD: ``W_k = trunc_k(W S) S^{-1}`` with ``S = diag(asvd_scales(abs_mean, alpha))``.

    ``abs_mean`` (``n``) is ``mean_t |x_tj|`` over the calibration tokens
    (:meth:`~rankwise.core.stats.LayerStats.input_abs_mean`).
    """
    W = _weight(W, dtype, name)
    m, n = W.shape
    validate_rank(rank, n, m, name)
    if abs_mean.shape != (n,):
        raise ValueError(f"abs_mean{_where(name)} must have shape ({n},), got {tuple(abs_mean.shape)}")
    s = asvd_scales(abs_mean, alpha, floor=floor, name=name).to(W.device, W.dtype)
    U, S, Vh = truncated_svd(W * s[None, :], rank, dtype=None, name=name)
    B, A = factors_from_svd(U, S, Vh, balance=balance)
    return LowRankFactors(check_finite(B / s[None, :], "down factor B", name), A)


def fwsvd_row_weights(row_fisher: Tensor, *, floor: float = SCALE_FLOOR, name: str | None = None) -> Tensor:
    """FWSVD's row weights ``d_i = sqrt(f_i)`` (``m``), floored at ``floor * max_i d_i``."""
    if not isinstance(row_fisher, torch.Tensor) or row_fisher.ndim != 1:
        raise ValueError(f"row_fisher{_where(name)} must be a vector (m,), got "
                         f"{getattr(row_fisher, 'shape', type(row_fisher))}")
    f = row_fisher.detach().to(torch.float64)
    check_finite(f, "Fisher row sums", name)
    if bool((f < 0).any()):
        raise ValueError(f"Fisher row sums{_where(name)} must be >= 0")
    return _floored(f.sqrt(), floor, "FWSVD row weights (Fisher)", name)


def fwsvd_factors(W: Tensor | nn.Linear, row_fisher: Tensor, rank: int, *, floor: float = SCALE_FLOOR,
                  balance: Balance = "sqrt", dtype: torch.dtype | None = torch.float64,
                  name: str | None = None) -> LowRankFactors:
    """FWSVD: ``W_k = D^{-1} trunc_k(D W)`` with ``D = diag(sqrt(f))`` and ``f`` the Fisher row sums (``m``).

    ``row_fisher`` is :meth:`~rankwise.core.stats.LayerStats.fisher_rows` (sum over the input
    dimension of the summed squared weight gradients).
    """
    W = _weight(W, dtype, name)
    m, n = W.shape
    validate_rank(rank, n, m, name)
    if row_fisher.shape != (m,):
        raise ValueError(f"row_fisher{_where(name)} must have shape ({m},), got {tuple(row_fisher.shape)}")
    d = fwsvd_row_weights(row_fisher, floor=floor, name=name).to(W.device, W.dtype)
    U, S, Vh = truncated_svd(d[:, None] * W, rank, dtype=None, name=name)
    B, A = factors_from_svd(U, S, Vh, balance=balance)
    return LowRankFactors(B, check_finite(A / d[:, None], "up factor A", name))


def svd_llm_factors(W: Tensor | nn.Linear, H: Tensor, rank: int, *, damping: float = 1e-6, retries: int = 5,
                    balance: Balance = "sqrt", dtype: torch.dtype | None = torch.float64,
                    name: str | None = None, cholesky: CholeskyResult | None = None
                    ) -> tuple[LowRankFactors, CholeskyResult]:
    """SVD-LLM(W): ``W_k = trunc_k(W S) S^{-1}`` with ``S S^T = H + lam I`` (``H = X^T X``, ``n x n``).

    ``lam = damping * mean(diag H) * 10^i`` at attempt ``i`` (see
    :func:`~rankwise.core.linalg.damped_cholesky`); ``damping=0`` is the exact, undamped Cholesky,
    which raises :class:`~rankwise.core.errors.NumericalError` when ``H`` is singular. A precomputed
    ``cholesky`` (of the same ``H``) skips the factorisation. Returns the factors and the Cholesky
    result (``L``, absolute jitter, attempts).
    """
    W = _weight(W, dtype, name)
    m, n = W.shape
    validate_rank(rank, n, m, name)
    if not isinstance(H, torch.Tensor) or tuple(H.shape) != (n, n):
        raise ValueError(f"H{_where(name)} must be an ({n}, {n}) matrix, got {getattr(H, 'shape', type(H))}")
    if cholesky is None:
        cholesky = damped_cholesky(H, damping=damping, retries=retries, dtype=W.dtype, name=name)
    L = cholesky.L.to(W.device, W.dtype)
    f = weighted_lowrank_factors(W, rank, right=L, balance=balance, dtype=None, name=name)
    return f, cholesky


# ----------------------------------------------------------------------------------------------
# configs: compress(model, SVDLLMConfig(...), calib=batches)


_ALLOCATIONS = ("uniform", "dynamic")


@dataclass(frozen=True)
class _BaselineConfig(MethodConfig):
    """Fields every baseline config shares: ``param_ratio`` (kept-parameter fraction of the targets, in
    ``(0, 1]``), ``allocation`` (``"uniform"`` or Swift-SVD's ``"dynamic"`` ranks), ``balance`` (how the
    singular values are split between the factors), ``compute_dtype``, ``measure_error`` (report each
    layer's relative output error: collects ``X^T X``) and ``targets`` (a selector; None = every linear
    inside the transformer blocks). The method's own options are validated by its constructor."""

    param_ratio: float = 0.4
    allocation: Literal["uniform", "dynamic"] = "uniform"
    balance: Balance = "sqrt"
    compute_dtype: torch.dtype = torch.float64
    measure_error: bool = True
    targets: Selector = None

    def __post_init__(self) -> None:
        owner = type(self).__name__
        check_ratio(self.param_ratio, f"{owner}.param_ratio")
        check_choice(f"{owner}.allocation", self.allocation, _ALLOCATIONS)
        check_bool(f"{owner}.measure_error", self.measure_error)
        self.method_class(**self.method_options())  # the method's constructor validates its options

    def pipeline_settings(self) -> dict[str, Any]:
        return dict(ratio=self.param_ratio, allocation=self.allocation, measure_error=self.measure_error)

    def method_options(self) -> dict[str, Any]:
        skip = set(_BaselineConfig.__dataclass_fields__) - {"balance", "compute_dtype"}
        return {k: getattr(self, k) for k in self.__dataclass_fields__ if k not in skip}


@dataclass(frozen=True)
class PlainSVDConfig(_BaselineConfig):
    """Plain truncated SVD of each target weight (no calibration data needed with ``measure_error=False``)."""


@dataclass(frozen=True)
class ASVDConfig(_BaselineConfig):
    """ASVD: activation-scaled SVD; ``alpha`` the exponent of ``mean |x|`` (0.5), ``floor`` the scales' relative floor."""

    alpha: float = 0.5
    floor: float = SCALE_FLOOR


@dataclass(frozen=True)
class FWSVDConfig(_BaselineConfig):
    """FWSVD: Fisher-row-weighted SVD (``compress(..., loss_fn=...)``); ``fisher`` ``"batch"`` or ``"sample"``."""

    fisher: Literal["batch", "sample"] = "batch"
    floor: float = SCALE_FLOOR


@dataclass(frozen=True)
class SVDLLMConfig(_BaselineConfig):
    """SVD-LLM(W): whitening with the damped Cholesky factor of ``X^T X`` (``damping`` relative, x10 per retry)."""

    damping: float = 1e-6
    retries: int = 5


# ----------------------------------------------------------------------------------------------
# the layer methods


def _need_stats(stats: LayerStats | None, method: str, name: str) -> LayerStats:
    if stats is None:
        raise CalibrationError(f"{method} needs calibration statistics for layer {name!r}; run it through "
                               "rankwise.compress.compress(model, config, calib=batches)")
    return stats


def _floor(owner: str, floor: Any) -> float:
    return check_number(f"{owner}.floor", floor, 0.0, 1.0, low_open=True, high_open=True)  # type: ignore[return-value]


class _Base(LayerMethod):
    def __init__(self, *, balance: Balance = "sqrt", compute_dtype: torch.dtype = torch.float64):
        owner = type(self).__name__
        self.balance: Balance = check_choice(f"{owner}.balance", balance, ("sqrt", "left", "right"))  # type: ignore[assignment]
        self.compute_dtype = check_dtype(f"{owner}.compute_dtype", compute_dtype)
        self._info: dict[str, Any] = {}

    def info(self) -> dict[str, Any]:
        return dict(self._info)


@register_layer_method
class PlainSVD(_Base):
    """Plain truncated SVD of the weight (no calibration data needed)."""

    name = "svd"
    aliases = ("plain-svd", "plain")
    needs = ()
    config_class = PlainSVDConfig

    def fit(self, name: str, layer: nn.Linear, rank: int, stats: LayerStats | None = None,
            paired: PairedStats | None = None) -> LowRankFactors:
        return plain_svd_factors(layer.weight, rank, balance=self.balance, dtype=self.compute_dtype, name=name)


@register_layer_method
class ASVD(_Base):
    """ASVD: SVD of the weight scaled by the activation magnitudes ``(mean |x|)^alpha`` (``alpha = 0.5``)."""

    name = "asvd"
    needs = ("input_abs_mean",)
    config_class = ASVDConfig

    def __init__(self, *, alpha: float = 0.5, floor: float = SCALE_FLOOR, balance: Balance = "sqrt",
                 compute_dtype: torch.dtype = torch.float64):
        super().__init__(balance=balance, compute_dtype=compute_dtype)
        self.alpha = check_number("ASVD.alpha", alpha, 0.0)
        self.floor = _floor("ASVD", floor)

    def fit(self, name: str, layer: nn.Linear, rank: int, stats: LayerStats | None = None,
            paired: PairedStats | None = None) -> LowRankFactors:
        st = _need_stats(stats, "ASVD", name)
        return asvd_factors(layer.weight, st.input_abs_mean(), rank, alpha=self.alpha, floor=self.floor,
                            balance=self.balance, dtype=self.compute_dtype, name=name)


@register_layer_method
class FWSVD(_Base):
    """FWSVD: SVD of the weight with rows weighted by the square root of their Fisher information.

    The Fisher row sums come from the gradients of a task loss (``compress(..., loss_fn=...)``);
    ``fisher="batch"`` squares each batch's gradient (the original recipe), ``"sample"`` each
    sample's (independent of the batching).
    """

    name = "fwsvd"
    needs = ("fisher_diag",)
    needs_grad = True
    config_class = FWSVDConfig

    def __init__(self, *, fisher: Literal["batch", "sample"] = "batch", floor: float = SCALE_FLOOR,
                 balance: Balance = "sqrt", compute_dtype: torch.dtype = torch.float64):
        super().__init__(balance=balance, compute_dtype=compute_dtype)
        self.fisher = check_choice("FWSVD.fisher", fisher, ("batch", "sample"))
        self.floor = _floor("FWSVD", floor)

    def collect_options(self) -> dict[str, Any]:
        return {"fisher": self.fisher}

    def fit(self, name: str, layer: nn.Linear, rank: int, stats: LayerStats | None = None,
            paired: PairedStats | None = None) -> LowRankFactors:
        st = _need_stats(stats, "FWSVD", name)
        return fwsvd_factors(layer.weight, st.fisher_rows(normalized=False), rank, floor=self.floor,
                             balance=self.balance, dtype=self.compute_dtype, name=name)


@register_layer_method
class SVDLLM(_Base):
    """SVD-LLM(W): truncation-aware whitening with the Cholesky factor of ``X^T X`` (damped, with retries)."""

    name = "svd-llm"
    aliases = ("svdllm", "svdllm-w", "svd-llm-w", "svdllmw")
    needs = ("input_cov",)
    config_class = SVDLLMConfig

    def __init__(self, *, damping: float = 1e-6, retries: int = 5, balance: Balance = "sqrt",
                 compute_dtype: torch.dtype = torch.float64):
        super().__init__(balance=balance, compute_dtype=compute_dtype)
        self.damping = check_number("SVDLLM.damping", damping, 0.0)  # 0 = undamped Cholesky
        self.retries = check_int("SVDLLM.retries", retries, 0)

    def fit(self, name: str, layer: nn.Linear, rank: int, stats: LayerStats | None = None,
            paired: PairedStats | None = None) -> LowRankFactors:
        st = _need_stats(stats, "SVD-LLM(W)", name)
        H = st.input_cov(normalized=False)
        key = f"chol:{name}:{self.damping!r}:{self.retries}:{self.compute_dtype}"
        chol = self.cache.get(key) if self.cache is not None else None
        f, chol = svd_llm_factors(layer.weight, H, rank, damping=self.damping, retries=self.retries,
                                  balance=self.balance, dtype=self.compute_dtype, name=name, cholesky=chol)
        if self.cache is not None:
            self.cache[key] = chol
        self._info = {"jitter": chol.jitter, "cholesky_attempts": chol.attempts}
        return f
