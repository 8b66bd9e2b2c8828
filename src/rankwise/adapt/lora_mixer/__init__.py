"""LoRA-Mixer: token-routed LoRA experts inside the projections, with the Routing Specialization Loss.

Paper: "LoRA-Mixer: Coordinate Modular LoRA Experts Through Serial Attention Routing" (Li et al.,
ICLR 2026, arXiv 2507.00029). Equation numbers are those of the ICLR version.

Each targeted projection ``W (d_out, d_in)`` (attention Q, K, V, O; ``in_proj``/``out_proj`` of SSM
blocks) gets ``E`` LoRA experts ``s_e B_e A_e`` (PEFT naming: ``A_e (r_e, d_in)``, ``B_e (d_out, r_e)``,
``s_e = alpha / r_e``) and a per-token router ``p(x) = softmax(W_r x)``, ``W_r (E, d_in)`` (Eq. 4)::

    y = W x + sum_e  g_e(x) * s_e B_e A_e dropout(x)

so the routed update flows on serially into the attention/SSM mixer. The gate ``g`` depends on the
fusion mode: ``"soft"`` (training: ``g = p``, all experts, fully differentiable), ``"topk"`` (inference:
the ``K = min(top_k_infer, E)`` largest ``p_e``, ties to the lowest index, renormalised to sum 1 unless
``renormalize=False``; with ``K = E`` exactly the soft gate) or ``"hard"`` (stage 1 of the hard-soft
scheme: a one-hot gate from each example's domain label, :func:`hard_routing`). By default the model's
``train()``/``eval()`` mode picks soft/top-K; :func:`fusion` forces one.

Routing Specialization Loss (Sec. 3.3, Eq. 3 and 5), per adapted layer over the N (non-padding) tokens::

    p_bar_i = mean_x p_i(x);   f_bar_i = share of the top-k routing slots taken by expert i (no gradient)
    L_RSL   = alpha * E * sum_i p_bar_i f_bar_i  + entropy_sign * lambda * mean_x H(p(x))

(the factor E — Switch Transformer's normalisation — makes the balance term equal alpha at uniform
routing, as the spec's check states; Eq. 3 prints it without E, which only rescales alpha).

``entropy_sign = +1`` (default) *lowers* the per-token entropy when minimised (sharp, selective
routing: the mechanism the paper describes); ``-1`` is Eq. 5 as printed (raises it). With
``lambda = 0`` it is the plain auxiliary loss of Eq. 3. :func:`rsl_loss` sums it over the layers;
:func:`preserve_loss` is Eq. 11, ``beta * sum ||theta_i - theta_i^(0)||^2`` over loaded experts.

Experts come from :func:`adapt` (new: ``A`` Kaiming-uniform, ``B = 0``, router ``N(0, 0.02^2)``) or
from existing LoRAs (``experts=[...]``: PEFT/rankwise LoRA directories, rankwise ``AdapterState``
files or objects), frozen by default — the plug-and-play regime, where only the router trains.

A routed mixture depends on the input, so it cannot be merged into ``W``: :func:`merge` raises.
"""

from __future__ import annotations

import contextlib
import math
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Sequence, Union

import torch
from torch import nn

from rankwise.core import adapters, io
from rankwise.core.adapters import AdapterLayer, validate_adapter_name
from rankwise.core.errors import ArtifactError, NumericalError, RankwiseError
from rankwise.core.lora import AdapterState
from rankwise.core.registry import register
from rankwise.core.select import Selector
from rankwise.core.surgery import replace_module

__all__ = [
    "FUSIONS",
    "LoRAMixerConfig",
    "LoRAMixerLinear",
    "adapt",
    "adapter_names",
    "apply_lora_mixer",
    "delete_adapter",
    "disable_adapters",
    "enable_adapters",
    "fusion",
    "hard_routing",
    "load_adapter",
    "merge",
    "mixer_layers",
    "normalized_entropy",
    "preserve_loss",
    "routing_stats",
    "rsl_loss",
    "rsl_terms",
    "save_adapter",
    "set_active",
    "set_stage",
    "topk_gate",
    "unload",
    "unmerge",
]

FUSIONS = ("soft", "topk", "hard")
SHARE = ("none", "layer")
#: Projections that read the same input within a layer (their router is shared with share_router="layer").
_QKV = ("query", "key", "value", "q_proj", "k_proj", "v_proj")
F_DEFINITIONS = ("topk", "top1")
STAGES = ("experts", "router", "all")
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_KIND = "rankwise.lora_mixer"
_OWN_FILES = {CONFIG_FILE, WEIGHTS_FILE}
#: Probabilities are clamped to this floor inside log p of the entropy (p log p -> 0 as p -> 0).
LOG_FLOOR = 1e-12
DEFAULT_TARGET = ("query", "key", "value", "attention.output.dense", "q_proj", "k_proj", "v_proj", "o_proj",
                  "in_proj", "out_proj")
ExpertSource = Union[str, Path, AdapterState]


def _pos_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 1


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(float(v))


