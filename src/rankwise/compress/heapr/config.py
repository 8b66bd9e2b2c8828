"""HEAPr's config (the spec's defaults)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from rankwise.core.validate import check_choice, check_int, check_unit

__all__ = ["HEAPrConfig", "SCOPES", "FISHERS", "SCORES"]

SCOPES = ("global", "layer")
FISHERS = ("expert", "per_token")
#: "heapr" is the method; the others are the atomic ablation scores of the spec's baselines
SCORES = ("heapr", "energy", "taylor", "random")


@dataclass(frozen=True)
class HEAPrConfig:
    """HEAPr settings.

    Attributes:
        prune_ratio: ``p``, the fraction of routed-expert atoms removed, in ``[0, 1)``; ``int(N (1 - p))``
            atoms are kept (over all MoE layers with ``scope="global"``, per layer with ``"layer"``).
        scope: ``"global"`` (the paper's default, HEAPr-G) or ``"layer"`` (HEAPr-L, the ablation).
        fisher: ``"expert"`` (Eq. 16: one output-space Fisher ``G_i`` per expert) or ``"per_token"``
            (the spec's option ``1/2 mean_t (a_tj g_t . u_j)^2``, same passes).
        score: ``"heapr"`` or an ablation score under the same ranking: ``"energy"`` (CAMERA-like
            ``mean_t a^2 ||u||^2``), ``"taylor"`` (first order ``|mean_t a g . u|``), ``"random"``.
        seed: seed of the ``"random"`` score.
    """

    prune_ratio: float = 0.25
    scope: Literal["global", "layer"] = "global"
    fisher: Literal["expert", "per_token"] = "expert"
    score: Literal["heapr", "energy", "taylor", "random"] = "heapr"
    seed: int = 0

    def __post_init__(self) -> None:
        check_unit("HEAPrConfig.prune_ratio", self.prune_ratio, high_open=True)
        check_choice("HEAPrConfig.scope", self.scope, SCOPES)
        check_choice("HEAPrConfig.fisher", self.fisher, FISHERS)
        check_choice("HEAPrConfig.score", self.score, SCORES)
        check_int("HEAPrConfig.seed", self.seed, 0)
