"""Fitting one layer: the method's factors checked, the ``LowRankLinear`` swapped in, the report row written."""

from __future__ import annotations

import time
from typing import Any, Mapping

import torch
from torch import nn

from rankwise.compress.base import CompressionReport, LayerMethod, LayerReport, PairedStats
from rankwise.compress.config import CompressConfig
from rankwise.core.errors import NumericalError
from rankwise.core.layers import LowRankLinear
from rankwise.core.linalg import LowRankFactors
from rankwise.core.stats import LayerStats
from rankwise.core.surgery import replace_module

Tensor = torch.Tensor

__all__ = ["Fitter"]


def _check_factors(name: str, f: Any, m: int, n: int, rank: int) -> tuple[Tensor, Tensor]:
    if isinstance(f, LowRankFactors) or (isinstance(f, tuple) and len(f) == 2):
        B, A = f
    else:
        raise TypeError(f"layer {name!r}: the method returned {type(f).__name__}, expected LowRankFactors (B, A)")
    if tuple(B.shape) != (rank, n) or tuple(A.shape) != (m, rank):
        raise ValueError(f"layer {name!r}: factors B {tuple(B.shape)} / A {tuple(A.shape)} do not have the shapes "
                         f"({rank}, {n}) / ({m}, {rank})")
    for what, t in (("B", B), ("A", A)):
        if not bool(torch.isfinite(t).all()):
            raise NumericalError(f"layer {name!r}: factor {what} has NaN/Inf values")
    return B, A


def _cached_error(cache: dict[str, Any] | None, name: str, W: Tensor, B: Tensor, A: Tensor, H: Tensor) -> float:
    """:func:`~rankwise.compress.base.relative_output_error` with ``W H`` memoised per layer (float64).

    ``tr(E H E^T) = tr(W H W^T) - 2 <A B, W H> + tr((A^T A)(B H B^T))`` costs ``O(r n^2)`` once ``W H``
    (``O(m n^2)``) is known; the memo (kept with a :class:`Calibration`) is reused by every method fitted
    from the same statistics; it is keyed by the statistics object and a checksum of the weight.
    """
    W64 = W.detach().to(torch.float64)
    H64 = H.detach().to(W64.device, torch.float64)
    hit = cache.get(name) if cache is not None else None
    key = (tuple(W64.shape), float(W64.sum()), float(W64.square().sum()), float(W64[..., ::7].abs().sum()))
    if hit is not None and hit[0] == key and hit[3] is H:
        WH, den = hit[1], hit[2]
    else:
        WH = W64 @ H64
        den = float((WH * W64).sum())
        if cache is not None:
            cache[name] = (key, WH, den, H)
    A64 = A.detach().to(W64.device, torch.float64)
    B64 = B.detach().to(W64.device, torch.float64)
    cross = float(((A64 @ B64) * WH).sum())
    quad = float(((A64.mT @ A64) * (B64 @ H64 @ B64.mT)).sum())
    num = max(den - 2.0 * cross + quad, 0.0)
    if den <= 0.0:
        return 0.0 if num <= 0.0 else float("inf")
    return num / den


class Fitter:
    """Fits and swaps layers, filling the report (shared by the whole, block and checkpoint modes)."""

    def __init__(self, model: nn.Module, method: LayerMethod, cfg: CompressConfig, ranks: Mapping[str, int],
                 report: CompressionReport, progress: Any = None, err_cache: dict[str, Any] | None = None):
        self.err_cache = err_cache
        self.model = model
        self.method = method
        self.cfg = cfg
        self.ranks = ranks
        self.report = report
        self.progress = progress
        self.seconds = 0.0

    def fit(self, name: str, stats: LayerStats | None, paired: PairedStats | None = None) -> None:
        layer = self.model.get_submodule(name)
        if not isinstance(layer, nn.Linear):
            raise TypeError(f"layer {name!r} is a {type(layer).__name__}, not an nn.Linear")
        m, n = layer.weight.shape
        rank = self.ranks[name]
        t0 = time.perf_counter()
        f = self.method.fit(name, layer, rank, stats=stats, paired=paired)
        B, A = _check_factors(name, f, m, n, rank)
        new = LowRankLinear.from_linear(layer, factors=(B, A))
        secs = time.perf_counter() - t0
        self.seconds += secs
        err = None
        if self.cfg.measure_error:
            H = stats.xtx if (stats is not None and stats.xtx is not None) else (paired.H if paired is not None else None)
            if H is not None:
                err = _cached_error(self.err_cache, name, layer.weight, new.down.weight, new.up.weight, H)
        bias = layer.bias is not None
        replace_module(self.model, name, new)
        self.report.layers.append(LayerReport(
            name=name, shape=(m, n), rank=rank, params_before=m * n + (m if bias else 0),
            params_after=new.num_parameters, rel_error=err, seconds=secs, info=dict(self.method.info())))
        if self.progress is not None:
            self.progress.advance()
