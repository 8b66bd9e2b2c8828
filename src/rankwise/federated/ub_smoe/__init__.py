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

    from rankwise.federated.ub_smoe import UBSMoEConfig, SyntheticMoETask, convert_to_lora_moe, make_ub_smoe_client_fn
    from rankwise.federated.runner import build_strategy, run_federated
    task = SyntheticMoETask(num_clients=12)                  # or a task whose model holds LoRAMoE layers
    cfg = UBSMoEConfig(rank=4, client_budget={0: 0.25, 1: 0.5, 2: 1.0}, clients_per_round=4)
    strategy = build_strategy("ub-smoe", cfg, task)          # a flwr Strategy
    run_federated(strategy, make_ub_smoe_client_fn(task), task.num_clients, rounds=15)

Layout: :mod:`.config` holds :class:`UBSMoEConfig`; the MoE layer (:class:`LoRAMoE`, the routing,
Mixtral conversion) is the family module :mod:`rankwise.federated.moe` and the synthetic MoE task is
in :mod:`rankwise.federated.tasks` (both re-exported here); the client loop is the family's
(:func:`rankwise.federated.client.train_steps`).
"""

from __future__ import annotations

import json
import logging
import math
import re
from typing import Any, Iterable, Mapping, Sequence

import numpy as np
import torch
from torch import nn

from rankwise.core.errors import SelectionError
from rankwise.core.registry import register
from rankwise.federated.baselines import HetLoRALogic, product_contributions
from rankwise.federated.client import _ClientImpl, make_client_fn, task_loss, train_steps
from rankwise.federated.common import finite_number
from rankwise.federated.config import FederatedConfig
from rankwise.federated.moe import LoRAMoE, convert_to_lora_moe, modulated_routing, moe_layers, switch_aux_loss
from rankwise.federated.registry import register_method
from rankwise.federated.strategy import ClientUpdate, LoRAStrategyLogic, flower_class
from rankwise.federated.tasks import SyntheticMoETask, TensorData
from rankwise.federated.ub_smoe.config import AGGREGATIONS, DEFAULT_TIERS, PG_SCALES, UBSMoEConfig

__all__ = [
    "AGGREGATIONS", "DEFAULT_TIERS", "PG_SCALES",
    "A3SMoELogic", "FLoRISTLogic", "LoRAMoE", "NaiveSMoELogic", "SMoELLBLogic", "SyntheticMoETask", "UBSMoEConfig",
    "UBSMoELogic",
    "apply_pseudo_gradient", "client_routing", "convert_to_lora_moe", "ffn_flops", "global_utilisation",
    "local_train_moe", "make_ub_smoe_client_fn", "modulated_routing", "moe_layers", "phi_regulariser", "pg_factor",
    "switch_aux_loss", "target_modulation", "task_loss", "ub_smoe_strategy", "update_phi", "utilisation_entropy",
]

log = logging.getLogger("rankwise.federated")
_EXPERT_RX = re.compile(r"^(?P<layer>.+)\.experts\.(?P<e>\d+)\.(?P<proj>[^.]+)$")


# ------------------------------------------------------------------------------------------------
# pure math (spec "Method")
# ------------------------------------------------------------------------------------------------

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
    phi_bar and checkpointed with the rest). ``config`` may be a plain :class:`FederatedConfig` (the CLI);
    it is then read as ``UBSMoEConfig.from_base(config)``. M is parsed from the adapter's module names
    ``<layer>.experts.<i>.<proj>``; ``k_max`` (argument, else ``config.k_max``) may stay None: each client
    then sends the budget beta_c and derives ``K_c = floor(K_max beta_c)`` from its model's top-k.
    """

    method = "ub-smoe"
    supports_server_optimizer = False
    variant: dict[str, Any] = {}

    def __init__(self, config: FederatedConfig, init_adapter: Any, *, k_max: int | None = None, **kwargs: Any) -> None:
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
        self.update_routing(rnd, updates, w, stats)

    def apply_combined(self, rnd: int, combined: dict[str, torch.Tensor], updates: list[ClientUpdate]) -> None:
        """Robust aggregation: the combined changes of every tensor (phi_bar included), then the DMR update.
        (``aggregation="activation"`` applies to the mean only.)"""
        super().apply_combined(rnd, combined, updates)
        self.update_routing(rnd, updates, self.weights(updates), [self.read_stats(u) for u in updates])

    def update_routing(self, rnd: int, updates: list[ClientUpdate], w: list[float],
                       stats: list[tuple[np.ndarray, np.ndarray, int] | None]) -> None:
        """The DMR step from the clients' routing statistics: u~, phi~, ``phi <- zeta phi_bar + (1 - zeta) phi~``."""
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
            self.save_checkpoint()  # nothing is written after a refused round
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

    client_payload = HetLoRALogic.client_payload  # the first k_i components, as HetLoRA

    def aggregate(self, rnd: int, updates: list[ClientUpdate]) -> None:
        w = self.weights(updates)
        for m in self.modules:
            bs = torch.cat([wi * u.tensors[f"{m}.lora_B"].double() for u, wi in zip(updates, w)], dim=1)
            As = torch.cat([u.tensors[f"{m}.lora_A"].double() for u in updates], dim=0)
            qb, rb = torch.linalg.qr(bs)
            qa, ra = torch.linalg.qr(As.T)
            self._keep_energy(m, qb, qa, *torch.linalg.svd(rb @ ra.T, full_matrices=False))
        for n, d in self._head_average(updates, w).items():
            self.tensors[n].add_(d)

    def _keep_energy(self, m: str, qb: torch.Tensor | None, qa: torch.Tensor | None, u_: torch.Tensor,
                     s_: torch.Tensor, vh: torch.Tensor) -> None:
        """Module ``m``'s global factors from the SVD ``(Q_B U) S (V^T Q_A^T)``: the fewest components reaching
        ``energy`` (at most r), zero beyond (``qb`` / ``qa`` None: identity)."""
        A, B = self.tensors[f"{m}.lora_A"], self.tensors[f"{m}.lora_B"]
        e = s_.pow(2)
        total = float(e.sum())
        if total <= 0:
            j = 0
        else:
            frac = torch.cumsum(e, 0) / total
            j = min(self.config.rank, int((frac < self.energy - 1e-12).sum()) + 1)
        root = s_[:j].clamp_min(0).sqrt()
        a = root[:, None] * vh[:j]
        b = u_[:, :j] * root[None, :]
        A.zero_()
        B.zero_()
        A[:j] = (a if qa is None else a @ qa.T).float()
        B[:, :j] = (b if qb is None else qb @ b).float()
        self.kept_ranks[m] = j

    def contributions(self, rnd: int, updates: list[ClientUpdate]) -> list[dict[str, tuple[torch.Tensor, Any]]]:
        """Each client's full-size update ``B_i A_i`` per module (key ``product:<module>``); head changes."""
        return product_contributions(self, updates)

    def apply_combined(self, rnd: int, combined: dict[str, torch.Tensor], updates: list[ClientUpdate]) -> None:
        for m in self.modules:
            self._keep_energy(m, None, None, *torch.linalg.svd(combined[f"product:{m}"], full_matrices=False))
        for n in self.head_names():
            self.tensors[n].add_(combined[n].float())


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

    The family's client loop (:func:`rankwise.federated.client.train_steps`) with UB-SMoE's objective
    and the pseudo-gradient applied after every backward. Returns the mean task loss and the routing
    statistics ``{"layers", "counts" (L, M), "tokens" (L,), "k"}``.
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

    def objective(loss: torch.Tensor) -> torch.Tensor:
        total = loss
        for _, layer in layers:
            if spec["dmr"] and layer.phi.requires_grad:
                total = total + phi_regulariser(layer.phi, lo, hi, float(spec["phi_reg"]))
            if float(spec["lb"]) > 0:
                total = total + float(spec["lb"]) * layer.last["aux"]
        return total

    def pseudo_gradient() -> None:
        if spec["pg"]:
            for (_, layer), (_, _, rho) in zip(layers, routing):
                apply_pseudo_gradient(_expert_grads(layer), layer.last["pi"], layer.last["used"], rho)

    loss = train_steps(model, data, steps=steps, batch_size=batch_size, lr=lr, head_lr=head_lr,
                       weight_decay=weight_decay, seed=seed, objective=objective, after_backward=pseudo_gradient)
    for _, layer in layers:
        layer.record = False
    stats = {"layers": names, "counts": [layer.counts.tolist() for _, layer in layers],
             "tokens": [layer.tokens for _, layer in layers], "k": routing[0][0]}
    return loss, stats


