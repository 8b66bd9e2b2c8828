"""Reproduction of DAF (dynamic sensitivity-aware re-allocation) on the embedded MiniLM, against a static
allocation, PEFT's LoRA and PEFT's AdaLoRA at the same trainable-parameter budget.

Setting (spec "Reproduction at small scale", the CDKA/PSOFT set-up of :mod:`rankwise.repro.cdka`): the
pretrained all-MiniLM-L6-v2 + a linear head on mean-pooled tokens, the seeded 4-class "negated
sentiment x topic" task (2 000 train / 1 000 test, at most 16 tokens, batch 16). The top ``top_layers``
encoder layers are adapted (their six linear layers are DAF's candidates: q, k, v, attention output,
fc1, fc2); the frozen layers below are run once and cached. Every model trains with the shared loop
(:class:`rankwise.train.finetune.Trainer`: AdamW, linear schedule with 6 % warm-up, clipping 1.0) in
lock step on the same batches; the head trains in every row at 1e-3 (the head-only row too), outside the budget.

Budget ``P = (2 · top_layers) · R_QV · 768``: the size of rank-``R_QV`` LoRA on q and v of the adapted
layers (9 216 in quick mode with 2 layers, 18 432 in full mode with 4 layers: the spec's 6 layers x 160 steps x
3 seeds x 5 rows would not fit 10 minutes on 2 busy cores, and the spec allows cutting layers/steps, never seeds). Rows:

* **DAF**: ``DAFConfig(lora_rank=4, budget_params=P)``; round 0 at step 0, then rounds at
  ``analysis_every`` with ``n_b`` fixed analysis batches (drawn apart from the training batches);
* **static (round 0 only)**: the same model right after round 0, never re-allocated (SPT-style);
* **LoRA q,v (PEFT)**: ``peft.LoraConfig(r=R_QV, target_modules=["query", "value"])`` = exactly ``P``;
* **AdaLoRA q,v (PEFT)**: ``peft.AdaLoraConfig(init_r=2 R_QV, target_r=R_QV)`` on q, v, so that its final
  rank budget is ``R_QV`` per matrix on average (final parameters ``P + 36``: the singular values);
  ``update_and_allocate`` runs after every optimizer step and AdaLoRA's orthogonality regulariser (weight
  0.1, PEFT adds it only to an output ``.loss``, which our logits model has not) is added to the gradients
  at the same point (:class:`AdaLoraHook`); schedule ``tinit = 10 %``, ``tfinal = 30 %`` of the steps;
* **head only** (full mode): the frozen encoder with a trained head.

Every adapter row uses scaling 2 (``alpha = 2 r``; AdaLoRA: ``lora_alpha = 2 init_r``, PEFT divides by ``init_r``).
Learning rates: every row gets its best adapter rate from the same grid by :func:`lr_sweep` on a
development seed with a validation split (``DafSettings.lrs``), the grid extended at an edge for every row
until no row's best rate sits at an edge; the head trains at one rate (``lr_head``) in every row, the
head-only reference included; full mode reuses the quick-mode rates.

DAF's change test (:func:`change_threshold`): a rebuild applies when more than ``1.5 / C`` of the
selection mask over the ``C = 6 top_layers`` candidates changes, i.e. one swap. The official 0.10 means
"a quarter of the units swapped" at the spec's sizes (8 units in 36 candidates) but "half of them or more"
with the 3-4 units of this budget (in full mode one swap is 2/24 = 0.083 < 0.10, so DAF could only equal
the static allocation); one swap keeps the spec's meaning here.
What runs is :class:`DafSettings` (``SETTINGS[mode]``; ``rankwise reproduce daf --set analysis_every=20``):
the model, data sizes, layers, steps, the analysis schedule, the rows, DAF's unit rank, the baselines' rank
and targets, the budget (``None``: the formula above), AdaLoRA's schedule and regulariser, and the learning
rates.

Checks (spec "THE CLAIM"): (a) DAF mean test accuracy >= static + 0.5 point; (b) DAF >= AdaLoRA - 0.5
point (``claim`` checks with the paired per-example differences of correctness on the test sentences, so
they carry a bootstrap interval); (c) DAF's training adapter parameters never exceed ``P`` at any step
(exact; a ``wiring`` check). (a) and (b) are expected to hold only qualitatively at this scale.

Preconditions (added with the conversion to the skeleton; they can only move the verdict to
``inconclusive``): the task does not saturate (not every row of (a) and (b) at >= 99 % test accuracy, the
design's "within a point of 100 %") and the compared baselines, the static allocation and AdaLoRA, learned
(test accuracy above chance 1/4 by more than 0.10, the floor the LoRA reproduction uses).
"""

