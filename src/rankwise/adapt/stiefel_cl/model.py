"""EBLoRA on a whole model: :func:`adapt` (one task's adapter), :class:`EBLoRAContinual` (the task loop:
gradient initialisation, Riemannian training, protected-subspace update, merge; state saved and resumed),
the PEFT export of a task's update and the adapter API (:data:`EBLORA`, an
:class:`~rankwise.core.adapters.AdapterMethod`)."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import torch
from torch import nn

from rankwise.adapt.stiefel_cl.config import _UNSUPPORTED, EBLoRAConfig
from rankwise.adapt.stiefel_cl.functional import check_feasible, empty_basis, gradient_init
from rankwise.adapt.stiefel_cl.layer import EBLoRALinear
from rankwise.adapt.stiefel_cl.optimizer import RiemannianAdamW
from rankwise.core.adapters import AdapterMethod, wrap_layer
from rankwise.core.calibration import LossFn, given_gradients, gradient_pass, mean_gradients
from rankwise.core.lora import AdapterState
from rankwise.core.peft_format import write_adapter_dir
from rankwise.core.registry import register
from rankwise.core.select import Selector


class _EBLoRAMethod(AdapterMethod):
    def calibration_batches(self, config: EBLoRAConfig) -> int:
        return config.grad_batches


#: EBLoRA's model-level adapter API (set_active, merge, save_adapter, load_adapter, ...).
EBLORA = _EBLoRAMethod(EBLoRALinear, "rankwise.stiefel_cl", method="stiefel_cl", default_lr=1e-3)

(eblora_layers, adapter_names, set_active, enable_adapters, disable_adapters, merge, unmerge, delete_adapter, unload,
 save_adapter, load_adapter) = EBLORA.public_api()


def _base_of(mod: nn.Module) -> nn.Linear:
    return mod.base_layer if isinstance(mod, EBLoRALinear) else mod  # type: ignore[return-value]


def _target_layers(model: nn.Module, target: Selector) -> list[tuple[str, nn.Module]]:
    return EBLORA.target_layers(model, target, rejects=lambda m: isinstance(m, _UNSUPPORTED)
                                or type(m).__name__ == "Conv1D")


def _protected_of(mod: nn.Module) -> torch.Tensor | None:
    F = mod.protected if isinstance(mod, EBLoRALinear) else None
    return None if F is None or F.shape[1] == 0 else F


def collect_gradients(model: nn.Module, layers: Sequence[tuple[str, nn.Module]], batches: Iterable[Any],
                      loss_fn: LossFn | None = None, max_batches: int = 8) -> dict[str, torch.Tensor]:
    """``G = dL/dW`` of ``layers``' base weights averaged over up to ``max_batches`` batches (float64), with every
    EBLoRA adapter switched off (eval mode; flags, modes and ``.grad`` restored). An empty loader raises
    ValueError, NaN/inf NumericalError naming the layer; an all-zero gradient is returned as is (the
    initialisation falls back to random directions with a warning)."""
    if batches is None:
        raise ValueError("EBLoRA needs gradient batches (calib=... / grad_loader) to initialise and protect")
    weights = {n: _base_of(m).weight for n, m in layers}
    disable = [layer for _, layer in eblora_layers(model)]
    sums, count = gradient_pass(model, weights, batches, loss_fn, max_batches=max_batches, disable=disable,
                                needs="EBLoRA's gradient is undefined", who="EBLoRA")
    if count == 0:
        raise ValueError("the gradient loader yielded no batch; EBLoRA needs at least one to estimate G")
    zero = {n for n, g in sums.items() if float(g.abs().max()) == 0.0}
    out = mean_gradients({n: g for n, g in sums.items() if n not in zero}, count, who="EBLoRA", zero_hint="")
    out.update({n: sums[n] for n in zero})
    return {n: out[n] for n in sums}


def _layer_plan(model: nn.Module, hits: Sequence[tuple[str, nn.Module]], rank: int, name: str
                ) -> dict[str, torch.Tensor | None]:
    """Check every layer before anything changes; returns the protected basis each new adapter must avoid
    (a full basis is dropped with a warning: no feasible V is left, protection stops for that layer)."""
    bases: dict[str, torch.Tensor | None] = {}
    for lname, mod in hits:
        if isinstance(mod, EBLoRALinear) and name in mod.eblora_U:
            raise ValueError(f"layer {lname!r} already has an adapter named {name!r}; choose another name "
                             "or delete it first")
        base = _base_of(mod)
        F = _protected_of(mod)
        if F is not None and F.shape[1] >= base.in_features:
            warnings.warn(f"layer {lname!r}: the protected subspace fills all {base.in_features} input "
                          "directions; no feasible V is left, so this layer stops protecting earlier tasks",
                          stacklevel=3)
            F = None
        if rank > base.out_features:
            raise ValueError(f"layer {lname!r}: rank {rank} exceeds out_features={base.out_features}; "
                             f"choose rank <= {min(base.out_features, base.in_features)}")
        check_feasible(base.in_features, 0 if F is None else F.shape[1], rank, lname)
        bases[lname] = F
    return bases


def adapt(model: nn.Module, config: EBLoRAConfig | None = None, target: Selector = None, name: str = "default", *,
          calib: Iterable[Any] | None = None, loss_fn: LossFn | None = None,
          gradients: Mapping[str, torch.Tensor] | None = None) -> nn.Module:
    """Add EBLoRA adapter ``name`` to the Linear layers ``target`` selects (default ``config.target``); in place.

    Gradient initialisation (spec step 2): ``G`` averaged over ``config.grad_batches`` batches of ``calib``
    with ``loss_fn(model, batch)`` (default: the output's ``.loss``), or precomputed ``gradients``
    ``{layer: G (d_out, d_in)}``; ``V``, ``U`` from the rank-r SVD of ``G (I - F F^T)`` with each layer's
    protected basis ``F``; ``s = -(alpha0 + beta0 l / (L - 1))`` (0 by default, so the model is unchanged).
    Every other parameter is frozen (unfreeze a task head yourself). Everything is checked before the model
    changes (rank vs. ``d_in - rank(F)``: ValueError naming the layer); on any error it is unchanged.
    """
    config = EBLORA.start_adapt(model, config, EBLoRAConfig, name)
    hits = _target_layers(model, config.target if target is None else target)
    bases = _layer_plan(model, hits, config.rank, name)
    if gradients is not None:
        grads = given_gradients(gradients, {n: (_base_of(m).out_features, _base_of(m).in_features) for n, m in hits},
                                check=True)
    else:
        grads = collect_gradients(model, hits, calib, loss_fn, config.grad_batches)
    plan = []
    for i, (lname, mod) in enumerate(hits):
        seed = None if config.seed is None else config.seed + i
        U, V = gradient_init(grads[lname], bases[lname], config.rank, generator_seed=seed, name=lname)
        w = _base_of(mod).weight
        dtype = w.dtype if w.is_floating_point() else torch.float32
        if dtype in (torch.float16, torch.bfloat16):
            dtype = torch.float32  # U, V and F stay in float32 under mixed precision (spec)
        plan.append((lname, mod, U.to(dtype), V.to(dtype), config.initial_magnitude(i, len(hits))))
    cfg = {"method": "stiefel_cl", "alpha": config.alpha, "energy_threshold": config.energy_threshold}
    with EBLORA.all_or_nothing(model):
        for lname, mod, U, V, s in plan:
            layer = wrap_layer(model, lname, mod, EBLoRALinear)
            if bases[lname] is None and layer.protected.shape[1]:
                layer.set_protected(empty_basis(layer.in_features))
            layer.set_factors(name, U, V, s, config.scaling, config=cfg)
            layer.set_active(name)
        EBLORA.finish_adapt(model, name)
    return model


apply_eblora = adapt


def make_optimizer(model: nn.Module, name: str = "default", *, lr: float = 1e-3, weight_decay: float = 0.0,
                   betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                   direction_lr_scale: float | None = None, rank: int | None = None,
                   extra_params: Iterable[nn.Parameter] = (), extra_lr: float | None = None) -> RiemannianAdamW:
    """:class:`RiemannianAdamW` over adapter ``name``: U and V (Stiefel, V with its layer's protected basis),
    the magnitudes (Euclidean), and ``extra_params`` (e.g. a task head, at ``extra_lr``, default ``lr``).
    ``direction_lr_scale`` None: ``sqrt(4096 / r)``."""
    layers = EBLORA.require_adapter(model, name)
    r = rank or layers[0][1].rank(name)
    scale = direction_lr_scale if direction_lr_scale is not None else EBLoRAConfig(rank=r).lr_scale
    dirs, mags, protected = [], [], {}
    for _, layer in layers:
        U, V = layer.eblora_U[name], layer.eblora_V[name]
        dirs += [U, V]
        mags.append(layer.eblora_s[name])
        if layer.protected.shape[1]:
            protected[V] = layer.protected
    groups: list[dict[str, Any]] = [{"params": dirs, "stiefel": True}, {"params": mags}]
    extra = [p for p in extra_params if p.requires_grad]
    if extra:
        groups.append({"params": extra, "lr": lr if extra_lr is None else extra_lr})
    return RiemannianAdamW(groups, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                           direction_lr_scale=scale, protected=protected)


def peft_state(model: nn.Module, name: str = "default") -> AdapterState:
    """Adapter ``name`` as a PEFT LoRA state: ``lora_B = c s U`` (out, r), ``lora_A = V^T`` (r, in), scaling 1."""
    factors, scaling = {}, {}
    for lname, layer in EBLORA.require_adapter(model, name):
        U, V = layer.eblora_U[name].detach(), layer.eblora_V[name].detach()
        cs = layer.scaling[name] * layer.eblora_s[name].detach()
        factors[lname] = {"lora_A": V.T.contiguous().clone(), "lora_B": (cs * U).contiguous()}
        scaling[lname] = 1.0
    r = next(iter(factors.values()))["lora_A"].shape[0]
    return AdapterState(config={"method": "stiefel_cl", "rank": int(r), "alpha": float(r), "use_rslora": False,
                                "dropout": 0.0, "targets": list(factors)}, factors=factors, scaling=scaling)


def _module_names(model: nn.Module) -> list[str]:
    wrappers = [n for n, _ in eblora_layers(model)]
    return [n for n, _ in model.named_modules() if n and not any(n.startswith(w + ".") for w in wrappers)]


def export_peft(model: nn.Module, directory: str | Path, name: str = "default",
                base_model_name_or_path: str | None = None, *, overwrite: bool | None = None) -> Path:
    """Write adapter ``name`` as a PEFT LoRA directory (``B = c s U``, ``A = V^T``, ``lora_alpha = r``) that
    ``peft.PeftModel.from_pretrained(base, directory)`` loads; ``base`` is the model the adapter was trained on
    (in continual learning: the model with the earlier tasks merged)."""
    return write_adapter_dir(peft_state(model, name), directory, name=name, module_names=_module_names(model),
                             base_model_name_or_path=base_model_name_or_path, overwrite=overwrite)


register("stiefel_cl", config=EBLoRAConfig, entry=adapt, adapter=EBLORA)
