"""Swift-SVD: activation-aware low-rank compression from one eigendecomposition of the output covariance.

"Swift-SVD" (ICML 2026, arXiv 2604.01609; official code github.com/hiahei/Swift-SVD). Spec:
``shared/methods/swift_svd.md``.

Notation (PyTorch convention): a linear layer ``y = x W^T + b``, ``W`` ``m x n`` (out x in);
calibration inputs ``X`` (``N x n``, all tokens stacked); output without bias ``Y = X W^T`` (``N x m``).

**Closed-form optimum** (the paper's theorem). With ``C = Y^T Y = W (X^T X) W^T`` (``m x m``) and its
eigendecomposition ``C = V diag(lambda) V^T`` (``lambda_1 >= ... >= lambda_m >= 0``), ``W_k = V_k V_k^T W``
minimises ``||X W^T - X W_k^T||_F^2`` over rank-``k`` matrices and the minimum is ``sum_{i>k} lambda_i``
(``X W_k^T = Y V_k V_k^T`` is the Eckart-Young truncation of ``Y``).

**Algorithm** (per layer, any order, inputs from the original model):

1. stream ``C += Y_b^T Y_b`` over calibration batches (float64; the bias is *not* part of ``Y``);
   memory ``O(m^2)``, no activation is stored (:mod:`rankwise.core.stats`, kind ``"output_cov"``);
2. one ``eigh(C)``, eigenpairs sorted descending, negative eigenvalues clamped to 0
   (``sigma_i = sqrt(lambda_i)`` are the singular values of ``Y``);
   for a layer wider at the output (``m > n``) the exact reduction to the ``n x n`` problem
   ``Q^T C Q`` (``W = Q R``) of :func:`swift_svd_spectrum` gives the same eigenpairs at
   ``O(m^2 n)`` instead of ``O(m^3)``, and at ``O(m n^2 + n^3)`` as ``R H R^T`` when the input
   covariance ``H = X^T X`` was collected too (the pipeline's default, ``measure_error=True``); in
   float32 the extra error is bounded by :func:`float32_excess_bound`;
3. choose ``k`` (uniform budget, or the dynamic allocation below);
4. ``B = V_k^T W`` (``k x n``), ``A = V_k`` (``m x k``): ``Linear(n -> k, B, no bias)`` then
   ``Linear(k -> m, A, bias b)``.

No inverse, no Cholesky, no second SVD: it works unchanged when ``X^T X`` is singular (fewer tokens
than input features), where an undamped Cholesky (SVD-LLM(W)) fails.

**Dynamic rank allocation** (from the official code): block influence times a local loss proxy,
exact per-type budgets; it serves every method of the pipeline and lives in
:mod:`rankwise.compress.allocation` (its functions are re-exported here).

Choices (see ``docs/methods/swift_svd.md``): ``alpha = 2.5`` (the allocation function's value; the
command line of the official code defaults to 1.0); ``log(1 + eps)`` (not the commented ``log(e + eps)``);
``log(1 + eps)`` is floored at ``1e-12`` so that a zero-output layer gets a finite score; scores are
computed in log space and normalised by their maximum (no overflow at ``alpha = 2.5``); the base rank
is at least 1 so that no layer is removed. A layer whose ``C`` is zero gets the zero matrix (with a
warning). The KV-cache mode of the paper (caching the latent ``X B^T`` of ``k_proj``/``v_proj``) is
not implemented.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Literal

import torch
from torch import nn

from rankwise.compress.allocation import (
    INFLUENCE_EPS,
    LOG_FLOOR,
    allocation_scores,
    block_influence,
    dynamic_ranks,
    normalize_influence,
)
from rankwise.compress.api import compress
from rankwise.compress.base import CompressionReport, LayerMethod, PairedStats, check_ratio, register_layer_method
from rankwise.compress.calibration import Calibration
from rankwise.compress.config import MethodConfig, check_dtype
from rankwise.core.layers import validate_rank
from rankwise.core.linalg import LowRankFactors, check_finite, eigh_desc, normalized_effective_rank
from rankwise.core.registry import register
from rankwise.core.select import Selector
from rankwise.core.stats import CalibrationError, LayerStats
from rankwise.core.validate import check_choice, check_number, check_unit

Tensor = torch.Tensor

__all__ = [
    "SwiftSVDConfig", "SwiftSVD", "swift_svd_compress", "output_covariance", "swift_svd_spectrum",
    "swift_svd_factors", "swift_svd_error", "float32_excess_bound", "FLOAT32_UNIT_ROUNDOFF", "block_influence", "normalize_influence", "allocation_scores",
    "dynamic_ranks", "INFLUENCE_EPS", "LOG_FLOOR",
]

def _where(name: str | None) -> str:
    return f" of layer {name!r}" if name else ""


# ----------------------------------------------------------------------------------------------
# the per-layer decomposition


def output_covariance(W: Tensor, X: Tensor, *, dtype: torch.dtype = torch.float64) -> Tensor:
    """``C = Y^T Y`` with ``Y = X W^T`` (``X`` ``(..., n)`` flattened to tokens; bias excluded), ``m x m``."""
    X = X.detach().reshape(-1, X.shape[-1]).to(dtype)
    Y = X @ W.detach().to(X.device, dtype).mT
    return Y.mT @ Y


#: Float32 unit roundoff ``u = 2^-24``, the constant of :func:`float32_excess_bound`.
FLOAT32_UNIT_ROUNDOFF = 2.0 ** -24


def _reduction_tol(dtype: torch.dtype) -> float:
    # the output energy outside span(W) that the reduction may drop before it falls back to the full eigh:
    # sqrt(eps) of the compute dtype (1.5e-8 in float64, 3.5e-4 in float32), far above rounding
    return float(torch.finfo(dtype).eps) ** 0.5


def swift_svd_spectrum(C: Tensor | None, *, weight: Tensor | None = None, input_cov: Tensor | None = None,
                       dtype: torch.dtype | None = torch.float64, name: str | None = None) -> tuple[Tensor, Tensor]:
    """Step 2: ``eigh(C)`` sorted descending, negative eigenvalues clamped to 0; returns ``(lambda (m,), V (m, p))``.

    Without ``weight``, ``p = m`` (the full eigendecomposition). With the layer's ``weight`` ``W``
    (``m x n``) and ``m > n`` (a layer wider at the output than at the input: BERT's 1536 x 384
    ``intermediate.dense``, Llama's 11008 x 4096 ``up_proj``/``gate_proj``), the *exact reduction*:
    ``C = W H W^T`` has rank at most ``n`` and its range lies in ``span(W)``, so with the thin QR
    ``W = Q R`` (``Q`` ``m x n`` orthonormal), ``C = Q (Q^T C Q) Q^T`` and the eigenpairs of ``C`` are
    ``(lambda_i, Q u_i)`` for the eigenpairs ``(lambda_i, u_i)`` of the ``n x n`` matrix ``Q^T C Q``;
    the other ``m - n`` eigenvalues are 0. Then ``p = n`` and ``lambda[n:] = 0``. Cost
    ``O(m^2 n + m n^2 + n^3)`` instead of ``O(m^3)``. The identity needs ``C`` to be the output
    covariance of this very ``W`` (as the pipeline collects it); if more than ``sqrt(eps)`` of
    ``trace(C)`` lies outside ``span(W)`` (statistics of another weight), the full ``eigh`` runs instead.

    With the input covariance ``input_cov`` ``H = X^T X`` (``n x n``) of the same tokens as well (the
    pipeline collects it by default to measure every layer's error), the ``n x n`` problem is formed
    without ``C``: ``Q^T C Q = Q^T W H W^T Q = R H R^T``, cost ``O(m n^2 + n^3)``, linear in ``m``
    (``C`` may then be None). Exact in exact arithmetic; with streamed statistics ``C`` and ``W H W^T``
    differ by the rounding of the model's forward pass only.

    Raises :class:`~rankwise.core.errors.NumericalError` naming the layer if ``C`` has NaN/Inf.
    """
    if input_cov is not None and weight is not None and weight.ndim == 2 and weight.shape[0] > weight.shape[1]:
        return _spectrum_from_input_cov(weight, input_cov, dtype or input_cov.dtype, name)
    if not isinstance(C, torch.Tensor) or C.ndim != 2 or C.shape[0] != C.shape[1]:
        raise ValueError(f"output covariance{_where(name)} must be a square matrix, got {getattr(C, 'shape', type(C))}")
    check_finite(C, "accumulated output covariance C", name)
    m = C.shape[0]
    if weight is not None:
        if weight.ndim != 2 or weight.shape[0] != m:
            raise ValueError(f"weight{_where(name)} must have {m} rows to match its output covariance, "
                             f"got {tuple(weight.shape)}")
        if weight.shape[1] < m:
            reduced = _reduced_spectrum(C, weight, dtype or C.dtype, name)
            if reduced is not None:
                return reduced
    return eigh_desc(C, floor=0.0, dtype=dtype, name=name)


def _reduced_spectrum(C: Tensor, W: Tensor, dtype: torch.dtype, name: str | None) -> tuple[Tensor, Tensor] | None:
    """The exact reduction of :func:`swift_svd_spectrum` (``m > n``); None if ``C`` is not in ``span(W)``."""
    m = W.shape[0]
    Cd = C.to(dtype)
    Q = torch.linalg.qr(check_finite(W.detach().to(Cd.device, dtype), "weight", name), mode="reduced").Q
    M = Q.mT @ (Cd @ Q)
    total = float(torch.diagonal(Cd).sum())
    if total > 0 and abs(total - float(torch.diagonal(M).sum())) > _reduction_tol(dtype) * total:
        return None
    return _lift(M, Q, m, dtype, name)


def _lift(M: Tensor, Q: Tensor, m: int, dtype: torch.dtype, name: str | None) -> tuple[Tensor, Tensor]:
    """Eigenpairs of the ``n x n`` reduced matrix ``M`` mapped back to ``m`` dims: ``(lambda (m,), Q U (m, n))``."""
    lam_n, U = eigh_desc(M, floor=0.0, dtype=dtype, name=name)
    lam = torch.cat([lam_n, torch.zeros(m - M.shape[0], dtype=lam_n.dtype, device=lam_n.device)])
    return lam, Q @ U


def _spectrum_from_input_cov(W: Tensor, H: Tensor, dtype: torch.dtype, name: str | None) -> tuple[Tensor, Tensor]:
    """``m > n``: the eigenpairs of ``C = W H W^T`` from the ``n x n`` matrix ``R H R^T`` (``W = Q R``)."""
    m, n = W.shape
    if not isinstance(H, torch.Tensor) or tuple(H.shape) != (n, n):
        raise ValueError(f"input covariance{_where(name)} must be ({n}, {n}) for a weight of shape {(m, n)}, "
                         f"got {tuple(getattr(H, 'shape', ()))}")
    Hd = check_finite(H.detach().to(dtype), "accumulated input covariance H", name)
    Q, R = torch.linalg.qr(check_finite(W.detach().to(Hd.device, dtype), "weight", name), mode="reduced")
    return _lift(R @ Hd @ R.mT, Q, m, dtype, name)


def float32_excess_bound(lam: Tensor, rank: int, size: int) -> float:
    """Bound on the extra error of the float32 factors over the float64 optimum, ``4 k p u lambda_1``.

    ``lam``: the spectrum of ``C`` (descending); ``rank``: ``k``; ``size``: ``p``, the order of the
    eigenproblem actually solved (``min(m, n)`` with the reduction of :func:`swift_svd_spectrum`, ``m``
    without); ``u = 2^-24``. Derivation: the float32 path computes the exact top-``k`` eigenvectors
    ``P'`` of a perturbed ``C + Delta`` (rounding ``C`` or ``H``, ``W``, ``Q`` and ``R`` to float32,
    backward-stable ``eigh``: ``||Delta||_2 <= c p u lambda_1``); since ``P'`` is optimal for ``C + Delta``,
    ``tr(P C) - tr(P' C) <= 2 k ||Delta||_2``, and the loss of orthogonality of the float32 ``V_k`` adds a
    term of the same order; ``c = 2`` covers both (the tests check it on random wide and tall layers).
    The error is the absolute ``||X W^T - X B^T A^T||_F^2`` of :func:`swift_svd_error`. Float32 is accurate
    enough when this bound is small against the optimum ``sum_{i>k} lambda_i`` (``SwiftSVD.info()``
    reports the ratio as ``float32_excess_bound_rel``).
    """
    lam = lam.to(torch.float64)
    return 4.0 * rank * size * FLOAT32_UNIT_ROUNDOFF * float(lam[0].clamp_min(0)) if lam.numel() else 0.0


def swift_svd_factors(
    W: Tensor | nn.Linear,
    C: Tensor | None,
    rank: int,
    *,
    spectrum: tuple[Tensor, Tensor] | None = None,
    input_cov: Tensor | None = None,
    dtype: torch.dtype = torch.float64,
    name: str | None = None,
) -> LowRankFactors:
    """Step 4: ``B = V_k^T W`` (``k x n``), ``A = V_k`` (``m x k``), so ``A B = V_k V_k^T W``.

    ``C`` is the ``m x m`` output covariance (or pass its ``spectrum = (lambda, V)`` from
    :func:`swift_svd_spectrum`; with ``input_cov`` ``H = X^T X`` and ``m > n`` it uses the ``R H R^T``
    reduction and ``C`` may be None). A zero ``C`` (the layer's output is zero on the calibration data)
    gives the zero matrix (``B = 0``) with a warning.
    """
    if isinstance(W, nn.Linear):
        W = W.weight
    if not isinstance(W, torch.Tensor) or W.ndim != 2:
        raise ValueError(f"weight{_where(name)} must be an (out, in) matrix")
    W64 = check_finite(W.detach().to(dtype), "weight", name)
    m, n = W64.shape
    validate_rank(rank, n, m, name)
    if spectrum is None and input_cov is not None and m > n:
        spectrum = swift_svd_spectrum(C, weight=W64, input_cov=input_cov, dtype=dtype, name=name)
    if spectrum is None:
        if C is None:
            raise ValueError("give C or spectrum" + (" (or input_cov for a layer wider at the output)" if m > n else ""))
        if tuple(C.shape) != (m, m):
            raise ValueError(f"output covariance{_where(name)} must be ({m}, {m}) for a weight of shape {(m, n)}, "
                             f"got {tuple(C.shape)}")
        spectrum = swift_svd_spectrum(C, weight=W64, dtype=dtype, name=name)
    lam, V = spectrum
    Vk = V[:, :rank].to(W64.device, dtype)
    if float(lam.sum()) <= 0.0:
        warnings.warn(f"layer {name or '?'}: its output is zero on the calibration data (C = 0); the rank-{rank} "
                      "Swift-SVD approximation is the zero matrix", RuntimeWarning, stacklevel=2)
        return LowRankFactors(torch.zeros(rank, n, dtype=dtype, device=W64.device), Vk.clone())
    B = Vk.mT @ W64
    return LowRankFactors(check_finite(B, "down factor B", name), Vk.contiguous())


def swift_svd_error(C_or_lambda: Tensor, rank: int) -> float:
    """The optimal error ``sum_{i>k} lambda_i`` of :func:`swift_svd_factors` at rank ``k`` (absolute, not relative)."""
    lam = C_or_lambda
    if lam.ndim == 2:
        lam = swift_svd_spectrum(lam)[0]
    lam = lam.to(torch.float64).clamp_min(0)
    return float(lam[rank:].sum())


_ALLOCATIONS = ("dynamic", "uniform")


@dataclass(frozen=True)
class SwiftSVDConfig(MethodConfig):
    """Swift-SVD with the paper's defaults.

    Attributes:
        param_ratio: kept-parameter fraction ``rho`` of the target layers, in ``(0, 1]`` (0.4).
        allocation: ``"dynamic"`` (the paper's block-influence / local-loss allocation, default) or
            ``"uniform"`` (``k = floor(rho m n / (m + n))`` for every layer).
        alpha: exponent of the allocation score (2.5).
        base_fraction: base rank as a fraction of the uniform rank (0.5).
        accumulate_dtype: dtype of the streamed ``C`` (float64).
        compute_dtype: dtype of the eigendecomposition and factors (float64).
        targets: which layers (a :mod:`rankwise.core.select` selector); None = every ``nn.Linear`` in
            the model's transformer blocks.
    """

    param_ratio: float = 0.4
    allocation: Literal["dynamic", "uniform"] = "dynamic"
    alpha: float = 2.5
    base_fraction: float = 0.5
    accumulate_dtype: torch.dtype = torch.float64
    compute_dtype: torch.dtype = torch.float64
    targets: Selector = None

    def __post_init__(self) -> None:
        check_ratio(self.param_ratio, "SwiftSVDConfig.param_ratio")
        check_choice("SwiftSVDConfig.allocation", self.allocation, _ALLOCATIONS)
        check_number("SwiftSVDConfig.alpha", self.alpha)
        check_unit("SwiftSVDConfig.base_fraction", self.base_fraction)
        check_dtype("SwiftSVDConfig.accumulate_dtype", self.accumulate_dtype)
        check_dtype("SwiftSVDConfig.compute_dtype", self.compute_dtype)

    def pipeline_settings(self) -> dict[str, Any]:
        return dict(ratio=self.param_ratio, allocation=self.allocation, alpha=self.alpha,
                    base_fraction=self.base_fraction, dtype=self.accumulate_dtype)

    def method_options(self) -> dict[str, Any]:
        return {"compute_dtype": self.compute_dtype}


@register_layer_method
class SwiftSVD(LayerMethod):
    """Swift-SVD as a per-layer method of the pipeline (``compress(..., method="swift-svd")``).

    Reads the streamed output covariance (stats kind ``"output_cov"``, bias excluded). Options:
    ``compute_dtype`` (float64 default; float32 for speed on large layers, with the error bound of
    :func:`float32_excess_bound`). Layers wider at the output than at the input use the exact reduction
    of :func:`swift_svd_spectrum`: ``R H R^T`` from the input covariance when it was collected (the
    pipeline's default), else ``Q^T C Q``. :meth:`info` reports the predicted relative error
    ``sum_{i>k} lambda_i / sum_i lambda_i``, the normalised effective rank of ``Y`` (NER), the output
    energy ``||Y||_F^2`` and, in float32, ``float32_excess_bound_rel`` (the bound over the optimum).
    """

    name = "swift-svd"
    aliases = ("swiftsvd", "swift")
    needs = ("output_cov", "input_cov")
    config_class = SwiftSVDConfig

    def needs_for(self, out_features: int, in_features: int) -> tuple[str, ...]:
        # wider at the output: the n x n input covariance gives R H R^T (C, m x m, is never collected)
        return ("input_cov",) if out_features > in_features else ("output_cov",)

    def __init__(self, *, compute_dtype: torch.dtype = torch.float64):
        self.compute_dtype = check_dtype("SwiftSVD.compute_dtype", compute_dtype)
        self._info: dict[str, Any] = {}

    def fit(self, name: str, layer: nn.Linear, rank: int, stats: LayerStats | None = None,
            paired: PairedStats | None = None) -> LowRankFactors:
        if stats is None:
            raise CalibrationError(f"Swift-SVD needs the output covariance of layer {name!r}; run it through "
                                   "rankwise.compress.compress(model, config, calib=batches)")
        if stats.output_bias:
            raise ValueError(f"layer {name!r}: the output covariance was collected with the bias folded in "
                             "(output_bias=True); Swift-SVD keeps the bias outside the factors")
        m, n = layer.weight.shape
        validate_rank(rank, n, m, name)
        key = f"eigh:{name}:{self.compute_dtype}"
        spec = self.cache.get(key) if self.cache is not None else None
        if spec is None:
            if m > n and stats.xtx is not None:
                # R H R^T: the n x n problem without touching the m x m C (measure_error collects H by default)
                spec = swift_svd_spectrum(None, weight=layer.weight, input_cov=stats.input_cov(normalized=False),
                                          dtype=self.compute_dtype, name=name)
            else:
                C = stats.output_cov(normalized=False)
                if tuple(C.shape) != (m, m):
                    raise ValueError(f"layer {name!r}: output covariance of shape {tuple(C.shape)} does not fit a "
                                     f"{m} x {n} weight")
                spec = swift_svd_spectrum(C, weight=layer.weight, dtype=self.compute_dtype, name=name)
            if self.cache is not None:
                self.cache[key] = spec
        with warnings.catch_warnings():
            warnings.simplefilter("default")
            f = swift_svd_factors(layer.weight, None, rank, spectrum=spec, dtype=self.compute_dtype, name=name)
        lam = spec[0].to(torch.float64)
        total = float(lam.sum())
        self._info = {
            "predicted_rel_error": float(lam[rank:].sum()) / total if total > 0 else 0.0,
            "ner": normalized_effective_rank(lam.clamp_min(0).sqrt()) if total > 0 else 0.0,
            "energy": total,
        }
        if self.compute_dtype == torch.float32:
            tail = float(lam[rank:].sum())
            bound = float32_excess_bound(lam, rank, spec[1].shape[1])
            self._info["float32_excess_bound_rel"] = bound / tail if tail > 0 else (0.0 if bound == 0 else math.inf)
        return f

    def info(self) -> dict[str, Any]:
        return dict(self._info)


# ----------------------------------------------------------------------------------------------
# deprecated entry point


def swift_svd_compress(
    model: nn.Module,
    calib: Iterable[Any] | Any,
    config: SwiftSVDConfig | None = None,
    *,
    target: Selector = None,
    mode: Literal["auto", "whole", "blocks"] = "auto",
    forward: Callable[[nn.Module, Any], Any] | None = None,
    mask: Any = "auto",
    blocks: str | None = None,
    progress: bool = False,
) -> CompressionReport:
    """Deprecated alias of ``compress(model, config, calib=calib)`` (``config`` defaults to ``SwiftSVDConfig()``).

    ``calib`` may also be a :class:`~rankwise.compress.calibration.Calibration` (``compress(...,
    calibration=cal)``).
    """
    warnings.warn("swift_svd_compress(model, calib, config) is deprecated; use "
                  "rankwise.compress.compress(model, SwiftSVDConfig(...), calib=batches)", DeprecationWarning, stacklevel=2)
    cfg = config or SwiftSVDConfig()
    if not isinstance(cfg, SwiftSVDConfig):
        raise TypeError(f"config must be a SwiftSVDConfig, got {type(cfg).__name__}")
    data = {"calibration": calib} if isinstance(calib, Calibration) else {"calib": calib}
    return compress(model, cfg, **data, target=target, mode=mode, forward=forward, mask=mask, blocks=blocks,
                    progress=progress)


register("swift_svd", config=SwiftSVDConfig, entry=compress, module=__name__)
