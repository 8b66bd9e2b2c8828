"""GFWSVD as a per-layer method of the shared pipeline, and the deprecated ``gfwsvd_compress``."""

from __future__ import annotations

import time
import warnings
from dataclasses import replace
from typing import Any, Callable, Iterable, Mapping

import torch
from torch import nn

from rankwise.compress.api import compress
from rankwise.compress.base import CompressionReport, LayerMethod, PairedStats, register_layer_method
from rankwise.compress.gfwsvd.collect import collect_kronecker_fisher
from rankwise.compress.gfwsvd.config import GFWSVDConfig
from rankwise.compress.gfwsvd.decompose import kronecker_whiteners
from rankwise.compress.gfwsvd.fisher import KroneckerFactors, _where
from rankwise.core.linalg import LowRankFactors, check_finite, weighted_lowrank_factors
from rankwise.core.select import Selector
from rankwise.core.stats import CalibrationError, LayerStats
from rankwise.core.surgery import get_submodule

Tensor = torch.Tensor

__all__ = ["GFWSVDMethod", "gfwsvd_compress"]


@register_layer_method
class GFWSVDMethod(LayerMethod):
    """GFWSVD as a per-layer method of the shared pipeline (``compress(model, GFWSVDConfig(...), ...)``).

    The Kronecker factors are whole-model statistics (one backward of a task loss through every
    target), so they are collected once by :meth:`prepare` (or given: ``compress(...,
    prepared=factors)``, ``factors=``) before the layers are fitted; ``feed = "original"`` (gradients of
    the unmodified model).
    """

    name = "gfwsvd"
    needs = ()
    feed = "original"
    paired = False
    needs_grad = True
    config_class = GFWSVDConfig

    def __init__(self, config: GFWSVDConfig | None = None, factors: Mapping[str, KroneckerFactors] | None = None,
                 **overrides: Any):
        cfg = GFWSVDConfig.with_options(config, overrides, "GFWSVD")
        self.config = cfg
        self.factors: dict[str, KroneckerFactors] = dict(factors or {})
        self._info: dict[str, Any] = {}

    def rank_for(self, m: int, n: int) -> int:
        return self.config.rank(m, n)

    def load_prepared(self, state: Any) -> None:
        """Use precomputed ``{layer: KroneckerFactors}`` (from :func:`collect_kronecker_fisher` or :func:`load_factors`)."""
        if not _is_factor_map(state):
            raise TypeError("prepared= must map layer names to KroneckerFactors (from collect_kronecker_fisher or "
                            f"load_factors), got {type(state).__name__}")
        self.factors.update(state)

    def is_prepared(self, names: Iterable[str]) -> bool:
        return all(n in self.factors for n in names)

    def prepare(self, model: nn.Module, calib: Iterable[Any], *, target: Selector = None,
                loss_fn: Callable[[Any, Any], Tensor] | None = None,
                forward: Callable[[nn.Module, Any], Any] | None = None, mask: Any = "auto") -> None:
        """Collect the factors of the targets (skipping layers whose factors were given)."""
        if isinstance(target, (list, tuple)) and all(isinstance(t, str) for t in target):
            wanted = {t for t in target if t not in self.factors}
            if not wanted:
                return
            target = lambda n, m, _w=frozenset(wanted): n in _w  # noqa: E731  (exact names, no pattern matching)
        fac = collect_kronecker_fisher(model, calib, loss_fn, self.config, target=target, forward=forward, mask=mask)
        for k, v in fac.items():
            self.factors.setdefault(k, v)

    def fit(self, name: str, layer: nn.Linear, rank: int, stats: LayerStats | None = None,
            paired: PairedStats | None = None) -> LowRankFactors:
        if name not in self.factors:
            raise CalibrationError(f"GFWSVD has no Kronecker factors for layer {name!r}: collect them with "
                                   "collect_kronecker_fisher(...) / GFWSVDMethod.prepare(...) on a task loss first")
        if not isinstance(layer, nn.Linear):
            raise TypeError(f"layer {name!r} is a {type(layer).__name__}, GFWSVD compresses nn.Linear layers")
        kf = self.factors[name]
        t0 = time.perf_counter()
        W = layer.weight.detach().to(torch.float64)
        m, n = W.shape
        if kf.P.shape != (n, n) or kf.Q.shape != (m, m):
            raise ValueError(f"need P {n}x{n} and Q {m}x{m} for W {m}x{n}{_where(name)}, got P {tuple(kf.P.shape)}, "
                             f"Q {tuple(kf.Q.shape)}")
        check_finite(W, "weight W", name)
        # one pair of damped Cholesky factors serves the closed form (= gfwsvd_factors) and the predicted increase
        L_P, L_Q = kronecker_whiteners(kf.P.to(W), kf.Q.to(W), damping=self.config.damping,
                                       retries=self.config.damping_retries, name=name)
        f = weighted_lowrank_factors(W, rank, left=L_Q.mT, right=L_P, dtype=torch.float64, name=name)
        B, A = f.B.to(torch.float64), f.A.to(torch.float64)
        resid = L_Q.mT @ W @ L_P - (L_Q.mT @ A) @ (B @ L_P)  # L_Q^T (W - A B) L_P, in factored form
        self._info = {"predicted_loss_increase": 0.5 * float(resid.square().sum()),
                      "mff_iters": kf.iters, "mff_converged": kf.converged, "samples": kf.samples,
                      "factor_kind": kf.kind, "seconds": time.perf_counter() - t0}
        return f

    def info(self) -> dict[str, Any]:
        return dict(self._info)


