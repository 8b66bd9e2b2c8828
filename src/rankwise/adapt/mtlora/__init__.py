"""mtLoRA: scalable multi-task LoRA (Tian, Ledent, Sun; ICLR 2026, arXiv 2603.01526).

mtLoRA starts from HydraLoRA's asymmetric mixture (one shared down-projection ``A (r, d_in)``, ``E``
expert up-projections ``B_i (d_out, r)``, a per-token softmax router) and changes three things:

1. **Block-level adaptation.** One adapter per transformer block, parallel to the FFN sub-block
   (``placement="ffn"``, the paper's default; ``"attention"`` or ``"both"`` also exist): with ``x``
   the input of the FFN, the block computes ``FFN(x) + Adapter(x)``; the adapter bypasses the FFN's
   non-linearity. ``placement="component"`` puts the same adapter on individual linear layers
   (``Linear(x) + Adapter(x)``), which with a coarse router and no spectral term is HydraLoRA.
2. **Fine-grained routing (FGR).** The ``d_out`` output dimensions are split into ``G = d_out /
   group_size`` contiguous groups, each with its own softmax over the experts::

       logits = W_r x  (W_r: (E G, d_in)),  reshaped (G, E);  g = softmax over E within each group
       Adapter(x) = (alpha / r) * sum_i  g_i(x) ⊙ B_i (A dropout(x))        (g_i repeated group_size times)

   ``group_size = d_out`` is HydraLoRA's coarse router.
3. **Spectral-aware regularisation** of every expert ``B_i`` (:func:`spectral_penalty`): with the
   (detached) singular values ``sigma`` of ``B_i``, weights ``w_k = exp(-sigma_k / mean(sigma))`` and
   ``c = ||B_i||_F / sqrt(r)`` (detached), ``L_spec(B_i) = sum_{k,l} (w_k w_l (G - c^2 I)_{kl})^2``;
   low singular directions are pushed to orthogonality, high ones (the shared knowledge) left free.

The training loss is ``L_task + balance_alpha * L_bal + spectral_lambda * L_spec`` with HydraLoRA's
load-balance term ``L_bal`` (squared coefficient of variation of the mean routing weights over the
experts, summed over adapters) and ``L_spec`` added only on scheduled steps (every
``spectral_every`` steps); :func:`mtlora_regularizers` computes both from the last forward pass.

Which basis the spectral weights act in is a choice (the spec allows either):
``spectral_basis="singular"`` (default) expresses the Gram matrix in ``B_i``'s own right-singular
basis (``V^T B^T B V``), so that weight ``w_k`` multiplies exactly the k-th singular direction;
``"column"`` is the official code's variant, which multiplies the weight of the k-th largest
singular value onto the k-th column index of ``B_i``.

Usage::

    from rankwise.adapt.mtlora import MtLoRAConfig, adapt, mtlora_regularizers
    model = adapt(hf_model, MtLoRAConfig(rank=8, alpha=32, num_experts=4, routing_group_size=192,
                                         spectral_lambda=0.5, spectral_every=50))
    for step, batch in enumerate(loader):
        loss = task_loss(model(**batch)) + mtlora_regularizers(model, step)
        ...

A routed mixture is input dependent, and a block-level adapter reads the FFN's input and writes to
its output around a non-linearity, so mtLoRA cannot be folded into the base weights: :func:`merge`
raises :class:`~rankwise.core.errors.RankwiseError` saying so.
"""

from __future__ import annotations

import contextlib
import math
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch
from torch import nn

from rankwise.core import adapters, io
from rankwise.core.adapters import AdapterLayer, validate_adapter_name
from rankwise.core.errors import ArtifactError, NumericalError, RankwiseError, SelectionError
from rankwise.core.registry import register
from rankwise.core.select import Selector, matcher, select
from rankwise.core.surgery import replace_module

__all__ = [
    "PLACEMENTS",
    "MtLoRAConfig",
    "MtLoRALinear",
    "adapt",
    "adapter_names",
    "apply_mtlora",
    "balance_loss",
    "delete_adapter",
    "disable_adapters",
    "enable_adapters",
    "hydralora_config",
    "load_adapter",
    "merge",
    "mtlora_layers",
    "mtlora_regularizers",
    "num_parameters",
    "routing_report",
    "routing_weights",
    "save_adapter",
    "set_active",
    "spectral_due",
    "spectral_penalty",
    "spectral_weights",
    "spectrum_report",
    "unload",
    "unmerge",
]

PLACEMENTS = ("ffn", "attention", "both", "component")
BASES = ("singular", "column")
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_KIND = "rankwise.mtlora"
_OWN_FILES = {CONFIG_FILE, WEIGHTS_FILE}
#: Epsilon of the squared coefficient of variation (HydraLoRA's ``cv_squared``).
CV_EPS = 1e-10

#: (input module, output module) suffixes of a block's sub-layer, per placement. The adapter reads the
#: input of the first and adds its output to the output of the second. BERT/RoBERTa/ViT (HF), Llama/
#: Qwen/Mistral, CLIP/OPT-style fc1/fc2, GPT-NeoX/Falcon.
BLOCK_PAIRS: dict[str, tuple[tuple[str, str], ...]] = {
    "ffn": (("intermediate.dense", "output.dense"), ("mlp.up_proj", "mlp.down_proj"), ("mlp.fc1", "mlp.fc2"),
            ("mlp.dense_h_to_4h", "mlp.dense_4h_to_h")),
    "attention": (("attention.self.query", "attention.output.dense"), ("self_attn.q_proj", "self_attn.o_proj"),
                  ("attention.attention.query", "attention.output.dense"), ("self_attn.q_proj", "self_attn.out_proj"),
                  ("attention.query_key_value", "attention.dense")),
}


