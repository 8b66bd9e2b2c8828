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

from rankwise.adapt.daf.config import (  # noqa: F401
    BERT_CANDIDATES,
    CONFIG_FILE,
    DAFConfig,
    FILL,
    LossFn,
    OLD_FIELDS,
    RANK_BY,
    renamed_keys,
    ROLES,
    WEIGHTS_FILE,
)
from rankwise.adapt.daf.functional import (  # noqa: F401
    allocate,
    change_fraction,
    NumericalError,
    resolve_budget,
    smooth,
    unit_cost,
)
from rankwise.adapt.daf.layer import (  # noqa: F401
    AdapterLayer,
    DAFLinear,
    RankwiseError,
    validate_adapter_name,
)
from rankwise.adapt.daf.analysis import (  # noqa: F401
    active_parameter_count,
    apply_allocation,
    check_refocusable,
    default_loss,
    refocus_optimizer,
    SelectionError,
    take_batches,
    taylor_sensitivity,
)
from rankwise.adapt.daf.controller import (  # noqa: F401
    DAFController,
    DAFRound,
)
from rankwise.adapt.daf.model import (  # noqa: F401
    adapt,
    adapter_names,
    ArtifactError,
    DAF,
    daf_layers,
    DAFTrainer,
    delete_adapter,
    disable_adapters,
    enable_adapters,
    load_adapter,
    merge,
    register,
    replace_module,
    report,
    save_adapter,
    Selector,
    set_active,
    unload,
    unmerge,
)

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
