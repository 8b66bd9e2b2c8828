"""DAF: dynamic sensitivity-aware fine-tuning, "Rebuild-and-Refocus" (ICML 2026; official code E-green11/DAF).

Budgeted PEFT methods decide once where the trainable parameters go. DAF re-measures, periodically
and on the *current* model, how sensitive the loss is to each candidate weight matrix, and moves the
budget: matrices that stopped mattering are frozen (their learned update stays in the forward pass),
newly important ones get a fresh LoRA unit, the rest keep training. Steps (spec "Method"):

1. Sensitivity (first-order Taylor, context-aware): on ``n_b`` fixed batches, forward/backward through
   the current model (adapters on) with every PEFT parameter's ``requires_grad`` temporarily off, and
   accumulate per element ``s(θ_i) = Σ_batches |g_i θ_i|``; the matrix score is ``S_j = Σ_{i ∈ W_j} s(θ_i)``
   (:func:`taylor_sensitivity`, float64 accumulation).
2. Smoothing: ``S_j ← ema · S_j^prev + (1 - ema) · S_j`` (0.7 by default; first round raw) (:func:`smooth`).
3. Allocation: one pool of matrices, each unit a rank-``r`` LoRA of cost ``r (d_in + d_out)``; sort by
   ``S_j / cost_j`` and add greedily until ``P``, passing over a unit that does not fit to try cheaper
   ones (the spec's simplified rankwise default, ``fill="skip"``); ``rank_by="score"`` with
   ``fill="stop"`` (stop at the first unit that does not fit) is the official code's rule within a
   group (:func:`allocate`).
4. Change test: the new allocation is applied only if the fraction of changed matrix selections
   (changed entries of the selection mask over all candidates, as the official code counts them)
   exceeds ``change_thresholds[0]`` = 0.10 (:func:`change_fraction`); the vector threshold (0.20) is
   kept in the config for the official variant with vectors, which rankwise does not train.
5. Rebuild-and-Refocus: outdated units are frozen but kept; newly selected matrices get a fresh LoRA
   (``A`` Kaiming-uniform, ``B = 0``: the function is unchanged at the rebuild); re-selected frozen
   units train again (one unit per matrix, as in the official model); the optimizer drops the frozen
   parameters (and their state), keeps the survivors' Adam moments and adds the new ones to the
   adapter's param group (:func:`refocus_optimizer`). Only *training* units count against ``P``.
6. Schedule: round 0 when the adapter is created (:func:`adapt`), then every ``analysis_every`` steps
   (an int) or every fraction of the total steps (a float; default 0.25) (:class:`DAFController`).

Usage with any training loop::

    from rankwise.adapt.daf import DAFConfig, DAFController, adapt
    adapt(model, DAFConfig(budget_params=24_576, lora_rank=4), batches=train_batches, loss_fn=loss_fn)
    ctl = DAFController(model, analysis_data=train_batches, loss_fn=loss_fn, total_steps=160)
    for step, batch in enumerate(batches):
        ctl.maybe_update(step, optimizer)      # refocuses the optimizer in place when a round applies
        loss_fn(model, batch).backward(); optimizer.step(); optimizer.zero_grad()
    ctl.history                                # one DAFRound per analysis: scores, selected, frozen, applied

With the shared loop (:class:`rankwise.train.finetune.Trainer`) use ``lockstep(..., callback=ctl.callback(trainer))``;
:class:`DAFTrainer` is a self-contained loop with an optimizer factory (the spec's API sketch).

Choices (see docs/methods/daf.md): the analysis runs in train mode (dropout on) under a forked RNG
seeded by ``config.seed`` (the official code seeds 0 and uses train mode); round 0 of a new adapter
measures the model with the other adapters switched off (the new adapter is empty and will be the
only active one, so that *is* the current model); ``budget_fraction`` is a fraction of the cost of a
unit on every candidate.
"""

from __future__ import annotations

import contextlib
import logging
import math
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

import torch
from torch import nn

from rankwise.core import adapters, io
from rankwise.core.adapters import AdapterLayer, validate_adapter_name
from rankwise.core.errors import ArtifactError, NumericalError, RankwiseError, SelectionError
from rankwise.core.registry import register
from rankwise.core.select import Selector
from rankwise.core.surgery import replace_module

