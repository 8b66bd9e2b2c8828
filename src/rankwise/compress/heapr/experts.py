"""Routed experts as separate ``nn.Linear`` MLPs: the layout HEAPr's per-expert hooks and slicing need.

transformers 5 stores the routed experts of one MoE layer fused, as 3-D parameters of one module
(``gate_up_proj`` of shape ``(E, 2 I, H)``, ``down_proj`` of shape ``(E, H, I)``) and applies the
router weight inside that module's forward. :func:`unfuse_experts` replaces every such module by an
:class:`UnfusedExperts` holding one :class:`ExpertMLP` per expert (``gate_proj``, ``up_proj``,
``down_proj``), with the router weight applied *outside* the expert MLP. The forward runs the same
operations in the same order as transformers' eager loop, so the logits are identical (tested
bit-for-bit on Qwen2-MoE and Mixtral).

After pruning, experts of one layer have unequal widths (``ExpertMLP.width``); an expert of width 0
outputs zeros.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["ExpertMLP", "UnfusedExperts", "SUPPORTED", "find_fused_experts", "moe_layers", "unfuse_experts"]

#: what :func:`unfuse_experts` recognises (named in the error for models without MoE blocks)
SUPPORTED = ("Qwen2MoE", "Qwen3MoE", "Mixtral", "OLMoE", "DeepSeek-V2/V3-style", "any transformers 5 fused "
             "experts module with gate_up_proj (E, 2I, H), down_proj (E, H, I) and act_fn")


def _bare_linear(in_f: int, out_f: int, dtype: torch.dtype | None, device: Any) -> nn.Linear:
    """A bias-free ``nn.Linear`` with uninitialised weights (width 0 allowed, without torch's warning)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Initializing zero-element tensors")
        return nn.utils.skip_init(nn.Linear, in_f, out_f, bias=False, device=device, dtype=dtype)


def _linear(weight: torch.Tensor) -> nn.Linear:
    """A bias-free ``nn.Linear`` holding a copy of ``weight`` (``out x in``), without a random init."""
    out_f, in_f = weight.shape
    lin = _bare_linear(in_f, out_f, weight.dtype, weight.device)
    with torch.no_grad():
        lin.weight.copy_(weight)
    lin.weight.requires_grad_(weight.requires_grad)
    return lin


class ExpertMLP(nn.Module):
    """One routed expert: ``down(act(gate x) * up x)`` (gated) or ``down(act(up x))`` (``gate_proj=None``).

    Atom ``j`` (HEAPr's atomic expert) is row ``j`` of ``gate_proj`` and ``up_proj`` and column ``j``
    of ``down_proj``; its output is ``down_proj.weight[:, j] * a_j(x)``.
    """

    def __init__(self, gate_proj: nn.Linear | None, up_proj: nn.Linear, down_proj: nn.Linear,
                 act_fn: Callable[[torch.Tensor], torch.Tensor]):
        super().__init__()
        self.gate_proj = gate_proj
        self.up_proj = up_proj
        self.down_proj = down_proj
        self.act_fn = act_fn

    @property
    def width(self) -> int:
        """Number of atoms (intermediate neurons)."""
        return int(self.down_proj.weight.shape[1])

    @property
    def gated(self) -> bool:
        return self.gate_proj is not None

    def intermediate(self, x: torch.Tensor) -> torch.Tensor:
        """``a(x)`` (``..., width``): the input of ``down_proj``."""
        if self.gate_proj is None:
            return self.act_fn(self.up_proj(x))
        return self.act_fn(self.gate_proj(x)) * self.up_proj(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.intermediate(x))

    def keep(self, index: torch.Tensor) -> None:
        """Keep only the atoms ``index`` (sorted 1-D long tensor): slice gate/up rows and down columns."""
        idx = index.to(self.down_proj.weight.device)
        if self.gate_proj is not None:
            self.gate_proj = _linear(self.gate_proj.weight.detach()[idx])
        self.up_proj = _linear(self.up_proj.weight.detach()[idx])
        self.down_proj = _linear(self.down_proj.weight.detach()[:, idx])

    @classmethod
    def empty(cls, hidden: int, width: int, act_fn: Callable, gated: bool = True, *,
              dtype: torch.dtype | None = None, device: Any = None) -> "ExpertMLP":
        """An expert of the given width with uninitialised weights (filled by ``load_state_dict``)."""
        def lin(i: int, o: int) -> nn.Linear:
            return _bare_linear(i, o, dtype, device)
        return cls(lin(hidden, width) if gated else None, lin(hidden, width), lin(width, hidden), act_fn)


class UnfusedExperts(nn.Module):
    """The routed experts of one MoE layer as a ``ModuleList`` of :class:`ExpertMLP`.

    ``forward(hidden_states (T, H), top_k_index (T, k), top_k_weights (T, k)) -> (T, H)``: the same
    signature and arithmetic as transformers' fused experts; expert ``e`` sees only its routed tokens
    and its output is multiplied by the router weight afterwards (so a hook on ``experts[e]`` or its
    ``down_proj`` sees the expert's own output, before the router weight).
    """

    def __init__(self, experts: list[ExpertMLP]):
        super().__init__()
        self.experts = nn.ModuleList(experts)
        self.num_experts = len(experts)

    def __getitem__(self, i: int) -> ExpertMLP:
        return self.experts[i]  # type: ignore[return-value]

    def __len__(self) -> int:
        return self.num_experts

    @property
    def widths(self) -> list[int]:
        return [e.width for e in self.experts]

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        final = torch.zeros_like(hidden_states)
        with torch.no_grad():
            expert_mask = F.one_hot(top_k_index, num_classes=self.num_experts).permute(2, 1, 0)
            expert_hit = torch.greater(expert_mask.sum(dim=(-1, -2)), 0).nonzero()
        for hit in expert_hit:
            e = int(hit[0])
            top_k_pos, token_idx = torch.where(expert_mask[e])
            out = self.experts[e](hidden_states[token_idx])
            out = out * top_k_weights[token_idx, top_k_pos, None]
            final.index_add_(0, token_idx, out.to(final.dtype))
        return final

    @classmethod
    def from_fused(cls, fused: nn.Module) -> "UnfusedExperts":
        """Copy the weights of a transformers 5 fused experts module into per-expert MLPs."""
        gu, down = fused.gate_up_proj.detach(), fused.down_proj.detach()
        inter = down.shape[2]
        experts = []
        for e in range(gu.shape[0]):
            experts.append(ExpertMLP(_linear(gu[e, :inter]), _linear(gu[e, inter:]), _linear(down[e]),
                                     fused.act_fn))
        return cls(experts)


def _is_fused(m: nn.Module) -> bool:
    gu, down = getattr(m, "gate_up_proj", None), getattr(m, "down_proj", None)
    if not (isinstance(gu, torch.Tensor) and isinstance(down, torch.Tensor) and gu.ndim == 3 and down.ndim == 3):
        return False
    E, two_i, H = gu.shape
    return (not getattr(m, "is_transposed", False) and not getattr(m, "has_bias", False)
            and callable(getattr(m, "act_fn", None)) and two_i % 2 == 0
            and tuple(down.shape) == (E, H, two_i // 2))


def find_fused_experts(model: nn.Module) -> list[str]:
    """Qualified names of the transformers 5 fused routed-experts modules of ``model``."""
    return [n for n, m in model.named_modules() if n and _is_fused(m)]


def moe_layers(model: nn.Module) -> dict[str, UnfusedExperts]:
    """The unfused MoE layers of ``model`` by qualified name (empty if :func:`unfuse_experts` did not run)."""
    return {n: m for n, m in model.named_modules() if isinstance(m, UnfusedExperts)}


def unfuse_experts(model: nn.Module) -> list[str]:
    """Replace every fused routed-experts module of ``model`` by an :class:`UnfusedExperts`, in place.

    Exact: the model computes the same logits (same operations in the same order). Shared experts
    (ordinary MLPs) are left as they are. Returns the names of all unfused MoE layers (including
    ones unfused before: calling it twice is a no-op). Raises ``TypeError`` listing the supported
    layouts when the model has no MoE block.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    fused = find_fused_experts(model)
    if not fused and not moe_layers(model):
        raise TypeError(f"{type(model).__name__} has no recognised mixture-of-experts block; supported: "
                        + "; ".join(SUPPORTED))
    new = {n: UnfusedExperts.from_fused(model.get_submodule(n)) for n in fused}  # build all before changing any
    for n, m in new.items():
        parent, _, child = n.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, m)
    return list(moe_layers(model))