def _pos_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(float(value))


# ------------------------------------------------------------------------------------------------
# configuration
# ------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class MtLoRAConfig:
    """mtLoRA hyper-parameters (defaults: the official LLaMA-2 scripts).

    Attributes:
        rank: r >= 1 of the shared ``A (r, d_in)`` and each ``B_i (d_out, r)``; at most min(d_in, d_out).
        alpha: scaling numerator, ``s = alpha / r`` (official: r = 16, alpha = 64).
        num_experts: E >= 1 expert up-projections per adapter (official 16). E = 1 disables the router.
        placement: "ffn" (default), "attention", "both" (block level), or "component" (one adapter per
            linear layer that ``target`` selects: HydraLoRA's placement).
        routing_group_size: output dimensions per routing group; must divide d_out. ``None``: d_out / 2
            (G = 2, the paper's 2048 for d = 4096; d_out when odd). ``group_size = d_out``: coarse router.
        dropout: dropout on the adapter's input (not the router's), in [0, 1) (official 0.05).
        balance_alpha: weight of the load-balance term (0.01).
        spectral_lambda: weight of the spectral term (1.0 on BBH, 0.5 on Dolly/MMLU; default 0.5).
        spectral_every: the spectral term is added on steps ``step > 0`` with ``step % spectral_every == 0``
            (the official ``step - last >= 500`` schedule when called every step).
        spectral_basis: "singular" (weights on B_i's own singular directions) or "column" (official code).
        spectral_max_matrices: at most this many B_i per spectral computation (sampled; official 64).
        target: linear-layer names for ``placement="component"`` (ignored by block placements).
        block_pairs: extra (input suffix, output suffix) pairs that identify a block's sub-layer, tried
            before :data:`BLOCK_PAIRS`, for architectures rankwise does not know.
        seed: seeds the initialisation (A and W_r Kaiming-uniform(a=sqrt 5), B_i = 0); None: global RNG.
    """

    rank: int = 16
    alpha: float = 64.0
    num_experts: int = 16
    placement: str = "ffn"
    routing_group_size: int | None = None
    dropout: float = 0.05
    balance_alpha: float = 0.01
    spectral_lambda: float = 0.5
    spectral_every: int = 500
    spectral_basis: str = "singular"
    spectral_max_matrices: int = 64
    target: tuple[str, ...] = ("query", "value")
    block_pairs: tuple[tuple[str, str], ...] = ()
    seed: int | None = 0

    def __post_init__(self) -> None:
        for f in ("rank", "num_experts", "spectral_every", "spectral_max_matrices"):
            if not _pos_int(getattr(self, f)):
                raise ValueError(f"MtLoRAConfig.{f} must be an int >= 1, got {getattr(self, f)!r}")
        if not _number(self.alpha) or float(self.alpha) <= 0:
            raise ValueError(f"MtLoRAConfig.alpha must be a finite number > 0, got {self.alpha!r}")
        if self.placement not in PLACEMENTS:
            raise ValueError(f"MtLoRAConfig.placement must be one of {PLACEMENTS}, got {self.placement!r}")
        if self.routing_group_size is not None and not _pos_int(self.routing_group_size):
            raise ValueError(f"MtLoRAConfig.routing_group_size must be None or an int >= 1, "
                             f"got {self.routing_group_size!r}")
        if not _number(self.dropout) or not 0.0 <= float(self.dropout) < 1.0:
            raise ValueError(f"MtLoRAConfig.dropout must be in [0, 1), got {self.dropout!r}")
        for f in ("balance_alpha", "spectral_lambda"):
            v = getattr(self, f)
            if not _number(v) or float(v) < 0:
                raise ValueError(f"MtLoRAConfig.{f} must be a finite number >= 0, got {v!r}")
            object.__setattr__(self, f, float(v))
        if self.spectral_basis not in BASES:
            raise ValueError(f"MtLoRAConfig.spectral_basis must be one of {BASES}, got {self.spectral_basis!r}")
        target = (self.target,) if isinstance(self.target, str) else self.target
        if not isinstance(target, (tuple, list)) or not target or not all(isinstance(t, str) and t for t in target):
            raise ValueError("MtLoRAConfig.target must be a non-empty tuple of module-name patterns, "
                             f"got {self.target!r}")
        object.__setattr__(self, "target", tuple(target))
        pairs = self.block_pairs
        if not isinstance(pairs, (tuple, list)) or not all(
                isinstance(p, (tuple, list)) and len(p) == 2 and all(isinstance(s, str) and s for s in p)
                for p in pairs):
            raise ValueError("MtLoRAConfig.block_pairs must be a tuple of (input suffix, output suffix) string pairs, "
                             f"got {self.block_pairs!r}")
        object.__setattr__(self, "block_pairs", tuple(tuple(p) for p in pairs))
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)):
            raise ValueError(f"MtLoRAConfig.seed must be an int or None, got {self.seed!r}")
        object.__setattr__(self, "alpha", float(self.alpha))
        object.__setattr__(self, "dropout", float(self.dropout))
        if self.num_experts == 1 and self.routing_group_size is not None:
            warnings.warn("MtLoRAConfig: num_experts=1 disables the router; routing_group_size is ignored",
                          stacklevel=3)


