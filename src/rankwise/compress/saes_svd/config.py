"""SAES-SVD's config: the paper's defaults (choices where it is silent are marked in the package docstring)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from rankwise.compress.config import MethodConfig, check_patterns
from rankwise.compress.saes_svd.cealc import (
    Objective,
    Whitener,
    _check_beta,
    _check_cap_shrink,
    beta_interval,
    saes_rank,
)
from rankwise.core.validate import check_bool, check_choice, check_int, check_number

__all__ = ["SAESConfig", "SAESSVDConfig"]


@dataclass(frozen=True)
class SAESConfig(MethodConfig):
    """SAES-SVD settings (the paper's defaults; choices marked in the module docstring).

    Attributes:
        compression_ratio: fraction of each target layer's parameters REMOVED, in ``[0, 1)`` (paper
            convention: 0.2 keeps 80%); rank ``floor((1 - ratio) m n / (m + n))``.
        beta: ``"aces"`` (per-layer adaptive, Alg. 3) or a fixed ``beta`` in ``[0, 1)`` (CEALC with
            ``alpha = beta / (1 - beta)``; ``0.0`` = SVD-LLM with sequential, compressed-upstream inputs).
        beta_bounds: ACES search interval (``(0.25, 0.75)``, Table 4), on ``beta`` or on ``alpha`` (``bounds_on``).
        beta_cap: guardrail cap ``< 1`` on every candidate (0.95). shrink: factor in ``(0, 1]`` (1.0).
        aces_objective: ``"ratio"`` (Eq. 17, recommended) or ``"energy"`` (tail only).
        refine: one refinement of the subspace at ``G(beta*)`` (App. A.3).
        targets: module-name patterns (``None`` = every ``nn.Linear`` the pipeline's selector allows).
        ridge: relative ridge of the whitening (``1e-6 * mean diag H``), x10 per failed Cholesky, at
            most ``ridge_retries`` (5) times. whitener: ``"cholesky"`` (paper) or ``"symmetric"``.
        exact_rer: also log the exact RER at ``beta*`` and at both interval ends (two extra
            ``svdvals`` per layer; the spec's check of the FS-FOA surrogate).
    """

    compression_ratio: float = 0.2
    beta: float | str = "aces"
    beta_bounds: tuple[float, float] = (0.25, 0.75)
    bounds_on: Literal["beta", "alpha"] = "beta"
    beta_cap: float = 0.95
    shrink: float = 1.0
    aces_objective: Objective = "ratio"
    refine: bool = False
    targets: tuple[str, ...] | None = None
    ridge: float = 1e-6
    ridge_retries: int = 5
    whitener: Whitener = "cholesky"
    exact_rer: bool = True

    def __post_init__(self) -> None:
        saes_rank(2, 2, self.compression_ratio)  # validates the ratio
        if isinstance(self.beta, str):
            if self.beta != "aces":
                raise ValueError(f"SAESConfig.beta must be 'aces' or a number in [0, 1), got {self.beta!r}")
        else:
            _check_beta(self.beta)
        object.__setattr__(self, "beta_bounds", tuple(self.beta_bounds))
        beta_interval(self.beta_bounds, self.bounds_on)
        _check_cap_shrink(self.beta_cap, self.shrink)
        check_choice("SAESConfig.aces_objective", self.aces_objective, ("ratio", "energy"))
        check_bool("SAESConfig.refine", self.refine)
        check_bool("SAESConfig.exact_rer", self.exact_rer)
        check_number("SAESConfig.ridge", self.ridge, 0.0)
        check_int("SAESConfig.ridge_retries", self.ridge_retries, 0)
        check_choice("SAESConfig.whitener", self.whitener, ("cholesky", "symmetric"))
        object.__setattr__(self, "targets", check_patterns("SAESConfig.targets", self.targets))

    @property
    def keep(self) -> float:
        """Fraction of parameters kept, ``1 - compression_ratio``."""
        return 1.0 - self.compression_ratio

    @property
    def interval(self) -> tuple[float, float]:
        """The ``beta`` interval ACES searches."""
        return beta_interval(self.beta_bounds, self.bounds_on)

    def rank(self, m: int, n: int) -> int:
        """The uniform rank of an ``m x n`` layer."""
        return saes_rank(m, n, self.compression_ratio)

    def method_options(self) -> dict[str, Any]:
        """The fields that configure :class:`SAESMethod` (everything but the ratio and the targets)."""
        d = {k: getattr(self, k) for k in self.__dataclass_fields__ if k not in ("compression_ratio", "targets")}
        d["beta_bounds"] = list(self.beta_bounds)
        return d

    def pipeline_settings(self) -> dict[str, Any]:
        """Kept fraction ``1 - compression_ratio``, uniform ranks."""
        return dict(ratio=self.keep, allocation="uniform")


#: The name that matches the other method configs (``SwiftSVDConfig``, ``GFWSVDConfig``); same class.
SAESSVDConfig = SAESConfig
