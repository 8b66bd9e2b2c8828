"""CDKA on a whole model: calibration gradients, :func:`adapt`, the report and the adapter API
(:data:`CDKA`, an :class:`~rankwise.core.adapters.AdapterMethod`)."""

from __future__ import annotations

import math
from typing import Any, Iterable, Mapping, Sequence

import torch
from torch import nn

from rankwise.adapt.cdka.config import _UNSUPPORTED, CDKAConfig, LossFn, parse_budget
from rankwise.adapt.cdka.functional import (
    CDKAChoice,
    alignment,
    candidates,
    check_shape,
    choose_configuration,
    gradient_init,
    num_parameters,
)
from rankwise.adapt.cdka.layer import CDKALinear
from rankwise.core.adapters import AdapterMethod
from rankwise.core.calibration import default_loss, given_gradients, gradient_pass, mean_gradients  # noqa: F401 (default_loss re-exported)
from rankwise.core.errors import RankwiseError
from rankwise.core.registry import register
from rankwise.core.select import Selector
from rankwise.core.surgery import replace_module


class _CDKAMethod(AdapterMethod):
    def calibration_batches(self, config: CDKAConfig) -> int:
        return config.calib_batches if config.needs_gradient else 0


#: CDKA's model-level adapter API (set_active, merge, save_adapter, load_adapter, ...).
CDKA = _CDKAMethod(CDKALinear, "rankwise.cdka", default_lr=3e-3)

cdka_layers = CDKA.layers
adapter_names = CDKA.adapter_names
set_active = CDKA.set_active
enable_adapters = CDKA.enable
disable_adapters = CDKA.disable
merge = CDKA.merge
unmerge = CDKA.unmerge
delete_adapter = CDKA.delete_adapter
unload = CDKA.unload
save_adapter = CDKA.save_adapter
load_adapter = CDKA.load_adapter


def _target_layers(model: nn.Module, target: Selector) -> list[tuple[str, nn.Module]]:
    """Linear layers (or CDKALinear wrappers) that ``target`` selects; Conv/Embedding -> NotImplementedError."""
    return CDKA.target_layers(model, target,
                              rejects=lambda m: isinstance(m, _UNSUPPORTED) or type(m).__name__ == "Conv1D")


def _base_of(mod: nn.Module) -> nn.Linear:
    return mod.base_layer if isinstance(mod, CDKALinear) else mod  # type: ignore[return-value]


def collect_gradients(model: nn.Module, layers: Sequence[tuple[str, nn.Module]], batches: Iterable[Any],
                      loss_fn: LossFn | None = None, max_batches: int = 8) -> dict[str, torch.Tensor]:
    """Full-fine-tuning gradients ``G = dL/dW0`` of ``layers``, averaged over up to ``max_batches`` batches.

    Returns ``{name: G (d_out, d_in) float64}``. Runs in eval mode (no dropout, so ``G`` is
    deterministic), with every CDKA adapter of the model switched off (``G`` belongs to the base
    model) and only the targeted base weights requiring gradients; the model's modes, flags and
    ``.grad`` fields are restored afterwards. An empty loader, a non-finite loss or gradient
    (NumericalError) and an all-zero gradient (ValueError) are reported naming the layer. The pass is
    :func:`rankwise.core.calibration.gradient_pass`.
    """
    if batches is None:
        raise ValueError("CDKA needs calibration batches (calib=...) to estimate the fine-tuning gradient")
    layers_now = [layer for _, layer in cdka_layers(model)]
    if any(layer.merged_adapters for layer in layers_now):
        raise RankwiseError("unmerge the CDKA adapters before adding another one")
    weights = {n: _base_of(m).weight for n, m in layers}
    sums, count = gradient_pass(model, weights, batches, loss_fn, max_batches=max_batches, disable=layers_now,
                                needs="alignment is undefined", who="CDKA")
    return mean_gradients(sums, count, who="CDKA", zero_hint="(the loss does not depend on this layer, or the "
                          "batches carry no signal); the alignment score is undefined")