def hydralora_config(rank: int = 8, alpha: float = 16.0, num_experts: int = 4,
                     target: tuple[str, ...] = ("query", "value"), d_out: int | None = None,
                     dropout: float = 0.05, balance_alpha: float = 0.01, seed: int | None = 0) -> MtLoRAConfig:
    """HydraLoRA as an mtLoRA configuration: component placement, coarse router, no spectral term.

    ``d_out``: the output width of the targeted layers (coarse routing = one group of ``d_out``); None
    takes each layer's own width (the same thing when every target has one width).
    """
    return MtLoRAConfig(rank=rank, alpha=alpha, num_experts=num_experts, placement="component",
                        routing_group_size=d_out if d_out is not None else _COARSE, dropout=dropout,
                        balance_alpha=balance_alpha, spectral_lambda=0.0, target=tuple(target), seed=seed)


#: Sentinel group size meaning "one group of the layer's own d_out" (set by :func:`hydralora_config`).
_COARSE = 2 ** 31 - 1


def _group_size(config: MtLoRAConfig, d_out: int) -> int:
    if config.num_experts == 1:
        return d_out
    gs = config.routing_group_size
    if gs is None:
        return d_out // 2 if d_out % 2 == 0 else d_out
    if gs == _COARSE:
        return d_out
    return gs


def num_parameters(d_in: int, d_out: int, rank: int, num_experts: int, groups: int) -> int:
    """Trainable parameters of one adapter: ``d_in r + E r d_out + E G d_in`` (no router when E = 1).

    For a block-FFN adapter of a d-wide model this is the spec's ``d r + E r d + E G d``.
    """
    router = num_experts * groups * d_in if num_experts > 1 else 0
    return d_in * rank + num_experts * rank * d_out + router


# ------------------------------------------------------------------------------------------------
# the pure math
# ------------------------------------------------------------------------------------------------

def routing_weights(logits: torch.Tensor, num_groups: int, num_experts: int, *, where: str = "router") -> torch.Tensor:
    """FGR routing weights: ``logits (..., E G)`` -> ``(..., G, E)``, softmax over E within each group.

    Non-finite logits raise :class:`NumericalError` naming ``where``.
    """
    if logits.shape[-1] != num_groups * num_experts:
        raise ValueError(f"{where}: logits have {logits.shape[-1]} entries, expected G*E = {num_groups * num_experts}")
    if not bool(torch.isfinite(logits).all()):
        raise NumericalError(f"{where}: routing logits hold NaN or inf")
    return torch.softmax(logits.reshape(*logits.shape[:-1], num_groups, num_experts).float(), dim=-1).to(logits.dtype)


def balance_loss(routing: torch.Tensor) -> torch.Tensor:
    """HydraLoRA's load-balance term: ``Var(p_bar) / (mean(p_bar)^2 + eps)`` over the E experts.

    ``routing (..., E)``: routing weights of every token (and group); ``p_bar`` is their mean over all
    leading dimensions. The variance is the unbiased one (``torch.var``, as HydraLoRA's ``cv_squared``);
    0 when the mean routing is uniform. A single expert gives 0.
    """
    e = routing.shape[-1]
    if e < 2:
        return routing.new_zeros(())
    p_bar = routing.reshape(-1, e).float().mean(0)
    return p_bar.var() / (p_bar.mean().square() + CV_EPS)


def spectral_weights(sigma: torch.Tensor) -> torch.Tensor:
    """``w_k = exp(-sigma_k / mean(sigma))``; uniform weights (1) when ``mean(sigma)`` is 0 or not finite."""
    m = sigma.mean()
    if not bool(torch.isfinite(sigma).all()) or float(m) <= 0.0:
        return torch.ones_like(sigma)
    return torch.exp(-sigma / m)


def spectral_penalty(B: torch.Tensor, basis: str = "singular") -> torch.Tensor:
    """Spectral-aware orthogonality penalty of one expert ``B (d_out, r)`` (scalar, >= 0).

    ``sum_{k,l} (w_k w_l (Gram - c^2 I)_{kl})^2`` with ``Gram = B^T B`` (in B's right-singular basis for
    ``basis="singular"``, on its column indices for ``"column"``), ``w`` from :func:`spectral_weights` of
    the singular values (descending) and ``c = ||B||_F / sqrt(r)``; ``w``, ``c`` and the basis are
    detached, so the gradient reaches ``B`` only through the Gram matrix. An SVD failure (degenerate
    ``B``) falls back to uniform weights and the column basis. Computed in float32 or wider.
    """
    if basis not in BASES:
        raise ValueError(f"spectral_penalty: basis must be one of {BASES}, got {basis!r}")
    if B.ndim != 2:
        raise ValueError(f"spectral_penalty: B must be 2-D (d_out, r), got shape {tuple(B.shape)}")
    Bw = B if B.dtype in (torch.float32, torch.float64) else B.float()
    r = Bw.shape[1]
    V = None
    with torch.no_grad():
        try:
            _, sigma, Vh = torch.linalg.svd(Bw.detach().double(), full_matrices=False)
            w = spectral_weights(sigma).to(Bw.dtype)
            V = Vh.T.to(Bw.dtype)
        except RuntimeError:  # torch.linalg.LinAlgError derives from RuntimeError
            w = torch.ones(r, dtype=Bw.dtype, device=Bw.device)
        c2 = Bw.detach().square().sum() / r
    gram = Bw.T @ Bw
    if basis == "singular" and V is not None:
        gram = V.T @ gram @ V
    D = gram - c2 * torch.eye(r, dtype=Bw.dtype, device=Bw.device)
    return (w[:, None] * w[None, :] * D).square().sum()


def spectral_due(step: int, every: int) -> bool:
    """Whether the spectral term is added at ``step`` (0-based): ``step > 0`` and ``step % every == 0``."""
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be an int >= 0, got {step!r}")
    if not _pos_int(every):
        raise ValueError(f"spectral_every must be an int >= 1, got {every!r}")
    return step > 0 and step % every == 0