from __future__ import annotations

import copy
import dataclasses
import statistics
from pathlib import Path
from typing import Any, Sequence

import torch
from torch import nn

from rankwise.adapt import daf
from rankwise.repro.cdka import LABELS, negation_task
from rankwise.repro.kit.cached_encoder import (
    CachedSplit,
    FrozenPrefix,
    TopModel,
    adapter_optimizer,
    batch_indices,
    evaluate_cached,
    median_step_ms,
    peft_inject,
    sweep_val_accuracy,
    trainable_adapter_params,
)
from rankwise.repro.result import ClaimCheck, Precondition, Table
from rankwise.repro.kit.minilm import MiniLMReproduction
from rankwise.repro.skeleton import Records, Settings, pyplot, save_figure, setting
from rankwise.train.finetune import Batch, FinetuneConfig, Trainer, lockstep

ID = "daf"
CLAIM = ("Re-measuring sensitivity on the current model during training and moving the PEFT budget to the newly "
         "important matrices (freezing, not discarding, the outdated ones) fine-tunes better than a static "
         "allocation and at least as well as AdaLoRA at the same trainable-parameter budget.")

R_DAF = 4
R_QV = 3
QV = ("query", "value")
HIDDEN = 384
LR_HEAD = 1e-3
ORTH_REG = 0.1
ROWS = ("DAF", "static (round 0 only)", "LoRA q,v (PEFT)", "AdaLoRA q,v (PEFT)")
# adapter learning rate per row, chosen by lr_sweep() on the grid {1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 1e-1, 3e-1} (dev seed 100,
# quick settings, 1 600 training / 400 validation sentences; the head at LR_HEAD). Validation accuracy per rate:
#   DAF      0.675 0.6175 0.565  0.4975 0.4725 0.49     (best 3e-4, the lower edge: the adapters barely move)
#   static   0.675 0.6175 0.5675 0.4975 0.465  0.4975   (best 3e-4)
#   LoRA     0.6675 0.6975 0.6075 0.8125 0.5675 0.4875  (best 1e-2)
#   AdaLoRA  0.6675 0.6675 0.6675 0.675 0.865  0.9775   (best 1e-1, the upper edge)
# That grid ended at DAF's and static's optimum (lower edge) and at AdaLoRA's (upper edge), so it was extended by
# one half-decade at each edge, for every row, same seed, split and head rate (2026-12-01, with the one-swap change
# test, which in quick mode passes the same swaps as 0.10: 2/12 candidates exceeds both):
#            1e-4     3e-1
#   DAF      0.6725   0.2175   (3e-4 stays best, now inside the grid)
#   static   0.6725   0.2175   (3e-4)
#   LoRA     0.67     0.2175   (1e-2)
#   AdaLoRA  0.6675   0.53     (1e-1 stays best, now inside the grid)
# The head trains at LR_HEAD in every row; "head only" (full mode) trains only its head, at LR_HEAD too (before the
# review it had 3e-2, thirty times the adapter rows' head rate). smoke and full use these quick-mode rates.
LRS: tuple[tuple[str, float], ...] = (("DAF", 3e-4), ("static (round 0 only)", 3e-4), ("LoRA q,v (PEFT)", 1e-2),
                                      ("AdaLoRA q,v (PEFT)", 1e-1))


