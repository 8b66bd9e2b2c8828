"""DAF on a whole model: :func:`adapt` (round 0), the report, :class:`DAFTrainer` (a minimal loop around the
controller) and the adapter API (:data:`DAF`, an :class:`~rankwise.core.adapters.AdapterMethod`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

import torch
from torch import nn

from rankwise.adapt.daf.analysis import _base_of, apply_allocation, take_batches, taylor_sensitivity
from rankwise.adapt.daf.config import DAFConfig, LossFn, _pos_int, renamed_keys
from rankwise.adapt.daf.controller import DAFController, DAFRound
from rankwise.adapt.daf.functional import allocate, resolve_budget, unit_cost
from rankwise.adapt.daf.layer import DAFLinear
from rankwise.core.adapters import AdapterMethod, deprecated_kwargs
from rankwise.core.errors import ArtifactError, NumericalError, SelectionError
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
    config = DAF.start_adapt(model, config, DAFConfig, name)
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


class DAFTrainer:
    """A self-contained DAF training loop (the spec's API sketch): round 0, periodic rounds, an optimizer factory.

    ``DAFTrainer(model, cfg, train_loader, loss_fn, make_optimizer).fit(steps)`` adapts ``model`` (if it
    has no DAF adapter ``name`` yet) on the first batches of ``train_loader``, then trains ``steps``
    steps, cycling over the loader, rebuilding the optimizer with ``make_optimizer`` after every
    applied round. ``history``: one :class:`DAFRound` per analysis; ``losses``; ``budget_trace``.
    Parameters that should train besides the adapter (a head) must have ``requires_grad`` set after
    construction, before :meth:`fit`.
    """

    def __init__(self, model: nn.Module, config: DAFConfig, train_loader: Iterable[Any], loss_fn: LossFn,
                 make_optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer], *, name: str = "default",
                 target: Selector = None) -> None:
        """``target`` (types, patterns or a predicate) overrides ``config.target`` for the candidates."""
        if not callable(make_optimizer):
            raise TypeError("DAFTrainer needs make_optimizer, a factory f(params) -> torch.optim.Optimizer "
                            "(DAF changes the trainable set during training)")
        self.model, self.config, self.loader, self.loss_fn = model, config, train_loader, loss_fn
        self.make_optimizer, self.name = make_optimizer, name
        if name not in adapter_names(model):
            adapt(model, config, target=target, name=name, calib=train_loader, loss_fn=loss_fn)
        self.losses: list[float] = []
        self.controller: DAFController | None = None

    @property
    def history(self) -> list[DAFRound]:
        return [] if self.controller is None else self.controller.history

    @property
    def budget_trace(self) -> list[int]:
        return [] if self.controller is None else self.controller.budget_trace

    def fit(self, steps: int) -> "DAFTrainer":
        if not _pos_int(steps):
            raise ValueError(f"steps must be an int >= 1, got {steps!r}")
        self.controller = DAFController(self.model, self.loader, self.loss_fn, name=self.name, config=self.config,
                                        total_steps=steps, make_optimizer=self.make_optimizer)
        opt = self.make_optimizer([p for p in self.model.parameters() if p.requires_grad])
        it = iter(self.loader)
        self.model.train()
        for step in range(steps):
            rnd = self.controller.maybe_update(step, opt)
            if rnd is not None and rnd.applied:
                opt = self.controller.optimizer
            try:
                batch = next(it)
            except StopIteration:
                it = iter(self.loader)
                batch = next(it)
            loss = self.loss_fn(self.model, batch)
            if not bool(torch.isfinite(loss.detach())):
                raise NumericalError(f"DAFTrainer: training loss is {float(loss.detach())} at step {step}")
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            self.losses.append(float(loss.detach()))
        return self


register("daf", config=DAFConfig, entry=adapt, adapter=DAF)