# ------------------------------------------------------------------------------------------------
# configuration
# ------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class LoRAMixerConfig:
    """LoRA-Mixer hyper-parameters (paper App. A.6/A.8 where stated; choices documented otherwise).

    Attributes:
        num_experts: E >= 1 (one per task/domain). E = 1 is plain LoRA (warning).
        rank, alpha: LoRA rank and scaling numerator of new experts (paper: r = 64, lora_alpha = 128).
        dropout: dropout on the experts' input, in [0, 1) (paper 0.1).
        top_k_infer: K >= 1 experts kept per token at inference (paper 3); capped at E with a warning.
        renormalize: renormalise the K kept weights to sum 1 (choice; the paper does not say).
        target: projection names (attention Q/K/V/O of BERT- and Llama-style models, SSM in/out_proj).
        rsl_alpha, rsl_lambda: alpha (balance) and lambda (entropy) of the RSL (choice: 0.01 each).
        entropy_sign: +1 (default: minimising lowers per-token entropy) or -1 (Eq. 5 as printed).
        f_definition: "topk" (f_bar = top-k slot share / k, default; = Eq. 3 for k = 1) or "top1" (Eq. 3).
        preserve_beta: beta of the expert-preservation term (Eq. 11; choice 1e-3).
        router_std: std of the router's normal initialisation (0.02).
        share_router: "none" (default: one router per projection; choice) or "layer" (one router shared by the
            query/key/value projections of a layer, which read the same input).
        seed: seeds the initialisation; None: the global RNG.
    """

    num_experts: int = 4
    rank: int = 64
    alpha: float = 128.0
    dropout: float = 0.1
    top_k_infer: int = 3
    renormalize: bool = True
    target: tuple[str, ...] = DEFAULT_TARGET
    rsl_alpha: float = 0.01
    rsl_lambda: float = 0.01
    entropy_sign: int = 1
    f_definition: str = "topk"
    preserve_beta: float = 1e-3
    router_std: float = 0.02
    share_router: str = "none"
    seed: int | None = 0

    def __post_init__(self) -> None:
        for f in ("num_experts", "rank"):
            if not _pos_int(getattr(self, f)):
                raise ValueError(f"LoRAMixerConfig.{f} must be an int >= 1, got {getattr(self, f)!r}")
        if isinstance(self.top_k_infer, bool) or not isinstance(self.top_k_infer, int) or self.top_k_infer < 1:
            raise ValueError(f"LoRAMixerConfig.top_k_infer must be an int >= 1, got {self.top_k_infer!r}")
        if self.top_k_infer > self.num_experts:
            warnings.warn(f"LoRAMixerConfig: top_k_infer={self.top_k_infer} > num_experts={self.num_experts}; "
                          f"capped at {self.num_experts}", stacklevel=3)
            object.__setattr__(self, "top_k_infer", self.num_experts)
        if self.num_experts == 1:
            warnings.warn("LoRAMixerConfig: num_experts=1 is plain LoRA (the router has nothing to choose)",
                          stacklevel=3)
        if not _number(self.alpha) or float(self.alpha) <= 0:
            raise ValueError(f"LoRAMixerConfig.alpha must be a finite number > 0, got {self.alpha!r}")
        if not _number(self.dropout) or not 0.0 <= float(self.dropout) < 1.0:
            raise ValueError(f"LoRAMixerConfig.dropout must be in [0, 1), got {self.dropout!r}")
        if not isinstance(self.renormalize, bool):
            raise ValueError(f"LoRAMixerConfig.renormalize must be a bool, got {self.renormalize!r}")
        target = (self.target,) if isinstance(self.target, str) else self.target
        if not isinstance(target, (tuple, list)) or not target or not all(isinstance(t, str) and t for t in target):
            raise ValueError(f"LoRAMixerConfig.target must be a non-empty tuple of module-name patterns, "
                             f"got {self.target!r} (pass types or callables to adapt(target=...))")
        object.__setattr__(self, "target", tuple(target))
        for f in ("rsl_alpha", "rsl_lambda", "preserve_beta"):
            v = getattr(self, f)
            if not _number(v) or float(v) < 0:
                raise ValueError(f"LoRAMixerConfig.{f} must be a finite number >= 0, got {v!r}")
            object.__setattr__(self, f, float(v))
        if self.entropy_sign not in (1, -1) or isinstance(self.entropy_sign, bool):
            raise ValueError(f"LoRAMixerConfig.entropy_sign must be +1 or -1, got {self.entropy_sign!r}")
        if self.f_definition not in F_DEFINITIONS:
            raise ValueError(f"LoRAMixerConfig.f_definition must be one of {F_DEFINITIONS}, got {self.f_definition!r}")
        if self.share_router not in SHARE:
            raise ValueError(f"LoRAMixerConfig.share_router must be one of {SHARE}, got {self.share_router!r}")
        if not _number(self.router_std) or float(self.router_std) <= 0:
            raise ValueError(f"LoRAMixerConfig.router_std must be a finite number > 0, got {self.router_std!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)):
            raise ValueError(f"LoRAMixerConfig.seed must be an int or None, got {self.seed!r}")
        object.__setattr__(self, "alpha", float(self.alpha))
        object.__setattr__(self, "dropout", float(self.dropout))
        object.__setattr__(self, "router_std", float(self.router_std))


def num_parameters(d_in: int, d_out: int, rank: int, num_experts: int) -> int:
    """Trainable parameters of one adapted projection: ``E r (d_in + d_out) + E d_in`` (experts + router)."""
    return num_experts * rank * (d_in + d_out) + num_experts * d_in


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


# ------------------------------------------------------------------------------------------------
# layers
# ------------------------------------------------------------------------------------------------

class _Mixer(nn.Module):
    """One named LoRA-Mixer adapter of one projection: experts ``A[e] (r_e, d_in)``, ``B[e] (d_out, r_e)``,
    router ``(E, d_in)``, per-expert scalings."""

    def __init__(self, d_in: int, d_out: int, ranks: Sequence[int], scalings: Sequence[float], dropout: float,
                 router_std: float, generator: torch.Generator, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.d_in, self.d_out, self.num_experts = d_in, d_out, len(ranks)
        bound = 1.0 / math.sqrt(d_in)  # kaiming_uniform(a=sqrt 5), PEFT's lora_A init
        self.A = nn.ParameterList([nn.Parameter(((torch.rand(r, d_in, generator=generator) * 2 - 1) * bound)
                                                .to(dtype=dtype, device=device)) for r in ranks])
        self.B = nn.ParameterList([nn.Parameter(torch.zeros(d_out, r, dtype=dtype, device=device)) for r in ranks])
        self.router = nn.Parameter((torch.randn(len(ranks), d_in, generator=generator) * router_std)
                                   .to(dtype=dtype, device=device))
        self.scalings = [float(s) for s in scalings]
        self.drop = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.frozen: list[bool] = [False] * len(ranks)
        self.reference: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}   # theta^(0) of preserved experts
        self.last_p: torch.Tensor | None = None
        self.where = ""

    def probabilities(self, x: torch.Tensor) -> torch.Tensor:
        logits = x @ self.router.T
        if not bool(torch.isfinite(logits).all()):
            raise NumericalError(f"{self.where}: router logits hold NaN or inf")
        return torch.softmax(logits.float(), dim=-1).to(x.dtype)

    def forward(self, x: torch.Tensor, mode: str, k: int, renormalize: bool,
                hard: torch.Tensor | None) -> torch.Tensor:
        x = x.to(self.router.dtype)
        p = self.probabilities(x)
        self.last_p = p if torch.is_grad_enabled() else p.detach()
        if mode == "hard":
            if hard is None:
                raise RankwiseError(f"{self.where}: hard routing needs expert labels (use hard_routing(model, labels))")
            if hard.shape[0] != x.shape[0]:
                raise ValueError(f"{self.where}: {hard.shape[0]} hard-routing labels for a batch of {x.shape[0]}")
            gate = nn.functional.one_hot(hard, self.num_experts).to(x.dtype)
            gate = gate.reshape(gate.shape[0], *([1] * (x.ndim - 2)), self.num_experts).expand(*x.shape[:-1], -1)
        elif mode == "soft":
            gate = p
        else:
            gate = topk_gate(p, k, renormalize)
        xd = self.drop(x)
        out = None
        for e in range(self.num_experts):
            ge = gate[..., e:e + 1]
            if mode == "hard" and not bool(ge.any()):
                continue  # no example of the batch uses this expert (skips its compute; same result)
            u = (xd @ self.A[e].T) @ self.B[e].T * self.scalings[e]
            out = ge * u if out is None else out + ge * u
        if out is None:
            out = x.new_zeros((*x.shape[:-1], self.d_out))
        if not bool(torch.isfinite(out).all()):
            raise NumericalError(f"{self.where}: the LoRA-Mixer output holds NaN or inf")
        return out


class LoRAMixerLinear(AdapterLayer):
    """A linear layer with named LoRA-Mixer adapters: ``y = base(x) + sum_active mixer(x)``.

    Shapes: ``x (..., in_features) -> (..., out_features)``. Fusion: "soft" in training mode, "topk" in
    eval mode, unless forced by :func:`fusion`; "hard" inside :func:`hard_routing`.
    """

    adapter_store = "mixer"
    adapter_fields = ("mixer", "adapter_config")
    adapter_label = "LoRA-Mixer adapter"
    family = "LoRA-Mixer"
    mergeable = False

    def __init__(self, base_layer: nn.Module, layer_name: str = "") -> None:
        if not isinstance(base_layer, nn.Linear):
            raise TypeError(f"LoRA-Mixer wraps nn.Linear layers, got {type(base_layer).__name__} at {layer_name!r}")
        super().__init__(base_layer, layer_name)
        self.in_features, self.out_features = base_layer.in_features, base_layer.out_features
        self.mixer = nn.ModuleDict()
        self.forced_fusion: str | None = None
        self.hard_labels: torch.Tensor | None = None
        self.train(base_layer.training)

    def fusion_mode(self) -> str:
        if self.hard_labels is not None:
            return "hard"
        if self.forced_fusion is not None:
            return self.forced_fusion
        return "soft" if self.training else "topk"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        result = self.base_layer(x)
        if self.disabled:
            return result
        mode = self.fusion_mode()
        for name in self.active_adapters:
            cfg = self.adapter_config[name]
            result = result + self.mixer[name](x, mode, cfg["top_k_infer"], cfg["renormalize"],
                                               self.hard_labels).to(result.dtype)
        return result

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, adapters={self.adapters}, "
                f"active={self.active_adapters}, disabled={self.disabled}")

    def _snapshot(self) -> dict[str, Any]:
        snap = super()._snapshot()
        snap["frozen"] = {n: list(m.frozen) for n, m in self.mixer.items()}
        return snap

    def _restore(self, snap: dict[str, Any]) -> None:
        super()._restore(snap)
        for n, fr in snap["frozen"].items():
            self.mixer[n].frozen = fr


