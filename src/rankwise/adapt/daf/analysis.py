"""DAF's analysis and rebuild steps on a model: the context-aware Taylor sensitivity (step 1), attaching,
freezing and reactivating units for a new allocation (step 5), and refocusing an optimizer on the result."""

from __future__ import annotations

import math
import warnings
from typing import Any, Iterable, Sequence

import torch
from torch import nn

from rankwise.adapt.daf.config import LossFn
from rankwise.adapt.daf.layer import DAFLinear
from rankwise.core.adapters import adapted_layers, all_or_nothing, require_adapter, sync_trainable
from rankwise.core.calibration import NonFiniteLoss, default_loss, gradient_pass  # noqa: F401 (default_loss re-exported)
from rankwise.core.errors import RankwiseError, SelectionError


def _base_of(mod: nn.Module) -> nn.Linear:
    return mod.base_layer if isinstance(mod, DAFLinear) else mod  # type: ignore[return-value]


def take_batches(data: Iterable[Any] | None, n: int, what: str = "DAF analysis") -> list[Any]:
    """The first ``n`` batches of ``data`` as a list; fewer than ``n``: warn and use what exists; none: ValueError."""
    if data is None:
        raise ValueError(f"{what} needs batches of training data (calib=... / analysis_data=...)")
    if isinstance(data, (str, bytes)) or not isinstance(data, Iterable):
        raise TypeError(f"{what}: batches must be an iterable of batches, got {type(data).__name__}")
    out = []
    for b in data:
        out.append(b)
        if len(out) == n:
            break
    if not out:
        raise ValueError(f"{what}: the batch iterable is empty; at least one batch is needed to measure sensitivity")
    if len(out) < n:
        warnings.warn(f"{what}: calib_batches={n} but only {len(out)} batch(es) exist; using {len(out)}",
                      stacklevel=3)
    return out


# ------------------------------------------------------------------------------------------------
# step 1: context-aware Taylor sensitivity
# ------------------------------------------------------------------------------------------------

