"""A sparse mixture-of-experts FFN whose experts are LoRA-able Linears, with modulated routing.

Shared by the federated SMoE methods (UB-SMoE and its baselines in :mod:`rankwise.federated.ub_smoe`)
and the synthetic MoE task (:class:`rankwise.federated.tasks.SyntheticMoETask`):

* :func:`modulated_routing`: Top-K routing inside a candidate set, with an optional per-expert
  modulation phi added to the candidates' logits (UB-SMoE's Dynamic Modulated Routing, steps 1-3;
  phi = None is plain Top-K routing);
* :class:`LoRAMoE`: the layer (router, SwiGLU experts ``experts.<i>.w1|w3|w2``, phi, routing statistics);
* :func:`convert_to_lora_moe`: turns transformers-5 Mixtral blocks into equivalent LoRAMoE layers;
* :func:`switch_aux_loss`: the Switch load-balancing loss.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from rankwise.core.errors import SelectionError
from rankwise.core.surgery import replace_module

__all__ = ["LoRAMoE", "convert_to_lora_moe", "modulated_routing", "moe_layers", "switch_aux_loss"]


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


def switch_aux_loss(active: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    """Switch load-balancing loss ``M sum_i f_i P_i`` (f_i: fraction of routed assignments, P_i: mean prob)."""
    m = probs.shape[-1]
    f = active.float().sum(0) / active.float().sum().clamp_min(1.0)
    return m * (f * probs.mean(0)).sum()



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