# ------------------------------------------------------------------------------------------------
# model-level operations
# ------------------------------------------------------------------------------------------------

def mixer_layers(model: nn.Module) -> list[tuple[str, LoRAMixerLinear]]:
    """``(qualified name, LoRAMixerLinear)`` of every LoRA-Mixer layer of ``model``, in model order."""
    return adapters.adapted_layers(model, LoRAMixerLinear)


def adapter_names(model: nn.Module) -> list[str]:
    return adapters.adapter_names(model, LoRAMixerLinear)


def _all_or_nothing(model: nn.Module) -> contextlib.AbstractContextManager[None]:
    return adapters.all_or_nothing(model, LoRAMixerLinear)


def _sync_trainable(model: nn.Module, freeze_base: bool, stage: str = "all") -> None:
    """Active adapters: router trainable unless ``stage == "experts"``; experts trainable unless frozen or
    ``stage == "router"``. Inactive adapters frozen; with ``freeze_base`` every other parameter too."""
    own: set[int] = set()
    for _, layer in mixer_layers(model):
        for name, mx in layer.mixer.items():
            on = name in layer.active_adapters
            mx.router.requires_grad_(on and stage != "experts")
            own.add(id(mx.router))
            for e in range(mx.num_experts):
                for p in (mx.A[e], mx.B[e]):
                    p.requires_grad_(on and stage != "router" and not mx.frozen[e])
                    own.add(id(p))
    if freeze_base:
        for p in model.parameters():
            if id(p) not in own:
                p.requires_grad_(False)