__all__ = [
    "DAFConfig",
    "DAFController",
    "DAFLinear",
    "DAFRound",
    "DAFTrainer",
    "active_parameter_count",
    "adapt",
    "adapter_names",
    "allocate",
    "apply_allocation",
    "change_fraction",
    "check_refocusable",
    "daf_layers",
    "delete_adapter",
    "disable_adapters",
    "enable_adapters",
    "load_adapter",
    "merge",
    "refocus_optimizer",
    "report",
    "resolve_budget",
    "save_adapter",
    "set_active",
    "smooth",
    "taylor_sensitivity",
    "unit_cost",
    "unload",
    "unmerge",
]

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_KIND = "rankwise.daf"
_OWN_FILES = {CONFIG_FILE, WEIGHTS_FILE}
RANK_BY = ("score_per_cost", "score")
FILL = ("stop", "skip")
ROLES = ("candidate", "training", "frozen")
#: the six linear layers of a BERT block (q, k, v, attention output, fc1, fc2), as module-name suffixes
BERT_CANDIDATES = ("query", "key", "value", "attention.output.dense", "intermediate.dense", "output.dense")

LossFn = Callable[[nn.Module, Any], torch.Tensor]
log = logging.getLogger(__name__)


def _pos_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(float(value))


# ------------------------------------------------------------------------------------------------
# configuration
# ------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class DAFConfig:
    """DAF hyper-parameters (defaults: the paper's: LoRA rank 8, n_b = 8, EMA 0.7, thresholds 0.10 / 0.20).

    Attributes:
        lora_rank: rank ``r`` of every LoRA unit; a unit on ``W (d_out, d_in)`` costs ``r (d_in + d_out)``.
        lora_alpha: LoRA scaling numerator, ``s = alpha / r``.
        budget_params: the budget ``P`` as an absolute number of *training* adapter parameters; None: use
            ``budget_fraction``.
        budget_fraction: ``P`` as a fraction in (0, 1] of the cost of a unit on every candidate matrix.
        target: module-name patterns of the candidate matrices (default: the six linear layers of a BERT
            block); pass types or a callable to :func:`adapt` as ``target=``.
        analysis_batches: ``n_b >= 1``, batches per sensitivity analysis.
        analysis_every: steps between analyses (int >= 1) or a fraction of the total steps in (0, 1]
            (float; default 0.25: rounds at 0, 25 %, 50 %, 75 % of training).
        ema: weight of the previous scores in the smoothing, in [0, 1).
        change_thresholds: (matrix, vector) thresholds of the change test, each in [0, 1].
        rank_by: ``"score_per_cost"`` (greedy by ``S_j / cost_j``) or ``"score"`` (by ``S_j``, official).
        fill: ``"skip"`` a unit that does not fit and continue with cheaper ones (fills the budget; the
            rankwise default) or ``"stop"`` at the first unit that does not fit (the official rule).
        analysis_train_mode: run the analysis in train mode (dropout on, official) or eval mode.
        dropout: dropout on the adapter input, in [0, 1).
        seed: seeds the analysis RNG and the LoRA initialisations.
    """

    lora_rank: int = 8
    lora_alpha: float = 16.0
    budget_params: int | None = None
    budget_fraction: float = 0.25
    target: tuple[str, ...] = BERT_CANDIDATES
    analysis_batches: int = 8
    analysis_every: int | float = 0.25
    ema: float = 0.7
    change_thresholds: tuple[float, float] = (0.10, 0.20)
    rank_by: str = "score_per_cost"
    fill: str = "skip"
    analysis_train_mode: bool = True
    dropout: float = 0.0
    seed: int = 0

    def __post_init__(self) -> None:
        if not _pos_int(self.lora_rank):
            raise ValueError(f"DAFConfig.lora_rank must be an int >= 1, got {self.lora_rank!r}")
        if not _number(self.lora_alpha) or float(self.lora_alpha) <= 0:
            raise ValueError(f"DAFConfig.lora_alpha must be a finite number > 0, got {self.lora_alpha!r}")
        object.__setattr__(self, "lora_alpha", float(self.lora_alpha))
        if self.budget_params is not None and not _pos_int(self.budget_params):
            raise ValueError(f"DAFConfig.budget_params must be None or an int >= 1, got {self.budget_params!r}")
        if not _number(self.budget_fraction) or not 0.0 < float(self.budget_fraction) <= 1.0:
            raise ValueError(f"DAFConfig.budget_fraction must be in (0, 1], got {self.budget_fraction!r}")
        object.__setattr__(self, "budget_fraction", float(self.budget_fraction))
        target = (self.target,) if isinstance(self.target, str) else self.target
        if (not isinstance(target, (tuple, list)) or not target
                or not all(isinstance(t, str) and t for t in target)):
            raise ValueError("DAFConfig.target must be a non-empty tuple of module-name patterns, got "
                             f"{self.target!r} (pass types or callables to adapt(target=...))")
        object.__setattr__(self, "target", tuple(target))
        if not _pos_int(self.analysis_batches):
            raise ValueError(f"DAFConfig.analysis_batches must be an int >= 1 (zero batches cannot measure "
                             f"sensitivity), got {self.analysis_batches!r}")
        ae = self.analysis_every
        if isinstance(ae, bool) or not isinstance(ae, (int, float)) or (
                isinstance(ae, int) and ae < 1) or (isinstance(ae, float) and not 0.0 < ae <= 1.0):
            raise ValueError("DAFConfig.analysis_every must be an int >= 1 (steps) or a float in (0, 1] "
                             f"(fraction of the total steps), got {ae!r}")
        if not _number(self.ema) or not 0.0 <= float(self.ema) < 1.0:
            raise ValueError(f"DAFConfig.ema must be in [0, 1), got {self.ema!r}")
        object.__setattr__(self, "ema", float(self.ema))
        th = self.change_thresholds
        if (not isinstance(th, (tuple, list)) or len(th) != 2
                or not all(_number(t) and 0.0 <= float(t) <= 1.0 for t in th)):
            raise ValueError(f"DAFConfig.change_thresholds must be two numbers in [0, 1] (matrix, vector), got {th!r}")
        object.__setattr__(self, "change_thresholds", (float(th[0]), float(th[1])))
        if self.rank_by not in RANK_BY:
            raise ValueError(f"DAFConfig.rank_by must be one of {RANK_BY}, got {self.rank_by!r}")
        if self.fill not in FILL:
            raise ValueError(f"DAFConfig.fill must be one of {FILL}, got {self.fill!r}")
        if not isinstance(self.analysis_train_mode, bool):
            raise ValueError(f"DAFConfig.analysis_train_mode must be a bool, got {self.analysis_train_mode!r}")
        if not _number(self.dropout) or not 0.0 <= float(self.dropout) < 1.0:
            raise ValueError(f"DAFConfig.dropout must be in [0, 1), got {self.dropout!r}")
        object.__setattr__(self, "dropout", float(self.dropout))
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise ValueError(f"DAFConfig.seed must be an int >= 0, got {self.seed!r}")

    @property
    def scaling(self) -> float:
        return self.lora_alpha / self.lora_rank

    def interval(self, total_steps: int | None) -> int:
        """Steps between analyses: ``analysis_every`` itself, or ``max(1, round(fraction * total_steps))``."""
        if isinstance(self.analysis_every, int):
            return self.analysis_every
        if total_steps is None:
            raise ValueError("DAFConfig.analysis_every is a fraction of the total steps; pass total_steps")
        return max(1, int(round(self.analysis_every * total_steps)))

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["target"] = list(self.target)
        d["change_thresholds"] = list(self.change_thresholds)
        return d

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> "DAFConfig":
        d = dict(d)
        d["target"] = tuple(d.get("target", BERT_CANDIDATES))
        d["change_thresholds"] = tuple(d.get("change_thresholds", (0.10, 0.20)))
        return cls(**{k: v for k, v in d.items() if k in cls.__dataclass_fields__})


