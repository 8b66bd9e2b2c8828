"""PSOFT on a whole model: :func:`adapt`, the orthogonality report and the adapter API
(:data:`PSOFT`, an :class:`~rankwise.core.adapters.AdapterMethod`)."""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import nn

from rankwise.adapt.psoft.config import PSOFTConfig, _UNSUPPORTED
from rankwise.adapt.psoft.functional import principal_factors
from rankwise.adapt.psoft.layer import PSOFTLinear, _is_conv1d
from rankwise.core.adapters import AdapterMethod
from rankwise.core.registry import register
from rankwise.core.select import Selector
from rankwise.core.surgery import replace_module


class _PSOFTMethod(AdapterMethod):
    pass


#: PSOFT's model-level adapter API (set_active, merge, save_adapter, load_adapter, ...).
PSOFT = _PSOFTMethod(PSOFTLinear, "rankwise.psoft", default_lr=1e-2)

psoft_layers = PSOFT.layers
adapter_names = PSOFT.adapter_names
set_active = PSOFT.set_active
enable_adapters = PSOFT.enable
disable_adapters = PSOFT.disable
merge = PSOFT.merge
unmerge = PSOFT.unmerge
delete_adapter = PSOFT.delete_adapter
unload = PSOFT.unload
save_adapter = PSOFT.save_adapter
load_adapter = PSOFT.load_adapter


def _base_of(mod: nn.Module) -> nn.Module:
    return mod.base_layer if isinstance(mod, PSOFTLinear) else mod


def _in_out(mod: nn.Module) -> tuple[int, int]:
    base = _base_of(mod)
    if isinstance(base, nn.Linear):
        return base.in_features, base.out_features
    return int(base.weight.shape[0]), int(base.weight.shape[1])


def _dense(mod: nn.Module) -> torch.Tensor:
    base = _base_of(mod)
    return base.weight.T if _is_conv1d(base) else base.weight


def _target_layers(model: nn.Module, target: Selector) -> list[tuple[str, nn.Module]]:
    return PSOFT.target_layers(model, target,
                                  accepts=lambda m: isinstance(m, nn.Linear) or _is_conv1d(m),
                                  rejects=lambda m: isinstance(m, _UNSUPPORTED),
                                  supported="linear layers (nn.Linear, transformers Conv1D)")


def adapt(model: nn.Module, config: PSOFTConfig | None = None, target: Selector = None,
          name: str = "default") -> nn.Module:
    """Add PSOFT adapter ``name`` to the linear layers ``target`` selects (default ``config.target``); in place.

    One SVD per layer (float64) gives the frozen ``A``, ``B``; the core starts at ``M = I`` so the
    model's outputs are unchanged. The new adapter becomes the active (and only trainable) one; every
    other parameter is frozen (unfreeze a task head yourself). ``r`` above ``min(d_in, d_out)`` of a
    layer raises ValueError naming it; ``r = 1`` warns (the skew part is empty, only the vectors
    train). Everything is computed before the model changes; on any error it is unchanged.
    """
    config = PSOFT.start_adapt(model, config, PSOFTConfig, name)
    hits = _target_layers(model, config.target if target is None else target)
    for lname, mod in hits:
        d_in, d_out = _in_out(mod)
        if config.rank > min(d_in, d_out):
            raise ValueError(f"PSOFT r={config.rank} for layer {lname!r} exceeds min(in_features={d_in}, "
                             f"out_features={d_out}) = {min(d_in, d_out)}; choose r in [1, {min(d_in, d_out)}]")
        if isinstance(mod, PSOFTLinear) and name in mod.psoft:
            raise ValueError(f"layer {lname!r} already has an adapter named {name!r}; choose another name "
                             "or delete it first")
    if config.rank == 1 and config.orth:
        warnings.warn("PSOFT with r=1: the skew-symmetric part is empty, only the relaxation vectors train",
                      stacklevel=2)
    plan = []
    for lname, mod in hits:
        W = _dense(mod)
        dtype = W.dtype if W.is_floating_point() else torch.float32
        B, A, _ = principal_factors(W, config.rank, config.singular_values_on, name=lname)
        plan.append((lname, mod, A.to(dtype), B.to(dtype)))
    with PSOFT.all_or_nothing(model):
        for lname, mod, A, B in plan:
            layer = mod if isinstance(mod, PSOFTLinear) else PSOFTLinear(mod, layer_name=lname)
            if layer is not mod:
                replace_module(model, lname, layer)
            layer.add_adapter(name, A, B, orth=config.orth, train_alpha=config.train_alpha,
                              train_beta=config.train_beta, cayley_mode=config.cayley, terms=config.neumann_terms,
                              eps=config.neumann_eps, dropout=config.dropout, config={"method": "psoft",
                                                              "singular_values_on": config.singular_values_on})
            layer.set_active(name)
        for _, layer in psoft_layers(model):
            if name not in layer.psoft:
                layer.active_adapters = []
        PSOFT.sync_trainable(model, freeze_base=True)
    return model


apply_psoft = adapt


@torch.no_grad()
def orthogonality_report(model: nn.Module, name: str | None = None) -> list[dict[str, Any]]:
    """Per layer and adapter: ``||M^T M - I||_F`` (``orth_error``), ``||R^T R - I||_F`` (``cayley_error``,
    the Neumann truncation's share) and the spectral norm of ``Q`` (``q_norm``; Neumann needs it < 1)."""
    rows = []
    for lname, layer in psoft_layers(model):
        for n in layer.adapters:
            if name is not None and n != name:
                continue
            c = layer.psoft[n]
            eye = torch.eye(c.r, dtype=torch.float64)
            M = c.matrix().double().cpu()
            R = c.rotation().double().cpu()
            Q = c.skew()
            rows.append({"layer": lname, "adapter": n, "r": c.r,
                         "orth_error": float(torch.linalg.matrix_norm(M.T @ M - eye)),
                         "cayley_error": float(torch.linalg.matrix_norm(R.T @ R - eye)),
                         "q_norm": None if Q is None or c.r < 2 else float(torch.linalg.matrix_norm(Q.double(), 2))})
    if name is not None and not rows:
        raise KeyError(f"the model has no PSOFT adapter named {name!r}")
    return rows


def check_neumann(model: nn.Module) -> list[str]:
    """Run every PSOFT adapter's Neumann-accuracy check now (one host read each; each adapter warns at most
    once, as on ``model.eval()``); returns ``"layer/adapter"`` of those that warned now."""
    return [f"{lname}/{n}" for lname, layer in psoft_layers(model) for n in layer.adapters
            if layer.psoft[n].check_neumann()]


register("psoft", config=PSOFTConfig, entry=adapt, adapter=PSOFT)
