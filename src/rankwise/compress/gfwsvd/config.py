"""GFWSVD's config (the spec's defaults)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch

from rankwise.compress.config import MethodConfig, check_dtype, check_patterns
from rankwise.compress.gfwsvd.decompose import gfwsvd_rank
from rankwise.core.validate import check_choice, check_int, check_number

Storage = Literal["tokens", "recompute"]
FactorKind = Literal["mff", "kfac"]

__all__ = ["GFWSVDConfig"]


# ----------------------------------------------------------------------------------------------
# configuration


@dataclass(frozen=True)
class GFWSVDConfig(MethodConfig):
    """GFWSVD settings (spec defaults).

    Attributes:
        param_ratio: fraction of each target layer's parameters KEPT, ``rho`` in ``(0, 1]``; the uniform
            rank is ``floor(rho m n / (m + n))`` (0.8 = the paper's "20% compression").
        power_iters: ``T``, MFF power iterations (10).
        tol: early stop when the relative change of ``P`` falls below it (1e-6).
        damping: relative floor ``lam = damping * mean(diag)`` for ``P`` and ``Q`` (1e-4), x10 per failed
            Cholesky, at most ``damping_retries`` (5) times.
        rank_multiple: ranks rounded down to a multiple of it (1 = no rounding; 8 = the official
            pipeline's hardware-friendly rounding), at least 1.
        approximation: ``"mff"`` (nearest Kronecker product, the method) or ``"kfac"`` (the K-FAC ablation
            ``P = E[x x^T]``, ``Q = E[delta delta^T]``).
        storage: ``"tokens"`` keeps each sample's ``(X_s, D_s)`` (one backward pass; memory
            ``O(tokens (m + n))`` per layer) or ``"recompute"`` re-runs the data for every half-step
            (``2 T + 1`` passes; memory ``O(m^2 + n^2)``; needs re-iterable calibration data).
        layers_per_pass: with ``"tokens"``, collect at most this many layers per backward pass (``None``
            = all at once) to bound memory.
        targets: module-name patterns to compress (``None`` = every ``nn.Linear`` the selector allows).
        compute_dtype: dtype of the MFF contractions (float64; float32 halves their time on CPU); the
            sums over chunks of samples and the factors are float64 either way.
    """

    param_ratio: float = 0.8
    power_iters: int = 10
    tol: float = 1e-6
    damping: float = 1e-4
    damping_retries: int = 5
    rank_multiple: int = 1
    approximation: FactorKind = "mff"
    storage: Storage = "tokens"
    layers_per_pass: int | None = None
    targets: tuple[str, ...] | None = None
    compute_dtype: torch.dtype = torch.float64

    def __post_init__(self) -> None:
        check_dtype("GFWSVDConfig.compute_dtype", self.compute_dtype)
        check_number("GFWSVDConfig.param_ratio", self.param_ratio, 0.0, 1.0, low_open=True)
        check_int("GFWSVDConfig.rank_multiple", self.rank_multiple, 1)
        check_int("GFWSVDConfig.power_iters", self.power_iters, 1)
        check_number("GFWSVDConfig.tol", self.tol, 0.0)
        check_number("GFWSVDConfig.damping", self.damping, 0.0)
        check_int("GFWSVDConfig.damping_retries", self.damping_retries, 0)
        check_choice("GFWSVDConfig.approximation", self.approximation, ("mff", "kfac"))
        check_choice("GFWSVDConfig.storage", self.storage, ("tokens", "recompute"))
        check_int("GFWSVDConfig.layers_per_pass", self.layers_per_pass, 1, allow_none=True)
        object.__setattr__(self, "targets", check_patterns("GFWSVDConfig.targets", self.targets))

    def rank(self, m: int, n: int) -> int:
        """The uniform rank of an ``m x n`` layer under this config."""
        return gfwsvd_rank(m, n, self.param_ratio, self.rank_multiple)

    def method_options(self) -> dict[str, Any]:
        """The fields that configure :class:`GFWSVDMethod` (everything but the targets)."""
        return {k: getattr(self, k) for k in self.__dataclass_fields__ if k != "targets"}

    def pipeline_settings(self) -> dict[str, Any]:
        """Uniform ranks, or the method's own rule (:func:`gfwsvd_rank`) when ranks are rounded to a multiple."""
        return dict(ratio=self.param_ratio, allocation="method" if self.rank_multiple > 1 else "uniform")