@dataclasses.dataclass(frozen=True, kw_only=True)
class DafSettings(Settings):
    """What the DAF reproduction runs; ``SETTINGS[mode]`` holds each mode's values."""

    model: str = setting("all-MiniLM-L6-v2", "the pretrained encoder (zoo.minilm)", choices=("all-MiniLM-L6-v2",))
    n_train: int = setting(2000, "training sentences (a multiple of 4)", lo=4)
    n_test: int = setting(1000, "test sentences (a multiple of 4)", lo=4)
    top_layers: int = setting(2, "adapted top encoder layers; their six Linears are DAF's candidates", lo=1, hi=6)
    steps: int = setting(60, "training steps of every row (the same batches)", lo=1)
    batch_size: int = setting(16, "sentences per step", lo=1)
    max_length: int = setting(16, "tokens per sentence", lo=1)
    analysis_every: int = setting(30, "steps between DAF's analysis rounds", lo=1)
    analysis_batches: int = setting(2, "fixed analysis batches per round (n_b)", lo=1)
    rows: tuple[str, ...] = setting(ROWS, "rows trained (DAF always)")
    r_daf: int = setting(R_DAF, "rank of a DAF unit (alpha = 2 r)", lo=1)
    r_qv: int = setting(R_QV, "rank of the LoRA baseline and AdaLoRA's target rank (init 2 r)", lo=1)
    baseline_targets: tuple[str, ...] = setting(QV, "modules of the LoRA and AdaLoRA baselines")
    budget: int | None = setting(None, "DAF's budget P (None: rank-r_qv LoRA on q and v of the adapted layers, "
                                       "2 top_layers r_qv (384 + 384))", lo=1)
    adalora_tinit: float = setting(0.1, "AdaLoRA's warm-up (no pruning), a fraction of the steps", lo=0.0, hi=1.0)
    adalora_tfinal: float = setting(0.3, "AdaLoRA's final fine-tuning at the target budget, a fraction of the steps",
                                    lo=0.0, hi=1.0)
    orth_reg: float = setting(ORTH_REG, "AdaLoRA's orthogonality regulariser weight", lo=0.0)
    change_threshold: float | None = setting(None, "DAF's matrix change test: applied when the changed fraction of "
                                                   "the candidates' selection mask exceeds this (None: 1.5 / (6 "
                                                   "top_layers), one swap passes; the official 0.10 asks for 2 of "
                                                   "the 3-4 units here, see change_threshold())", lo=0.0, hi=1.0)
    lr_head: float = setting(LR_HEAD, "head learning rate of every row (the head-only row included)", lo=0.0)
    lrs: tuple[tuple[str, float], ...] = setting(LRS, "(row, adapter lr) per adapter row, by lr_sweep at lr_head")

    def validate(self) -> None:
        if self.n_train % 4 or self.n_test % 4:
            raise ValueError(f"DafSettings.n_train and n_test must be multiples of 4, got {self.n_train}, "
                             f"{self.n_test}")
        known = ROWS + ("head only",)
        unknown = [r for r in self.rows if r not in known]
        if unknown:
            raise ValueError(f"DafSettings.rows must be among {known}, got {unknown}")
        if not {"DAF", "static (round 0 only)", "AdaLoRA q,v (PEFT)"} <= set(self.rows):
            raise ValueError(f"DafSettings.rows must include DAF, static (round 0 only) and AdaLoRA q,v (PEFT), "
                             f"got {self.rows}")
        missing = [r for r in self.rows if r != "head only" and r not in {x[0] for x in self.lrs}]
        if missing:
            raise ValueError(f"DafSettings.lrs has no learning rate for {missing}")


SETTINGS: dict[str, DafSettings] = {
    "smoke": DafSettings(n_train=96, n_test=64, top_layers=1, steps=4, analysis_every=2, analysis_batches=1),
    "quick": DafSettings(),
    "full": DafSettings(top_layers=4, steps=160, analysis_every=40, analysis_batches=4, rows=ROWS + ("head only",)),
}
STATIC_MARGIN = 0.005      # claim (a): acc(DAF) - acc(static) >= 0.5 point
ADALORA_SLACK = -0.005     # claim (b): acc(DAF) - acc(AdaLoRA) >= -0.5 point
SATURATED = 0.99           # precondition: not every compared row at >= 99 % test accuracy
MIN_ABOVE_CHANCE = 0.10    # precondition: static's and AdaLoRA's accuracy - chance (1/4) > 0.10
COMPARED = ("DAF", "static (round 0 only)", "AdaLoRA q,v (PEFT)")


