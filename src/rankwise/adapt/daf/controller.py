"""DAF during training: :class:`DAFController` runs the periodic re-allocation rounds (:class:`DAFRound`
records one)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Iterable

import torch
from torch import nn

from rankwise.adapt.daf.analysis import _unit_params, active_parameter_count, apply_allocation, check_refocusable, refocus_optimizer, take_batches, taylor_sensitivity
from rankwise.adapt.daf.config import DAFConfig, LossFn, _pos_int, log
from rankwise.adapt.daf.functional import allocate, change_fraction, resolve_budget, smooth
from rankwise.adapt.daf.layer import DAFLinear
from rankwise.core.adapters import require_adapter
from rankwise.core.errors import RankwiseError


# the training-time controller
# ------------------------------------------------------------------------------------------------

@dataclass
class DAFRound:
    """One analysis round: when, the scores, what was selected and what changed.

    ``scores`` are the smoothed ``S_j`` (``raw_scores`` before smoothing); ``applied`` says whether the
    change test passed (round 0 always applies); ``skipped`` holds the reason when the analysis was
    skipped (non-finite loss); ``active_params`` is the budget count after the round.
    """

    step: int
    raw_scores: dict[str, float]
    scores: dict[str, float]
    selected: list[str]
    previous: list[str]
    change: float
    applied: bool
    added: list[str] = field(default_factory=list)
    frozen: list[str] = field(default_factory=list)
    reactivated: list[str] = field(default_factory=list)
    active_params: int = 0
    budget: int = 0
    skipped: str | None = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


class DAFController:
    """Runs DAF's periodic analysis and Rebuild-and-Refocus inside any training loop (spec steps 1-6).

    Args:
        model: a model with DAF adapter ``name`` (from :func:`adapt`, which ran round 0).
        analysis_data: an iterable of batches; its first ``config.calib_batches`` are taken once and
            reused every round (reproducible analysis batches, as the official code's fixed seed).
        loss_fn: ``f(model, batch) -> scalar`` (default ``model(...).loss``).
        name: the adapter.
        config: defaults to the config the adapter was created with.
        total_steps: needed when ``config.analysis_every`` is a fraction.
        make_optimizer: optional factory ``f(params) -> Optimizer``; when given, an applied round builds
            a new optimizer over the trainable parameters (survivors' state copied) instead of editing the
            old one in place; the new one is in ``round.optimizer``/``self.optimizer``.

    Call :meth:`maybe_update` before the optimizer step of every step ``i`` (``i = 0, 1, ...``): at
    ``i > 0`` and ``i % interval == 0`` it analyses and, if the change test passes, rebuilds and
    refocuses ``optimizer``. :meth:`callback` adapts it to :func:`rankwise.train.finetune.lockstep`.
    """

    def __init__(self, model: nn.Module, analysis_data: Iterable[Any], loss_fn: LossFn | None = None, *,
                 name: str = "default", config: DAFConfig | None = None, total_steps: int | None = None,
                 make_optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer] | None = None) -> None:
        layers = require_adapter(model, name, DAFLinear)
        meta = layers[0][1].adapter_config[name]
        self.config = config if config is not None else DAFConfig.from_json(meta)
        if not isinstance(self.config, DAFConfig):
            raise TypeError(f"config must be a DAFConfig, got {type(self.config).__name__}")
        if total_steps is not None and not _pos_int(total_steps):
            raise ValueError(f"total_steps must be an int >= 1, got {total_steps!r}")
        if make_optimizer is not None and not callable(make_optimizer):
            raise TypeError("make_optimizer must be a factory f(params) -> torch.optim.Optimizer")
        self.model, self.name, self.loss_fn = model, name, loss_fn
        self.total_steps = total_steps
        self.interval = self.config.interval(total_steps)
        self.budget = int(meta.get("budget", resolve_budget(self.config, self.costs())))
        self.batches = take_batches(analysis_data, self.config.calib_batches, "DAF analysis")
        self.make_optimizer = make_optimizer
        self.optimizer: torch.optim.Optimizer | None = None
        self.rounds_done = int(meta.get("round", 0))
        self.history: list[DAFRound] = []
        self.budget_trace: list[int] = []

    def costs(self) -> dict[str, int]:
        return {n: layer.cost(self.config.rank) for n, layer in require_adapter(self.model, self.name, DAFLinear)}

    def selected(self) -> list[str]:
        return [n for n, layer in require_adapter(self.model, self.name, DAFLinear) if layer.role[self.name] == "training"]

    def due(self, step: int) -> bool:
        return step > 0 and step % self.interval == 0 and (self.total_steps is None or step < self.total_steps)

    def maybe_update(self, step: int, optimizer: torch.optim.Optimizer | None = None) -> DAFRound | None:
        """Run a round if ``step`` is an analysis step; returns the round (None otherwise)."""
        self.budget_trace.append(active_parameter_count(self.model, self.name))
        if not self.due(step):
            return None
        return self.update(step, optimizer)

    def update(self, step: int, optimizer: torch.optim.Optimizer | None = None) -> DAFRound:
        """Analyse now (steps 1-2), allocate (3), test the change (4), rebuild and refocus (5)."""
        if optimizer is not None and self.make_optimizer is None:
            check_refocusable(optimizer)  # before anything changes
        layers = dict(require_adapter(self.model, self.name, DAFLinear))
        previous = self.selected()
        raw = taylor_sensitivity(self.model, self.batches, self.loss_fn, layers=list(layers.items()),
                                 context="current", seed=self.config.seed, train_mode=self.config.analysis_train_mode)
        if raw is None:
            rnd = DAFRound(step, {}, {}, previous, previous, 0.0, False, active_params=self.budget_trace[-1]
                           if self.budget_trace else active_parameter_count(self.model, self.name),
                           budget=self.budget, skipped="non-finite loss during the analysis")
            self.history.append(rnd)
            return rnd
        prev_scores = {n: layer.score[self.name] for n, layer in layers.items()}
        has_prev = all(v is not None for v in prev_scores.values())
        scores = smooth(prev_scores if has_prev else None, raw, self.config.ema)
        for n, layer in layers.items():
            layer.score[self.name] = scores[n]
        costs = self.costs()
        selected = allocate(scores, costs, self.budget, rank_by=self.config.rank_by, fill=self.config.fill)
        change = change_fraction(previous, selected, list(layers))
        applied = change > self.config.change_thresholds[0]
        self.rounds_done += 1
        rnd = DAFRound(step, raw, scores, selected, previous, change, applied, budget=self.budget)
        if applied:
            gen = torch.Generator().manual_seed(self.config.seed * 1_000_003 + self.rounds_done)
            before = {id(p): p for p in _unit_params(self.model, self.name, previous)}
            diff = apply_allocation(self.model, self.name, selected, gen)
            rnd.added, rnd.frozen, rnd.reactivated = diff["added"], diff["frozen"], diff["reactivated"]
            now = _unit_params(self.model, self.name, selected)
            removed = _unit_params(self.model, self.name, diff["frozen"])
            added = [p for p in now if id(p) not in before]
            keep = [p for p in now if id(p) in before]
            if optimizer is not None or self.make_optimizer is not None:
                self.optimizer = self._refocus(optimizer, removed, added, keep)
        for layer in layers.values():
            layer.adapter_config[self.name]["round"] = self.rounds_done
        rnd.active_params = active_parameter_count(self.model, self.name)
        log.info("DAF round %d at step %d: change %.3f (%s); selected %s; added %s, frozen %s, reactivated %s; "
                 "%d / %d budget parameters", self.rounds_done, step, change, "applied" if applied else "kept",
                 selected, rnd.added, rnd.frozen, rnd.reactivated, rnd.active_params, self.budget)
        if rnd.active_params > self.budget:
            raise RankwiseError(f"internal: DAF active parameters {rnd.active_params} exceed the budget {self.budget}")
        self.history.append(rnd)
        return rnd

    def _refocus(self, optimizer: torch.optim.Optimizer | None, removed: list[nn.Parameter],
                 added: list[nn.Parameter], keep: list[nn.Parameter]) -> torch.optim.Optimizer:
        if self.make_optimizer is None:
            return refocus_optimizer(optimizer, removed, added, keep)
        params = [p for p in self.model.parameters() if p.requires_grad]
        new = self.make_optimizer(params)
        if not isinstance(new, torch.optim.Optimizer):
            raise TypeError(f"make_optimizer returned {type(new).__name__}, not a torch.optim.Optimizer")
        if isinstance(optimizer, torch.optim.Optimizer):
            for p in params:
                if p in optimizer.state:
                    new.state[p] = optimizer.state[p]
        return new

    def callback(self, trainer: Any) -> Callable[[int, Any], None]:
        """A ``lockstep``/loop callback ``f(i, losses)`` for a :class:`rankwise.train.finetune.Trainer`.

        Called after step ``i``, it runs :meth:`maybe_update` for step ``i + 1`` on ``trainer.optimizer``
        and keeps ``trainer.params`` (the clipped parameters) equal to the model's trainable ones.
        """
        def call(i: int, _losses: Any = None) -> None:
            rnd = self.maybe_update(i + 1, trainer.optimizer)
            if rnd is not None and rnd.applied:
                if self.optimizer is not None and self.optimizer is not trainer.optimizer:
                    raise RankwiseError("DAFController.callback edits the trainer's optimizer in place; do not "
                                        "combine it with make_optimizer")
                trainer.params[:] = [p for p in trainer.model.parameters() if p.requires_grad]
        return call