def _target_layers(model: nn.Module, target: Selector) -> list[tuple[str, nn.Module]]:
    return adapters.target_layers(model, target, LoRAMixerLinear)


def _base(m: nn.Module) -> nn.Linear:
    return m.base_layer if isinstance(m, LoRAMixerLinear) else m


def _router_group(lname: str) -> str | None:
    parent, _, last = lname.rpartition(".")
    return parent if last in _QKV else None


def _read_expert(src: ExpertSource, k: int) -> tuple[AdapterState, str]:
    if isinstance(src, AdapterState):
        return src, f"expert {k} (AdapterState)"
    if isinstance(src, (str, Path)):
        path = Path(src)
        if path.is_dir():
            from rankwise.adapt.lora import import_peft   # the family's reference LoRA: PEFT directories

            return import_peft(path), str(path)
        return AdapterState.load(path), str(path)
    raise TypeError(f"expert {k}: expected a LoRA directory, an AdapterState file path or an AdapterState, "
                    f"got {type(src).__name__}")


def adapt(model: nn.Module, config: LoRAMixerConfig | None = None, target: Selector = None, name: str = "default",
          *, experts: Sequence[ExpertSource] | None = None, freeze_experts: bool = True) -> nn.Module:
    """Add LoRA-Mixer adapter ``name`` to the linear layers ``target`` selects (default ``config.target``).

    Without ``experts`` the E experts are new (B = 0: the model's outputs are unchanged). With
    ``experts`` (exactly E LoRAs: PEFT/rankwise LoRA directories, ``AdapterState`` files or objects;
    each must adapt exactly the targeted modules, with matching shapes; ranks and scalings may differ)
    the experts are those LoRAs, frozen unless ``freeze_experts=False`` (then :func:`preserve_loss`
    pulls them towards the loaded weights). The adapter becomes the active one; the base model is
    frozen. On any error the model is unchanged.
    """
    config = LoRAMixerConfig() if config is None else config
    if not isinstance(config, LoRAMixerConfig):
        raise TypeError(f"adapt: config must be a LoRAMixerConfig, got {type(config).__name__}")
    if not isinstance(model, nn.Module):
        raise TypeError(f"adapt: model must be an nn.Module, got {type(model).__name__}")
    validate_adapter_name(name)
    hits = _target_layers(model, config.target if target is None else target)
    for lname, mod in hits:
        b = _base(mod)
        if config.rank > min(b.in_features, b.out_features):
            raise ValueError(f"LoRA-Mixer rank={config.rank} for layer {lname!r} exceeds min(in_features="
                             f"{b.in_features}, out_features={b.out_features}); choose rank in "
                             f"[1, {min(b.in_features, b.out_features)}]")
        if isinstance(mod, LoRAMixerLinear) and name in mod.mixer:
            raise ValueError(f"layer {lname!r} already has a LoRA-Mixer adapter named {name!r}")
    loaded: list[tuple[AdapterState, str]] = []
    if experts is not None:
        if isinstance(experts, (str, Path, AdapterState)) or len(experts) != config.num_experts:
            n = 1 if isinstance(experts, (str, Path, AdapterState)) else len(experts)
            raise ValueError(f"LoRA-Mixer: {n} expert(s) given for num_experts={config.num_experts}; "
                             "give one per expert")
        loaded = [_read_expert(src, k) for k, src in enumerate(experts)]
        names = {n for n, _ in hits}
        for state, src in loaded:
            mods = set(state.modules())
            if mods != names:
                raise ValueError(f"{src}: the LoRA adapts {sorted(mods - names)[:5] or 'no extra module'} beyond the "
                                 f"target and lacks {sorted(names - mods)[:5] or 'nothing'}; the target must select "
                                 "exactly the modules every expert adapts")
            for lname, mod in hits:
                b = _base(mod)
                if state.shape(lname) != (b.out_features, b.in_features):
                    raise ValueError(f"{src}: module {lname!r} has LoRA shape (out, in) = {state.shape(lname)}, but "
                                     f"the model's layer is ({b.out_features}, {b.in_features})")
    gen = torch.Generator().manual_seed(config.seed if config.seed is not None
                                        else int(torch.randint(0, 2**62, (1,)).item()))
    record = {"method": "lora_mixer", "top_k_infer": config.top_k_infer, "renormalize": config.renormalize,
              "dropout": config.dropout, "rsl_alpha": config.rsl_alpha, "rsl_lambda": config.rsl_lambda,
              "entropy_sign": config.entropy_sign, "f_definition": config.f_definition,
              "preserve_beta": config.preserve_beta, "router_std": config.router_std}
    shared: dict[str, _Mixer] = {}
    with _all_or_nothing(model):
        for lname, mod in hits:
            layer = mod if isinstance(mod, LoRAMixerLinear) else LoRAMixerLinear(mod, layer_name=lname)
            if layer is not mod:
                replace_module(model, lname, layer)
            b = layer.base_layer
            if loaded:
                ranks = [s.rank(lname) for s, _ in loaded]
                scalings = [float(s.scaling[lname]) for s, _ in loaded]
            else:
                ranks, scalings = [config.rank] * config.num_experts, [config.alpha / config.rank] * config.num_experts
            mx = _Mixer(b.in_features, b.out_features, ranks, scalings, config.dropout, config.router_std, gen,
                        b.weight.dtype, b.weight.device)
            mx.where = f"{lname} [{name}]"
            if loaded:
                with torch.no_grad():
                    for e, (s, _) in enumerate(loaded):
                        mx.A[e].copy_(s.factors[lname]["lora_A"])
                        mx.B[e].copy_(s.factors[lname]["lora_B"])
                        mx.reference[e] = (mx.A[e].detach().clone(), mx.B[e].detach().clone())
                mx.frozen = [bool(freeze_experts)] * config.num_experts
            group = _router_group(lname) if config.share_router == "layer" else None
            if group is not None:
                if group in shared and shared[group].router.shape == mx.router.shape:
                    mx.router = shared[group].router          # the same Parameter: one router for Q/K/V
                else:
                    shared[group] = mx
            layer.mixer[name] = mx
            layer.adapter_config[name] = dict(record, ranks=ranks, scalings=scalings, router_group=group,
                                              sources=[src for _, src in loaded] or None)
            layer.active_adapters = [name]
        for _, layer in mixer_layers(model):
            if name not in layer.mixer:
                layer.active_adapters = []
        _sync_trainable(model, freeze_base=True)
    return model