# ------------------------------------------------------------------------------------------------
# layers
# ------------------------------------------------------------------------------------------------

class _Adapter(nn.Module):
    """One named mtLoRA adapter at one place: ``A (r, d_in)``, ``B (E, d_out, r)``, ``router (E G, d_in)``."""

    def __init__(self, d_in: int, d_out: int, rank: int, num_experts: int, group_size: int, scaling: float,
                 dropout: float, generator: torch.Generator | None, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.d_in, self.d_out, self.rank, self.num_experts = d_in, d_out, rank, num_experts
        self.group_size, self.groups, self.scaling = group_size, d_out // group_size, float(scaling)
        bound = 1.0 / math.sqrt(d_in)  # kaiming_uniform(a=sqrt 5) on a (., d_in) weight
        A = (torch.rand(rank, d_in, generator=generator) * 2 - 1) * bound
        self.A = nn.Parameter(A.to(dtype=dtype, device=device))
        self.B = nn.Parameter(torch.zeros(num_experts, d_out, rank, dtype=dtype, device=device))
        if num_experts > 1:
            R = (torch.rand(num_experts * self.groups, d_in, generator=generator) * 2 - 1) * bound
            self.router: nn.Parameter | None = nn.Parameter(R.to(dtype=dtype, device=device))
        else:
            self.router = None
        self.drop = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.last_routing: torch.Tensor | None = None
        self.where = ""

    def routing(self, x: torch.Tensor) -> torch.Tensor:
        """Routing weights ``(..., G, E)`` of inputs ``x (..., d_in)`` (all ones when E = 1)."""
        if self.router is None:
            return x.new_ones((*x.shape[:-1], 1, 1))
        return routing_weights(x @ self.router.T, self.groups, self.num_experts, where=self.where)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.to(self.A.dtype)
        z = self.drop(x) @ self.A.T                                   # (..., r)
        u = torch.einsum("...r,edr->...ed", z, self.B)                # (..., E, d_out)
        if self.router is None:
            out = u[..., 0, :]
        else:
            g = self.routing(x)                                       # (..., G, E)
            self.last_routing = g if torch.is_grad_enabled() else g.detach()
            u = u.reshape(*u.shape[:-1], self.groups, self.group_size)
            out = (u * g.transpose(-1, -2).unsqueeze(-1)).sum(-3).reshape(*x.shape[:-1], self.d_out)
        out = out * self.scaling
        if not bool(torch.isfinite(out).all()):
            raise NumericalError(f"{self.where}: the mtLoRA adapter output holds NaN or inf")
        return out


def _owned_base(base: nn.Module) -> nn.Linear:
    if not isinstance(base, nn.Linear):
        raise TypeError(f"mtLoRA wraps nn.Linear layers, got {type(base).__name__}")
    return base


class MtLoRALinear(AdapterLayer):
    """A linear layer that may carry mtLoRA adapters and/or pass its input on to other layers' adapters.

    ``forward(x (..., in)) -> (..., out)`` is ``base(x) + sum_active adapter(u)`` where ``u`` is ``x`` for
    adapters placed on this layer itself ("component") and the input last seen by the block's input
    layer for block-level adapters (that layer is an :class:`MtLoRALinear` too, which records its input
    for its *sinks*). Adapters live in ``self.mtlora`` (an ``nn.ModuleDict`` by name).
    """

    adapter_store = "mtlora"
    adapter_fields = ("mtlora", "adapter_config")
    adapter_label = "mtLoRA adapter"
    family = "mtLoRA"
    mergeable = False

    def __init__(self, base_layer: nn.Module, layer_name: str = "") -> None:
        super().__init__(_owned_base(base_layer), layer_name)
        self.in_features, self.out_features = base_layer.in_features, base_layer.out_features
        self.mtlora = nn.ModuleDict()
        object.__setattr__(self, "_sinks", [])   # plain list: sinks are not submodules of this layer
        object.__setattr__(self, "_tapped", None)
        self.train(base_layer.training)

    def add_sink(self, sink: "MtLoRALinear") -> None:
        if not any(s is sink for s in self._sinks):
            self._sinks.append(sink)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for s in self._sinks:
            object.__setattr__(s, "_tapped", x)
        result = self.base_layer(x)
        if self.disabled or not self.active_adapters:
            object.__setattr__(self, "_tapped", None)
            return result
        tapped = self._tapped
        object.__setattr__(self, "_tapped", None)
        for name in self.active_adapters:
            src = self.adapter_config[name]["input_from"]
            if src is None:
                u = x
            else:
                if tapped is None:
                    raise RankwiseError(f"mtLoRA adapter {name!r} at {self.layer_name!r} reads the input of "
                                        f"{src!r}, which did not run before it in this forward pass")
                u = tapped
            result = result + self.mtlora[name](u).to(result.dtype)
        return result

    def adapter_parameters(self, name: str) -> list[tuple[nn.Parameter, bool]]:
        return [(p, True) for p in self.mtlora[name].parameters()]

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, adapters={self.adapters}, "
                f"active={self.active_adapters}, sinks={len(self._sinks)}, disabled={self.disabled}")

    def _snapshot(self) -> dict[str, Any]:
        snap = super()._snapshot()
        snap["sinks"] = list(self._sinks)
        return snap

    def _restore(self, snap: dict[str, Any]) -> None:
        super()._restore(snap)
        object.__setattr__(self, "_sinks", snap["sinks"])


# ------------------------------------------------------------------------------------------------
# model-level operations
# ------------------------------------------------------------------------------------------------

