"""mtLoRA on a whole model: placement, :func:`adapt`, the regularisers and reports, and the adapter API
(:data:`MTLORA`, an :class:`~rankwise.core.adapters.AdapterMethod`)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from rankwise.adapt.mtlora.config import BLOCK_PAIRS, MtLoRAConfig, _group_size
from rankwise.adapt.mtlora.functional import balance_loss, spectral_due, spectral_penalty, spectral_weights
from rankwise.adapt.mtlora.layer import MtLoRALinear, _Adapter, _base_linear, _install, _linear_at
from rankwise.core.adapters import AdapterMethod
from rankwise.core.errors import NumericalError, RankwiseError, SelectionError
from rankwise.core.registry import register
from rankwise.core.select import Selector, matcher, select
from rankwise.core.surgery import replace_module


# ------------------------------------------------------------------------------------------------
# model-level operations
# ------------------------------------------------------------------------------------------------

class _MtLoRAMethod(AdapterMethod):
    """mtLoRA's artefact: per adapted layer ``mtlora_A (r, d_in)``, ``mtlora_B (E, d_out, r)`` and, when
    E > 1, ``mtlora_router (E G, d_in)``; records hold the settings, including the input layer of a
    block-level adapter. Pruning also drops sinks that no adapter reads any more."""

    def prune(self, model: nn.Module) -> None:
        _prune(model)

    def auxiliary_loss(self, model: nn.Module, config: MtLoRAConfig) -> Any:
        """:func:`mtlora_regularizers` of the active adapters at each step (None when both weights are 0)."""
        if config.balance_alpha == 0 and config.spectral_lambda == 0:
            return None
        return lambda m, batch, outputs, step: mtlora_regularizers(m, step)


_NO_MERGE = ("mtLoRA adapters cannot be merged into the base weights: the expert mixture is weighted per token by "
             "the router (input dependent), and a block-level adapter reads the FFN's input and adds to its output "
             "around the non-linearity, so no fixed weight matrix computes the same function. Keep the adapters "
             "as modules (disable_adapters gives the base model)")


#: mtLoRA's model-level adapter API (set_active, save_adapter, load_adapter, ...; merging is refused).
MTLORA = _MtLoRAMethod(MtLoRALinear, "rankwise.mtlora", no_merge=_NO_MERGE)

mtlora_layers = MTLORA.layers
adapter_names = MTLORA.adapter_names
set_active = MTLORA.set_active
enable_adapters = MTLORA.enable
disable_adapters = MTLORA.disable
merge = MTLORA.merge
unmerge = MTLORA.unmerge
delete_adapter = MTLORA.delete_adapter
unload = MTLORA.unload
save_adapter = MTLORA.save_adapter
load_adapter = MTLORA.load_adapter


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
    config = MTLORA.start_adapt(model, config, MtLoRAConfig, name)
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
    with MTLORA.all_or_nothing(model):
        for tap, out, d_in, d_out, gs, base_out in specs:
            _install(model, name, tap, out, d_in, d_out, gs, config.rank, config.num_experts,
                     config.alpha / config.rank, config.dropout, gen, base_out.weight.dtype, base_out.weight.device,
                     _config_record(config, gs))
        for _, layer in mtlora_layers(model):
            if name not in layer.mtlora:
                layer.active_adapters = []
        MTLORA.sync_trainable(model, freeze_base=True)
    return model


apply_mtlora = adapt


def _config_record(config: MtLoRAConfig, gs: int) -> dict[str, Any]:
    return {"method": "mtlora", "rank": config.rank, "alpha": config.alpha, "num_experts": config.num_experts,
            "placement": config.placement, "routing_group_size": gs, "dropout": config.dropout,
            "balance_alpha": config.balance_alpha, "spectral_lambda": config.spectral_lambda,
            "spectral_every": config.spectral_every, "spectral_basis": config.spectral_basis,
            "spectral_max_matrices": config.spectral_max_matrices}


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


register("mtlora", config=MtLoRAConfig, entry=adapt, adapter=MTLORA)
