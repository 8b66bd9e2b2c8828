"""LoRA-Mixer on a whole model: :func:`adapt` (fresh or loaded experts), training stages and routing
controls, the routing losses, and the adapter API (:data:`LORA_MIXER`, an
:class:`~rankwise.core.adapters.AdapterMethod`)."""

from __future__ import annotations

import contextlib
import math
from pathlib import Path
from typing import Any, Iterator, Sequence

import torch
from torch import nn

from rankwise.adapt.lora_mixer.config import ExpertSource, LoRAMixerConfig, STAGES, _QKV
from rankwise.adapt.lora_mixer.functional import rsl_terms
from rankwise.adapt.lora_mixer.layer import LoRAMixerLinear, _Mixer
from rankwise.core.adapters import AdapterMethod
from rankwise.core.errors import NumericalError, RankwiseError
from rankwise.core.lora import AdapterState
from rankwise.core.peft_format import import_peft
from rankwise.core.registry import register
from rankwise.core.select import Selector
from rankwise.core.surgery import replace_module


# ------------------------------------------------------------------------------------------------
# model-level operations
# ------------------------------------------------------------------------------------------------

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


class _LoRAMixerMethod(AdapterMethod):
    """LoRA-Mixer's artefact: per layer ``mixer_A.<e> (r_e, d_in)``, ``mixer_B.<e> (d_out, r_e)`` and
    ``mixer_router (E, d_in)``; records hold ranks, scalings, frozen flags and the routing settings. A
    router shared by a layer's Q/K/V is stored per layer and tied again on load. Trainable flags follow
    the training stage (:func:`set_stage`)."""

    def sync_trainable(self, model: nn.Module, freeze_base: bool) -> None:
        _sync_trainable(model, freeze_base)

    def auxiliary_loss(self, model: nn.Module, config: LoRAMixerConfig) -> Any:
        """``L_RSL + L_preserve`` (Eq. 12 less the task loss) after each forward pass: :func:`rsl_loss` with the
        batch's ``attention_mask`` (padding excluded) and :func:`preserve_loss` (0 unless experts were loaded)."""
        def loss(m: nn.Module, batch: Any, outputs: Any, step: int) -> torch.Tensor:
            inputs = getattr(batch, "inputs", batch)
            mask = inputs.get("attention_mask") if isinstance(inputs, dict) else None
            total = rsl_loss(m, mask)
            return total + preserve_loss(m).to(total)
        return loss


_NO_MERGE = ("LoRA-Mixer adapters cannot be merged into the base weights: each token's update is a router-weighted "
             "(input-dependent) mixture of the experts, so no single weight matrix computes it. Keep the adapter as "
             "modules, or merge one expert's LoRA (rankwise.adapt.lora) if a static model is needed")


#: LoRA-Mixer's model-level adapter API (set_active, save_adapter, load_adapter, ...; merging is refused).
LORA_MIXER = _LoRAMixerMethod(LoRAMixerLinear, "rankwise.lora_mixer", no_merge=_NO_MERGE)

mixer_layers = LORA_MIXER.layers
adapter_names = LORA_MIXER.adapter_names
set_active = LORA_MIXER.set_active
enable_adapters = LORA_MIXER.enable
disable_adapters = LORA_MIXER.disable
merge = LORA_MIXER.merge
unmerge = LORA_MIXER.unmerge
delete_adapter = LORA_MIXER.delete_adapter
unload = LORA_MIXER.unload
save_adapter = LORA_MIXER.save_adapter
load_adapter = LORA_MIXER.load_adapter


def _target_layers(model: nn.Module, target: Selector) -> list[tuple[str, nn.Module]]:
    return LORA_MIXER.target_layers(model, target)


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
    config = LORA_MIXER.start_adapt(model, config, LoRAMixerConfig, name)
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
    with LORA_MIXER.all_or_nothing(model):
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


register("lora_mixer", config=LoRAMixerConfig, entry=adapt, adapter=LORA_MIXER)