apply_lora_mixer = adapt


def _require_adapter(model: nn.Module, name: str) -> list[tuple[str, LoRAMixerLinear]]:
    return adapters.require_adapter(model, name, LoRAMixerLinear)


def set_active(model: nn.Module, names: str | Sequence[str]) -> None:
    """Make ``names`` the active (trainable) adapter(s) of every LoRA-Mixer layer; the others inactive (frozen)."""
    adapters.set_active(model, names, LoRAMixerLinear, _sync_trainable)


def set_stage(model: nn.Module, stage: str) -> None:
    """Choose what trains in the active adapters: "experts" (stage 1, hard routing: experts only),
    "router" (stage 2 / plug-and-play: routers only) or "all" (routers and unfrozen experts).
    Other parameters keep their flags (a task head the caller unfroze stays trainable)."""
    if stage not in STAGES:
        raise ValueError(f"stage must be one of {STAGES}, got {stage!r}")
    if not mixer_layers(model):
        raise RankwiseError("the model has no LoRA-Mixer layers")
    _sync_trainable(model, freeze_base=False, stage=stage)


@contextlib.contextmanager
def hard_routing(model: nn.Module, labels: torch.Tensor) -> Iterator[None]:
    """Inside the block, every example goes to the expert its label names (one-hot gate; stage 1).

    ``labels (batch,)``: integer expert indices in ``[0, E)``; out-of-range labels raise ``ValueError``.
    """
    layers = mixer_layers(model)
    if not layers:
        raise RankwiseError("the model has no LoRA-Mixer layers")
    if not isinstance(labels, torch.Tensor) or labels.ndim != 1 or labels.dtype.is_floating_point:
        raise ValueError("hard_routing: labels must be a 1-D integer tensor (one expert index per example)")
    e_min = min(layer.mixer[n].num_experts for _, layer in layers for n in layer.active_adapters) if any(
        layer.active_adapters for _, layer in layers) else 0
    if labels.numel() and (int(labels.min()) < 0 or int(labels.max()) >= e_min):
        raise ValueError(f"hard_routing: labels must lie in [0, {e_min}) (one per expert), got range "
                         f"[{int(labels.min())}, {int(labels.max())}]")
    for _, layer in layers:
        layer.hard_labels = labels.long()
    try:
        yield
    finally:
        for _, layer in layers:
            layer.hard_labels = None