def mtlora_layers(model: nn.Module) -> list[tuple[str, MtLoRALinear]]:
    """``(qualified name, MtLoRALinear)`` of every mtLoRA wrapper of ``model``, in model order."""
    return adapters.adapted_layers(model, MtLoRALinear)


def adapter_names(model: nn.Module) -> list[str]:
    return adapters.adapter_names(model, MtLoRALinear)


def _all_or_nothing(model: nn.Module) -> contextlib.AbstractContextManager[None]:
    return adapters.all_or_nothing(model, MtLoRALinear)


def _sync_trainable(model: nn.Module, freeze_base: bool) -> None:
    """Active adapters' parameters trainable, inactive ones frozen; every other parameter frozen if ``freeze_base``."""
    adapters.sync_trainable(model, MtLoRALinear, freeze_base)


def _linear_at(model: nn.Module, name: str) -> nn.Module | None:
    try:
        m = model.get_submodule(name)
    except AttributeError:
        return None
    return m if isinstance(m, (nn.Linear, MtLoRALinear)) else None


def _base_linear(m: nn.Module) -> nn.Linear:
    return m.base_layer if isinstance(m, MtLoRALinear) else m


def _plan(model: nn.Module, config: MtLoRAConfig, target: Selector) -> list[tuple[str | None, str]]:
    """``[(input layer name or None, output layer name)]`` of the places to adapt, in model order."""
    wrapped = {n for n, _ in mtlora_layers(model)}
    names = [n for n, _ in model.named_modules() if n and not any(n.startswith(w + ".") for w in wrapped)]
    if config.placement == "component":
        hits = select(model, config.target if target is None else target, allow_empty=True)
        out = []
        for n, m in hits:
            owner = next((w for w in wrapped if n.startswith(w + ".")), None)
            if owner is not None:
                if n == owner + ".base_layer":
                    out.append((None, owner))
                continue
            if isinstance(m, (nn.Linear, MtLoRALinear)):
                out.append((None, n))
        if not out:
            lin = [n for n in names if isinstance(model.get_submodule(n), (nn.Linear, MtLoRALinear))]
            shown_target = config.target if target is None else target
            raise SelectionError(f"mtLoRA (placement='component'): target {shown_target!r} "
                                 f"matched no Linear layer. Available Linear layers: {', '.join(lin[:40]) or 'none'}")
        return list(dict.fromkeys(out))
    kinds = ("attention", "ffn") if config.placement == "both" else (config.placement,)
    block_ok = matcher(target) if target is not None else (lambda n, m: True)
    out = []
    for kind in kinds:
        pairs = tuple(config.block_pairs) + BLOCK_PAIRS[kind]
        found: dict[str, tuple[str, str]] = {}
        for n in names:
            for tap_sfx, out_sfx in pairs:
                if n != out_sfx and not n.endswith("." + out_sfx):
                    continue
                prefix = n[: len(n) - len(out_sfx)].rstrip(".")
                tap = f"{prefix}.{tap_sfx}" if prefix else tap_sfx
                if tap == n or _linear_at(model, tap) is None or _linear_at(model, n) is None:
                    continue
                if prefix in found:
                    continue
                if not block_ok(prefix, model.get_submodule(prefix) if prefix else model):
                    continue
                found[prefix] = (tap, n)
        out.extend(found.values())
    if not out:
        lin = [n for n in names if isinstance(model.get_submodule(n), (nn.Linear, MtLoRALinear))]
        known = "; ".join(f"{k}: " + ", ".join(f"{a} -> {b}" for a, b in v) for k, v in BLOCK_PAIRS.items())
        raise SelectionError(
            f"mtLoRA (placement={config.placement!r}): found no transformer block with a recognisable "
            f"{'/'.join(kinds)} sub-layer{'' if target is None else f' among blocks matching {target!r}'}. "
            f"Known (input -> output) layer pairs: {known}. Linear layers found: {', '.join(lin[:40]) or 'none'}. "
            "Pass MtLoRAConfig(block_pairs=((input_suffix, output_suffix),)) for another architecture, "
            "or placement='component'")
    order = {n: i for i, (n, _) in enumerate(model.named_modules())}
    return sorted(dict.fromkeys(out), key=lambda p: order[p[1]])


def adapt(model: nn.Module, config: MtLoRAConfig | None = None, target: Selector = None,
          name: str = "default") -> nn.Module:
    """Add mtLoRA adapter ``name`` to ``model`` in place and return it.

    Block placements adapt every transformer block with a recognisable FFN/attention sub-layer
    (``target``, if given, selects blocks by their name, e.g. ``"encoder.layer.5"``); ``"component"``
    adapts the linear layers ``target`` (default ``config.target``) selects. The new adapter is the
    active and only trainable one; every other parameter is frozen. Raises ``ValueError`` for a rank
    above min(d_in, d_out) or a group size that does not divide d_out (naming the layer),
    ``SelectionError`` when nothing fits; on any error the model is unchanged.
    """
    config = MtLoRAConfig() if config is None else config
    if not isinstance(config, MtLoRAConfig):
        raise TypeError(f"adapt: config must be an MtLoRAConfig, got {type(config).__name__}")
    if not isinstance(model, nn.Module):
        raise TypeError(f"adapt: model must be an nn.Module, got {type(model).__name__}")
    validate_adapter_name(name)
    places = _plan(model, config, target)
    specs = []
    for tap, out in places:
        base_in = _base_linear(_linear_at(model, tap)) if tap else None
        base_out = _base_linear(_linear_at(model, out))
        d_in = base_in.in_features if base_in is not None else base_out.in_features
        d_out = base_out.out_features
        if config.rank > min(d_in, d_out):
            raise ValueError(f"mtLoRA rank={config.rank} for {out!r} exceeds min(d_in={d_in}, d_out={d_out}) = "
                             f"{min(d_in, d_out)}; choose rank in [1, {min(d_in, d_out)}]")
        gs = _group_size(config, d_out)
        if d_out % gs:
            raise ValueError(f"mtLoRA routing_group_size={gs} does not divide d_out={d_out} of {out!r}; "
                             f"choose a divisor of {d_out}")
        existing = _linear_at(model, out)
        if isinstance(existing, MtLoRALinear) and name in existing.mtlora:
            raise ValueError(f"layer {out!r} already has an mtLoRA adapter named {name!r}; choose another name "
                             "or delete it first")
        specs.append((tap, out, d_in, d_out, gs, base_out))
    gen = torch.Generator().manual_seed(config.seed) if config.seed is not None else None
    with _all_or_nothing(model):
        for tap, out, d_in, d_out, gs, base_out in specs:
            _install(model, name, tap, out, d_in, d_out, gs, config.rank, config.num_experts,
                     config.alpha / config.rank, config.dropout, gen, base_out.weight.dtype, base_out.weight.device,
                     _config_record(config, gs))
        for _, layer in mtlora_layers(model):
            if name not in layer.mtlora:
                layer.active_adapters = []
        _sync_trainable(model, freeze_base=True)
    return model