# ------------------------------------------------------------------------------------------------
# the math (no model needed)
# ------------------------------------------------------------------------------------------------

def unit_cost(d_in: int, d_out: int, rank: int) -> int:
    """Trainable parameters of a rank-``rank`` LoRA unit on a ``(d_out, d_in)`` matrix: ``r (d_in + d_out)``."""
    if not (_pos_int(d_in) and _pos_int(d_out) and _pos_int(rank)):
        raise ValueError(f"unit_cost needs positive ints, got d_in={d_in!r}, d_out={d_out!r}, rank={rank!r}")
    return rank * (d_in + d_out)


def smooth(previous: Mapping[str, float] | None, new: Mapping[str, float], ema: float = 0.7) -> dict[str, float]:
    """Step 2: ``S ← ema · S_prev + (1 - ema) · S_new`` per matrix; ``new`` unchanged when there is no history.

    A matrix without a previous score (e.g. added to the candidates later) takes its raw score.
    """
    if not 0.0 <= ema < 1.0:
        raise ValueError(f"ema must be in [0, 1), got {ema!r}")
    if previous is None:
        return {k: float(v) for k, v in new.items()}
    out = {}
    for k, v in new.items():
        p = previous.get(k)
        out[k] = float(v) if p is None else ema * float(p) + (1.0 - ema) * float(v)
    return out