@contextlib.contextmanager
def fusion(model: nn.Module, mode: str | None) -> Iterator[None]:
    """Force "soft" or "topk" fusion whatever the train/eval mode inside the block (None: by mode)."""
    if mode is not None and mode not in ("soft", "topk"):
        raise ValueError(f"fusion mode must be 'soft', 'topk' or None, got {mode!r}")
    layers = mixer_layers(model)
    old = [layer.forced_fusion for _, layer in layers]
    for _, layer in layers:
        layer.forced_fusion = mode
    try:
        yield
    finally:
        for (_, layer), o in zip(layers, old):
            layer.forced_fusion = o


def enable_adapters(model: nn.Module) -> None:
    adapters.enable_adapters(model, LoRAMixerLinear)


def disable_adapters(model: nn.Module) -> None:
    """Make the model compute the base model's outputs (adapters kept)."""
    adapters.disable_adapters(model, LoRAMixerLinear)


_NO_MERGE = ("LoRA-Mixer adapters cannot be merged into the base weights: each token's update is a router-weighted "
             "(input-dependent) mixture of the experts, so no single weight matrix computes it. Keep the adapter as "
             "modules, or merge one expert's LoRA (rankwise.adapt.lora) if a static model is needed")


def merge(model: nn.Module) -> nn.Module:
    """Always raises :class:`RankwiseError`: a routed mixture has no weight-space equivalent."""
    raise RankwiseError(_NO_MERGE)


def unmerge(model: nn.Module) -> nn.Module:
    """Always raises :class:`RankwiseError` (nothing can have been merged)."""
    raise RankwiseError("no LoRA-Mixer adapter is merged (LoRA-Mixer adapters cannot be merged)")


def delete_adapter(model: nn.Module, name: str) -> None:
    adapters.delete_adapter(model, name, LoRAMixerLinear)


def unload(model: nn.Module) -> nn.Module:
    """Replace every LoRAMixerLinear by its base layer."""
    return adapters.unload(model, LoRAMixerLinear, merge_first=False)


# ------------------------------------------------------------------------------------------------
# training objectives and diagnostics
# ------------------------------------------------------------------------------------------------

def _active(model: nn.Module, name: str | None) -> list[tuple[str, _Mixer, dict[str, Any]]]:
    out = [(lname, layer.mixer[n], layer.adapter_config[n]) for lname, layer in mixer_layers(model)
           for n in layer.adapters if (n == name if name is not None else n in layer.active_adapters)]
    if not out:
        raise RankwiseError(f"the model has no {'active ' if name is None else ''}LoRA-Mixer adapter"
                            f"{'' if name is None else f' named {name!r}'}")
    return out


def rsl_loss(model: nn.Module, attention_mask: torch.Tensor | None = None, name: str | None = None, *,
             rsl_alpha: float | None = None, rsl_lambda: float | None = None,
             entropy_sign: int | None = None) -> torch.Tensor:
    """Routing Specialization Loss of the last forward pass, summed over the adapted layers (Eq. 3, 5).

    Per layer ``alpha * E * sum_i p_bar_i f_bar_i + entropy_sign * lambda * mean_x H(p(x))`` (the factor E,
    Switch Transformer's normalisation, makes the balance term equal ``alpha`` at uniform routing) with the
    adapter's config values (keyword overrides: ``rsl_lambda=0`` gives the plain auxiliary loss of
    Eq. 3). ``attention_mask``: ``(batch, seq)`` (1 = real token) for ``(batch, seq, d)`` inputs;
    padding is excluded from ``p_bar``, ``f_bar`` and the entropy mean. A non-finite value raises.
    """
    total: torch.Tensor | None = None
    for lname, mx, cfg in _active(model, name):
        if mx.last_p is None:
            raise RankwiseError(f"{mx.where}: no routing recorded; run a forward pass before rsl_loss")
        a = cfg["rsl_alpha"] if rsl_alpha is None else float(rsl_alpha)
        lam = cfg["rsl_lambda"] if rsl_lambda is None else float(rsl_lambda)
        sign = cfg["entropy_sign"] if entropy_sign is None else int(entropy_sign)
        t = rsl_terms(mx.last_p, attention_mask, k=cfg["top_k_infer"], f_definition=cfg["f_definition"], where=lname)
        term = a * mx.num_experts * (t["p_bar"] * t["f_bar"]).sum() + sign * lam * t["entropy"]
        total = term if total is None else total + term
    assert total is not None
    if not bool(torch.isfinite(total)):
        raise NumericalError(f"the routing loss is not finite ({float(total)})")
    return total