apply_mtlora = adapt


def _config_record(config: MtLoRAConfig, gs: int) -> dict[str, Any]:
    return {"method": "mtlora", "rank": config.rank, "alpha": config.alpha, "num_experts": config.num_experts,
            "placement": config.placement, "routing_group_size": gs, "dropout": config.dropout,
            "balance_alpha": config.balance_alpha, "spectral_lambda": config.spectral_lambda,
            "spectral_every": config.spectral_every, "spectral_basis": config.spectral_basis,
            "spectral_max_matrices": config.spectral_max_matrices}


def _wrap(model: nn.Module, lname: str) -> MtLoRALinear:
    mod = model.get_submodule(lname)
    if isinstance(mod, MtLoRALinear):
        return mod
    layer = MtLoRALinear(mod, layer_name=lname)
    replace_module(model, lname, layer)
    return layer


def _install(model: nn.Module, name: str, tap: str | None, out: str, d_in: int, d_out: int, gs: int, rank: int,
             num_experts: int, scaling: float, dropout: float, gen: torch.Generator | None, dtype: torch.dtype,
             device: torch.device, record: dict[str, Any]) -> _Adapter:
    out_layer = _wrap(model, out)
    if tap is not None:
        _wrap(model, tap).add_sink(out_layer)
    ad = _Adapter(d_in, d_out, rank, num_experts, gs, scaling, dropout, gen, dtype, device)
    ad.where = f"{out} [{name}]"
    out_layer.mtlora[name] = ad
    out_layer.adapter_config[name] = dict(record, input_from=tap, scaling=scaling)
    out_layer.active_adapters = [name]
    return ad


def _require_adapter(model: nn.Module, name: str) -> list[tuple[str, MtLoRALinear]]:
    return adapters.require_adapter(model, name, MtLoRALinear)


def set_active(model: nn.Module, names: str | Sequence[str]) -> None:
    """Make ``names`` the active (trainable) adapter(s) of every mtLoRA layer; the others inactive (frozen)."""
    adapters.set_active(model, names, MtLoRALinear)


def enable_adapters(model: nn.Module) -> None:
    adapters.enable_adapters(model, MtLoRALinear)


def disable_adapters(model: nn.Module) -> None:
    """Make the model compute the base model's outputs (adapters kept)."""
    adapters.disable_adapters(model, MtLoRALinear)


_NO_MERGE = ("mtLoRA adapters cannot be merged into the base weights: the expert mixture is weighted per token by "
             "the router (input dependent), and a block-level adapter reads the FFN's input and adds to its output "
             "around the non-linearity, so no fixed weight matrix computes the same function. Keep the adapters "
             "as modules (disable_adapters gives the base model)")


def merge(model: nn.Module) -> nn.Module:
    """Always raises :class:`RankwiseError`: a routed, block-level adapter has no weight-space equivalent."""
    raise RankwiseError(_NO_MERGE)


def unmerge(model: nn.Module) -> nn.Module:
    """Always raises :class:`RankwiseError` (nothing can have been merged)."""
    raise RankwiseError("no mtLoRA adapter is merged (mtLoRA adapters cannot be merged)")


def _prune(model: nn.Module) -> None:
    """Drop sinks no adapter reads from and unwrap layers that carry nothing."""
    layers = mtlora_layers(model)
    needed: dict[str, list[MtLoRALinear]] = {}
    for _, layer in layers:
        for cfg in layer.adapter_config.values():
            if cfg.get("input_from") is not None:
                needed.setdefault(cfg["input_from"], []).append(layer)
    for lname, layer in layers:
        keep = needed.get(lname, [])
        object.__setattr__(layer, "_sinks", [s for s in layer._sinks if any(s is k for k in keep)])
    for lname, layer in layers:
        if not layer.adapters and not layer._sinks:
            replace_module(model, lname, layer.base_layer)


def delete_adapter(model: nn.Module, name: str) -> None:
    """Remove adapter ``name`` everywhere, then drop unused sinks and unwrap layers that carry nothing."""
    adapters.delete_adapter(model, name, MtLoRALinear, unwrap_empty=False, after=_prune)


def unload(model: nn.Module) -> nn.Module:
    """Remove every mtLoRA wrapper (and adapter), giving back the base model's modules."""
    return adapters.unload(model, MtLoRALinear, merge_first=False)