def allocate(scores: Mapping[str, float], costs: Mapping[str, int], budget: int, *,
             rank_by: str = "score_per_cost", fill: str = "skip") -> list[str]:
    """Step 3: the matrices that receive a unit, greedily by ``S_j / cost_j`` (or ``S_j``) under ``budget``.

    Ties keep the order of ``scores`` (model order). ``fill="skip"`` passes over a unit that does not
    fit, ``"stop"`` ends at the first one (the official rule). Returns the selected names in the order of ``scores``;
    their total cost is ``<= budget`` by construction.
    """
    if rank_by not in RANK_BY:
        raise ValueError(f"rank_by must be one of {RANK_BY}, got {rank_by!r}")
    if fill not in FILL:
        raise ValueError(f"fill must be one of {FILL}, got {fill!r}")
    if set(scores) != set(costs):
        raise ValueError(f"scores and costs must name the same matrices; differ on "
                         f"{sorted(set(scores) ^ set(costs))[:5]}")
    names = list(scores)
    for n in names:
        s = scores[n]
        if not _number(s) or s < 0:
            raise NumericalError(f"sensitivity of {n!r} is {s!r}; scores must be finite and >= 0")
    key = (lambda n: scores[n] / costs[n]) if rank_by == "score_per_cost" else (lambda n: scores[n])
    order = sorted(range(len(names)), key=lambda i: -key(names[i]))  # stable: ties keep model order
    chosen: set[str] = set()
    used = 0
    for i in order:
        n = names[i]
        if used + costs[n] <= budget:
            chosen.add(n)
            used += costs[n]
        elif fill == "stop":
            break
    return [n for n in names if n in chosen]


def change_fraction(old: Iterable[str], new: Iterable[str], candidates: Sequence[str]) -> float:
    """Step 4: changed entries of the selection mask over the candidates, ``|old Δ new| / |candidates|``."""
    if not candidates:
        raise ValueError("change_fraction needs at least one candidate")
    return len(set(old) ^ set(new)) / len(candidates)


def resolve_budget(config: DAFConfig, costs: Mapping[str, int]) -> int:
    """The budget ``P``: ``config.budget_params`` or ``floor(budget_fraction · Σ_j cost_j)``.

    ValueError when ``P`` is smaller than the cheapest unit (nothing could ever be trained), naming its cost.
    """
    if not costs:
        raise ValueError("DAF needs at least one candidate matrix")
    P = config.budget_params if config.budget_params is not None else int(config.budget_fraction * sum(costs.values()))
    cheapest = min(costs, key=lambda n: costs[n])
    if P < costs[cheapest]:
        src = f"budget_params={config.budget_params}" if config.budget_params is not None else \
            f"budget_fraction={config.budget_fraction} of {sum(costs.values())} = {P}"
        raise ValueError(f"DAF budget ({src}) is smaller than one unit: the cheapest unit (rank "
                         f"{config.lora_rank} on {cheapest!r}) costs {costs[cheapest]} parameters; raise the budget "
                         "or lower lora_rank")
    return P


# ------------------------------------------------------------------------------------------------
# the layer
# ------------------------------------------------------------------------------------------------

class _Unit(nn.Module):
    """One LoRA unit: ``A (r, d_in)``, ``B (d_out, r)``; the update is ``s · B A x``."""

    def __init__(self, A: torch.Tensor, B: torch.Tensor) -> None:
        super().__init__()
        self.A = nn.Parameter(A.contiguous())
        self.B = nn.Parameter(B.contiguous())