def budget_for(top_layers: int, r_qv: int = R_QV, hidden: int = HIDDEN) -> int:
    """``P``: rank-``r_qv`` LoRA on q and v of ``top_layers`` layers of width ``hidden`` (384)."""
    return 2 * top_layers * r_qv * 2 * hidden


def _loss(model: nn.Module, batch: Batch) -> torch.Tensor:
    return nn.functional.cross_entropy(model(**batch.inputs), batch.labels)


class AdaLoraHook:
    """AdaLoRA's per-step work in the shared loop: the orthogonality regulariser's gradient, then (after
    the optimizer step, before ``zero_grad``) ``update_and_allocate(step)``, as PEFT's docs prescribe.

    :meth:`optimizer` returns an AdamW factory (adapter and head groups, as the other rows) whose optimizer
    runs these around its own step.
    """

    def __init__(self, tuner: nn.Module, orth_reg_weight: float = ORTH_REG) -> None:
        self.tuner, self.weight, self.step = tuner, orth_reg_weight, 0

    def regulariser(self) -> torch.Tensor | None:
        """``mean over A, B of ||P P^T - I||_F`` (A: rows, B: columns), PEFT's formula."""
        terms = []
        for n, p in self.tuner.model.named_parameters():
            if p.requires_grad and ("lora_A" in n or "lora_B" in n):
                cov = p @ p.T if "lora_A" in n else p.T @ p
                terms.append(torch.linalg.matrix_norm(cov - torch.eye(cov.shape[0], dtype=cov.dtype)))
        return torch.stack(terms).mean() if terms else None

    def optimizer(self, head: nn.Module, lr_adapter: float, lr_head: float):
        """An AdamW factory (adapter group at ``lr_adapter``, head group at ``lr_head``) running the hook."""
        head_ids = {id(p) for p in head.parameters()}
        hook = self

        class _Hooked(torch.optim.AdamW):
            def step(self, closure=None):  # noqa: ANN001
                if hook.weight > 0:
                    with torch.enable_grad():
                        reg = hook.regulariser()
                        if reg is not None:
                            (hook.weight * reg).backward()
                out = super().step(closure)
                hook.tuner.update_and_allocate(hook.step)
                hook.step += 1
                return out

        def factory(params: list[nn.Parameter]) -> torch.optim.Optimizer:
            groups = [{"params": [p for p in params if id(p) not in head_ids], "lr": lr_adapter},
                      {"params": [p for p in params if id(p) in head_ids], "lr": lr_head}]
            return _Hooked([g for g in groups if g["params"]], weight_decay=0.0)
        return factory

    def final_params(self) -> int:
        """Parameters of the ranks AdaLoRA keeps at the end: ``Σ_j nnz(E_j) (d_in + d_out + 1)``."""
        total = 0
        for _, m in self.tuner.model.named_modules():
            E = getattr(m, "lora_E", None)
            if isinstance(E, nn.ParameterDict) and "default" in E:
                k = int((E["default"].detach() != 0).sum())
                A, B = m.lora_A["default"], m.lora_B["default"]
                total += k * (A.shape[1] + B.shape[0] + 1)
        return total


def _head_only(base: TopModel) -> TopModel:
    h = copy.deepcopy(base)
    for p in h.parameters():
        p.requires_grad_(False)
    for p in h.classifier.parameters():
        p.requires_grad_(True)
    return h