# ------------------------------------------------------------------------------------------------
# training objective and diagnostics
# ------------------------------------------------------------------------------------------------

def _active(model: nn.Module, name: str | None) -> list[tuple[str, str, _Adapter, dict[str, Any]]]:
    out = []
    for lname, layer in mtlora_layers(model):
        for n in layer.adapters:
            if (name is None and n in layer.active_adapters) or n == name:
                out.append((lname, n, layer.mtlora[n], layer.adapter_config[n]))
    return out


def mtlora_regularizers(model: nn.Module, step: int, name: str | None = None) -> torch.Tensor:
    """``balance_alpha * L_bal + spectral_lambda * L_spec`` (the latter only on scheduled steps), a scalar.

    ``L_bal`` sums :func:`balance_loss` over the adapters' routing weights of the last forward pass
    (run the model first; tokens are not masked, as in HydraLoRA). ``L_spec`` is the mean of
    :func:`spectral_penalty` over the experts ``B_i`` of every adapter, at most
    ``spectral_max_matrices`` of them (a sample drawn from ``Generator(step)``). ``balance_alpha`` comes
    from each adapter's config; the spectral settings (lambda, schedule, basis, sample size) from the
    first adapter's. ``name``: one adapter (default: the active ones). A non-finite result
    raises :class:`NumericalError`.
    """
    ads = _active(model, name)
    if not ads:
        raise RankwiseError(f"the model has no {'active ' if name is None else ''}mtLoRA adapter"
                            f"{'' if name is None else f' named {name!r}'}")
    total: torch.Tensor | None = None
    for _lname, _n, ad, cfg in ads:
        if ad.router is not None and cfg["balance_alpha"] > 0:
            if ad.last_routing is None:
                raise RankwiseError(f"{ad.where}: no routing weights recorded; run a forward pass before "
                                    "mtlora_regularizers")
            term = cfg["balance_alpha"] * balance_loss(ad.last_routing)
            total = term if total is None else total + term
    cfg0 = ads[0][3]
    if cfg0["spectral_lambda"] > 0 and spectral_due(step, cfg0["spectral_every"]):
        mats = [(ad, i) for _l, _n, ad, _c in ads for i in range(ad.num_experts)]
        limit = cfg0["spectral_max_matrices"]
        if len(mats) > limit:
            idx = torch.randperm(len(mats), generator=torch.Generator().manual_seed(step))[:limit].tolist()
            mats = [mats[i] for i in sorted(idx)]
        spec = torch.stack([spectral_penalty(ad.B[i], cfg0["spectral_basis"]) for ad, i in mats]).mean()
        term = cfg0["spectral_lambda"] * spec
        total = term if total is None else total + term.to(total.dtype)
    if total is None:
        p = ads[0][2].A
        return p.new_zeros((), dtype=torch.float32)
    if not bool(torch.isfinite(total).all()):
        raise NumericalError(f"mtLoRA regulariser is not finite ({float(total)}) at step {step}")
    return total


@torch.no_grad()
def routing_report(model: nn.Module, name: str | None = None) -> list[dict[str, Any]]:
    """Per adapter: the mean routing weight of each expert over the last forward pass (and its groups)
    and the balance term; ``mean_routing`` is None for E = 1."""
    rows = []
    for lname, n, ad, _cfg in _active(model, name):
        r = ad.last_routing
        p_bar = None if r is None else r.reshape(-1, ad.num_experts).double().mean(0).tolist()
        rows.append({"layer": lname, "adapter": n, "experts": ad.num_experts, "groups": ad.groups,
                     "mean_routing": p_bar, "balance": None if r is None else float(balance_loss(r))})
    return rows


@torch.no_grad()
def spectrum_report(model: nn.Module, name: str | None = None) -> list[dict[str, Any]]:
    """Per adapter and expert: the singular values of ``B_i`` (descending, float64) and the spectral
    weights ``w`` the regulariser would use (the paper's singular-value-spectrum diagnostics)."""
    rows = []
    for lname, n, ad, _cfg in _active(model, name):
        for i in range(ad.num_experts):
            sigma = torch.linalg.svdvals(ad.B[i].detach().double())
            rows.append({"layer": lname, "adapter": n, "expert": i, "singular_values": sigma.tolist(),
                         "weights": spectral_weights(sigma).tolist()})
    return rows


# ------------------------------------------------------------------------------------------------
# save / load
# ------------------------------------------------------------------------------------------------

def save_adapter(model: nn.Module, directory: str | Path, name: str = "default", *,
                 overwrite: bool | None = None) -> Path:
    """Save adapter ``name`` to ``directory`` atomically (``adapter_model.safetensors`` + ``adapter_config.json``).

    Tensors per adapted layer ``m``: ``m.mtlora_A (r, d_in)``, ``m.mtlora_B (E, d_out, r)`` and, when
    E > 1, ``m.mtlora_router (E G, d_in)``; the header holds the per-layer settings (including the
    input layer of block-level adapters), the base-model fingerprint and SHA-256 digests.
    """
    layers = _require_adapter(model, name)
    tensors: dict[str, torch.Tensor] = {}
    modules: dict[str, dict[str, Any]] = {}
    for lname, layer in layers:
        ad = layer.mtlora[name]
        tensors[f"{lname}.mtlora_A"] = ad.A.detach()
        tensors[f"{lname}.mtlora_B"] = ad.B.detach()
        if ad.router is not None:
            tensors[f"{lname}.mtlora_router"] = ad.router.detach()
        modules[lname] = dict(layer.adapter_config[name])
    meta = {"kind": _KIND, "name": name, "modules": modules, "fingerprint": io.model_fingerprint(model)}
    directory = Path(directory)
    if overwrite is None:
        overwrite = directory.is_dir() and all(p.is_file() and p.name in _OWN_FILES for p in directory.iterdir())
    with io.atomic_dir(directory, overwrite=bool(overwrite)) as tmp:
        io.write_json(tmp / CONFIG_FILE, {"method": "mtlora", "name": name, "modules": modules})
        io.save_tensors(tmp / WEIGHTS_FILE, tensors, meta)
    return directory


