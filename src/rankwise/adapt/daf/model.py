"""DAF on a whole model: Taylor sensitivity, rebuilding the allocation, :func:`adapt` (round 0) and the
adapter API (:data:`DAF`, an :class:`~rankwise.core.adapters.AdapterMethod`)."""

from __future__ import annotations

import math
import warnings
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

import torch
from torch import nn

from rankwise.adapt.daf.config import DAFConfig, LossFn, renamed_keys
from rankwise.adapt.daf.functional import allocate, resolve_budget, unit_cost
from rankwise.adapt.daf.layer import DAFLinear
from rankwise.core.adapters import AdapterMethod, default_loss, deprecated_kwargs, validate_adapter_name
from rankwise.core.errors import ArtifactError, NumericalError, RankwiseError, SelectionError
from rankwise.core.registry import register
from rankwise.core.select import Selector
from rankwise.core.surgery import replace_module


# ------------------------------------------------------------------------------------------------
# model-level helpers
# ------------------------------------------------------------------------------------------------

class _DAFMethod(AdapterMethod):
    """DAF's artefact: units ``<layer>.daf_A``/``daf_B`` (none for a candidate without a unit); records hold
    role, score and scaling; the adapter's config goes into the metadata. A training run re-allocates
    through :class:`~rankwise.adapt.daf.DAFController` (:meth:`training_hook`)."""

    def calibration_batches(self, config: DAFConfig) -> int:
        return config.calib_batches

    def training_hook(self, model: nn.Module, config: DAFConfig, calib: Sequence[Any] | None,
                      total_steps: int) -> Callable[[Any, int], None]:
        from rankwise.adapt.daf.controller import DAFController  # the controller builds on this module

        controller = DAFController(model, calib, total_steps=total_steps)
        hooks: dict[int, Callable[[int, Any], None]] = {}

        def hook(trainer: Any, steps_done: int) -> None:
            if id(trainer) not in hooks:
                hooks[id(trainer)] = controller.callback(trainer)
            hooks[id(trainer)](steps_done - 1)
        return hook

    def extra_metadata(self, model: nn.Module, name: str, layers: Sequence[tuple[str, Any]]) -> dict[str, Any]:
        return {"config": dict(layers[0][1].adapter_config[name])}

    def read_context(self, meta: Mapping[str, Any], path: Path) -> dict[str, Any]:
        config = meta.get("config")
        if not isinstance(config, dict):
            raise ArtifactError(f"{path}: metadata lacks the config")
        config = renamed_keys(config)
        try:
            return {"config": config, "cfg": DAFConfig.from_json(config)}
        except (TypeError, ValueError) as e:
            raise ArtifactError(f"{path}: bad DAF config in the metadata ({e})") from e


#: DAF's model-level adapter API (set_active, merge, save_adapter, load_adapter, ...).
DAF = _DAFMethod(DAFLinear, "rankwise.daf", default_lr=3e-4)

daf_layers = DAF.layers
adapter_names = DAF.adapter_names
set_active = DAF.set_active
enable_adapters = DAF.enable
disable_adapters = DAF.disable
merge = DAF.merge
unmerge = DAF.unmerge
delete_adapter = DAF.delete_adapter
unload = DAF.unload
save_adapter = DAF.save_adapter
load_adapter = DAF.load_adapter
_layers_of = DAF.require_adapter