class DAFLinear(AdapterLayer):
    """An ``nn.Linear`` that is a DAF candidate of one or more named adapters.

    ``y = base(x) + Σ_{active adapters with a unit} s · B A dropout(x)``; shapes ``x (..., d_in) -> y (..., d_out)``.
    Per adapter the layer has a *role*: ``"candidate"`` (no unit), ``"training"`` (a trainable unit that
    counts against the budget) or ``"frozen"`` (a unit kept in the forward pass, not trained, free).
    ``score[name]`` is the smoothed sensitivity ``S_j`` of the last analysis (None before any).
    State-dict keys ``<layer>.daf.<name>.{A,B}``.
    """

    adapter_store = "role"
    adapter_fields = ("daf", "daf_dropout", "role", "score", "scaling", "adapter_config")
    adapter_label = "DAF adapter"
    family = "DAF"

    def __init__(self, base_layer: nn.Linear, layer_name: str = "") -> None:
        if not isinstance(base_layer, nn.Linear):
            raise TypeError(f"DAFLinear wraps nn.Linear, got {type(base_layer).__name__}"
                            f"{' at ' + layer_name if layer_name else ''}")
        super().__init__(base_layer, layer_name)
        self.in_features = base_layer.in_features
        self.out_features = base_layer.out_features
        self.daf = nn.ModuleDict()
        self.daf_dropout = nn.ModuleDict()
        self.role: dict[str, str] = {}
        self.score: dict[str, float | None] = {}
        self.scaling: dict[str, float] = {}
        self.train(base_layer.training)

    def cost(self, rank: int) -> int:
        return unit_cost(self.in_features, self.out_features, rank)

    # -- adapters -----------------------------------------------------------------------------
    def add_candidate(self, name: str, scaling: float, dropout: float, config: Mapping[str, Any]) -> None:
        validate_adapter_name(name)
        if name in self.role:
            raise ValueError(f"{self._where()} already has an adapter named {name!r}")
        self.role[name] = "candidate"
        self.score[name] = None
        self.scaling[name] = float(scaling)
        self.daf_dropout[name] = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.daf_dropout[name].train(self.training)
        self.adapter_config[name] = dict(config)

    def attach_unit(self, name: str, A: torch.Tensor, B: torch.Tensor) -> None:
        """Install a unit (copied, moved to the base's device) for adapter ``name``; its role becomes training."""
        self._require(name)
        if name in self.merged_adapters:
            raise RankwiseError(f"{self._where()}: adapter {name!r} is merged; unmerge first")
        if A.ndim != 2 or B.ndim != 2 or A.shape[1] != self.in_features or B.shape[0] != self.out_features \
                or A.shape[0] != B.shape[1] or not A.is_floating_point() or A.dtype != B.dtype:
            raise ValueError(f"{self._where()}: unit A {tuple(A.shape)}, B {tuple(B.shape)} does not fit "
                             f"(d_out={self.out_features}, d_in={self.in_features}); expected A (r, in), B (out, r) "
                             "of one floating dtype")
        dev = self.base_layer.weight.device
        unit = _Unit(A.detach().to(dev, copy=True), B.detach().to(dev, copy=True))
        unit.train(self.training)
        self.daf[name] = unit
        self.role[name] = "training"

    # -- math -----------------------------------------------------------------------------------
    def delta_weight(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor | None:
        """``s · B A`` of adapter ``name`` (``(d_out, d_in)``, float32 or wider), None without a unit."""
        self._require(name)
        if name not in self.daf:
            return None
        u = self.daf[name]
        dt = dtype or torch.promote_types(u.A.dtype, torch.float32)
        return (u.B.detach().to(dt) @ u.A.detach().to(dt)) * self.scaling[name]

    def mergeable_adapters(self) -> list[str]:
        """The active adapters that have a unit (candidates without one contribute nothing)."""
        return [n for n in self.active_adapters if n in self.daf]

    def adapter_parameters(self, name: str) -> list[tuple[nn.Parameter, bool]]:
        """The unit's ``A``, ``B`` (none for a candidate), trainable only in the "training" role."""
        if name not in self.daf:
            return []
        u, training = self.daf[name], self.role[name] == "training"
        return [(u.A, training), (u.B, training)]

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        result = self.base_layer(x, *args, **kwargs)
        if self.disabled or self.merged_adapters:
            return result
        for name in self.active_adapters:
            u = self.daf[name] if name in self.daf else None
            if u is None:
                continue
            xa = self.daf_dropout[name](x.to(u.A.dtype))
            update = (xa @ u.A.T) @ u.B.T * self.scaling[name]
            result = result + update.to(result.dtype)
        return result

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, roles={self.role}, "
                f"active={self.active_adapters}, merged={self.merged_adapters}, disabled={self.disabled}")


# ------------------------------------------------------------------------------------------------
# model-level helpers
# ------------------------------------------------------------------------------------------------

def daf_layers(model: nn.Module) -> list[tuple[str, DAFLinear]]:
    """``(qualified name, DAFLinear)`` of every DAF layer of ``model``, in model order."""
    return adapters.adapted_layers(model, DAFLinear)