def _check_record(path: Path, m: str, cfg: Any) -> None:
    ok = (isinstance(cfg, dict) and _pos_int(cfg.get("rank")) and _pos_int(cfg.get("num_experts"))
          and _pos_int(cfg.get("routing_group_size")) and _number(cfg.get("scaling"))
          and _number(cfg.get("dropout")) and 0.0 <= float(cfg["dropout"]) < 1.0
          and (cfg.get("input_from") is None or isinstance(cfg.get("input_from"), str))
          and _number(cfg.get("balance_alpha")) and _number(cfg.get("spectral_lambda"))
          and _pos_int(cfg.get("spectral_every")) and cfg.get("spectral_basis") in BASES
          and _pos_int(cfg.get("spectral_max_matrices")))
    if not ok:
        raise ArtifactError(f"{path}: bad metadata for module {m!r}")


def load_adapter(model: nn.Module, directory: str | Path, name: str = "default", *,
                 check_base: bool = True) -> nn.Module:
    """Load an adapter written by :func:`save_adapter` into ``model`` as adapter ``name`` (active, trainable).

    ArtifactError (model unchanged) for a missing, corrupt or truncated file, another artefact kind,
    another base model (fingerprint; skip with ``check_base=False``), or layers that do not fit.
    An adapter of the same name is replaced.
    """
    validate_adapter_name(name)
    directory = Path(directory)
    if not directory.is_dir():
        raise ArtifactError(f"{directory}: no such adapter directory")
    path = directory / WEIGHTS_FILE
    tensors, meta = io.load_tensors(path)
    if meta.get("kind") != _KIND:
        raise ArtifactError(f"{path}: not a rankwise mtLoRA adapter (kind={meta.get('kind')!r})")
    modules = meta.get("modules")
    if not isinstance(modules, dict) or not modules:
        raise ArtifactError(f"{path}: metadata lacks the module table")
    expected: set[str] = set()
    for m, cfg in modules.items():
        _check_record(path, m, cfg)
        expected |= {f"{m}.mtlora_A", f"{m}.mtlora_B"} | ({f"{m}.mtlora_router"} if cfg["num_experts"] > 1 else set())
    if set(tensors) != expected:
        raise ArtifactError(f"{path}: tensors do not match the module table (missing "
                            f"{sorted(expected - set(tensors))[:4]}, unexpected {sorted(set(tensors) - expected)[:4]})")
    if check_base:
        io.check_fingerprint(meta.get("fingerprint"), model, source=str(path))
    problems: list[str] = []
    for m, cfg in modules.items():
        out, tap = _linear_at(model, m), cfg["input_from"]
        if out is None:
            problems.append(f"module {m!r} is not a Linear layer of this model")
            continue
        if tap is not None and _linear_at(model, tap) is None:
            problems.append(f"input layer {tap!r} of {m!r} is not a Linear layer of this model")
            continue
        d_in = _base_linear(_linear_at(model, tap)).in_features if tap else _base_linear(out).in_features
        d_out = _base_linear(out).out_features
        r, e, gs = cfg["rank"], cfg["num_experts"], cfg["routing_group_size"]
        shapes = {"A": (r, d_in), "B": (e, d_out, r), "router": ((d_out // gs) * e, d_in)}
        bad = [k for k in shapes
               if f"{m}.mtlora_{k}" in tensors and tuple(tensors[f"{m}.mtlora_{k}"].shape) != shapes[k]]
        if d_out % gs or bad or len({tensors[k].dtype for k in tensors if k.startswith(m + ".mtlora_")}) != 1:
            problems.append(f"module {m!r}: tensors {bad or 'dtypes/group size'} do not fit d_in={d_in}, "
                            f"d_out={d_out}, r={r}, E={e}, group size {gs}")
    if problems:
        raise ArtifactError(f"{path} does not fit this model: {'; '.join(problems[:5])}")
    with _all_or_nothing(model):
        for _, layer in mtlora_layers(model):
            if name in layer.mtlora:
                del layer.mtlora[name]
                layer.adapter_config.pop(name, None)
                layer.active_adapters = [n for n in layer.active_adapters if n != name]
        for m, cfg in modules.items():
            A, B = tensors[f"{m}.mtlora_A"], tensors[f"{m}.mtlora_B"]
            d_out, d_in = B.shape[1], A.shape[1]
            record = {k: v for k, v in cfg.items() if k not in ("input_from", "scaling")}
            ad = _install(model, name, cfg["input_from"], m, d_in, d_out, cfg["routing_group_size"], cfg["rank"],
                          cfg["num_experts"], float(cfg["scaling"]), float(cfg["dropout"]),
                          torch.Generator().manual_seed(0), A.dtype,
                          _base_linear(model.get_submodule(m)).weight.device, record)
            with torch.no_grad():
                ad.A.copy_(A)
                ad.B.copy_(B)
                if ad.router is not None:
                    ad.router.copy_(tensors[f"{m}.mtlora_router"])
        for _, layer in mtlora_layers(model):
            if name not in layer.mtlora:
                layer.active_adapters = []
        _prune(model)
        _sync_trainable(model, freeze_base=True)
    return model


register("mtlora", config=MtLoRAConfig, entry=adapt)