def _is_factor_map(x: Any) -> bool:
    return isinstance(x, Mapping) and bool(x) and all(isinstance(v, KroneckerFactors) for v in x.values())


def gfwsvd_compress(
    model: nn.Module,
    factors_or_calib: Mapping[str, KroneckerFactors] | Iterable[Any],
    config: GFWSVDConfig | None = None,
    *,
    loss_fn: Callable[[Any, Any], Tensor] | None = None,
    target: Selector = None,
    forward: Callable[[nn.Module, Any], Any] | None = None,
    mask: Any = "auto",
    ranks: Mapping[str, int] | None = None,
    progress: bool = False,
) -> CompressionReport:
    """Deprecated alias of :func:`rankwise.compress.compress` with a :class:`GFWSVDConfig`.

    * ``gfwsvd_compress(model, factors, config)`` is ``compress(model, config, prepared=factors,
      target=<the layers named in factors>)`` (no calibration data, no error report):
      every layer named in ``factors`` is replaced (all or nothing); the same factors serve any ratio;
    * ``gfwsvd_compress(model, calib, config, loss_fn=...)`` is ``compress(model, config, calib,
      loss_fn=...)`` (the factors are collected by :meth:`GFWSVDMethod.prepare`).

    ``ranks`` overrides the rank of some layers (the others keep ``config.rank(m, n)``).
    """
    warnings.warn("gfwsvd_compress(model, factors_or_calib, config) is deprecated; use rankwise.compress.compress("
                  "model, GFWSVDConfig(...), calib=batches, loss_fn=...) or compress(model, GFWSVDConfig(...), "
                  "prepared=factors)", DeprecationWarning, stacklevel=2)
    cfg = config or GFWSVDConfig()
    if not isinstance(cfg, GFWSVDConfig):
        raise TypeError(f"config must be a GFWSVDConfig, got {type(cfg).__name__}")
    if isinstance(factors_or_calib, Mapping) and not factors_or_calib:
        raise ValueError("factors is empty: collect them with collect_kronecker_fisher(...) first")
    cc = cfg.to_compress_config()
    if not _is_factor_map(factors_or_calib):
        if ranks is not None:
            cc = replace(cc, allocation=dict(ranks))
        return compress(model, cc, factors_or_calib, target=target if target is not None else cfg.targets,
                        mode="whole", forward=forward, loss_fn=loss_fn, mask=mask, progress=progress)
    factors = factors_or_calib
    shapes = {}
    for name in factors:
        try:
            mod = get_submodule(model, name)
        except AttributeError:
            raise ValueError(f"factors name a layer {name!r} that the model does not have") from None
        if not isinstance(mod, nn.Linear):
            raise TypeError(f"{name!r} is a {type(mod).__name__}, not an nn.Linear")
        shapes[name] = tuple(mod.weight.shape)
    unknown = sorted(set(ranks or {}) - set(shapes))
    if unknown:
        raise ValueError(f"ranks given for layers without factors: {unknown[:5]}")
    alloc = {n: (ranks or {}).get(n, cfg.rank(m, k)) for n, (m, k) in shapes.items()}
    cc = replace(cc, allocation=alloc)
    return compress(model, cc, target=lambda n, m, _w=frozenset(shapes): n in _w, prepared=factors,
                    progress=progress)