def change_threshold(S: DafSettings) -> float:
    """DAF's matrix change threshold: ``S.change_threshold``, or (None) ``1.5 / C`` with ``C = 6 top_layers``
    candidate matrices, so that one swap (two changed mask entries) passes and no change does not.

    Why not the official 0.10: the test counts changed entries of the selection mask over all C candidates.
    At the spec's own sizes (36 candidates, P = 8 units) 0.10 asks for 4 changed entries, i.e. 2 of the 8
    units (a quarter) replaced. Here P holds 3-4 units in 12 (quick) or 24 (full) candidates; 0.10 then asks
    for 2 of 3-4 units (in full mode: one swap is 2/24 = 0.083, below 0.10), so DAF could only equal the
    static allocation unless the ranking turns over wholesale. A quarter of 3-4 units is one unit: one swap.
    """
    return S.change_threshold if S.change_threshold is not None else 1.5 / (6 * S.top_layers)


def _build(base: TopModel, analysis: list[Batch], S: DafSettings, seed: int, budget: int
           ) -> tuple[dict[str, nn.Module], dict[str, Any]]:
    import peft
    from peft.tuners.adalora import AdaLoraModel

    rows = S.rows
    r_qv = S.r_qv
    models: dict[str, nn.Module] = {}
    hooks: dict[str, Any] = {}
    cfg = daf.DAFConfig(lora_rank=S.r_daf, lora_alpha=2.0 * S.r_daf, budget_params=budget,
                        analysis_every=S.analysis_every,
                        analysis_batches=S.analysis_batches, change_thresholds=(change_threshold(S), 0.20),
                        seed=seed)
    m = daf.adapt(copy.deepcopy(base), cfg, batches=analysis, loss_fn=_loss)
    for p in m.classifier.parameters():
        p.requires_grad_(True)
    round0 = {"scores": {r["layer"]: r["score"] for r in daf.report(m)},
              "selected": [r["layer"] for r in daf.report(m) if r["role"] == "training"]}
    if "static (round 0 only)" in rows:
        models["static (round 0 only)"] = copy.deepcopy(m)
    models["DAF"] = m
    if "LoRA q,v (PEFT)" in rows:
        models["LoRA q,v (PEFT)"] = peft_inject(copy.deepcopy(base), peft.LoraConfig(
            r=r_qv, lora_alpha=2 * r_qv, target_modules=list(S.baseline_targets)))
    if "AdaLoRA q,v (PEFT)" in rows:
        steps = S.steps
        acfg = peft.AdaLoraConfig(init_r=2 * r_qv, target_r=r_qv, lora_alpha=4 * r_qv,
                                  target_modules=list(S.baseline_targets), total_step=steps,
                                  tinit=max(0, int(S.adalora_tinit * steps)), tfinal=max(1, int(S.adalora_tfinal * steps)),
                                  deltaT=1, orth_reg_weight=S.orth_reg)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            tuner = AdaLoraModel(copy.deepcopy(base), acfg, "default")
        for p in tuner.model.classifier.parameters():
            p.requires_grad_(True)
        models["AdaLoRA q,v (PEFT)"] = tuner
        hooks["AdaLoRA q,v (PEFT)"] = AdaLoraHook(tuner, S.orth_reg)
    if "head only" in rows:
        models["head only"] = _head_only(base)
    return {k: models[k] for k in S.rows if k in models}, {"hooks": hooks, "config": cfg, "round0": round0}


def _train(models: dict[str, nn.Module], hooks: dict[str, Any], batches: list[Batch], analysis: list[Batch],
           seed: int, lrs: dict[str, float], total: int, lr_head: float = LR_HEAD
           ) -> tuple[dict[str, Trainer], daf.DAFController | None, list[int]]:
    trainers: dict[str, Trainer] = {}
    for name, model in models.items():
        lr_h = lr_head  # the same head rate in every row, the head-only row included
        lr_a = lr_head if name == "head only" else lrs[name]
        cfg = FinetuneConfig(lr=lr_a, steps=total, batch_size=len(batches[0]), seed=seed)
        head = model.model.classifier if name in hooks else model.classifier
        make = hooks[name].optimizer(head, lr_a, lr_h) if name in hooks else adapter_optimizer(head, lr_a, lr_h)
        trainers[name] = Trainer(model, cfg, total, make)
    ctl = None
    callback = None
    trace: list[int] = []
    if "DAF" in models:
        ctl = daf.DAFController(models["DAF"], analysis, _loss, total_steps=total)
        daf_cb = ctl.callback(trainers["DAF"])
        trace.append(daf.active_parameter_count(models["DAF"]))

        def callback(i: int, losses: dict[str, float]) -> None:
            daf_cb(i, losses)  # the analysis round for step i + 1, if due
            if i + 1 < total:
                trace.append(daf.active_parameter_count(models["DAF"]))
    lockstep(trainers, batches, callback)
    return trainers, ctl, trace