def preserve_loss(model: nn.Module, name: str | None = None) -> torch.Tensor:
    """Expert preservation (Eq. 11): ``beta * sum ||theta_i - theta_i^(0)||^2`` over loaded (preserved) experts.

    ``theta^(0)`` are the weights the experts were loaded with; 0 when no expert was loaded. Gradient
    ``2 beta (theta - theta^(0))``.
    """
    total: torch.Tensor | None = None
    for _lname, mx, cfg in _active(model, name):
        for e, (A0, B0) in mx.reference.items():
            term = cfg["preserve_beta"] * ((mx.A[e] - A0.to(mx.A[e].device)).square().sum()
                                           + (mx.B[e] - B0.to(mx.B[e].device)).square().sum())
            total = term if total is None else total + term
    if total is None:
        return torch.zeros(())
    return total


@torch.no_grad()
def routing_stats(model: nn.Module, attention_mask: torch.Tensor | None = None, name: str | None = None
                  ) -> list[dict[str, Any]]:
    """Per adapted layer, from the last forward pass: ``p_bar``, top-1 load, top-k slot share ``f_bar``,
    normalised per-token entropy in [0, 1], and the top-1 expert of every valid token."""
    rows = []
    for lname, mx, cfg in _active(model, name):
        if mx.last_p is None:
            raise RankwiseError(f"{mx.where}: no routing recorded; run a forward pass first")
        t = rsl_terms(mx.last_p, attention_mask, k=cfg["top_k_infer"], where=lname)
        e = mx.num_experts
        top1 = t["top1"]
        rows.append({"layer": lname, "p_bar": t["p_bar"].tolist(), "f_bar": t["f_bar"].tolist(),
                     "top1_load": torch.bincount(top1, minlength=e).double().div(top1.numel()).tolist(),
                     "entropy": float(t["entropy"]) / math.log(e) if e > 1 else 0.0, "top1": top1})
    return rows


# ------------------------------------------------------------------------------------------------
# save / load
# ------------------------------------------------------------------------------------------------

def save_adapter(model: nn.Module, directory: str | Path, name: str = "default", *,
                 overwrite: bool | None = None) -> Path:
    """Save adapter ``name`` to ``directory`` atomically (``adapter_model.safetensors`` + ``adapter_config.json``).

    Tensors per layer ``m``: ``m.mixer_A.<e> (r_e, d_in)``, ``m.mixer_B.<e> (d_out, r_e)``, ``m.mixer_router
    (E, d_in)``; the header holds the per-layer settings (ranks, scalings, frozen flags), the base-model
    fingerprint and SHA-256 digests. The preservation reference of loaded experts is not saved: after
    :func:`load_adapter` the loaded weights are the reference.
    """
    layers = _require_adapter(model, name)
    tensors: dict[str, torch.Tensor] = {}
    modules: dict[str, dict[str, Any]] = {}
    for lname, layer in layers:
        mx = layer.mixer[name]
        for e in range(mx.num_experts):
            tensors[f"{lname}.mixer_A.{e}"] = mx.A[e].detach()
            tensors[f"{lname}.mixer_B.{e}"] = mx.B[e].detach()
        tensors[f"{lname}.mixer_router"] = mx.router.detach()
        modules[lname] = dict(layer.adapter_config[name], frozen=list(mx.frozen))
    meta = {"kind": _KIND, "name": name, "modules": modules, "fingerprint": io.model_fingerprint(model)}
    directory = Path(directory)
    if overwrite is None:
        overwrite = directory.is_dir() and all(p.is_file() and p.name in _OWN_FILES for p in directory.iterdir())
    with io.atomic_dir(directory, overwrite=bool(overwrite)) as tmp:
        io.write_json(tmp / CONFIG_FILE, {"method": "lora_mixer", "name": name, "modules": modules})
        io.save_tensors(tmp / WEIGHTS_FILE, tensors, meta)
    return directory


def _check_record(path: Path, m: str, cfg: Any) -> None:
    ok = (isinstance(cfg, dict) and isinstance(cfg.get("ranks"), list) and cfg["ranks"]
          and all(_pos_int(r) for r in cfg["ranks"]) and isinstance(cfg.get("scalings"), list)
          and len(cfg["scalings"]) == len(cfg["ranks"]) and all(_number(s) for s in cfg["scalings"])
          and isinstance(cfg.get("frozen"), list) and len(cfg["frozen"]) == len(cfg["ranks"])
          and all(isinstance(f, bool) for f in cfg["frozen"]) and _pos_int(cfg.get("top_k_infer"))
          and isinstance(cfg.get("renormalize"), bool) and _number(cfg.get("dropout"))
          and 0.0 <= float(cfg["dropout"]) < 1.0 and cfg.get("entropy_sign") in (1, -1)
          and cfg.get("f_definition") in F_DEFINITIONS
          and all(_number(cfg.get(k)) and float(cfg[k]) >= 0 for k in ("rsl_alpha", "rsl_lambda", "preserve_beta"))
          and _number(cfg.get("router_std")))
    if not ok:
        raise ArtifactError(f"{path}: bad metadata for module {m!r}")