def adapter_names(model: nn.Module) -> list[str]:
    """Names of the DAF adapters in ``model`` (in order of first appearance)."""
    return adapters.adapter_names(model, DAFLinear)


def _layers_of(model: nn.Module, name: str) -> list[tuple[str, DAFLinear]]:
    return adapters.require_adapter(model, name, DAFLinear)


def _all_or_nothing(model: nn.Module) -> contextlib.AbstractContextManager[None]:
    return adapters.all_or_nothing(model, DAFLinear)


def _sync_trainable(model: nn.Module, freeze_base: bool) -> None:
    """Units of active adapters whose role is "training" are trainable; every other unit is frozen;
    every non-DAF parameter is frozen when ``freeze_base``."""
    adapters.sync_trainable(model, DAFLinear, freeze_base)


def _target_layers(model: nn.Module, target: Selector) -> list[tuple[str, nn.Module]]:
    """Linear layers (or DAF wrappers) that ``target`` selects, never a wrapper's internals."""
    return adapters.target_layers(model, target, DAFLinear, typed=True)


def _base_of(mod: nn.Module) -> nn.Linear:
    return mod.base_layer if isinstance(mod, DAFLinear) else mod  # type: ignore[return-value]


def default_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    """``model(**batch).loss`` for a dict batch, ``model(*batch).loss`` for a tuple; otherwise pass ``loss_fn``."""
    if isinstance(batch, Mapping):
        out = model(**batch)
    elif isinstance(batch, (tuple, list)):
        out = model(*batch)
    else:
        out = model(batch)
    loss = out.get("loss") if isinstance(out, Mapping) else getattr(out, "loss", None)
    if not isinstance(loss, torch.Tensor):
        raise TypeError("the model's output has no .loss; pass loss_fn=lambda model, batch: <scalar loss>")
    return loss


