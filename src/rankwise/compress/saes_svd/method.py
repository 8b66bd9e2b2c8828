"""SAES-SVD as a per-layer method of the shared pipeline, its report, and the deprecated entry point."""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from rankwise.compress.api import compress
from rankwise.compress.base import CompressionReport, LayerMethod, PairedStats, register_layer_method
from rankwise.compress.saes_svd.cealc import (
    AcesResult,
    _aces_from_targets,
    _check_rank,
    _energy_ratio_gram,
    _factors_from_target,
    _prep,
    _targets,
    cealc_whitening,
)
from rankwise.compress.saes_svd.config import SAESConfig
from rankwise.core.linalg import LowRankFactors

__all__ = ["SAESMethod", "SAESReport", "saes_svd_compress"]


@dataclass
class SAESReport(CompressionReport):
    """:class:`~rankwise.compress.base.CompressionReport` with SAES-SVD's per-layer diagnostics as properties."""

    def _info(self, key: str) -> dict[str, Any]:
        return {l.name: l.info.get(key) for l in self.layers}

    @property
    def beta_per_layer(self) -> dict[str, float]:
        """The ``beta`` each layer was compressed with (ACES's choice or the fixed value)."""
        return self._info("beta")

    @property
    def rer_exact(self) -> dict[str, float]:
        """Exact retained energy ratio of ``G(beta)`` at the layer's rank (Eq. 14)."""
        return self._info("rer_exact")

    @property
    def rer_surrogate(self) -> dict[str, float | None]:
        """FS-FOA estimate ``1 - rho~(beta)`` of the RER (ACES only)."""
        return self._info("rer_surrogate")

    @property
    def seconds_aces(self) -> float:
        """Time spent choosing ``beta`` (ACES), summed over layers."""
        return float(sum(l.info.get("seconds_aces", 0.0) for l in self.layers))


@register_layer_method
class SAESMethod(LayerMethod):
    """SAES-SVD as a per-layer method of the shared pipeline (``compress(model, SAESSVDConfig(...), calib=...)``).

    ``paired = True``: the pipeline hands :class:`~rankwise.compress.base.PairedStats` (``H``, ``Delta``
    of the layer on the same tokens in the partially compressed and the FP model); ``feed =
    "compressed"``: a layer's statistics are collected after every layer feeding it was compressed.
    :meth:`info` returns the per-layer diagnostics of the last :meth:`fit` (chosen ``beta``, exact and
    surrogate RER, ridge, time of ACES).
    """

    name = "saes-svd"
    needs = ()
    feed = "compressed"
    paired = True
    needs_grad = False
    config_class = SAESConfig
    report_class = SAESReport

    def __init__(self, config: SAESConfig | None = None, **options: Any):
        cfg = SAESConfig.with_options(config, options, "SAES-SVD")
        self.config = cfg
        self._info: dict[str, Any] = {}

    def rank_for(self, m: int, n: int) -> int:
        return self.config.rank(m, n)

    def fit(self, name: str, layer: nn.Linear, rank: int, stats: Any = None,
            paired: PairedStats | None = None) -> LowRankFactors:
        """CEALC factors of ``layer`` at ``rank`` with ``beta`` fixed or chosen by ACES."""
        cfg = self.config
        if paired is None:
            raise ValueError(f"SAES-SVD needs paired statistics (H, Delta) for layer {name!r}; run it through "
                             "the compression pipeline, which collects them")
        if not isinstance(layer, nn.Linear):
            raise TypeError(f"layer {name!r} is a {type(layer).__name__}, SAES-SVD compresses nn.Linear layers")
        if paired.tokens <= 0:
            raise ValueError(f"layer {name!r}: no calibration token (empty calibration set)")
        t0 = time.perf_counter()
        W, H, Dl = _prep(layer.weight, paired.H, paired.Delta, name)
        _check_rank(rank, *W.shape, name)
        wh = cealc_whitening(H, ridge=cfg.ridge, retries=cfg.ridge_retries, whitener=cfg.whitener, name=name)
        S_l, D_l = _targets(W, H, Dl, wh)
        lo, hi = cfg.interval
        delta_zero = not bool(Dl.any())
        t1 = time.perf_counter()
        aces: AcesResult | None = None
        if cfg.beta == "aces":
            aces = _aces_from_targets(S_l, D_l, rank, lo, hi, cfg.beta_cap, cfg.shrink, cfg.aces_objective,
                                      cfg.refine, delta_zero=delta_zero)
            beta = aces.beta
        else:
            beta = float(cfg.beta)
        t2 = time.perf_counter()
        factors, sig = _factors_from_target(S_l + beta * D_l, wh, rank, name)
        s2 = sig.square()
        tot = float(s2.sum())
        info: dict[str, Any] = {
            "beta": beta, "alpha": beta / (1.0 - beta), "rer_exact": float(s2[:rank].sum()) / tot if tot > 0 else 1.0,
            "ridge_abs": wh.lam, "cholesky_attempts": wh.attempts, "delta_zero": delta_zero,
            "delta_rel": float(torch.linalg.matrix_norm(Dl) / torch.linalg.matrix_norm(H).clamp_min(1e-300)),
            "tokens": int(paired.tokens), "seconds_aces": t2 - t1, "seconds_total": 0.0,
        }
        if aces is not None:
            info.update(rer_surrogate=1.0 - aces.rho_surrogate if cfg.aces_objective == "ratio" else float("nan"),
                        aces_reason=aces.reason, aces_candidates=list(aces.candidates), aces_roots=list(aces.roots))
            if aces.coefficients is not None and cfg.aces_objective == "energy":
                c = aces.coefficients
                info["rer_surrogate"] = 1.0 - c.tail(beta) / c.total(beta) if c.total(beta) > 0 else 1.0
        if cfg.exact_rer:
            info["rer_exact_lo"] = _energy_ratio_gram(S_l + lo * D_l, rank)
            info["rer_exact_hi"] = _energy_ratio_gram(S_l + hi * D_l, rank)
            info["interval"] = [lo, hi]
        info["seconds_total"] = time.perf_counter() - t0
        self._info = info
        return factors

    def info(self) -> dict[str, Any]:
        return dict(self._info)


def saes_svd_compress(
    model: nn.Module,
    calib: Any,
    config: SAESConfig | None = None,
    *,
    target: Any = None,
    forward: Any = None,
    mask: Any = "auto",
    blocks: str | None = None,
    progress: bool = False,
) -> SAESReport:
    """Deprecated alias of ``compress(model, config, calib)`` (``config`` defaults to ``SAESSVDConfig()``).

    SAES-SVD runs block-sequentially (the closed loop: block by block and, inside a block, group by
    group, ``H`` and ``Delta`` collected on the same tokens from the partially compressed and the
    full-precision model). Returns an :class:`SAESReport` (``beta_per_layer``, ``rer_exact``,
    ``rer_surrogate``, ``seconds_aces``; also in ``extra["seconds_aces"]``).
    """
    warnings.warn("saes_svd_compress(model, calib, config) is deprecated; use "
                  "rankwise.compress.compress(model, SAESSVDConfig(...), calib=batches)", DeprecationWarning, stacklevel=2)
    cfg = config or SAESConfig()
    if not isinstance(cfg, SAESConfig):
        raise TypeError(f"config must be an SAESConfig, got {type(cfg).__name__}")
    report = compress(model, cfg, calib, target=target, mode="blocks", forward=forward, mask=mask, blocks=blocks,
                      progress=progress)
    report.extra["seconds_aces"] = report.seconds_aces
    return report