def _target_layers(model: nn.Module, target: Selector) -> list[tuple[str, nn.Module]]:
    """Linear layers (or DAF wrappers) that ``target`` selects, never a wrapper's internals."""
    return DAF.target_layers(model, target, typed=True)


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
    (the official behaviour: the round is skipped).
    """
    if context not in ("current", "base"):
        raise ValueError(f"context must be 'current' or 'base', got {context!r}")
    loss_fn = default_loss if loss_fn is None else loss_fn
    if not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable (model, batch) -> loss, got {type(loss_fn).__name__}")
    if layers is None:
        if name is None:
            raise ValueError("pass the adapter name or the candidate layers")
        layers = _layers_of(model, name)
    if not batches:
        raise ValueError("taylor_sensitivity needs at least one batch")
    weights = {n: _base_of(m).weight for n, m in layers}
    all_layers = daf_layers(model)
    if any(layer.merged_adapters for _, layer in all_layers):
        raise RankwiseError("unmerge the DAF adapters before a sensitivity analysis")
    flags = {id(p): (p, p.requires_grad) for p in model.parameters()}
    grads_before = {n: w.grad for n, w in weights.items()}
    modes = {m: m.training for m in model.modules()}
    disabled = [(layer, layer.disabled) for _, layer in all_layers]
    acc = {n: torch.zeros((), dtype=torch.float64, device=w.device) for n, w in weights.items()}
    try:
        for p in model.parameters():
            p.requires_grad_(False)
        for w in weights.values():
            w.requires_grad_(True)
            w.grad = None
        if context == "base":
            for layer, _ in disabled:
                layer.disabled = True
        model.train(train_mode)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            for i, batch in enumerate(batches):
                loss = loss_fn(model, batch)
                if not isinstance(loss, torch.Tensor) or loss.ndim != 0:
                    shape = f" of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else ""
                    raise TypeError(f"loss_fn must return a scalar tensor, got {type(loss).__name__}{shape}")
                if not bool(torch.isfinite(loss.detach())):
                    warnings.warn(f"DAF sensitivity: the loss is {float(loss.detach())} on analysis batch {i}; "
                                  "skipping this round (the allocation is kept)", stacklevel=2)
                    return None
                loss.float().backward()
                for n, w in weights.items():
                    if w.grad is not None:
                        acc[n] += (w.grad.detach().to(torch.float64) * w.detach().to(torch.float64)).abs().sum()
                        w.grad = None
    finally:
        for p, flag in flags.values():
            p.requires_grad_(flag)
        for n, w in weights.items():
            w.grad = grads_before[n]
        for layer, d in disabled:
            layer.disabled = d
        for m, mode in modes.items():
            m.training = mode
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
    layers = dict(_layers_of(model, name))
    selected = list(dict.fromkeys(selected))
    unknown = [s for s in selected if s not in layers]
    if unknown:
        raise SelectionError(f"{unknown[:3]} are not candidates of DAF adapter {name!r}")
    rank = int(layers[next(iter(layers))].adapter_config[name]["rank"])
    out: dict[str, list[str]] = {"added": [], "frozen": [], "reactivated": [], "kept": []}
    sel = set(selected)
    with DAF.all_or_nothing(model):
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
        DAF.sync_trainable(model, freeze_base=False)
    return out


def active_parameter_count(model: nn.Module, name: str = "default") -> int:
    """Parameters of the *training* units of adapter ``name`` (what the budget counts)."""
    return sum(u.A.numel() + u.B.numel() for _, layer in _layers_of(model, name)
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


# ------------------------------------------------------------------------------------------------
# adapt (round 0)
# ------------------------------------------------------------------------------------------------

def _costs(layers: Sequence[tuple[str, nn.Module]], rank: int) -> dict[str, int]:
    return {n: unit_cost(_base_of(m).in_features, _base_of(m).out_features, rank) for n, m in layers}


@deprecated_kwargs(batches="calib")
def adapt(model: nn.Module, config: DAFConfig | None = None, target: Selector = None, name: str = "default", *,
          calib: Iterable[Any] | None = None, loss_fn: LossFn | None = None,
          selection: Sequence[str] | None = None) -> nn.Module:
    """Add DAF adapter ``name``: wrap the candidate matrices ``target`` selects and run round 0; in place.

    Round 0 measures the Taylor sensitivity of every candidate on the first ``config.calib_batches``
    of ``batches`` with ``loss_fn(model, batch) -> scalar`` (default ``model(...).loss``), on the model
    with the other DAF adapters switched off, and attaches a fresh LoRA unit (``B = 0``: outputs
    unchanged) to the matrices the greedy allocation picks under the budget. Alternatively
    ``selection`` (layer names) skips the analysis. The new adapter becomes the active and only
    trainable one; every other parameter is frozen (unfreeze a task head yourself). Then train with a
    :class:`DAFController` (or :class:`DAFTrainer`) to re-allocate during training.

    Errors (model unchanged): ValueError for a rank above ``min(d_in, d_out)`` of a candidate, a budget
    below the cheapest unit (the message gives its cost), no batches and no selection, an empty batch
    iterable; SelectionError when ``target`` matches no Linear layer.
    """
    config = DAFConfig() if config is None else config
    if not isinstance(config, DAFConfig):
        raise TypeError(f"adapt: config must be a DAFConfig, got {type(config).__name__}")
    if not isinstance(model, nn.Module):
        raise TypeError(f"adapt: model must be an nn.Module, got {type(model).__name__}")
    validate_adapter_name(name)
    merged = [n for n, layer in daf_layers(model) if layer.merged_adapters]
    if merged:
        raise RankwiseError(f"adapters are merged in {merged[:3]}; unmerge before adding an adapter")
    hits = _target_layers(model, config.target if target is None else target)
    for lname, mod in hits:
        base = _base_of(mod)
        lim = min(base.in_features, base.out_features)
        if config.rank > lim:
            raise ValueError(f"DAF rank={config.rank} for layer {lname!r} exceeds min(in_features="
                             f"{base.in_features}, out_features={base.out_features}) = {lim}; choose rank in "
                             f"[1, {lim}]")
        if isinstance(mod, DAFLinear) and name in mod.role:
            raise ValueError(f"layer {lname!r} already has a DAF adapter named {name!r}; choose another name or "
                             "delete it first")
    costs = _costs(hits, config.rank)
    budget = resolve_budget(config, costs)
    if selection is not None:
        selection = [selection] if isinstance(selection, str) else list(selection)
        unknown = [s for s in selection if s not in costs]
        if unknown:
            raise SelectionError(f"selection {unknown[:3]} are not candidates; candidates: {list(costs)[:10]}")
        if sum(costs[s] for s in selection) > budget:
            raise ValueError(f"selection costs {sum(costs[s] for s in selection)} parameters, above the "
                             f"budget {budget}")
        scores: dict[str, float] | None = None
        selected = selection
    else:
        if calib is None:
            raise ValueError("DAF adapt needs training batches for the round-0 sensitivity analysis: pass "
                             "calib=<iterable of batches> and loss_fn=<f(model, batch) -> loss>, or an explicit "
                             "selection=[layer names]")
        data = take_batches(calib, config.calib_batches, "DAF round 0")
        scores = taylor_sensitivity(model, data, loss_fn, layers=hits, context="base", seed=config.seed,
                                    train_mode=config.analysis_train_mode)
        if scores is None:
            raise NumericalError("DAF round 0: the loss is non-finite on the analysis batches; cannot allocate")
        selected = allocate(scores, costs, budget, rank_by=config.rank_by, fill=config.fill)
    meta = {"method": "daf", **config.to_json(), "budget": budget, "round": 0}
    gen = torch.Generator().manual_seed(config.seed)
    with DAF.all_or_nothing(model):
        for lname, mod in hits:
            layer = mod if isinstance(mod, DAFLinear) else DAFLinear(mod, layer_name=lname)
            if layer is not mod:
                replace_module(model, lname, layer)
            layer.add_candidate(name, config.scaling, config.dropout, meta)
            if scores is not None:
                layer.score[name] = scores[lname]
        for _, layer in daf_layers(model):
            layer.active_adapters = [name] if name in layer.role else []
        apply_allocation(model, name, selected, gen)
        DAF.sync_trainable(model, freeze_base=True)
    return model


def report(model: nn.Module, name: str = "default") -> list[dict[str, Any]]:
    """Per candidate layer of adapter ``name``: role, smoothed score, unit cost."""
    rows = []
    for lname, layer in _layers_of(model, name):
        rank = int(layer.adapter_config[name]["rank"])
        rows.append({"layer": lname, "role": layer.role[name], "score": layer.score[name], "cost": layer.cost(rank)})
    return rows


register("daf", config=DAFConfig, entry=adapt, adapter=DAF)