def take_batches(data: Iterable[Any] | None, n: int, what: str = "DAF analysis") -> list[Any]:
    """The first ``n`` batches of ``data`` as a list; fewer than ``n``: warn and use what exists; none: ValueError."""
    if data is None:
        raise ValueError(f"{what} needs batches of training data (batches=... / analysis_data=...)")
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
        warnings.warn(f"{what}: analysis_batches={n} but only {len(out)} batch(es) exist; using {len(out)}",
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
    rank = int(layers[next(iter(layers))].adapter_config[name]["lora_rank"])
    out: dict[str, list[str]] = {"added": [], "frozen": [], "reactivated": [], "kept": []}
    sel = set(selected)
    with _all_or_nothing(model):
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
        _sync_trainable(model, freeze_base=False)
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


def adapt(model: nn.Module, config: DAFConfig | None = None, target: Selector = None, name: str = "default", *,
          batches: Iterable[Any] | None = None, loss_fn: LossFn | None = None,
          selection: Sequence[str] | None = None) -> nn.Module:
    """Add DAF adapter ``name``: wrap the candidate matrices ``target`` selects and run round 0; in place.

    Round 0 measures the Taylor sensitivity of every candidate on the first ``config.analysis_batches``
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
        if config.lora_rank > lim:
            raise ValueError(f"DAF lora_rank={config.lora_rank} for layer {lname!r} exceeds min(in_features="
                             f"{base.in_features}, out_features={base.out_features}) = {lim}; choose lora_rank in "
                             f"[1, {lim}]")
        if isinstance(mod, DAFLinear) and name in mod.role:
            raise ValueError(f"layer {lname!r} already has a DAF adapter named {name!r}; choose another name or "
                             "delete it first")
    costs = _costs(hits, config.lora_rank)
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
        if batches is None:
            raise ValueError("DAF adapt needs training batches for the round-0 sensitivity analysis: pass "
                             "batches=<iterable of batches> and loss_fn=<f(model, batch) -> loss>, or an explicit "
                             "selection=[layer names]")
        data = take_batches(batches, config.analysis_batches, "DAF round 0")
        scores = taylor_sensitivity(model, data, loss_fn, layers=hits, context="base", seed=config.seed,
                                    train_mode=config.analysis_train_mode)
        if scores is None:
            raise NumericalError("DAF round 0: the loss is non-finite on the analysis batches; cannot allocate")
        selected = allocate(scores, costs, budget, rank_by=config.rank_by, fill=config.fill)
    meta = {"method": "daf", **config.to_json(), "budget": budget, "round": 0}
    gen = torch.Generator().manual_seed(config.seed)
    with _all_or_nothing(model):
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
        _sync_trainable(model, freeze_base=True)
    return model


# ------------------------------------------------------------------------------------------------
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
        analysis_data: an iterable of batches; its first ``config.analysis_batches`` are taken once and
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
        layers = _layers_of(model, name)
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
        self.batches = take_batches(analysis_data, self.config.analysis_batches, "DAF analysis")
        self.make_optimizer = make_optimizer
        self.optimizer: torch.optim.Optimizer | None = None
        self.rounds_done = int(meta.get("round", 0))
        self.history: list[DAFRound] = []
        self.budget_trace: list[int] = []

    def costs(self) -> dict[str, int]:
        return {n: layer.cost(self.config.lora_rank) for n, layer in _layers_of(self.model, self.name)}

    def selected(self) -> list[str]:
        return [n for n, layer in _layers_of(self.model, self.name) if layer.role[self.name] == "training"]

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
        layers = dict(_layers_of(self.model, self.name))
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
            adapt(model, config, target=target, name=name, batches=train_loader, loss_fn=loss_fn)
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


# ------------------------------------------------------------------------------------------------
# contract operations
# ------------------------------------------------------------------------------------------------

def report(model: nn.Module, name: str = "default") -> list[dict[str, Any]]:
    """Per candidate layer of adapter ``name``: role, smoothed score, unit cost."""
    rows = []
    for lname, layer in _layers_of(model, name):
        rank = int(layer.adapter_config[name]["lora_rank"])
        rows.append({"layer": lname, "role": layer.role[name], "score": layer.score[name], "cost": layer.cost(rank)})
    return rows


def set_active(model: nn.Module, names: str | Sequence[str]) -> None:
    """Make ``names`` the active adapter(s) of every DAF layer; their training units become trainable."""
    adapters.set_active(model, names, DAFLinear)


def enable_adapters(model: nn.Module) -> None:
    adapters.enable_adapters(model, DAFLinear)


def disable_adapters(model: nn.Module) -> None:
    """Make the model compute the base model's outputs (adapters kept). Refused while merged."""
    adapters.disable_adapters(model, DAFLinear)


def merge(model: nn.Module) -> nn.Module:
    """Merge the active adapters' units (training and frozen) into the base weights; all-or-nothing."""
    adapters.merge_all(model, DAFLinear)
    return model


def unmerge(model: nn.Module) -> nn.Module:
    adapters.unmerge_all(model, DAFLinear)
    return model


def delete_adapter(model: nn.Module, name: str) -> None:
    adapters.delete_adapter(model, name, DAFLinear)


def unload(model: nn.Module, merge_first: bool = True) -> nn.Module:
    """Replace every DAFLinear by its base layer (merging the active adapters first if ``merge_first``)."""
    return adapters.unload(model, DAFLinear, merge_first)


# ------------------------------------------------------------------------------------------------
# save / load
# ------------------------------------------------------------------------------------------------

def save_adapter(model: nn.Module, directory: str | Path, name: str = "default", *,
                 overwrite: bool | None = None) -> Path:
    """Save adapter ``name`` atomically: ``adapter_model.safetensors`` (units ``<layer>.daf_A``/``daf_B``;
    header: per-layer role, score, scaling, the config, the base-model fingerprint, SHA-256 digests) and a
    readable ``adapter_config.json``. Candidates without a unit are recorded too (their scores drive the
    next round's smoothing)."""
    layers = _layers_of(model, name)
    tensors: dict[str, torch.Tensor] = {}
    modules: dict[str, dict[str, Any]] = {}
    for lname, layer in layers:
        if name in layer.daf:
            tensors[f"{lname}.daf_A"] = layer.daf[name].A.detach()
            tensors[f"{lname}.daf_B"] = layer.daf[name].B.detach()
        modules[lname] = {"role": layer.role[name], "score": layer.score[name], "scaling": layer.scaling[name],
                          "in_features": layer.in_features, "out_features": layer.out_features}
    config = dict(layers[0][1].adapter_config[name])
    meta = {"kind": _KIND, "name": name, "config": config, "modules": modules,
            "fingerprint": io.model_fingerprint(model)}
    directory = Path(directory)
    if overwrite is None:
        overwrite = directory.is_dir() and all(p.is_file() and p.name in _OWN_FILES for p in directory.iterdir())
    with io.atomic_dir(directory, overwrite=bool(overwrite)) as tmp:
        io.write_json(tmp / CONFIG_FILE, {"method": "daf", "name": name, "config": config, "modules": modules})
        io.save_tensors(tmp / WEIGHTS_FILE, tensors, meta)
    return directory


def load_adapter(model: nn.Module, directory: str | Path, name: str = "default", *,
                 check_base: bool = True) -> nn.Module:
    """Load an adapter written by :func:`save_adapter` into ``model`` as adapter ``name`` (active).

    Replaces an adapter of that name. ArtifactError (model unchanged) for a missing, corrupt or
    truncated file, another artefact kind, another base model (fingerprint; skip with
    ``check_base=False``), or modules that do not fit.
    """
    validate_adapter_name(name)
    directory = Path(directory)
    if not directory.is_dir():
        raise ArtifactError(f"{directory}: no such adapter directory")
    path = directory / WEIGHTS_FILE
    tensors, meta = io.load_tensors(path)
    if meta.get("kind") != _KIND:
        raise ArtifactError(f"{path}: not a rankwise DAF adapter (kind={meta.get('kind')!r})")
    modules, config = meta.get("modules"), meta.get("config")
    if not isinstance(modules, dict) or not modules or not isinstance(config, dict):
        raise ArtifactError(f"{path}: metadata lacks the module table or the config")
    try:
        cfg = DAFConfig.from_json(config)
    except (TypeError, ValueError) as e:
        raise ArtifactError(f"{path}: bad DAF config in the metadata ({e})") from e
    expected: set[str] = set()
    for m, info in modules.items():
        if not isinstance(info, dict) or info.get("role") not in ROLES or not _number(info.get("scaling")) \
                or not (info.get("score") is None or _number(info.get("score"))):
            raise ArtifactError(f"{path}: bad metadata for module {m!r}")
        if info["role"] != "candidate":
            expected |= {f"{m}.daf_A", f"{m}.daf_B"}
    if set(tensors) != expected:
        raise ArtifactError(f"{path}: tensors do not match the module table (missing "
                            f"{sorted(expected - set(tensors))[:4]}, unexpected {sorted(set(tensors) - expected)[:4]})")
    if check_base:
        io.check_fingerprint(meta.get("fingerprint"), model, source=str(path))
    if any(layer.merged_adapters for _, layer in daf_layers(model)):
        raise RankwiseError("unmerge the DAF adapters before loading one")
    found: dict[str, nn.Module] = {}
    problems: list[str] = []
    for m, info in modules.items():
        try:
            mod = model.get_submodule(m)
        except AttributeError:
            problems.append(f"module {m!r} does not exist in the model")
            continue
        base = _base_of(mod)
        if not isinstance(base, nn.Linear):
            problems.append(f"module {m!r} is a {type(mod).__name__}, not nn.Linear")
            continue
        if f"{m}.daf_A" in tensors:
            A, B = tensors[f"{m}.daf_A"], tensors[f"{m}.daf_B"]
            if A.ndim != 2 or B.ndim != 2 or A.shape != (cfg.lora_rank, base.in_features) \
                    or B.shape != (base.out_features, cfg.lora_rank) or A.dtype != B.dtype:
                problems.append(f"module {m!r}: unit A {tuple(A.shape)}, B {tuple(B.shape)} does not fit "
                                f"({base.out_features}, {base.in_features}) with rank {cfg.lora_rank}")
                continue
        found[m] = mod
    if problems:
        raise ArtifactError(f"{path} does not fit this model: {'; '.join(problems[:5])}")
    with _all_or_nothing(model):
        for lname, layer in daf_layers(model):
            if name in layer.role:
                layer.delete_adapter(name)
        for m, mod in found.items():
            info = modules[m]
            layer = model.get_submodule(m)
            if not isinstance(layer, DAFLinear):
                layer = DAFLinear(mod, layer_name=m)
                replace_module(model, m, layer)
            layer.add_candidate(name, float(info["scaling"]), cfg.dropout, config)
            layer.score[name] = None if info["score"] is None else float(info["score"])
            if info["role"] != "candidate":
                layer.attach_unit(name, tensors[f"{m}.daf_A"], tensors[f"{m}.daf_B"])
                layer.role[name] = info["role"]
        for lname, layer in list(daf_layers(model)):
            layer.active_adapters = [name] if name in layer.role else []
            if not layer.adapters:
                replace_module(model, lname, layer.base_layer)
        _sync_trainable(model, freeze_base=True)
    return model


register("daf", config=DAFConfig, entry=adapt)
