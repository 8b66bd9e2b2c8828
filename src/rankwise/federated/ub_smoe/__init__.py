"""UB-SMoE: universally balanced sparse MoE for resource-heterogeneous federated fine-tuning (arXiv 2605.16690).

Every client fine-tunes the same LoRA experts (one common rank r, one LoRA per expert projection) of a
frozen sparse MoE, but activates only ``K_c = floor(K_max * beta_c)`` experts per token, so its FFN
cost scales with its compute budget ``beta_c``. Two mechanisms keep every expert trained:

* **Dynamic Modulated Routing (DMR)**, per MoE layer and token ``x`` (spec "Method", steps 1-7):
  ``s = W_r x`` (M,); candidates ``T(x) = top-N_p(s)`` with ``N_p = candidate_factor * K_max``;
  modulated logits ``m_i = s_i + phi_i`` on ``T(x)``, ``m_i = s_i`` elsewhere; ``p = softmax(m)``;
  active set ``A_c(x) = top-K_c`` of ``p`` inside ``T(x)``; gates ``gamma_i = p_i / sum_{A} p_j``.
  The server turns each client's expert counts ``a_{c,i}`` and token count ``n_c`` into the global
  utilisation ``u~_i = sum_c p_c a_{c,i} / n_c`` (sums to ``K_bar``), a target
  ``phi~_i = tanh(u* / (u~_i + eps) - 1)`` with ``u* = K_bar / M``, and
  ``phi <- zeta * phi_bar + (1 - zeta) * phi~`` (``phi_bar``: weighted mean of the clients' locally
  trained phi). Clients add ``L_reg = lambda (||relu(phi_min - phi)||^2 + ||relu(phi - phi_max)||^2)``.
* **Universal Pseudo-Gradient (PG)**, client side after every backward: for every expert i,
  ``G_i <- G_i + rho_c * pi_i * sum_{j active in B} G_j`` with
  ``pi_i = (1/|B|) sum_x 1[i not in A_c(x)] p_i(x)`` and ``rho_c = pg_coef (1 - K_c / M)``
  (``pg_scale="inverse"``: ``pg_coef K_max / K_c``). The forward pass is untouched.

Baselines in this module, as registered federated methods on the same model, client and tiers:
``smoe-naive`` (plain Top-K_c, FedAvg), ``smoe-llb`` (plus a local Switch load-balancing loss),
``a3smoe`` (un-normalised gates rescaled by ``K_max / K_c`` and activation-aware aggregation). The
rank-heterogeneous LoRA baselines HetLoRA and FlexLoRA are in :mod:`rankwise.federated.baselines`;
FLoRIST (``florist``: SVD of the stacked client factors with an energy threshold) is here.

Choices that the spec marks as "not from the paper" are listed in docs/methods/ub_smoe.md.

API::

    from rankwise.federated.ub_smoe import UBSMoEConfig, SyntheticMoETask, convert_to_lora_moe
    from rankwise.federated.runner import build_strategy, run_federated
    task = SyntheticMoETask(num_clients=12)                  # or a task whose model holds LoRAMoE layers
    cfg = UBSMoEConfig(rank=4, client_budget={0: 0.25, 1: 0.5, 2: 1.0}, clients_per_round=4)
    strategy = build_strategy("ub-smoe", cfg, task)          # a flwr Strategy
    run_federated(strategy, make_ub_smoe_client_fn(task), task.num_clients, rounds=15)
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import re
import time
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Sequence

import numpy as np
import torch
from torch import nn

from rankwise.core.errors import SelectionError
from rankwise.core.registry import register
from rankwise.core.surgery import replace_module
from rankwise.federated.common import finite_number
from rankwise.federated.config import FSLoRAConfig
from rankwise.federated.strategy import ClientUpdate, LoRAStrategyLogic, flower_class
from rankwise.federated.tasks import TensorData, dirichlet_partition

__all__ = [
    "A3SMoELogic", "FLoRISTLogic", "LoRAMoE", "NaiveSMoELogic", "SMoELLBLogic", "SyntheticMoETask", "UBSMoEConfig",
    "UBSMoELogic",
    "apply_pseudo_gradient", "convert_to_lora_moe", "ffn_flops", "global_utilisation", "make_ub_smoe_client_fn",
    "modulated_routing", "moe_layers", "phi_regulariser", "pg_factor", "switch_aux_loss", "target_modulation",
    "ub_smoe_strategy", "update_phi", "utilisation_entropy",
]

log = logging.getLogger("rankwise.federated")
PG_SCALES = ("sparsity", "inverse")
AGGREGATIONS = ("fedavg", "activation")
DEFAULT_TIERS = (0.25, 0.5, 0.75, 1.0)
_EXPERT_RX = re.compile(r"^(?P<layer>.+)\.experts\.(?P<e>\d+)\.(?P<proj>[^.]+)$")


# ------------------------------------------------------------------------------------------------
# configuration
# ------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class UBSMoEConfig(FSLoRAConfig):
    """UB-SMoE hyper-parameters (an :class:`FSLoRAConfig` so that it runs on the shared federated server).

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
            if not isinstance(cid, int) or isinstance(cid, bool) or cid < 0:
                raise ValueError(f"UBSMoEConfig.client_budget: client id {cid!r} must be an int >= 0")
            if not finite_number(b) or not 0.0 <= float(b) <= 1.0:
                raise ValueError(f"UBSMoEConfig.client_budget: client {cid} has budget {b!r}; beta must be in [0, 1]")
            budget[cid] = float(b)
        object.__setattr__(self, "client_budget", budget)
        tiers = tuple(self.budget_tiers) if isinstance(self.budget_tiers, (tuple, list)) else None
        if not tiers or not all(finite_number(b) and 0.0 <= float(b) <= 1.0 for b in tiers):
            raise ValueError(f"UBSMoEConfig.budget_tiers must be a non-empty tuple of betas in [0, 1], "
                             f"got {self.budget_tiers!r}")
        object.__setattr__(self, "budget_tiers", tuple(float(b) for b in tiers))
        if self.k_max is not None and (not isinstance(self.k_max, int) or isinstance(self.k_max, bool)
                                       or self.k_max < 1):
            raise ValueError(f"UBSMoEConfig.k_max must be None or an int >= 1, got {self.k_max!r}")
        if self.k_max is not None:
            for cid in sorted(budget):
                self.k_of(cid, self.k_max)
        if not isinstance(self.candidate_factor, int) or isinstance(self.candidate_factor, bool) \
                or self.candidate_factor < 1:
            raise ValueError(f"UBSMoEConfig.candidate_factor must be an int >= 1 (N_p = factor * K_max >= K_max), "
                             f"got {self.candidate_factor!r}")
        for name in ("dmr", "modulation_update", "pseudo_gradient", "output_rescale"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"UBSMoEConfig.{name} must be a bool, got {getattr(self, name)!r}")
        if not finite_number(self.dmr_momentum) or not 0.0 <= float(self.dmr_momentum) < 1.0:
            raise ValueError(f"UBSMoEConfig.dmr_momentum (zeta) must be in [0, 1), got {self.dmr_momentum!r}")
        pr = self.phi_range
        if (not isinstance(pr, (tuple, list)) or len(pr) != 2 or not all(finite_number(v) for v in pr)
                or float(pr[0]) >= float(pr[1])):
            raise ValueError(f"UBSMoEConfig.phi_range must be (phi_min, phi_max) with phi_min < phi_max, got {pr!r}")
        object.__setattr__(self, "phi_range", (float(pr[0]), float(pr[1])))
        for name in ("phi_reg", "pg_coef", "load_balance_coef"):
            v = getattr(self, name)
            if not finite_number(v) or float(v) < 0:
                raise ValueError(f"UBSMoEConfig.{name} must be a finite number >= 0, got {v!r}")
        if not finite_number(self.eps) or float(self.eps) <= 0:
            raise ValueError(f"UBSMoEConfig.eps must be a finite number > 0, got {self.eps!r}")
        if self.pg_scale not in PG_SCALES:
            raise ValueError(f"UBSMoEConfig.pg_scale must be one of {PG_SCALES}, got {self.pg_scale!r}")
        if self.aggregation not in AGGREGATIONS:
            raise ValueError(f"UBSMoEConfig.aggregation must be one of {AGGREGATIONS}, got {self.aggregation!r}")

    @classmethod
    def from_base(cls, base: FSLoRAConfig, **overrides: Any) -> "UBSMoEConfig":
        """A UBSMoEConfig carrying ``base``'s shared fields (rank, lrs, steps, sampling, seed) and UB-SMoE defaults."""
        if isinstance(base, UBSMoEConfig):
            return dataclasses.replace(base, **overrides) if overrides else base
        shared = {f.name: getattr(base, f.name) for f in dataclasses.fields(FSLoRAConfig)}
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


