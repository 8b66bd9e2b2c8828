"""UB-SMoE's configuration: :class:`UBSMoEConfig`, a :class:`~rankwise.federated.config.FederatedConfig`
with the routing, pseudo-gradient and aggregation options of the paper (see the package docstring)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Mapping

from rankwise.core.validate import check_bool, check_choice, check_int, check_number, check_positive, check_unit
from rankwise.federated.common import finite_number
from rankwise.federated.config import FederatedConfig

__all__ = ["AGGREGATIONS", "DEFAULT_TIERS", "PG_SCALES", "UBSMoEConfig"]

PG_SCALES = ("sparsity", "inverse")
AGGREGATIONS = ("fedavg", "activation")
DEFAULT_TIERS = (0.25, 0.5, 0.75, 1.0)


@dataclass(frozen=True)
class UBSMoEConfig(FederatedConfig):
    """UB-SMoE hyper-parameters (an :class:`FederatedConfig` so that it runs on the shared federated server).

    Inherited fields keep their meaning (rank = the ONE common LoRA rank of every expert projection;
    ``client_ranks`` is ignored: compute heterogeneity is K_c, not rank). Defaults: r = 8, alpha = 16,
    AdamW lr 3e-4 without weight decay, H = 10 local steps, clients weighted by examples (p_c = n_c / sum n).

    Attributes:
        client_budget: ``{client id: beta_c in [0, 1]}``; ``K_c = floor(k_max * beta_c)`` must be >= 1.
        budget_tiers: betas cycled over client ids for clients missing from ``client_budget``
            (default: the four tiers 0.25, 0.5, 0.75, 1).
        k_max: K_max (None: the model's own top-k).
        candidate_factor: N_p = candidate_factor * K_max (K_max <= N_p <= M is checked against the model).
        dmr: Dynamic Modulated Routing on/off (off: phi is neither used nor updated).
        modulation_update: with dmr, the server moves phi toward the utilisation target phi~ (False: phi is
            only trained locally and averaged; SMoE-LLB uses this to give its balancing loss a routing
            parameter while the router stays frozen).
        dmr_momentum: zeta in [0, 1) of ``phi <- zeta phi_bar + (1 - zeta) phi~``.
        phi_range: (phi_min, phi_max) of the range regulariser; phi_reg: its lambda >= 0.
        eps: epsilon of ``phi~ = tanh(u* / (u~ + eps) - 1)``.
        pseudo_gradient: PG on/off; pg_scale: "sparsity" (rho = pg_coef (1 - K_c / M)) or "inverse"
            (rho = pg_coef K_max / K_c); pg_coef >= 0.
        aggregation: "fedavg" (p_c-weighted mean of every LoRA change) or "activation"
            (FLAME/A3SMoE: expert i of layer l weighted by p_c a_{c,i}).
        load_balance_coef: coefficient of a local Switch load-balancing loss (0: off; SMoE-LLB uses 0.01).
        output_rescale: A3SMoE's gates ``p_i 1[i in A] K_max / K_c`` instead of renormalised gates.
    """

    rank: int = 8
    alpha: float = 16.0
    local_steps: int = 10
    batch_size: int = 8
    client_lr: float = 3e-4
    weighting: str = "examples"
    client_budget: Mapping[int, float] = field(default_factory=dict)
    budget_tiers: tuple[float, ...] = DEFAULT_TIERS
    k_max: int | None = None
    candidate_factor: int = 2
    dmr: bool = True
    dmr_momentum: float = 0.9
    modulation_update: bool = True
    phi_range: tuple[float, float] = (-1.0, 1.0)
    phi_reg: float = 0.1
    eps: float = 1e-6
    pseudo_gradient: bool = True
    pg_scale: str = "sparsity"
    pg_coef: float = 1.0
    aggregation: str = "fedavg"
    load_balance_coef: float = 0.0
    output_rescale: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.client_budget, Mapping):
            raise ValueError(f"UBSMoEConfig.client_budget must be a mapping {{client id: beta}}, "
                             f"got {type(self.client_budget).__name__}")
        budget: dict[int, float] = {}
        for cid, b in self.client_budget.items():
            check_int(f"UBSMoEConfig.client_budget: client id {cid!r}", cid, 0)
            budget[cid] = check_unit(f"UBSMoEConfig.client_budget: client {cid}'s budget beta", b)
        object.__setattr__(self, "client_budget", budget)
        tiers = tuple(self.budget_tiers) if isinstance(self.budget_tiers, (tuple, list)) else ()
        if not tiers:
            raise ValueError(f"UBSMoEConfig.budget_tiers must be a non-empty tuple of betas in [0, 1], "
                             f"got {self.budget_tiers!r}")
        object.__setattr__(self, "budget_tiers", tuple(check_unit("UBSMoEConfig.budget_tiers entry", b) for b in tiers))
        check_int("UBSMoEConfig.k_max", self.k_max, 1, allow_none=True)
        if self.k_max is not None:
            for cid in sorted(budget):
                self.k_of(cid, self.k_max)
        check_int("UBSMoEConfig.candidate_factor (N_p = factor * K_max >= K_max)", self.candidate_factor, 1)
        for name in ("dmr", "modulation_update", "pseudo_gradient", "output_rescale"):
            check_bool(f"UBSMoEConfig.{name}", getattr(self, name))
        check_unit("UBSMoEConfig.dmr_momentum (zeta)", self.dmr_momentum, high_open=True)
        pr = self.phi_range
        if (not isinstance(pr, (tuple, list)) or len(pr) != 2 or not all(finite_number(v) for v in pr)
                or float(pr[0]) >= float(pr[1])):
            raise ValueError(f"UBSMoEConfig.phi_range must be (phi_min, phi_max) with phi_min < phi_max, got {pr!r}")
        object.__setattr__(self, "phi_range", (float(pr[0]), float(pr[1])))
        for name in ("phi_reg", "pg_coef", "load_balance_coef"):
            check_number(f"UBSMoEConfig.{name}", getattr(self, name), 0.0)
        check_positive("UBSMoEConfig.eps", self.eps)
        check_choice("UBSMoEConfig.pg_scale", self.pg_scale, PG_SCALES)
        check_choice("UBSMoEConfig.aggregation", self.aggregation, AGGREGATIONS)

    @classmethod
    def from_base(cls, base: FederatedConfig, **overrides: Any) -> "UBSMoEConfig":
        """A UBSMoEConfig carrying ``base``'s shared fields (rank, lrs, steps, sampling, seed) and UB-SMoE defaults."""
        if isinstance(base, UBSMoEConfig):
            return dataclasses.replace(base, **overrides) if overrides else base
        shared = {f.name: getattr(base, f.name) for f in dataclasses.fields(FederatedConfig)}
        return cls(**{**shared, **overrides})

    def budget_of(self, client: int) -> float:
        """beta_c: ``client_budget[client]``, else ``budget_tiers[client % len(budget_tiers)]``."""
        if client in self.client_budget:
            return self.client_budget[client]
        return self.budget_tiers[client % len(self.budget_tiers)]

    def k_of(self, client: int, k_max: int) -> int:
        """K_c = floor(k_max * beta_c); ValueError naming the client if it is below 1."""
        beta = self.budget_of(client)
        k = int(math.floor(k_max * beta + 1e-9))
        if k < 1:
            raise ValueError(f"client {client}: budget beta={beta} gives K_c = floor({k_max} * {beta}) = {k} "
                             f"active experts; it must be >= 1 (raise the budget or K_max)")
        return min(k, k_max)

    def check_model(self, num_experts: int, k_max: int, num_clients: int | None = None) -> None:
        """Check N_p against (K_max, M) and K_c >= 1 for every known client (raises ValueError)."""
        n_p = self.candidate_factor * k_max
        if not k_max <= n_p <= num_experts:
            raise ValueError(f"candidate set size N_p = candidate_factor {self.candidate_factor} x K_max {k_max} "
                             f"= {n_p} must lie in [K_max={k_max}, M={num_experts}]")
        if k_max > num_experts:
            raise ValueError(f"k_max {k_max} exceeds the number of experts M = {num_experts}")
        ids = set(self.client_budget) | set(range(num_clients or 0))
        for cid in sorted(ids):
            self.k_of(cid, k_max)

    def to_json(self) -> dict[str, Any]:
        d = super().to_json()
        d["client_budget"] = {str(k): v for k, v in self.client_budget.items()}
        d["budget_tiers"] = list(self.budget_tiers)
        d["phi_range"] = list(self.phi_range)
        return d