class _UBSMoEClientImpl(_ClientImpl):
    """The family's client with UB-SMoE's local training (K_c, DMR, PG, L_reg) and routing statistics."""

    def train(self, model: nn.Module, data: TensorData, config: dict[str, Any], *,
              seed: int) -> tuple[float, dict[str, Any]]:
        loss, stats = local_train_moe(
            model, data, json.loads(config["ub-smoe"]), steps=int(config["local-steps"]),
            batch_size=int(config["batch-size"]), lr=float(config["lr"]), head_lr=float(config["head-lr"]),
            weight_decay=float(config.get("weight-decay", 0.0)), seed=seed)
        if self.faults.get(self.partition) == "stats":
            stats["counts"] = [[float("nan")] * len(c) for c in stats["counts"]]
        return loss, {"k": int(stats.pop("k")), "moe-stats": json.dumps(stats)}


_CLIENT_CLS: list[type] = []


def UBSMoEClient(task: Any, partition: int, faults: Mapping[int, str] | None = None) -> Any:
    """A Flower ``NumPyClient`` running UB-SMoE's local training on ``partition`` of ``task``.

    ``faults`` as for :func:`rankwise.federated.client.LoRAClient`, plus ``"stats"`` (NaN routing counts).
    """
    if not _CLIENT_CLS:
        from flwr.client import NumPyClient

        _CLIENT_CLS.append(type("UBSMoEClient", (_UBSMoEClientImpl, NumPyClient), {}))
    return _CLIENT_CLS[0](task, partition, faults)


def make_ub_smoe_client_fn(task: str | Any = "synthetic-moe", task_kwargs: Mapping[str, Any] | None = None,
                           faults: Mapping[int, str] | None = None) -> Any:
    """A Flower ``client_fn(context)`` for UB-SMoE and its SMoE baselines (partition from ``node_config``)."""
    return make_client_fn(task, task_kwargs, faults, client=UBSMoEClient)


# ------------------------------------------------------------------------------------------------
# registration
# ------------------------------------------------------------------------------------------------

def _ub_client_factory(task: Any, task_kwargs: Any, faults: Any) -> Any:
    return make_ub_smoe_client_fn(task, task_kwargs, faults)


for _cname, _cls in _LOGICS.items():
    if _cls is FLoRISTLogic:  # a LoRA method: the shared LoRA client and the LoRA task
        register_method(_cls.method, _cls, _cname, config=FederatedConfig)
    else:
        register_method(_cls.method, _cls, _cname, client_factory=_ub_client_factory, default_task="synthetic-moe",
                        config=UBSMoEConfig)
register("ub_smoe", config=UBSMoEConfig, entry=ub_smoe_strategy)