def adapt(model: nn.Module, config: CDKAConfig | None = None, target: Selector = None, name: str = "default", *,
          calib: Iterable[Any] | None = None, loss_fn: LossFn | None = None,
          gradients: Mapping[str, torch.Tensor] | None = None) -> nn.Module:
    """Add CDKA adapter ``name`` to the Linear layers ``target`` selects (default ``config.target``); in place.

    ``calib`` (an iterable of batches) and ``loss_fn(model, batch) -> scalar`` (default: the output's
    ``.loss``) estimate the fine-tuning gradient ``G`` needed by ``config_mode="aligned"`` and
    ``init="gradient"``; alternatively pass precomputed ``gradients`` ``{layer name: G (d_out, d_in)}``.
    The new adapter becomes the active (and only trainable) one; every other parameter is frozen
    (unfreeze a task head yourself). Everything is computed and checked before the model changes;
    on any error the model is unchanged. Returns the model.
    """
    config = CDKA.start_adapt(model, config, CDKAConfig, name)
    hits = _target_layers(model, config.target if target is None else target)
    for lname, mod in hits:
        if isinstance(mod, CDKALinear) and name in mod.cdka:
            raise ValueError(f"layer {lname!r} already has an adapter named {name!r}; choose another name "
                             "or delete it first")
        base = _base_of(mod)
        if config.config_mode == "fixed":
            check_shape(base.out_features, base.in_features, config.r1, config.r2, config.r, lname)
        else:  # budget feasibility before any gradient is computed
            candidates(base.out_features, base.in_features,
                       parse_budget(config.budget, base.out_features, base.in_features),
                       config.budget_tolerance, name=lname)

    grads: dict[str, torch.Tensor] = {}
    if gradients is not None:
        grads = given_gradients(gradients, {n: (_base_of(m).out_features, _base_of(m).in_features) for n, m in hits})
    elif config.needs_gradient:
        grads = collect_gradients(model, hits, calib, loss_fn, config.calib_batches)

    gen = torch.Generator().manual_seed(config.seed) if config.seed is not None else None
    plan = []
    for lname, mod in hits:
        base = _base_of(mod)
        d_out, d_in = base.out_features, base.in_features
        G = grads.get(lname)
        if config.config_mode == "aligned":
            budget = parse_budget(config.budget, d_out, d_in)
            choice = choose_configuration(G, budget, config.budget_tolerance, name=lname)
        else:
            r1, r2, r = config.r1, config.r2, config.r
            choice = CDKAChoice(r1, r2, r, num_parameters(d_out, d_in, r1, r2, r),
                                None if G is None else alignment(G, r1, r2, r, name=lname))
        w = base.weight
        dtype = w.dtype if w.is_floating_point() else torch.float32
        r1, r2, r = choice.r1, choice.r2, choice.r
        if config.init == "gradient":
            B, A = gradient_init(G, r1, r2, r, config.init_scale)
            B, A = B.to(dtype), A.to(dtype)
            B0, A0 = B, A
        else:
            A = torch.empty(r, r1, d_in // r2, dtype=torch.float32)
            for k in range(r):
                nn.init.kaiming_uniform_(A[k], a=math.sqrt(5), generator=gen)
            A = A.to(dtype)
            B = torch.zeros(r, d_out // r1, r2, dtype=dtype)
            B0 = A0 = None
        cfg = {"method": "cdka", "r1": r1, "r2": r2, "r": r, "params": choice.params, "align": choice.align,
               "budget": None if config.config_mode == "fixed" else parse_budget(config.budget, d_out, d_in),
               "config_mode": config.config_mode, "init": config.init, "alpha": config.alpha,
               "use_rslora": config.use_rslora}
        plan.append((lname, mod, B, A, B0, A0, config.scaling(r), cfg))

    with CDKA.all_or_nothing(model):
        for lname, mod, B, A, B0, A0, s, cfg in plan:
            layer = mod if isinstance(mod, CDKALinear) else CDKALinear(mod, layer_name=lname)
            if layer is not mod:
                replace_module(model, lname, layer)
            layer.set_components(name, B, A, s, B0=B0, A0=A0, dropout=config.dropout, config=cfg)
            layer.set_active(name)
        for _, layer in cdka_layers(model):
            if name not in layer.cdka:
                layer.active_adapters = []
        CDKA.sync_trainable(model, freeze_base=True)
    return model


apply_cdka = adapt


def report(model: nn.Module, name: str | None = None) -> list[dict[str, Any]]:
    """Per adapted layer and adapter: ``layer, adapter, d_out, d_in, r1, r2, r, params, budget, align``."""
    rows = []
    for lname, layer in cdka_layers(model):
        for n in layer.adapters:
            if name is not None and n != name:
                continue
            r1, r2, r = layer.shape_of(n)
            cfg = layer.adapter_config.get(n, {})
            rows.append({"layer": lname, "adapter": n, "d_out": layer.out_features, "d_in": layer.in_features,
                         "r1": r1, "r2": r2, "r": r,
                         "params": num_parameters(layer.out_features, layer.in_features, r1, r2, r),
                         "budget": cfg.get("budget"), "align": cfg.get("align")})
    if name is not None and not rows:
        raise KeyError(f"the model has no CDKA adapter named {name!r}; it has {adapter_names(model) or 'none'}")
    return rows


register("cdka", config=CDKAConfig, entry=adapt, adapter=CDKA)
