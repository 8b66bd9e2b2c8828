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
3. choose ``k`` (uniform budget, or the dynamic allocation below);
4. ``B = V_k^T W`` (``k x n``), ``A = V_k`` (``m x k``): ``Linear(n -> k, B, no bias)`` then
   ``Linear(k -> m, A, bias b)``.

No inverse, no Cholesky, no second SVD: it works unchanged when ``X^T X`` is singular (fewer tokens
than input features), where an undamped Cholesky (SVD-LLM(W)) fails.

**Dynamic rank allocation** (from the official code; per module type ``t``, e.g. query, key, value,
attention output, FFN in, FFN out; here: the layer's name relative to its transformer block):

1. block influence ``I_l = mean_tokens (1 - cos(h_l, h_{l+1}))`` (``h_l`` enters block ``l``,
   ``h_{l+1}`` leaves it; padding excluded), normalised ``I~_l = (I_l - min I)/(max I - min I + 1e-6) + 1``;
2. local loss proxy ``eps_{l,t} = sqrt(sum_i sigma_i^2) = ||Y||_F``;
3. score ``s_{l,t} = I~_l^alpha * log(1 + eps_{l,t})^(1 - alpha)``, ``alpha = 2.5``;
4. type budget ``R_t = L * k_u(t)`` with the uniform rank ``k_u = floor(rho m n / (m + n))``; base rank
   ``max(1, floor(0.5 k_u))`` per layer;
5. the remaining budget is split proportionally to the scores, floored, clipped to ``min(m, n)``;
   leftover units go one each to the highest scores (and round again while any remain), so the
   ranks of a type sum to ``R_t`` exactly.

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
from typing import Any, Callable, Iterable, Literal, Mapping, Sequence

import torch
from torch import nn

from rankwise.compress.base import (
    CompressionReport,
    LayerMethod,
    PairedStats,
    check_ratio,
    register_layer_method,
    uniform_rank,
)
from rankwise.core.errors import NumericalError
from rankwise.core.layers import validate_rank
from rankwise.core.linalg import LowRankFactors, check_finite, eigh_desc, normalized_effective_rank
from rankwise.core.registry import register
from rankwise.core.select import Selector
from rankwise.core.stats import CalibrationError, LayerStats

Tensor = torch.Tensor

__all__ = [
    "SwiftSVDConfig", "SwiftSVD", "swift_svd_compress", "output_covariance", "swift_svd_spectrum",
    "swift_svd_factors", "swift_svd_error", "block_influence", "normalize_influence", "allocation_scores",
    "dynamic_ranks", "INFLUENCE_EPS", "LOG_FLOOR",
]

#: ``1e-6`` in ``I~ = (I - min)/(max - min + 1e-6) + 1`` (official code).
INFLUENCE_EPS = 1e-6
#: Floor of ``log(1 + eps)`` in the score (keeps a zero-output layer's score finite).
LOG_FLOOR = 1e-12


def _where(name: str | None) -> str:
    return f" of layer {name!r}" if name else ""


# ----------------------------------------------------------------------------------------------
# the per-layer decomposition


def output_covariance(W: Tensor, X: Tensor, *, dtype: torch.dtype = torch.float64) -> Tensor:
    """``C = Y^T Y`` with ``Y = X W^T`` (``X`` ``(..., n)`` flattened to tokens; bias excluded), ``m x m``."""
    X = X.detach().reshape(-1, X.shape[-1]).to(dtype)
    Y = X @ W.detach().to(X.device, dtype).mT
    return Y.mT @ Y


def swift_svd_spectrum(C: Tensor, *, dtype: torch.dtype | None = torch.float64,
                       name: str | None = None) -> tuple[Tensor, Tensor]:
    """Step 2: ``eigh(C)`` sorted descending, negative eigenvalues clamped to 0; returns ``(lambda (m,), V (m, m))``.

    Raises :class:`~rankwise.core.errors.NumericalError` naming the layer if ``C`` has NaN/Inf.
    """
    if not isinstance(C, torch.Tensor) or C.ndim != 2 or C.shape[0] != C.shape[1]:
        raise ValueError(f"output covariance{_where(name)} must be a square matrix, got {getattr(C, 'shape', type(C))}")
    check_finite(C, "accumulated output covariance C", name)
    return eigh_desc(C, floor=0.0, dtype=dtype, name=name)


def swift_svd_factors(
    W: Tensor | nn.Linear,
    C: Tensor | None,
    rank: int,
    *,
    spectrum: tuple[Tensor, Tensor] | None = None,
    dtype: torch.dtype = torch.float64,
    name: str | None = None,
) -> LowRankFactors:
    """Step 4: ``B = V_k^T W`` (``k x n``), ``A = V_k`` (``m x k``), so ``A B = V_k V_k^T W``.

    ``C`` is the ``m x m`` output covariance (or pass its ``spectrum = (lambda, V)`` from
    :func:`swift_svd_spectrum`). A zero ``C`` (the layer's output is zero on the calibration data)
    gives the zero matrix (``B = 0``) with a warning.
    """
    if isinstance(W, nn.Linear):
        W = W.weight
    if not isinstance(W, torch.Tensor) or W.ndim != 2:
        raise ValueError(f"weight{_where(name)} must be an (out, in) matrix")
    W64 = check_finite(W.detach().to(dtype), "weight", name)
    m, n = W64.shape
    validate_rank(rank, n, m, name)
    if spectrum is None:
        if C is None:
            raise ValueError("give C or spectrum")
        if tuple(C.shape) != (m, m):
            raise ValueError(f"output covariance{_where(name)} must be ({m}, {m}) for a weight of shape {(m, n)}, "
                             f"got {tuple(C.shape)}")
        spectrum = swift_svd_spectrum(C, dtype=dtype, name=name)
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


@register_layer_method
class SwiftSVD(LayerMethod):
    """Swift-SVD as a per-layer method of the pipeline (``compress(..., method="swift-svd")``).

    Reads the streamed output covariance (stats kind ``"output_cov"``, bias excluded). Options:
    ``compute_dtype`` (float64 default; float32 for speed on large layers). :meth:`info` reports the
    predicted relative error ``sum_{i>k} lambda_i / sum_i lambda_i``, the normalised effective rank
    of ``Y`` (NER) and the output energy ``||Y||_F^2``.
    """

    name = "swift-svd"
    aliases = ("swiftsvd", "swift")
    needs = ("output_cov",)

    def __init__(self, *, compute_dtype: torch.dtype = torch.float64):
        if not (isinstance(compute_dtype, torch.dtype) and compute_dtype.is_floating_point):
            raise TypeError(f"compute_dtype must be a floating torch.dtype, got {compute_dtype!r}")
        self.compute_dtype = compute_dtype
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
            C = stats.output_cov(normalized=False)
            if tuple(C.shape) != (m, m):
                raise ValueError(f"layer {name!r}: output covariance of shape {tuple(C.shape)} does not fit a "
                                 f"{m} x {n} weight")
            spec = swift_svd_spectrum(C, dtype=self.compute_dtype, name=name)
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
        return f

    def info(self) -> dict[str, Any]:
        return dict(self._info)


# ----------------------------------------------------------------------------------------------
# dynamic rank allocation


def block_influence(h_in: Tensor, h_out: Tensor, mask: Tensor | None = None) -> tuple[float, int]:
    """Sum over tokens of ``1 - cos(h_in, h_out)`` and the token count (float64; padding excluded by ``mask``).

    ``h_in``/``h_out`` are ``(..., d)`` hidden states entering and leaving a block; ``mask`` has the
    leading shape (non-zero = keep). Divide the sums by the counts over all batches for ``I_l``.
    """
    if h_in.shape != h_out.shape:
        raise ValueError(f"block input {tuple(h_in.shape)} and output {tuple(h_out.shape)} differ in shape")
    a = h_in.detach().reshape(-1, h_in.shape[-1]).to(torch.float64)
    b = h_out.detach().reshape(-1, h_out.shape[-1]).to(torch.float64)
    if mask is not None and mask.numel() == a.shape[0]:
        keep = mask.reshape(-1).to(a.device) != 0
        a, b = a[keep], b[keep]
    cos = (a * b).sum(-1) / (a.norm(dim=-1) * b.norm(dim=-1)).clamp_min(1e-300)
    return float((1.0 - cos).sum()), int(a.shape[0])


def normalize_influence(influence: Sequence[float]) -> list[float]:
    """``I~_l = (I_l - min I) / (max I - min I + 1e-6) + 1`` (in ``[1, 2]``)."""
    vals = [float(v) for v in influence]
    if not vals:
        return []
    if not all(math.isfinite(v) for v in vals):
        raise NumericalError(f"block influence has non-finite values: {vals}")
    lo, hi = min(vals), max(vals)
    return [(v - lo) / (hi - lo + INFLUENCE_EPS) + 1.0 for v in vals]


def allocation_scores(importance: Sequence[float], eps: Sequence[float], alpha: float = 2.5) -> list[float]:
    """``s = I~^alpha * log(1 + eps)^(1 - alpha)``, normalised so that the largest score is 1 (log-space).

    ``importance`` are the normalised influences ``I~ >= 1`` of the layers' blocks, ``eps`` the local
    loss proxies ``||Y||_F`` (``>= 0``). ``log(1 + eps)`` is floored at :data:`LOG_FLOOR`.
    """
    if len(importance) != len(eps):
        raise ValueError(f"{len(importance)} importances but {len(eps)} eps values")
    logs = []
    for i, e in zip(importance, eps):
        if not (math.isfinite(i) and i > 0):
            raise ValueError(f"importance must be finite and > 0, got {i}")
        if not (math.isfinite(e) and e >= 0):
            raise ValueError(f"eps must be finite and >= 0, got {e}")
        logs.append(alpha * math.log(i) + (1.0 - alpha) * math.log(max(math.log1p(e), LOG_FLOOR)))
    top = max(logs) if logs else 0.0
    return [math.exp(v - top) for v in logs]


def dynamic_ranks(
    shapes: Mapping[str, tuple[int, int]],
    types: Mapping[str, str],
    importance: Mapping[str, float],
    eps: Mapping[str, float],
    ratio: float,
    *,
    alpha: float = 2.5,
    base_fraction: float = 0.5,
) -> dict[str, int]:
    """Swift-SVD's dynamic ranks: per type, ``L * k_u`` units split by score with exact budgets.

    Args:
        shapes: ``{layer: (m, n)}`` (out, in).
        types: ``{layer: type}``; layers of one type share a budget (they must have one shape).
        importance: ``{layer: I~}`` the normalised block influence of the layer's block (1 outside blocks).
        eps: ``{layer: ||Y||_F}`` the local loss proxy.
        ratio: kept-parameter fraction ``rho`` in ``(0, 1]``.
        alpha: score exponent (2.5).
        base_fraction: base rank ``max(1, floor(base_fraction * k_u))`` (0.5).
    Returns:
        ``{layer: rank}`` with ``sum`` per type ``== L * k_u`` and every rank in ``[1, min(m, n)]``.
    """
    rho = check_ratio(ratio)
    if not (isinstance(alpha, (int, float)) and math.isfinite(alpha)):
        raise ValueError(f"alpha={alpha!r} must be a finite number")
    if not (isinstance(base_fraction, (int, float)) and 0.0 <= base_fraction <= 1.0):
        raise ValueError(f"base_fraction={base_fraction!r} must be in [0, 1]")
    missing = [n for n in shapes if n not in types or n not in importance or n not in eps]
    if missing:
        raise ValueError(f"dynamic allocation: no type/importance/eps for layers {missing[:5]}")
    by_type: dict[str, list[str]] = {}
    for n in shapes:
        by_type.setdefault(types[n], []).append(n)
    ranks: dict[str, int] = {}
    for t, names in by_type.items():
        shp = {tuple(shapes[n]) for n in names}
        if len(shp) != 1:
            raise ValueError(f"layers of type {t!r} have different shapes {sorted(shp)}; give them different types")
        m, n = next(iter(shp))
        full = min(m, n)
        k_u = uniform_rank(m, n, rho)
        budget = len(names) * k_u
        base = max(1, math.floor(base_fraction * k_u))
        scores = allocation_scores([importance[x] for x in names], [eps[x] for x in names], alpha)
        remaining = budget - base * len(names)
        total = sum(scores)
        r = {x: min(full, base + math.floor(remaining * s / total)) for x, s in zip(names, scores)}
        left = budget - sum(r.values())
        order = sorted(range(len(names)), key=lambda i: (-scores[i], i))
        while left > 0:
            progressed = False
            for i in order:
                if left == 0:
                    break
                x = names[i]
                if r[x] < full:
                    r[x] += 1
                    left -= 1
                    progressed = True
            if not progressed:  # cannot happen: budget <= L * full
                raise RuntimeError(f"dynamic allocation of type {t!r} cannot place {left} rank unit(s)")
        ranks.update(r)
    return ranks


# ----------------------------------------------------------------------------------------------
# config and entry point


_ALLOCATIONS = ("dynamic", "uniform")


@dataclass(frozen=True)
class SwiftSVDConfig:
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
        check_ratio(self.param_ratio, "param_ratio")
        if self.allocation not in _ALLOCATIONS:
            raise ValueError(f"allocation={self.allocation!r} is not supported; choose one of {list(_ALLOCATIONS)}")
        if isinstance(self.alpha, bool) or not isinstance(self.alpha, (int, float)) or not math.isfinite(self.alpha):
            raise ValueError(f"alpha={self.alpha!r} must be a finite number (the paper uses 2.5)")
        if isinstance(self.base_fraction, bool) or not isinstance(self.base_fraction, (int, float)) \
                or not 0.0 <= self.base_fraction <= 1.0:
            raise ValueError(f"base_fraction={self.base_fraction!r} must be in [0, 1]")
        for f in ("accumulate_dtype", "compute_dtype"):
            v = getattr(self, f)
            if not (isinstance(v, torch.dtype) and v.is_floating_point):
                raise TypeError(f"{f} must be a floating torch.dtype, got {v!r}")

    def to_compress_config(self) -> Any:
        """The equivalent :class:`~rankwise.compress.pipeline.CompressConfig`."""
        from rankwise.compress.pipeline import CompressConfig

        return CompressConfig(method="swift-svd", ratio=self.param_ratio, allocation=self.allocation,
                              alpha=self.alpha, base_fraction=self.base_fraction, dtype=self.accumulate_dtype,
                              options={"compute_dtype": self.compute_dtype})


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
    """Compress ``model`` in place with Swift-SVD; returns the :class:`~rankwise.compress.base.CompressionReport`.

    ``calib`` is an iterable of calibration batches (dicts are passed as ``model(**batch)``), or a
    :class:`~rankwise.compress.pipeline.Calibration` from :func:`~rankwise.compress.pipeline.calibrate`
    (re-usable for several ratios: the eigendecompositions are computed once). ``target`` defaults to
    ``config.targets``. See :func:`rankwise.compress.compress` for the other arguments.
    """
    from rankwise.compress.pipeline import Calibration, compress

    cfg = config or SwiftSVDConfig()
    if not isinstance(cfg, SwiftSVDConfig):
        raise TypeError(f"config must be a SwiftSVDConfig, got {type(cfg).__name__}")
    tgt = target if target is not None else cfg.targets
    if isinstance(calib, Calibration):
        return compress(model, cfg, calibration=calib, target=tgt, mode=mode, forward=forward, mask=mask,
                        blocks=blocks, progress=progress)
    return compress(model, cfg, calib=calib, target=tgt, mode=mode, forward=forward, mask=mask, blocks=blocks,
                    progress=progress)


register("swift_svd", config=SwiftSVDConfig, entry=swift_svd_compress)
