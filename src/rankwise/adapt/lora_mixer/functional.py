"""LoRA-Mixer's math, no model needed: the top-k gate and the routing-specialisation terms."""

from __future__ import annotations

import math

import torch

from rankwise.adapt.lora_mixer.config import F_DEFINITIONS, LOG_FLOOR, _pos_int


# ------------------------------------------------------------------------------------------------
# the pure math
# ------------------------------------------------------------------------------------------------

def topk_gate(p: torch.Tensor, k: int, renormalize: bool = True) -> torch.Tensor:
    """Sparse top-K gate from routing probabilities ``p (..., E)``: the K largest kept (ties: lowest index).

    ``k >= E`` returns ``p`` itself (so top-K fusion with K = E equals soft fusion exactly).
    """
    e = p.shape[-1]
    if not _pos_int(k):
        raise ValueError(f"top-k must be an int >= 1, got {k!r}")
    if k >= e:
        return p
    _, order = torch.sort(p.detach(), dim=-1, descending=True, stable=True)
    idx = order[..., :k]
    gate = torch.zeros_like(p).scatter(-1, idx, p.gather(-1, idx))
    if renormalize:
        gate = gate / gate.sum(-1, keepdim=True).clamp_min(torch.finfo(p.dtype).tiny)
    return gate


def _flat(p: torch.Tensor, mask: torch.Tensor | None, where: str) -> torch.Tensor:
    """Routing probabilities of the valid tokens, ``(N, E)``."""
    e = p.shape[-1]
    if mask is None:
        return p.reshape(-1, e)
    if tuple(mask.shape) != tuple(p.shape[:-1]):
        raise ValueError(f"{where}: attention_mask of shape {tuple(mask.shape)} does not match the routed "
                         f"tokens {tuple(p.shape[:-1])}")
    flat = p.reshape(-1, e)[mask.reshape(-1).bool()]
    if flat.shape[0] == 0:
        raise ValueError(f"{where}: the attention mask leaves no token")
    return flat


def rsl_terms(p: torch.Tensor, mask: torch.Tensor | None = None, *, k: int = 1, f_definition: str = "topk",
              where: str = "router") -> dict[str, torch.Tensor]:
    """The pieces of the RSL for one layer from routing probabilities ``p (..., E)``.

    Returns ``p_bar (E,)`` (mean probability, differentiable), ``f_bar (E,)`` (share of the top-k slots
    per expert divided by k, or the top-1 share for ``f_definition="top1"``; detached), ``entropy``
    (mean over tokens of ``H(p(x)) = -sum p log p``, differentiable) and ``top1 (N,)`` (argmax expert of
    every valid token). ``mask`` (``p.shape[:-1]``, 1 = real token) excludes padding.
    """
    if f_definition not in F_DEFINITIONS:
        raise ValueError(f"f_definition must be one of {F_DEFINITIONS}, got {f_definition!r}")
    flat = _flat(p.float(), mask, where)
    e = flat.shape[-1]
    kk = 1 if f_definition == "top1" else min(k, e)
    with torch.no_grad():
        _, order = torch.sort(flat, dim=-1, descending=True, stable=True)
        slots = torch.zeros_like(flat).scatter(-1, order[:, :kk], 1.0)
        f_bar = slots.mean(0) / kk
    ent = -(flat * flat.clamp_min(LOG_FLOOR).log()).sum(-1).mean()
    return {"p_bar": flat.mean(0), "f_bar": f_bar, "entropy": ent, "top1": order[:, 0]}


def normalized_entropy(p: torch.Tensor, mask: torch.Tensor | None = None) -> float:
    """Mean per-token ``H(p(x)) / log E`` in [0, 1] (0 for E = 1)."""
    e = p.shape[-1]
    if e < 2:
        return 0.0
    return float(rsl_terms(p.detach(), mask)["entropy"]) / math.log(e)