def _setup(seed: int, S: DafSettings, bert: nn.Module, tok: Any, train: Sequence[tuple[str, int]]
           ) -> tuple[TopModel, FrozenPrefix, list[Batch], list[Batch]]:
    prefix = FrozenPrefix(bert, tok, len(bert.encoder.layer) - S.top_layers, S.max_length)
    idx_train = batch_indices(len(train), S.steps, S.batch_size, seed)
    idx_an = batch_indices(len(train), S.analysis_batches, S.batch_size, 10_000 + seed)
    split = CachedSplit(prefix, train, [idx_train, idx_an])
    base = TopModel(bert, S.top_layers, len(LABELS), seed)
    return base, prefix, split.batches(idx_train), split.batches(idx_an)


COLUMNS = ["test accuracy", "final train loss", "budget params (end)", "max budget params over steps", "rebuilds",
           "median step (ms)"]
COLUMN_NOTES = {"budget params (end)": "adapter parameters the budget counts at the end (DAF: training units; "
                                       "AdaLoRA: kept ranks incl. singular values; head excluded)",
                "rebuilds": "analysis rounds after step 0 whose change test passed"}


def _budget(S: DafSettings) -> int:
    return S.budget if S.budget is not None else budget_for(S.top_layers, S.r_qv)


def _measure(seed: int, S: DafSettings, bert: nn.Module, tok: Any) -> dict[str, Any]:
    """One seed: the seed's table fragment, its record (budget trace, rounds, losses) and per-example correctness."""
    table = Table(columns=list(COLUMNS), notes=dict(COLUMN_NOTES))
    train, test = negation_task(seed, S.n_train, S.n_test)
    base, prefix, batches, analysis = _setup(seed, S, bert, tok, train)
    test_split = CachedSplit(prefix, test, keep_all=True)
    budget = _budget(S)
    models, info = _build(base, analysis, S, seed, budget)
    trainers, ctl, trace = _train(models, info["hooks"], batches, analysis, seed, dict(S.lrs), len(batches),
                                  S.lr_head)
    rec: dict[str, Any] = {"budget": budget, "round0": info["round0"], "losses": {}}
    correct: dict[str, list[float]] = {}
    for row, model in models.items():
        acc, logits = evaluate_cached(model, test_split.hidden, test_split.mask, test_split.labels)
        correct[row] = (logits.argmax(-1) == test_split.labels).double().tolist()
        table.add(row, "test accuracy", acc)
        table.add(row, "final train loss", statistics.fmean(trainers[row].losses[-max(1, len(batches) // 5):]))
        table.add(row, "median step (ms)", median_step_ms(trainers[row]))
        if row == "AdaLoRA q,v (PEFT)":
            table.add(row, "budget params (end)", info["hooks"][row].final_params())
        elif row in ("DAF", "static (round 0 only)"):
            table.add(row, "budget params (end)", daf.active_parameter_count(model))
        elif row != "head only":
            table.add(row, "budget params (end)", trainable_adapter_params(model))
        rec["losses"][row] = trainers[row].losses
    if ctl is not None:
        table.add("DAF", "max budget params over steps", max(trace))
        table.add("DAF", "rebuilds", sum(r.applied for r in ctl.history))
        table.add("static (round 0 only)", "max budget params over steps",
                  daf.active_parameter_count(models["static (round 0 only)"]))
        rec["budget_trace"] = trace
        rec["rounds"] = [{"step": r.step, "selected": r.selected, "previous": r.previous, "change": r.change,
                          "applied": r.applied, "added": r.added, "frozen": r.frozen, "reactivated": r.reactivated,
                          "active_params": r.active_params, "skipped": r.skipped,
                          "scores": r.scores} for r in ctl.history]
    return {"table": table, "info": rec, "correct": correct}


def lr_sweep(grid: Sequence[float] = (1e-3, 3e-3, 1e-2), seed: int = 100, mode: str = "quick",
             n_val: int = 400, settings: DafSettings | None = None,
             lr_head: float | None = None) -> dict[str, dict[float, float]]:
    """Validation accuracy of every row at each adapter learning rate of ``grid`` (head at ``LR_HEAD``;
    the head-only row sweeps the head's rate), on a development seed, with the settings of ``mode`` (or
    ``settings``), training on the first ``n_train - n_val`` training sentences and scoring the last ``n_val``
    (never the test set). Every row gets the same grid and the same budget; :data:`LRS` holds the winners.
    """
    from rankwise import zoo

    S = settings if settings is not None else SETTINGS[mode]
    bert, tok = zoo.minilm()
    pool, _ = negation_task(seed, S.n_train, S.n_test)
    train, val = pool[: len(pool) - n_val], pool[len(pool) - n_val:]
    base, prefix, batches, analysis = _setup(seed, S, bert, tok, train)
    val_split = CachedSplit(prefix, val, keep_all=True)

    def fit(lr: float) -> dict[str, Any]:
        models, info = _build(base, analysis, S, seed, _budget(S))
        _train(models, info["hooks"], batches, analysis, seed, {r: lr for r in models}, len(batches),
               S.lr_head if lr_head is None else lr_head)
        return models

    return sweep_val_accuracy(grid, fit, val_split)


class DafReproduction(MiniLMReproduction):
    id = ID
    claim = CLAIM
    settings = SETTINGS
    columns = COLUMNS
    column_notes = COLUMN_NOTES

    def measure(self, settings: DafSettings, seed: int) -> dict[str, Any]:
        bert, tok = self.minilm()  # one load shared by every seed
        return _measure(seed, settings, bert, tok)

    def table(self, settings: DafSettings, records: Records[dict]) -> Table:
        table = super().table(settings, records)
        self._acc = {r: table.mean(r, "test accuracy") for r in table.rows}
        return table

    def preconditions(self, settings: DafSettings, records: Records[dict]) -> list[Precondition]:
        acc = self._acc
        chance = 1.0 / len(LABELS)
        return [
            Precondition(f"the task does not saturate: min over {', '.join(COMPARED)} of mean test accuracy",
                         min(acc[r] for r in COMPARED), "<", SATURATED),
            Precondition("the static allocation learned: mean test accuracy - chance (1/4)",
                         acc["static (round 0 only)"] - chance, ">", MIN_ABOVE_CHANCE),
            Precondition("AdaLoRA q,v (PEFT) learned: mean test accuracy - chance (1/4)",
                         acc["AdaLoRA q,v (PEFT)"] - chance, ">", MIN_ABOVE_CHANCE),
        ]

    def checks(self, settings: DafSettings, records: Records[dict]) -> list[ClaimCheck]:
        acc = self._acc
        budget = records.first["info"]["budget"]
        max_active = max(self._table.values("DAF", "max budget params over steps"))

        def paired(other: str) -> list[list[float]]:
            return [[a - b for a, b in zip(r["correct"]["DAF"], r["correct"][other])] for r in records]

        return [
            ClaimCheck("(a) test accuracy DAF - static allocation (round 0 only), mean over seeds",
                       acc["DAF"] - acc["static (round 0 only)"], ">=", STATIC_MARGIN, unit="acc",
                       samples=paired("static (round 0 only)")),
            ClaimCheck("(b) test accuracy DAF - AdaLoRA q,v (PEFT) at equal final budget, mean over seeds",
                       acc["DAF"] - acc["AdaLoRA q,v (PEFT)"], ">=", ADALORA_SLACK, unit="acc",
                       samples=paired("AdaLoRA q,v (PEFT)")),
            ClaimCheck("(c) DAF budget-counted parameters minus P, maximum over steps and seeds", max_active - budget,
                       "<=", 0, unit="params", note="exact invariant (frozen units are free, as in the paper)",
                       kind="wiring"),
        ]

    def figures(self, settings: DafSettings, records: Records[dict], out_dir: Path) -> list[str]:
        return _figures(self._table, records.first["info"], out_dir)

    def notes(self, settings: DafSettings, records: Records[dict]) -> str:
        S = settings
        budget = records.first["info"]["budget"]
        rounds = [r for s in records for r in s["info"].get("rounds", [])]
        applied = sum(r["applied"] for r in rounds)
        changes = [round(r["change"], 3) for r in rounds]
        return (
            f"MiniLM top {S.top_layers} layer(s) adapted (6 candidate matrices each; lower layers cached), "
            f"{S.steps} steps of batch {S.batch_size}, analysis every {S.analysis_every} steps on "
            f"{S.analysis_batches} fixed batches (train mode, seeded). Budget P = {budget} (rank-{S.r_qv} LoRA on "
            f"{', '.join(S.baseline_targets)} unless set); DAF units rank {S.r_daf}, greedy by S/cost until P (units "
            f"that do not fit are passed over). Rounds after step 0: {len(rounds)}, applied {applied}, change "
            f"fractions {changes} (threshold {change_threshold(S):.3f}). AdaLoRA on {', '.join(S.baseline_targets)} with "
            f"target_r={S.r_qv} (init_r={2 * S.r_qv}); its orthogonality regulariser is added to the gradients after "
            "clipping. Learning rates from one equal sweep per row on a development seed (the settings' lrs); the "
            "grid was extended at an edge, for every row, until no row's best rate sat at an edge. The head "
            f"trains at {S.lr_head:g} in every row, the head-only reference included (the CDKA/PSOFT convention). "
            f"DAF's change test: a rebuild applies when more than {change_threshold(S):.3f} of the candidates' "
            "selection mask changes (one swap; see daf.change_threshold). Accuracy margins of a few tenths of a point are within seed noise at this scale (tens of "
            "steps, a synthetic 4-class task): claims (a) and (b) are qualitative here, with paired intervals over "
            "the test sentences; (c) is exact.")

    def config(self, settings: DafSettings, records: Records[dict]) -> dict[str, Any]:
        return {"budget": records.first["info"]["budget"]}

    def extra(self, settings: DafSettings, records: Records[dict]) -> dict[str, Any]:
        return {"seeds": {str(s): r["info"] for s, r in records.items()}}


def _figures(table: Table, first: dict[str, Any], out_dir: Path) -> list[str]:
    plt = pyplot()
    rows = list(table.rows)
    fig, ax = plt.subplots(1, 3, figsize=(15, 4))
    means = [table.mean(r, "test accuracy") for r in rows]
    stds = [table.std(r, "test accuracy") for r in rows]
    ax[0].barh(rows, means, xerr=stds, color="tab:blue")
    ax[0].set_xlabel("test accuracy")
    ax[0].set_xlim(max(0.0, min(means) - 0.1), 1.0)
    ax[0].set_title("negated sentiment x topic, MiniLM")
    if "budget_trace" in first:
        ax[1].plot(first["budget_trace"], label="DAF training params")
        ax[1].axhline(first["budget"], color="k", ls="--", label="budget P")
        for r in first.get("rounds", []):
            ax[1].axvline(r["step"], color="tab:red" if r["applied"] else "tab:gray", ls=":")
        ax[1].set_xlabel("step")
        ax[1].set_ylabel("budget-counted parameters")
        ax[1].legend(fontsize=7)
        ax[1].set_title("budget invariant (red: applied rebuild)")
    for row, losses in first["losses"].items():
        k = max(1, len(losses) // 10)
        ax[2].plot([statistics.fmean(losses[max(0, i - k):i + 1]) for i in range(len(losses))], label=row)
    ax[2].set_xlabel("step")
    ax[2].set_ylabel("training loss (running mean)")
    ax[2].legend(fontsize=7)
    fig.tight_layout()
    return [save_figure(fig, out_dir / "daf_accuracy_budget_loss.png", dpi=110)]


REPRODUCTION = DafReproduction
run = DafReproduction.run