def _taylor(grad: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``sum_i |g_i theta_i|`` of one matrix, formed in float64."""
    return (grad.to(torch.float64) * weight.to(torch.float64)).abs().sum()


def taylor_sensitivity(model: nn.Module, batches: Sequence[Any], loss_fn: LossFn | None = None, *,
                       name: str | None = None, layers: Sequence[tuple[str, nn.Module]] | None = None,
                       context: str = "current", seed: int = 0, train_mode: bool = True
                       ) -> dict[str, float] | None:
    """``S_j = Σ_batches Σ_{i ∈ W_j} |g_i θ_i|`` for the candidate matrices of adapter ``name`` (spec step 1).

    ``batches``: the analysis batches (all are used); ``loss_fn(model, batch) -> scalar`` (default
    ``model(...).loss``). Gradients are taken only with respect to the candidates' base weights ``W_j``:
    every other parameter (the adapters' units, the head) has ``requires_grad`` off during the pass, so
    no ``.grad`` appears on them; flags, ``.grad`` fields and train/eval modes are restored afterwards.
    ``context="current"``: adapters as they are (the official context-aware analysis);
    ``"base"``: every DAF adapter switched off (round 0 of a new adapter). Products are formed and
    summed in float64 (AMP-safe). The RNG (dropout in train mode) is forked and seeded with ``seed``.
    Returns ``{layer name: S_j}`` (model order), or None after a warning when a loss is non-finite
    (the official behaviour: the round is skipped). The pass is :func:`rankwise.core.calibration.gradient_pass`.
    """
    if context not in ("current", "base"):
        raise ValueError(f"context must be 'current' or 'base', got {context!r}")
    if layers is None:
        if name is None:
            raise ValueError("pass the adapter name or the candidate layers")
        layers = require_adapter(model, name, DAFLinear)
    if not batches:
        raise ValueError("taylor_sensitivity needs at least one batch")
    weights = {n: _base_of(m).weight for n, m in layers}
    all_layers = adapted_layers(model, DAFLinear)
    if any(layer.merged_adapters for _, layer in all_layers):
        raise RankwiseError("unmerge the DAF adapters before a sensitivity analysis")
    try:
        acc, _ = gradient_pass(model, weights, batches, loss_fn, train=train_mode, seed=seed, reduce=_taylor,
                               disable=[layer for _, layer in all_layers] if context == "base" else (), who="DAF")
    except NonFiniteLoss as e:
        warnings.warn(f"DAF sensitivity: the loss is {e.value} on analysis batch {e.batch}; "
                      "skipping this round (the allocation is kept)", stacklevel=2)
        return None
    out = {n: float(v) for n, v in acc.items()}
    bad = [n for n, v in out.items() if not math.isfinite(v)]
    if bad:
        warnings.warn(f"DAF sensitivity: non-finite scores for {bad[:3]}; skipping this round", stacklevel=2)
        return None
    return out


# ------------------------------------------------------------------------------------------------
# step 5: rebuild
# ------------------------------------------------------------------------------------------------

def _fresh_unit(layer: DAFLinear, rank: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """``A`` Kaiming-uniform(a = sqrt 5) (PEFT's LoRA init), ``B = 0``; drawn on CPU from ``generator``."""
    w = layer.base_layer.weight
    dtype = w.dtype if w.is_floating_point() else torch.float32
    a = torch.empty(rank, layer.in_features, dtype=torch.float32)
    nn.init.kaiming_uniform_(a, a=math.sqrt(5), generator=generator)
    return a.to(dtype), torch.zeros(layer.out_features, rank, dtype=dtype)


def apply_allocation(model: nn.Module, name: str, selected: Iterable[str], generator: torch.Generator
                     ) -> dict[str, list[str]]:
    """Rebuild-and-Refocus (spec step 5) for adapter ``name``: make ``selected`` the training set.

    Training units no longer selected are frozen (kept in the forward pass); selected candidates get
    a fresh unit (``B = 0``, so the outputs do not change); selected frozen units train again. Returns
    ``{"added", "frozen", "reactivated", "kept"}`` (layer names). All-or-nothing.
    """
    layers = dict(require_adapter(model, name, DAFLinear))
    selected = list(dict.fromkeys(selected))
    unknown = [s for s in selected if s not in layers]
    if unknown:
        raise SelectionError(f"{unknown[:3]} are not candidates of DAF adapter {name!r}")
    rank = int(layers[next(iter(layers))].adapter_config[name]["rank"])
    out: dict[str, list[str]] = {"added": [], "frozen": [], "reactivated": [], "kept": []}
    sel = set(selected)
    with all_or_nothing(model, DAFLinear):
        for lname, layer in layers.items():  # model order: deterministic initialisation
            role = layer.role[name]
            if lname in sel:
                if role == "training":
                    out["kept"].append(lname)
                elif role == "frozen":
                    layer.role[name] = "training"
                    out["reactivated"].append(lname)
                else:
                    A, B = _fresh_unit(layer, rank, generator)
                    layer.attach_unit(name, A, B)
                    out["added"].append(lname)
            elif role == "training":
                layer.role[name] = "frozen"
                out["frozen"].append(lname)
        sync_trainable(model, DAFLinear, freeze_base=False)
    return out


def active_parameter_count(model: nn.Module, name: str = "default") -> int:
    """Parameters of the *training* units of adapter ``name`` (what the budget counts)."""
    return sum(u.A.numel() + u.B.numel() for _, layer in require_adapter(model, name, DAFLinear)
               for n, u in layer.daf.items() if n == name and layer.role[name] == "training")


def _unit_params(model: nn.Module, name: str, layer_names: Iterable[str]) -> list[nn.Parameter]:
    out = []
    for lname in layer_names:
        layer = model.get_submodule(lname)
        if isinstance(layer, DAFLinear) and name in layer.daf:
            out += [layer.daf[name].A, layer.daf[name].B]
    return out


def check_refocusable(optimizer: Any) -> None:
    """RankwiseError unless ``optimizer`` is a ``torch.optim.Optimizer`` whose param groups can be edited in place."""
    if not isinstance(optimizer, torch.optim.Optimizer) or not isinstance(getattr(optimizer, "param_groups", None),
                                                                          list):
        raise RankwiseError(f"cannot refocus a {type(optimizer).__name__} in place (it is not a torch.optim."
                            "Optimizer with param groups); pass make_optimizer=<factory f(params) -> Optimizer>")
    if isinstance(optimizer, torch.optim.LBFGS):
        raise RankwiseError("LBFGS keeps one global state over its parameters and cannot change them mid-training; "
                            "pass make_optimizer=<factory f(params) -> Optimizer>")


def refocus_optimizer(optimizer: torch.optim.Optimizer, removed: Sequence[nn.Parameter],
                      added: Sequence[nn.Parameter], keep: Sequence[nn.Parameter] = ()) -> torch.optim.Optimizer:
    """Drop ``removed`` (and their state) from ``optimizer``'s param groups and add ``added``, in place.

    ``added`` joins the group that holds a parameter of ``keep`` (surviving units of the adapter), else the
    group that held ``removed``, else the first group, so it shares that group's learning rate and
    schedule (an ``LRScheduler`` bound to the optimizer keeps working). Survivors keep their state
    (Adam moments). An optimizer that is not a ``torch.optim.Optimizer`` raises RankwiseError: rebuild it
    yourself with a factory (``DAFController(make_optimizer=...)``).
    """
    check_refocusable(optimizer)
    rem = {id(p) for p in removed}
    keep_ids = {id(p) for p in keep}
    target_group = None
    fallback = None
    for g in optimizer.param_groups:
        ids = {id(p) for p in g["params"]}
        if target_group is None and ids & keep_ids:
            target_group = g
        if fallback is None and ids & rem:
            fallback = g
    target_group = target_group or fallback or (optimizer.param_groups[0] if optimizer.param_groups else None)
    for g in optimizer.param_groups:
        g["params"] = [p for p in g["params"] if id(p) not in rem]
    for p in removed:
        optimizer.state.pop(p, None)
    present = {id(p) for g in optimizer.param_groups for p in g["params"]}
    new = [p for p in added if id(p) not in present]
    if new:
        if target_group is None:
            optimizer.add_param_group({"params": new})
        else:
            target_group["params"].extend(new)
    return optimizer