def load_adapter(model: nn.Module, directory: str | Path, name: str = "default", *,
                 check_base: bool = True) -> nn.Module:
    """Load an adapter written by :func:`save_adapter` into ``model`` as adapter ``name`` (active).

    ArtifactError (model unchanged) for a missing, corrupt or truncated file, another artefact kind,
    another base model (fingerprint; skip with ``check_base=False``), or layers that do not fit. An
    adapter of the same name is replaced; frozen experts stay frozen.
    """
    validate_adapter_name(name)
    directory = Path(directory)
    if not directory.is_dir():
        raise ArtifactError(f"{directory}: no such adapter directory")
    path = directory / WEIGHTS_FILE
    tensors, meta = io.load_tensors(path)
    if meta.get("kind") != _KIND:
        raise ArtifactError(f"{path}: not a rankwise LoRA-Mixer adapter (kind={meta.get('kind')!r})")
    modules = meta.get("modules")
    if not isinstance(modules, dict) or not modules:
        raise ArtifactError(f"{path}: metadata lacks the module table")
    expected: set[str] = set()
    for m, cfg in modules.items():
        _check_record(path, m, cfg)
        n = len(cfg["ranks"])
        expected |= {f"{m}.mixer_router"} | {f"{m}.mixer_{k}.{e}" for k in ("A", "B") for e in range(n)}
    if set(tensors) != expected:
        raise ArtifactError(f"{path}: tensors do not match the module table (missing "
                            f"{sorted(expected - set(tensors))[:4]}, unexpected {sorted(set(tensors) - expected)[:4]})")
    if check_base:
        io.check_fingerprint(meta.get("fingerprint"), model, source=str(path))
    problems = []
    for m, cfg in modules.items():
        try:
            mod = model.get_submodule(m)
        except AttributeError:
            problems.append(f"module {m!r} does not exist in the model")
            continue
        if not isinstance(mod, (nn.Linear, LoRAMixerLinear)):
            problems.append(f"module {m!r} is a {type(mod).__name__}, not a Linear layer")
            continue
        b = _base(mod)
        n = len(cfg["ranks"])
        want = {f"{m}.mixer_router": (n, b.in_features)}
        for e, r in enumerate(cfg["ranks"]):
            want[f"{m}.mixer_A.{e}"] = (r, b.in_features)
            want[f"{m}.mixer_B.{e}"] = (b.out_features, r)
        bad = [k for k, s in want.items() if tuple(tensors[k].shape) != s]
        if bad or len({tensors[k].dtype for k in want}) != 1:
            problems.append(f"module {m!r}: tensors {bad[:3] or 'dtypes'} do not fit "
                            f"({b.out_features}, {b.in_features})")
    if problems:
        raise ArtifactError(f"{path} does not fit this model: {'; '.join(problems[:5])}")
    with _all_or_nothing(model):
        for lname, layer in mixer_layers(model):
            if name in layer.mixer:
                del layer.mixer[name]
                layer.adapter_config.pop(name, None)
                layer.active_adapters = [n for n in layer.active_adapters if n != name]
        tied: dict[str, _Mixer] = {}
        for m, cfg in modules.items():
            mod = model.get_submodule(m)
            layer = mod if isinstance(mod, LoRAMixerLinear) else LoRAMixerLinear(mod, layer_name=m)
            if layer is not mod:
                replace_module(model, m, layer)
            router = tensors[f"{m}.mixer_router"]
            mx = _Mixer(layer.in_features, layer.out_features, cfg["ranks"], cfg["scalings"], float(cfg["dropout"]),
                        float(cfg["router_std"]), torch.Generator().manual_seed(0), router.dtype,
                        layer.base_layer.weight.device)
            mx.where = f"{m} [{name}]"
            with torch.no_grad():
                mx.router.copy_(router)
                for e in range(mx.num_experts):
                    mx.A[e].copy_(tensors[f"{m}.mixer_A.{e}"])
                    mx.B[e].copy_(tensors[f"{m}.mixer_B.{e}"])
                    if cfg.get("sources"):
                        mx.reference[e] = (mx.A[e].detach().clone(), mx.B[e].detach().clone())
            mx.frozen = list(cfg["frozen"])
            group = cfg.get("router_group")
            if isinstance(group, str):
                if group in tied and tied[group].router.shape == mx.router.shape:
                    if not torch.equal(tied[group].router.detach(), mx.router.detach()):
                        raise ArtifactError(f"{path}: module {m!r} shares the router of group {group!r} but its "
                                            "stored router differs")
                    mx.router = tied[group].router
                else:
                    tied[group] = mx
            layer.mixer[name] = mx
            layer.adapter_config[name] = {k: v for k, v in cfg.items() if k != "frozen"}
            layer.active_adapters = [name]
        for lname, layer in list(mixer_layers(model)):
            if name not in layer.mixer:
                layer.active_adapters = []
            if not layer.adapters:
                replace_module(model, lname, layer.base_layer)
        _sync_trainable(model, freeze_base=True)
    return model


register("lora_mixer", config=LoRAMixerConfig, entry=adapt)