# ------------------------------------------------------------------------------------------------
# pure math (spec "Method")
# ------------------------------------------------------------------------------------------------

def modulated_routing(scores: torch.Tensor, phi: torch.Tensor | None, k: int, n_p: int,
                      rescale_to: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """DMR routing of tokens (steps 1-3).

    Args:
        scores: raw router affinities ``s (T, M)``.
        phi: modulation ``(M,)`` added to the candidates' logits, or None (plain Top-K routing).
        k: K_c active experts per token; n_p: candidate set size N_p (``k <= n_p <= M``).
        rescale_to: None (gates renormalised over the active set, sum 1) or K_max (A3SMoE/FLAME:
            gates ``p_i K_max / K_c`` without renormalisation).
    Returns:
        ``gates (T, M)`` (zero outside the active set), ``active (T, M)`` bool, ``probs (T, M)`` = p.
    """
    t, m = scores.shape
    if not 1 <= k <= n_p <= m:
        raise ValueError(f"routing needs 1 <= K_c={k} <= N_p={n_p} <= M={m}")
    cand = torch.zeros_like(scores, dtype=torch.bool).scatter_(1, scores.topk(n_p, dim=1).indices, True)
    logits = scores if phi is None else scores + phi.to(scores.dtype) * cand
    probs = torch.softmax(logits, dim=-1)
    pick = probs.detach().masked_fill(~cand, -1.0).topk(k, dim=1).indices
    active = torch.zeros_like(cand).scatter_(1, pick, True)
    masked = probs * active
    if rescale_to is None:
        gates = masked / masked.sum(-1, keepdim=True).clamp_min(1e-30)
    else:
        gates = masked * (float(rescale_to) / k)
    return gates, active, probs


def global_utilisation(counts: torch.Tensor | np.ndarray, tokens: Sequence[float], weights: Sequence[float],
                       ks: Sequence[int]) -> tuple[torch.Tensor, float]:
    """``u~_i = sum_c p_c a_{c,i} / n_c`` over clients with ``n_c > 0`` (weights renormalised over them).

    ``counts (C, M)``, ``tokens (C,)``, ``weights (C,)`` = p_c, ``ks (C,)`` = K_c. Returns ``(u~ (M,) float64,
    K_bar)`` with ``K_bar = sum_c p_c K_c``; then ``sum_i u~_i = K_bar``. No client with tokens: zeros, 0.
    """
    a = torch.as_tensor(np.asarray(counts, dtype=np.float64))
    n = torch.as_tensor(np.asarray(tokens, dtype=np.float64))
    w = torch.as_tensor(np.asarray(weights, dtype=np.float64))
    keep = n > 0
    if not bool(keep.any()) or float(w[keep].sum()) <= 0:
        return torch.zeros(a.shape[1], dtype=torch.float64), 0.0
    p = w[keep] / w[keep].sum()
    u = (p[:, None] * a[keep] / n[keep][:, None]).sum(0)
    k_bar = float((p * torch.as_tensor([float(x) for x in ks], dtype=torch.float64)[keep]).sum())
    return u, k_bar


def target_modulation(u: torch.Tensor, k_bar: float, eps: float = 1e-6) -> torch.Tensor:
    """``phi~_i = tanh(u* / (u~_i + eps) - 1)``, ``u* = K_bar / M`` (step 6): 0 at balance, in (tanh(-1), 1).

    A non-finite ``u`` gives zeros with a warning (the round's modulation target is skipped).
    """
    u = u.double()
    if not bool(torch.isfinite(u).all()) or not math.isfinite(k_bar):
        log.warning("UB-SMoE: non-finite expert utilisation; the modulation target is reset to 0 this round")
        return torch.zeros_like(u)
    u_star = k_bar / u.shape[-1]
    return torch.tanh(u_star / (u.clamp_min(0) + eps) - 1.0)


def update_phi(phi_bar: torch.Tensor, phi_target: torch.Tensor, momentum: float) -> torch.Tensor:
    """``phi <- zeta phi_bar + (1 - zeta) phi~`` (step 6, momentum smoothing)."""
    return momentum * phi_bar.double() + (1.0 - momentum) * phi_target.double()


def phi_regulariser(phi: torch.Tensor, lo: float, hi: float, lam: float) -> torch.Tensor:
    """``L_reg = lam (||relu(lo - phi)||^2 + ||relu(phi - hi)||^2)`` (step 7); 0 inside [lo, hi]."""
    return lam * (torch.relu(lo - phi).pow(2).sum() + torch.relu(phi - hi).pow(2).sum())


def pg_factor(k: int, num_experts: int, k_max: int, scale: str = "sparsity", coef: float = 1.0) -> float:
    """rho_c: ``coef (1 - K_c / M)`` ("sparsity") or ``coef K_max / K_c`` ("inverse"); grows as K_c shrinks."""
    if scale == "sparsity":
        return float(coef) * (1.0 - k / num_experts)
    if scale == "inverse":
        return float(coef) * k_max / k
    raise ValueError(f"pg_scale must be one of {PG_SCALES}, got {scale!r}")


@torch.no_grad()
def apply_pseudo_gradient(expert_grads: Sequence[Sequence[torch.Tensor | None]], pi: torch.Tensor,
                          used: torch.Tensor, rho: float) -> None:
    """In place: ``G_i += rho pi_i sum_{j used} G_j`` for every expert i (the universal pseudo-gradient).

    ``expert_grads[i]``: expert i's LoRA gradient tensors (``.grad`` of its factors, same shapes for
    all experts; None = zero); ``pi (M,)``: batch mean of ``1[i inactive] p_i(x)``; ``used (M,)`` bool:
    experts activated by at least one token of the batch. Missing gradients are created.
    """
    m = len(expert_grads)
    if pi.shape != (m,) or used.shape != (m,):
        raise ValueError(f"pi and used must have shape ({m},), got {tuple(pi.shape)}, {tuple(used.shape)}")
    if rho == 0 or not bool(used.any()):
        return
    n = len(expert_grads[0])
    total = []
    for t in range(n):
        ref = next((g[t] for g in expert_grads if g[t] is not None), None)
        if ref is None:
            total.append(None)
            continue
        s = torch.zeros_like(ref, dtype=torch.float64)
        for j in range(m):
            if bool(used[j]) and expert_grads[j][t] is not None:
                s += expert_grads[j][t].double()
        total.append(s)
    for i in range(m):
        c = rho * float(pi[i])
        if c == 0:
            continue
        for t in range(n):
            if total[t] is not None:
                expert_grads[i][t].add_((c * total[t]).to(expert_grads[i][t].dtype))


def switch_aux_loss(active: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    """Switch load-balancing loss ``M sum_i f_i P_i`` (f_i: fraction of routed assignments, P_i: mean prob)."""
    m = probs.shape[-1]
    f = active.float().sum(0) / active.float().sum().clamp_min(1.0)
    return m * (f * probs.mean(0)).sum()


def utilisation_entropy(u: torch.Tensor) -> float:
    """``H(u / sum u) / log M`` in [0, 1] (1 = perfectly balanced experts)."""
    u = u.double().clamp_min(0)
    if float(u.sum()) <= 0:
        return 0.0
    q = u / u.sum()
    h = -(q[q > 0] * q[q > 0].log()).sum()
    return float(h / math.log(u.shape[0]))


def ffn_flops(hidden: int, ffn: int, num_experts: int, k: int, rank: int = 0, projections: int = 3) -> int:
    """Multiply-adds x 2 per token of one MoE FFN at K active experts: router + K SwiGLU experts (+ LoRA)."""
    expert = projections * hidden * ffn + projections * rank * (hidden + ffn)
    return 2 * (hidden * num_experts + k * expert)


# ------------------------------------------------------------------------------------------------
# the LoRA-MoE layer and surgery
# ------------------------------------------------------------------------------------------------

_ACTS = {"silu": nn.functional.silu, "gelu": nn.functional.gelu, "relu": nn.functional.relu}


class _Expert(nn.Module):
    """A SwiGLU expert ``w2(act(w1 x) * w3 x)``: w1, w3 ``(ffn, hidden)``, w2 ``(hidden, ffn)`` Linears."""

    def __init__(self, hidden: int, ffn: int, act: str) -> None:
        super().__init__()
        self.w1 = nn.Linear(hidden, ffn, bias=False)
        self.w3 = nn.Linear(hidden, ffn, bias=False)
        self.w2 = nn.Linear(ffn, hidden, bias=False)
        self.act = act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(_ACTS[self.act](self.w1(x)) * self.w3(x))


class LoRAMoE(nn.Module):
    """A sparse MoE FFN with per-expert Linears (LoRA-able), DMR routing and routing statistics.

    ``x (..., hidden) -> (..., hidden)``. Modules: ``router`` (Linear hidden -> M, no bias),
    ``experts.<i>.w1|w3|w2``; parameter ``phi (M,)`` (the DMR modulation). Routing state set by the
    client: ``k`` (K_c), ``k_max``, ``n_p``, ``dmr`` (use phi), ``rescale`` (A3SMoE gates).
    While ``record`` is on, ``counts (M,)`` / ``tokens`` accumulate (float64) and each forward leaves
    ``last`` = dict(pi (M,), used (M,), aux) for the pseudo-gradient and the load-balancing loss.
    """

    def __init__(self, hidden: int, ffn: int, num_experts: int, top_k: int, act: str = "silu",
                 candidate_factor: int = 2, router_bias: bool = False) -> None:
        super().__init__()
        if act not in _ACTS:
            raise ValueError(f"act must be one of {sorted(_ACTS)}, got {act!r}")
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k must be in [1, num_experts={num_experts}], got {top_k}")
        self.hidden, self.ffn, self.num_experts = hidden, ffn, num_experts
        self.router = nn.Linear(hidden, num_experts, bias=router_bias)
        self.experts = nn.ModuleList(_Expert(hidden, ffn, act) for _ in range(num_experts))
        self.phi = nn.Parameter(torch.zeros(num_experts))
        self.k_max = self.k = top_k
        self.n_p = min(num_experts, candidate_factor * top_k)
        self.dmr = True
        self.rescale = False
        self.record = False
        self.counts = torch.zeros(num_experts, dtype=torch.float64)
        self.tokens = 0.0
        self.last: dict[str, Any] = {}

    def configure(self, *, k: int | None = None, n_p: int | None = None, dmr: bool | None = None,
                  rescale: bool | None = None, record: bool | None = None) -> None:
        k = self.k if k is None else int(k)
        n_p = self.n_p if n_p is None else int(n_p)
        if not 1 <= k <= self.k_max or not k <= n_p <= self.num_experts:
            raise ValueError(f"need 1 <= K_c={k} <= K_max={self.k_max} and K_c <= N_p={n_p} <= M={self.num_experts}")
        self.k, self.n_p = k, n_p
        if dmr is not None:
            self.dmr = bool(dmr)
        if rescale is not None:
            self.rescale = bool(rescale)
        if record is not None:
            self.record = bool(record)

    def reset_stats(self) -> None:
        self.counts = torch.zeros(self.num_experts, dtype=torch.float64)
        self.tokens = 0.0
        self.last = {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        h = x.reshape(-1, self.hidden)
        scores = self.router(h).float()
        gates, active, probs = modulated_routing(scores, self.phi if self.dmr else None, self.k, self.n_p,
                                                 rescale_to=self.k_max if self.rescale else None)
        out = torch.zeros_like(h)
        used = active.any(0)
        for i in used.nonzero().flatten().tolist():
            idx = active[:, i].nonzero().flatten()
            y = self.experts[i](h[idx]) * gates[idx, i, None].to(h.dtype)
            out = out.index_add(0, idx, y)
        if self.record:
            with torch.no_grad():
                self.counts += active.sum(0).double()
                self.tokens += float(h.shape[0])
            self.last = {"pi": ((~active) * probs.detach()).double().mean(0), "used": used,
                         "aux": switch_aux_loss(active, probs)}
        return out.reshape(shape)


def moe_layers(model: nn.Module) -> list[tuple[str, LoRAMoE]]:
    """The model's :class:`LoRAMoE` layers, in model order; SelectionError "no MoE layer found" if none."""
    found = [(n, m) for n, m in model.named_modules() if isinstance(m, LoRAMoE)]
    if not found:
        raise SelectionError("no MoE layer found: the model has no LoRAMoE layer (convert a Mixtral-style model "
                             "with convert_to_lora_moe first)")
    return found


def convert_to_lora_moe(model: nn.Module, *, candidate_factor: int = 2) -> nn.Module:
    """Replace every Mixtral-style sparse MoE block (``gate.weight (M, H)``; fused ``experts.gate_up_proj
    (M, 2I, H)`` and ``experts.down_proj (M, H, I)``, transformers 5) by an equivalent :class:`LoRAMoE` in place.

    The converted layer routes exactly as Mixtral (softmax, Top-K, renormalised gates) while phi = 0 and
    K_c = K_max; per-expert Linears ``experts.<i>.w1|w3|w2`` are then LoRA targets. Raises
    SelectionError "no MoE layer found" when the model has none, ValueError on shapes that disagree.
    """
    plan = []
    for name, mod in model.named_modules():
        gate, experts = getattr(mod, "gate", None), getattr(mod, "experts", None)
        if gate is None or experts is None or not hasattr(experts, "gate_up_proj"):
            continue
        if hasattr(mod, "shared_expert"):
            raise ValueError(f"{name}: MoE blocks with a shared expert (Qwen2-MoE) are not supported")
        w_r = gate.weight.detach()
        gu, down = experts.gate_up_proj.detach(), experts.down_proj.detach()
        m, hdim = w_r.shape
        if gu.shape[0] != m or gu.shape[2] != hdim or gu.shape[1] % 2 or down.shape != (m, hdim, gu.shape[1] // 2):
            raise ValueError(f"{name}: router {tuple(w_r.shape)} and experts gate_up {tuple(gu.shape)} / down "
                             f"{tuple(down.shape)} do not agree")
        top_k = int(getattr(gate, "top_k", getattr(mod, "top_k", 2)))
        plan.append((name, m, hdim, gu.shape[1] // 2, top_k, w_r, gu, down, mod.training))
    if not plan:
        raise SelectionError("no MoE layer found: no module with a router 'gate' and fused 'experts' "
                             "(gate_up_proj, down_proj) in this model")
    act = "silu"
    cfg = getattr(model, "config", None)
    if cfg is not None and getattr(cfg, "hidden_act", "silu") in _ACTS:
        act = cfg.hidden_act
    for name, m, hdim, ffn, top_k, w_r, gu, down, training in plan:
        layer = LoRAMoE(hdim, ffn, m, top_k, act=act, candidate_factor=candidate_factor)
        with torch.no_grad():
            layer.router.weight.copy_(w_r)
            for i, e in enumerate(layer.experts):
                e.w1.weight.copy_(gu[i, :ffn])
                e.w3.weight.copy_(gu[i, ffn:])
                e.w2.weight.copy_(down[i])
        layer.to(w_r.dtype)
        layer.phi.data = layer.phi.data.float()
        layer.train(training)
        replace_module(model, name, layer)
    return model


def _natural(name: str) -> list[Any]:
    """Sort key that orders ``layers.2`` before ``layers.10``."""
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]


def _expert_structure(modules: Iterable[str]) -> dict[str, dict[int, list[str]]]:
    """``{layer: {expert: [lora module names]}}`` parsed from ``<layer>.experts.<i>.<proj>`` names."""
    out: dict[str, dict[int, list[str]]] = {}
    for mname in modules:
        hit = _EXPERT_RX.match(mname)
        if hit:
            out.setdefault(hit["layer"], {}).setdefault(int(hit["e"]), []).append(mname)
    return out


# ------------------------------------------------------------------------------------------------
# server
# ------------------------------------------------------------------------------------------------

class UBSMoELogic(LoRAStrategyLogic):
    """UB-SMoE's server: all LoRA experts to every client with its K_c and the global phi; FedAvg of the
    changes; DMR update of phi from the clients' expert counts.

    The global phi of layer ``l`` is the head tensor ``head:<l>.phi`` (so it is sent, averaged into
    phi_bar and checkpointed with the rest). ``config`` may be a plain :class:`FSLoRAConfig` (the CLI);
    it is then read as ``UBSMoEConfig.from_base(config)``. M is parsed from the adapter's module names
    ``<layer>.experts.<i>.<proj>``; ``k_max`` (argument, else ``config.k_max``) may stay None: each client
    then sends the budget beta_c and derives ``K_c = floor(K_max beta_c)`` from its model's top-k.
    """

    method = "ub-smoe"
    supports_server_optimizer = False
    variant: dict[str, Any] = {}

    def __init__(self, config: FSLoRAConfig, init_adapter: Any, *, k_max: int | None = None, **kwargs: Any) -> None:
        super().__init__(config, init_adapter, **kwargs)
        self.ub = UBSMoEConfig.from_base(config, **self.variant)
        struct = _expert_structure(self.modules)
        if not struct:
            raise SelectionError("no MoE layer found: the adapter has no '<layer>.experts.<i>.<proj>' module "
                                 f"(modules: {self.modules[:6]})")
        self.layers = sorted(struct, key=_natural)
        sizes = {len(v) for v in struct.values()}
        if len(sizes) != 1:
            raise ValueError(f"MoE layers have different numbers of LoRA experts: {sorted(sizes)}")
        self.num_experts = sizes.pop()
        self.expert_modules = {l: [struct[l][i] for i in range(self.num_experts)] for l in self.layers}
        for l in self.layers:
            name = f"head:{l}.phi"
            if name not in self.tensors:
                self.tensors[name] = torch.zeros(self.num_experts)
            if tuple(self.tensors[name].shape) != (self.num_experts,):
                raise ValueError(f"{name} has shape {tuple(self.tensors[name].shape)}, expected ({self.num_experts},)")
        self.k_max = k_max if k_max is not None else self.ub.k_max
        if self.k_max is not None:  # otherwise each client checks K_c against its model's top-k
            self.ub.check_model(self.num_experts, int(self.k_max), self.num_clients)
        self._round_extra: tuple[int, dict[str, Any]] | None = None

    def k_of(self, pid: int) -> int | None:
        """K_c of client ``pid`` when K_max is known on the server (else None: the client derives it)."""
        return None if self.k_max is None else self.ub.k_of(pid, int(self.k_max))

    def client_payload(self, rnd: int, pid: int) -> tuple[list[np.ndarray], list, dict[str, float]]:
        names = list(self.tensors)
        return ([self.tensors[n].numpy().astype(np.float32, copy=True) for n in names],
                [(n, tuple(self.tensors[n].shape)) for n in names],
                {m: self.scaling for m in self.modules})

    def fit_config_extra(self, rnd: int, pid: int) -> dict[str, Any]:
        ub = self.ub
        spec = {"client": pid, "beta": ub.budget_of(pid), "k_max": self.k_max, "candidate_factor": ub.candidate_factor,
                "dmr": ub.dmr, "pg": ub.pseudo_gradient, "pg_scale": ub.pg_scale, "pg_coef": ub.pg_coef,
                "phi_range": list(ub.phi_range), "phi_reg": ub.phi_reg, "lb": ub.load_balance_coef,
                "rescale": ub.output_rescale, "layers": self.layers}
        return {"ub-smoe": json.dumps(spec)}

    def read_stats(self, u: ClientUpdate) -> tuple[np.ndarray, np.ndarray, int] | None:
        """The client's ``(counts (L, M), tokens (L,), K_c)`` from its metrics, or None (malformed: logged, skipped)."""
        try:
            d = json.loads(u.metrics["moe-stats"])
            k = u.metrics["k"]
            if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= self.num_experts:
                raise ValueError(f"K_c {k!r} is not an int in [1, {self.num_experts}]")
            expected = self.k_of(u.pid)
            if expected is not None and k != expected:
                raise ValueError(f"K_c {k} differs from the server's {expected}")
            counts = np.asarray(d["counts"], dtype=np.float64)
            tokens = np.asarray(d["tokens"], dtype=np.float64)
            if d["layers"] != self.layers or counts.shape != (len(self.layers), self.num_experts) \
                    or tokens.shape != (len(self.layers),):
                raise ValueError(f"shapes {counts.shape}, {tokens.shape} for {len(self.layers)} layers x "
                                 f"{self.num_experts} experts")
            finite = np.isfinite(counts).all() and np.isfinite(tokens).all()
            if not finite or (counts < 0).any() or (tokens < 0).any():
                raise ValueError("counts/tokens must be finite and >= 0")
        except (KeyError, TypeError, ValueError) as e:
            log.warning("UB-SMoE: client %d sent malformed routing statistics (%s); left out of the utilisation",
                        u.pid, e)
            return None
        return counts, tokens, int(k)

    def aggregate(self, rnd: int, updates: list[ClientUpdate]) -> None:
        w = self.weights(updates)
        stats = [self.read_stats(u) for u in updates]
        deltas: dict[str, torch.Tensor] = {}
        for n in self.tensors:
            if n.startswith("head:"):
                continue
            cur = self.tensors[n].double()
            deltas[n] = sum((wi * (u.tensors[n].double() - cur) for u, wi in zip(updates, w)),
                            torch.zeros_like(cur))
        if self.ub.aggregation == "activation":
            for li, l in enumerate(self.layers):
                for i, mods in enumerate(self.expert_modules[l]):
                    raw = [wi * (0.0 if s is None else float(s[0][li, i])) for wi, s in zip(w, stats)]
                    tot = sum(raw)
                    for mod in mods:
                        for kind in ("lora_A", "lora_B"):
                            n = f"{mod}.{kind}"
                            cur = self.tensors[n].double()
                            deltas[n] = (sum(((r / tot) * (u.tensors[n].double() - cur)
                                              for u, r in zip(updates, raw)), torch.zeros_like(cur))
                                         if tot > 0 else torch.zeros_like(cur))
        for n, d in deltas.items():
            self.tensors[n].add_(d.float())
        for n, d in self._head_average(updates, w).items():
            self.tensors[n].add_(d)
        row: dict[str, Any] = {"k_per_client": {str(u.pid): s[2] for u, s in zip(updates, stats) if s is not None}}
        ents, phis = [], []
        ok = [(s, wi, s[2]) for s, wi in zip(stats, w) if s is not None]
        for li, l in enumerate(self.layers):
            if ok:
                util, k_bar = global_utilisation(np.stack([s[0][li] for s, _, _ in ok]), [s[1][li] for s, _, _ in ok],
                                                 [wi for _, wi, _ in ok], [k for _, _, k in ok])
                ents.append(utilisation_entropy(util) if k_bar > 0 else float("nan"))
                if self.ub.dmr and self.ub.modulation_update and k_bar > 0:
                    target = target_modulation(util, k_bar, self.ub.eps)
                    name = f"head:{l}.phi"
                    self.tensors[name].copy_(update_phi(self.tensors[name], target, self.ub.dmr_momentum).float())
            phis.append(float(self.tensors[f"head:{l}.phi"].abs().mean()))
        row["utilisation_entropy"] = float(np.nanmean(ents)) if ents and not all(math.isnan(e) for e in ents) \
            else float("nan")
        row["phi_abs_mean"] = float(np.mean(phis))
        row["stats_bytes_per_client"] = 4 * len(self.layers) * (self.num_experts + 1)
        self._round_extra = (rnd, row)

    def aggregate_fit(self, server_round: int, results: list, failures: list) -> Any:
        self._round_extra = None
        out = super().aggregate_fit(server_round, results, failures)
        if self._round_extra is not None:
            rnd, extra = self._round_extra
            for h in self.history:
                if h["round"] == rnd:
                    h.update(extra)
            self.save_checkpoint()
        return out


class NaiveSMoELogic(UBSMoELogic):
    """Naive SMoE-FL: plain Top-K_c routing, FedAvg; no phi, no pseudo-gradient."""

    method = "smoe-naive"
    variant = {"dmr": False, "pseudo_gradient": False}


class SMoELLBLogic(UBSMoELogic):
    """SMoE-LLB: heterogeneous-K SMoE with a local Switch load-balancing loss (coefficient 0.01) on every client.

    With a frozen router the loss needs a trainable routing parameter: the per-expert bias phi on the
    candidates (trained locally by the loss, averaged by FedAvg; no server target, no L_reg, no PG).
    """

    method = "smoe-llb"
    variant = {"dmr": True, "modulation_update": False, "phi_reg": 0.0, "pseudo_gradient": False,
               "load_balance_coef": 0.01}


class A3SMoELogic(UBSMoELogic):
    """A3SMoE (the spec's interpretation): naive SMoE-FL + FLAME-style output rescaling + activation-aware
    aggregation."""

    method = "a3smoe"
    variant = {"dmr": False, "pseudo_gradient": False, "output_rescale": True, "aggregation": "activation"}


class FLoRISTLogic(LoRAStrategyLogic):
    """FLoRIST (rank-heterogeneous LoRA baseline of the spec): SVD of the stacked client factors, energy threshold.

    Client i trains the first k_i components of the global adapter (as HetLoRA). The server stacks
    ``B_s = [w_1 B_1, ..., w_n B_n]`` (out, sum k) and ``A_s = [A_1; ...; A_n]`` (sum k, in), so that
    ``B_s A_s = sum_i w_i B_i A_i`` without forming it; thin QRs of ``B_s`` and ``A_s^T`` and an SVD of
    the small core give the singular values, and the global adapter keeps the fewest components whose
    energy ``sum s_j^2`` reaches ``energy`` of the total (at most r): ``B = Q_B U_j sqrt(S_j)``,
    ``A = sqrt(S_j) V_j^T Q_A^T``, zero beyond j. The kept rank of each module is in :attr:`kept_ranks`.
    """

    method = "florist"
    supports_server_optimizer = False

    def __init__(self, *args: Any, energy: float = 0.95, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if not finite_number(energy) or not 0.0 < float(energy) <= 1.0:
            raise ValueError(f"FLoRIST energy threshold must be in (0, 1], got {energy!r}")
        self.energy = float(energy)
        self.kept_ranks: dict[str, int] = {}

    def client_payload(self, rnd: int, pid: int) -> tuple[list[np.ndarray], list, dict[str, float]]:
        k = self.config.rank_of(pid)
        arrays, layout = [], []
        for m in self.modules:
            a, b = self.tensors[f"{m}.lora_A"][:k].clone(), self.tensors[f"{m}.lora_B"][:, :k].clone()
            arrays += [a.numpy().astype(np.float32), b.numpy().astype(np.float32)]
            layout += [(f"{m}.lora_A", tuple(a.shape)), (f"{m}.lora_B", tuple(b.shape))]
        h_arrays, h_layout = self._head_payload()
        return arrays + h_arrays, layout + h_layout, {m: self.scaling for m in self.modules}

    def aggregate(self, rnd: int, updates: list[ClientUpdate]) -> None:
        w = self.weights(updates)
        r = self.config.rank
        for m in self.modules:
            A, B = self.tensors[f"{m}.lora_A"], self.tensors[f"{m}.lora_B"]
            bs = torch.cat([wi * u.tensors[f"{m}.lora_B"].double() for u, wi in zip(updates, w)], dim=1)
            As = torch.cat([u.tensors[f"{m}.lora_A"].double() for u in updates], dim=0)
            qb, rb = torch.linalg.qr(bs)
            qa, ra = torch.linalg.qr(As.T)
            u_, s_, vh = torch.linalg.svd(rb @ ra.T, full_matrices=False)
            e = s_.pow(2)
            total = float(e.sum())
            if total <= 0:
                j = 0
            else:
                frac = torch.cumsum(e, 0) / total
                j = min(r, int((frac < self.energy - 1e-12).sum()) + 1)
            root = s_[:j].clamp_min(0).sqrt()
            A.zero_()
            B.zero_()
            A[:j] = ((root[:, None] * vh[:j]) @ qa.T).float()
            B[:, :j] = (qb @ (u_[:, :j] * root[None, :])).float()
            self.kept_ranks[m] = j
        for n, d in self._head_average(updates, w).items():
            self.tensors[n].add_(d)


_LOGICS = {"UBSMoEStrategy": UBSMoELogic, "NaiveSMoEStrategy": NaiveSMoELogic, "SMoELLBStrategy": SMoELLBLogic,
           "A3SMoEStrategy": A3SMoELogic, "FLoRISTStrategy": FLoRISTLogic}


def __getattr__(name: str) -> Any:
    if name in _LOGICS:
        return flower_class(_LOGICS[name], name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def ub_smoe_strategy(config: UBSMoEConfig, init_adapter: Any, **kwargs: Any) -> Any:
    """``UBSMoEStrategy(config, init_adapter, **kwargs)``: the registry's entry point (a Flower Strategy)."""
    return flower_class(UBSMoELogic, "UBSMoEStrategy")(config, init_adapter, **kwargs)


# ------------------------------------------------------------------------------------------------
# client
# ------------------------------------------------------------------------------------------------

def task_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Cross-entropy for classification (labels (B,)) or token prediction (labels (B, T), -100 ignored)."""
    if labels.ndim == 1:
        return nn.functional.cross_entropy(logits, labels)
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100)


def _expert_grads(layer: LoRAMoE) -> list[list[torch.Tensor | None]]:
    out = []
    for e in layer.experts:
        gs = []
        for proj in ("w1", "w3", "w2"):
            lin = getattr(e, proj)
            for kind in ("lora_A", "lora_B"):
                d = getattr(lin, kind, None)
                if d is None or "default" not in d:
                    continue
                p = d["default"].weight
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                gs.append(p.grad)
        out.append(gs)
    return out


def client_routing(spec: Mapping[str, Any], layer: LoRAMoE) -> tuple[int, int, float]:
    """``(K_c, N_p, rho_c)`` of a client from the server's spec and its model's MoE layer (ValueError if invalid)."""
    k_max = layer.k_max if spec.get("k_max") is None else int(spec["k_max"])
    if not 1 <= k_max <= layer.k_max:
        raise ValueError(f"server K_max {k_max} exceeds the model's top-k {layer.k_max}")
    beta = float(spec["beta"])
    k = int(math.floor(k_max * beta + 1e-9))
    if not 1 <= k <= k_max:
        raise ValueError(f"client {spec.get('client')}: budget beta={beta} gives K_c = floor({k_max} * {beta}) = {k}; "
                         f"it must be in [1, {k_max}]")
    n_p = int(spec["candidate_factor"]) * k_max
    if not k_max <= n_p <= layer.num_experts:
        raise ValueError(f"candidate set size N_p = {n_p} must lie in [K_max={k_max}, M={layer.num_experts}]")
    rho = pg_factor(k, layer.num_experts, k_max, str(spec.get("pg_scale", "sparsity")), float(spec.get("pg_coef", 1.0)))
    return k, n_p, rho


def local_train_moe(model: nn.Module, data: TensorData, spec: Mapping[str, Any], *, steps: int, batch_size: int,
                    lr: float, head_lr: float | None = None, weight_decay: float = 0.0,
                    seed: int = 0) -> tuple[float, dict[str, Any]]:
    """H AdamW steps of ``task loss + L_reg (+ lb * Switch aux)`` with K_c routing, DMR and PG (spec ``spec``).

    Returns the mean task loss and the routing statistics ``{"layers", "counts" (L, M), "tokens" (L,)}``.
    """
    found = dict(moe_layers(model))
    names = list(spec.get("layers") or found)
    if sorted(names) != sorted(found):
        raise ValueError(f"server names MoE layers {names}, the model has {list(found)}")
    layers = [(n, found[n]) for n in names]  # statistics in the server's order
    routing = [client_routing(spec, layer) for _, layer in layers]
    for (_, layer), (k, n_p, _) in zip(layers, routing):
        layer.configure(k=k, n_p=n_p, dmr=bool(spec["dmr"]), rescale=bool(spec["rescale"]), record=True)
        layer.reset_stats()
    lo, hi = spec["phi_range"]
    params = [p for p in model.parameters() if p.requires_grad]
    head_ids = {id(p) for n, p in model.named_parameters() if p.requires_grad and "lora_" not in n}
    groups = [{"params": [p for p in params if id(p) not in head_ids], "lr": lr},
              {"params": [p for p in params if id(p) in head_ids], "lr": lr if head_lr is None else head_lr}]
    opt = torch.optim.AdamW([g for g in groups if g["params"]], weight_decay=weight_decay)
    gen = torch.Generator().manual_seed(seed)
    n = len(data)
    bs = min(batch_size, n)
    order: list[torch.Tensor] = []
    losses = []
    model.train()
    for _ in range(steps):
        if not order:
            perm = torch.randperm(n, generator=gen)
            order = [perm[s:s + bs] for s in range(0, n - bs + 1, bs)]
        inputs, y = data.select(order.pop(0))
        loss = task_loss(model(**inputs), y)
        if not torch.isfinite(loss):
            raise FloatingPointError(f"local training loss is {float(loss)}")
        total = loss
        for _, layer in layers:
            if spec["dmr"] and layer.phi.requires_grad:
                total = total + phi_regulariser(layer.phi, lo, hi, float(spec["phi_reg"]))
            if float(spec["lb"]) > 0:
                total = total + float(spec["lb"]) * layer.last["aux"]
        opt.zero_grad(set_to_none=True)
        total.backward()
        if spec["pg"]:
            for (_, layer), (_, _, rho) in zip(layers, routing):
                apply_pseudo_gradient(_expert_grads(layer), layer.last["pi"], layer.last["used"], rho)
        opt.step()
        losses.append(float(loss.detach()))
    model.eval()
    for _, layer in layers:
        layer.record = False
    stats = {"layers": names, "counts": [layer.counts.tolist() for _, layer in layers],
             "tokens": [layer.tokens for _, layer in layers], "k": routing[0][0]}
    return (float(np.mean(losses)) if losses else float("nan")), stats


def _client_impl() -> type:
    from rankwise.federated.client import _ClientImpl

    class _UBSMoEClientImpl(_ClientImpl):
        """The LoRA client with UB-SMoE's local training (K_c, DMR, PG, L_reg) and routing statistics."""

        def fit(self, parameters: list[np.ndarray], config: dict[str, Any]) -> tuple[list[np.ndarray], int, dict]:
            from rankwise.federated.client import _base_model, install, read_blocks
            from rankwise.federated.common import WIRE_DTYPE, decode_layout, derive_seed

            fault = self.faults.get(self.partition, "")
            if fault == "raise":
                raise RuntimeError(f"injected fault: client {self.partition} raises")
            if fault.startswith("sleep"):
                time.sleep(float(fault.partition(":")[2] or 30))
            layout = decode_layout(config["layout"])
            spec = json.loads(config["ub-smoe"])
            model = install(_base_model(self.task), parameters, layout, json.loads(config["scaling"]))
            data = self.task.client_data(self.partition)
            loss, stats = local_train_moe(
                model, data, spec, steps=int(config["local-steps"]), batch_size=int(config["batch-size"]),
                lr=float(config["lr"]), head_lr=float(config["head-lr"]),
                weight_decay=float(config.get("weight-decay", 0.0)),
                seed=derive_seed(int(config["seed"]), "batches", int(config["round"]), self.partition))
            out = read_blocks(model, layout)
            if fault == "nan":
                out[0] = out[0].copy()
                out[0].flat[0] = np.nan
            elif fault == "shape":
                out[0] = np.zeros((out[0].shape[0] + 1, *out[0].shape[1:]), WIRE_DTYPE)
            elif fault == "dtype":
                out[0] = out[0].astype(np.float64)
            elif fault == "stats":
                stats["counts"] = [[float("nan")] * len(c) for c in stats["counts"]]
            return out, len(data), {"loss": loss, "partition": self.partition, "k": int(stats.pop("k")),
                                    "moe-stats": json.dumps(stats)}

    return _UBSMoEClientImpl


_CLIENT_CLS: list[type] = []


def UBSMoEClient(task: Any, partition: int, faults: Mapping[int, str] | None = None) -> Any:
    """A Flower ``NumPyClient`` running UB-SMoE's local training on ``partition`` of ``task``.

    ``faults`` as for :func:`rankwise.federated.client.LoRAClient`, plus ``"stats"`` (NaN routing counts).
    """
    if not _CLIENT_CLS:
        from flwr.client import NumPyClient

        _CLIENT_CLS.append(type("UBSMoEClient", (_client_impl(), NumPyClient), {}))
    return _CLIENT_CLS[0](task, partition, faults)


def make_ub_smoe_client_fn(task: str | Any = "rankwise.federated.ub_smoe:SyntheticMoETask",
                           task_kwargs: Mapping[str, Any] | None = None,
                           faults: Mapping[int, str] | None = None) -> Any:
    """A Flower ``client_fn(context)`` for UB-SMoE and its SMoE baselines (partition from ``node_config``)."""
    from rankwise.federated.tasks import resolve_task

    kwargs = dict(task_kwargs or {})
    faults = dict(faults or {})

    def client_fn(context: Any) -> Any:
        pid = context.node_config.get("partition-id")
        if pid is None:
            raise ValueError("node_config lacks 'partition-id'")
        return UBSMoEClient(resolve_task(task, kwargs), int(pid), faults).to_client()

    return client_fn


# ------------------------------------------------------------------------------------------------
# a synthetic MoE task (tests, CLI smoke runs, users without a MoE model at hand)
# ------------------------------------------------------------------------------------------------

class _MoEClassifier(nn.Module):
    def __init__(self, d_in: int, hidden: int, ffn: int, num_experts: int, top_k: int, num_layers: int,
                 num_labels: int) -> None:
        super().__init__()
        self.embed = nn.Linear(d_in, hidden)
        self.moe = nn.ModuleList(LoRAMoE(hidden, ffn, num_experts, top_k, router_bias=True) for _ in range(num_layers))
        self.classifier = nn.Linear(hidden, num_labels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.embed(x))
        for layer in self.moe:
            h = h + layer(h)
        return self.classifier(h)


class SyntheticMoETask:
    """Teacher-student classification on a frozen random MoE (``x (B, d_in) -> logits (B, C)``).

    The base is a seeded MoE classifier (``num_layers`` LoRAMoE layers with residuals); its router
    carries a per-expert bias ``router_skew * linspace(1, -1, M)`` so that utilisation is imbalanced,
    as in a pretrained MoE; expert weights are drawn ``expert_scale`` times larger than 1/sqrt(fan_in)
    so that the MoE output, not the residual, decides the label. The teacher perturbs EVERY expert of
    the base by its own rank-``teacher_rank`` change (times ``teacher_scale``), so a student that
    leaves some experts untrained mislabels the tokens those experts receive. Labels are the
    teacher's argmax at its full top-k; partitions are Dirichlet non-IID over labels. ``targets``:
    all expert projections; ``head``: the classifier and every layer's phi.
    """

    name = "synthetic-moe"

    def __init__(self, num_clients: int = 16, per_client: int = 64, n_test: int = 512, d_in: int = 16,
                 hidden: int = 32, ffn: int = 32, num_experts: int = 8, top_k: int = 4, num_layers: int = 1,
                 num_labels: int = 4, teacher_rank: int = 2, router_skew: float = 1.0, teacher_scale: float = 2.0,
                 expert_scale: float = 3.0, dirichlet_alpha: float = 0.3, seed: int = 0) -> None:
        for k, v in dict(num_clients=num_clients, per_client=per_client, n_test=n_test, d_in=d_in, hidden=hidden,
                         ffn=ffn, num_experts=num_experts, top_k=top_k, num_layers=num_layers, num_labels=num_labels,
                         teacher_rank=teacher_rank).items():
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"SyntheticMoETask.{k} must be an int >= 1, got {v!r}")
        for k, v in dict(router_skew=router_skew, teacher_scale=teacher_scale, expert_scale=expert_scale).items():
            if not finite_number(v):
                raise ValueError(f"SyntheticMoETask.{k} must be a finite number, got {v!r}")
        self.num_clients, self.seed, self.top_k = num_clients, seed, top_k
        self.dims = (d_in, hidden, ffn, num_experts, top_k, num_layers, num_labels)
        self.targets: tuple[str, ...] = (r"re:.*\.experts\.\d+\.w[123]",)
        self.head: tuple[str, ...] = ("classifier.weight", "classifier.bias",
                                      *(f"moe.{i}.phi" for i in range(num_layers)))
        gen = torch.Generator().manual_seed(seed)
        base = _MoEClassifier(*self.dims)
        with torch.no_grad():
            for name, p in base.named_parameters():
                if name.endswith("phi"):
                    continue
                if name.endswith("router.bias"):
                    p.copy_(float(router_skew) * torch.linspace(1.0, -1.0, num_experts))
                    continue
                scale = 2.0 if "router" in name else float(expert_scale) if "experts" in name else 1.0
                p.copy_(scale * torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[-1]))
        teacher = _MoEClassifier(*self.dims)
        teacher.load_state_dict(base.state_dict())
        with torch.no_grad():
            for layer in teacher.moe:
                for e in layer.experts:
                    for lin in (e.w1, e.w3, e.w2):
                        o, i = lin.weight.shape
                        u = torch.randn(o, teacher_rank, generator=gen)
                        v = torch.randn(teacher_rank, i, generator=gen)
                        lin.weight.add_(float(teacher_scale) * (u @ v) / math.sqrt(i * teacher_rank))
        self._state = base.state_dict()
        n_train = per_client * num_clients
        x = torch.randn(n_train + n_test, d_in, generator=gen)
        with torch.no_grad():
            y = teacher(x).argmax(-1)
        self._train = TensorData({"x": x[:n_train]}, y[:n_train])
        self._test = TensorData({"x": x[n_train:]}, y[n_train:])
        self._parts = dirichlet_partition(y[:n_train], num_clients, dirichlet_alpha, seed, min_size=8)

    def build_model(self) -> nn.Module:
        m = _MoEClassifier(*self.dims)
        m.load_state_dict(self._state)
        return m

    def client_data(self, partition: int) -> TensorData:
        if not 0 <= partition < self.num_clients:
            raise ValueError(f"partition {partition} is outside 0..{self.num_clients - 1}")
        idx = torch.as_tensor(self._parts[partition])
        return TensorData({k: v[idx] for k, v in self._train.inputs.items()}, self._train.labels[idx])

    def test_data(self) -> TensorData:
        return self._test


# ------------------------------------------------------------------------------------------------
# registration
# ------------------------------------------------------------------------------------------------

def _register() -> None:
    from rankwise.federated.runner import register_method

    def lazy(cls: type) -> Any:
        return lambda: cls

    def client_factory(task: Any, task_kwargs: Any, faults: Any) -> Any:
        return make_ub_smoe_client_fn(task, task_kwargs, faults)

    for cname, cls in _LOGICS.items():
        if cls is FLoRISTLogic:  # a LoRA method: the shared LoRA client
            register_method(cls.method, lazy(cls), cname)
        else:
            register_method(cls.method, lazy(cls), cname, client_factory=client_factory)


register("ub_smoe", config=UBSMoEConfig, entry=ub_smoe_strategy)
_register()
