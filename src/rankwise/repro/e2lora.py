"""Reproduction of E²LoRA on the embedded MiniLM, against PEFT's LoRA at rank r0 and at matched parameters.

Setting (spec "Reproduction at small scale"; the task and the cached-prefix machinery are shared with
:mod:`rankwise.repro.cdka`): the pretrained all-MiniLM-L6-v2 with a linear head on mean-pooled tokens,
the seeded 4-class "negated sentiment x topic" task (2 000 train / 1 000 test, at most 16 tokens, batch
16). All ``top_layers`` = 6 encoder layers are adapted (N = 6; only the embeddings are cached), on
``query`` and ``value`` (quick) or also ``key`` and ``attention.output.dense`` (full). ``r0 = 8``,
``alpha = 16``. The E²LoRA plan is computed once per seed from 4 calibration batches of 16 (averaged; a
choice of the spec for stability) on the pretrained encoder with the freshly initialised head.

Rows (head excluded from the counts; exact counts in the table):

* **E²LoRA** (rankwise): ``E2LoRAConfig(base_rank=8, alpha=16, n_calib_batches=4)`` (adaptive
  thresholds, literal HRA);
* **LoRA r0 (PEFT)**: ``peft.LoraConfig(r=8, lora_alpha=16)`` on the same targets;
* **LoRA matched (PEFT)**: rank ``round(8 * P(E²LoRA) / P(LoRA r0))`` (per seed, the plan is
  data-dependent), ``lora_alpha = 2 r`` (the same scale 2 as r0's);
* full mode adds **E²LoRA shifted** (``hra_score="shifted"``), **ShareLoRA** (rankwise: one ``A`` per
  type at rank 8, per-layer ``B``; no PEFT implementation exists) and **LSS only** (intervals, uniform
  rank 8).

Learning rates: every row gets its best adapter rate from the same grid, chosen once per mode by
:func:`lr_sweep` on a development seed with a validation split (:data:`LRS`; smoke uses quick's); the head
trains at 1e-3 in every row. What runs is :class:`E2LoraSettings` (``SETTINGS[mode]``;
``rankwise reproduce e2lora --set steps=20``): the model, targets, data sizes, layers, steps, calibration
batches, rows, ``r0``, alpha and the learning rates.

Checks (spec "THE CLAIM"): (a) the trainable adapter count equals ``sum_types sum_k r_k (d_in + d_out)``
exactly (a ``wiring`` check) and its ratio to LoRA(r0) is <= 0.67 (``claim``); (b) for every module type on
every seed, the mean RMI of adjacent layers exceeds the mean RMI of layers at distance >= 2 (``claim``);
(c) mean test accuracy of E²LoRA >= LoRA(r0) - 1.5 points and >= LoRA matched - 0.5 point (qualitative at
this scale; ``claim`` checks with the paired per-example differences of correctness on the test
sentences, so they carry a bootstrap interval).

Issue 14: the negation task saturated (full mode: every row at 100 %), so quick and full now run the zoo's
``kind`` task (does a docstring document a class, a function or a method; a linear probe on frozen MiniLM
features reaches about 0.65 of it, the least of the zoo's tasks), 24 tokens, all 792 training / 318 test
docstrings; the negation task stays available (``task=negation``, its word lists are settings). Quick runs
one seed at 40 steps (the spec's; 60 did not fit the budget); every row trains at one rate per mode (no
sweep on ``kind`` yet; see :data:`LRS`).
A head-only row (a linear probe on the frozen encoder) is the lower bound of a new precondition.

Preconditions (with the conversion to the skeleton; they can only move the verdict to ``inconclusive``):
the task does not saturate (not every row at >= 99 % test accuracy, within one point of 100 %,
:data:`SATURATED`; it was 99.9 %), the adapters matter (LoRA r0 above the head-only probe), and LoRA r0, the baseline (c) compares
against, learned (test accuracy above chance 1/4 by more than 0.10, the floor the LoRA reproduction uses;
a new threshold).
"""

from __future__ import annotations

import copy
import dataclasses
import statistics
import warnings
from pathlib import Path
from typing import Any, Sequence

import torch
from torch import nn

from rankwise.adapt import e2lora as E
from rankwise.repro.kit import negation
from rankwise.repro.kit.cached_encoder import (
    CachedSplit,
    FrozenPrefix,
    TopModel,
    batch_indices,
    evaluate_cached,
    fit_probe_head,
    median_step_ms,
    peft_inject,
    sweep_val_accuracy,
    trainable_adapter_params,
    train_lockstep,
)
from rankwise.repro.result import ClaimCheck, Precondition, Table
from rankwise.repro.kit.minilm import MiniLMReproduction
from rankwise.repro.skeleton import Records, Settings, pyplot, save_figure, setting
from rankwise.train.finetune import Batch

ID = "e2lora"
CLAIM = ("Sharing one LoRA pair across adjacent layers whose gradient proxy entropies are similar (LSS) and giving "
         "each sharing interval a rank from its entropy (HRA) reaches LoRA-level accuracy with about half the "
         "trainable parameters, and beats LoRA at the same parameter budget.")

R0, ALPHA = 8, 16.0
LR_HEAD = 1e-3
QUICK_TARGETS = ("query", "value")
FULL_TARGETS = ("query", "key", "value", "attention.output.dense")
ROWS_QUICK = ("E²LoRA", "LoRA r0 (PEFT)", "LoRA matched (PEFT)")
ROWS_FULL = ROWS_QUICK + ("E²LoRA shifted", "ShareLoRA", "LSS only")
HEAD_ROW = "head only (probe, frozen encoder)"  # the lower bound, reported and used by a precondition
# (adapter lr, head lr) per row and mode, chosen by lr_sweep() on a development seed (see docs/methods/e2lora.md).
# quick: grid {3e-4, 1e-3, 3e-3, 1e-2} + 3e-2 (several bests were at the upper edge), seed 100, quick settings
# (q/v, 40 steps) for all six rows, 400 validation sentences. Best validation accuracy: E²LoRA 0.993 @1e-2,
# LoRA r0 0.735 @1e-2, LoRA matched 0.988 @1e-2, E²LoRA shifted 0.900 @1e-2, ShareLoRA 0.680 @3e-3, LSS only
# 0.793 @1e-2 (every row fell to <= 0.50 at 3e-2).
# full: its own sweep (the quick rates made every 1e-2 row collapse to chance at 150 steps on four targets):
# grid {3e-4, 1e-3, 3e-3}, seed 100, full settings (q/k/v/o, 150 steps), 400 validation sentences: every row
# reached validation accuracy 1.000 at 1e-3 and 3e-3 (LoRA r0 and ShareLoRA also at 3e-4; the others 0.983-0.988
# there). Ties are broken toward the grid centre, so every row trains at 1e-3. The task saturates at this budget.
LRS: dict[str, tuple[tuple[str, float, float], ...]] = {
    "quick": (
        ("E²LoRA", 1e-2, LR_HEAD),
        ("LoRA r0 (PEFT)", 1e-2, LR_HEAD),
        ("LoRA matched (PEFT)", 1e-2, LR_HEAD),
        ("E²LoRA shifted", 1e-2, LR_HEAD),
        ("ShareLoRA", 3e-3, LR_HEAD),
        ("LSS only", 1e-2, LR_HEAD),
    ),
}
LRS["full"] = tuple((row, 1e-3, LR_HEAD) for row, _, _ in LRS["quick"])
# issue 14: the negation task saturates (full mode: every row at 100 %), so quick and full moved to the zoo's
# 'kind' task. The rates above were swept on the negation task; on 'kind' no sweep has been run yet, so every row
# trains at ONE rate per mode, fixed before the runs (quick 3e-3, the centre of the quick grid, chosen when quick
# ran 60 steps and kept at 40; full 1e-3, the full-mode sweep's choice): no row gets more tuning than another.
# lr_sweep() re-runs the sweep.
LRS["negation quick"], LRS["negation full"] = LRS["quick"], LRS["full"]
LRS["quick"] = tuple((row, 3e-3, LR_HEAD) for row, _, _ in LRS["negation quick"])
LRS["smoke"] = LRS["quick"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class E2LoraSettings(Settings):
    """What the E²LoRA reproduction runs; ``SETTINGS[mode]`` holds each mode's values."""

    model: str = setting("all-MiniLM-L6-v2", "the pretrained encoder (zoo.minilm)", choices=("all-MiniLM-L6-v2",))
    targets: tuple[str, ...] = setting(QUICK_TARGETS, "adapted module names (every adapted layer)")
    task: str = setting("kind", "the task: a zoo text task (rankwise.zoo.text_tasks(); 'kind', the one frozen MiniLM "
                        "features solve least) or 'negation' (rankwise.repro.kit.negation, word lists below)")
    n_train: int | None = setting(None, "training examples (zoo task: a cap, None = all; negation: a multiple of 4)",
                                  lo=4)
    n_test: int | None = setting(None, "test examples (zoo task: a cap, None = all; negation: a multiple of 4)",
                                 lo=4)
    neg_films: tuple[str, ...] = setting(negation.FILMS, "negation task: film subjects")
    neg_foods: tuple[str, ...] = setting(negation.FOODS, "negation task: food subjects")
    neg_positive: tuple[str, ...] = setting(negation.POSITIVE, "negation task: positive adjectives")
    neg_negative: tuple[str, ...] = setting(negation.NEGATIVE, "negation task: negative adjectives")
    neg_fillers: tuple[str, ...] = setting(negation.FILLERS, "negation task: sentence endings")
    top_layers: int = setting(6, "adapted top encoder layers, N (the layers below are cached)", lo=1, hi=6)
    steps: int = setting(40, "training steps of every row (the same batches)", lo=1)
    batch_size: int = setting(16, "sentences per step", lo=1)
    calib_batches: int = setting(4, "calibration batches of the E²LoRA plan (gradient proxies)", lo=1)
    max_length: int = setting(16, "tokens per sentence", lo=1)
    rows: tuple[str, ...] = setting(ROWS_QUICK, "rows trained (E²LoRA always)")
    r0: int = setting(R0, "LoRA r0's rank and E²LoRA's base rank", lo=1)
    alpha: float = setting(ALPHA, "LoRA alpha of r0 (scale alpha / r0; the matched LoRA keeps the scale)", lo=0.0)
    lrs: tuple[tuple[str, float, float], ...] = setting(LRS["quick"], "(row, adapter lr, head lr) per row, by "
                                                                      "lr_sweep")

    def validate(self) -> None:
        if self.task == "negation":
            if self.n_train is None or self.n_test is None or self.n_train % 4 or self.n_test % 4:
                raise ValueError(f"E2LoraSettings.n_train and n_test must be multiples of 4 for the negation task, "
                                 f"got {self.n_train}, {self.n_test}")
        else:
            from rankwise import zoo

            if self.task not in zoo.text_tasks():
                raise ValueError(f"E2LoraSettings.task must be 'negation' or one of {zoo.text_tasks()}, "
                                 f"got {self.task!r}")
        unknown = [r for r in self.rows if r not in ROWS_FULL]
        if unknown:
            raise ValueError(f"E2LoraSettings.rows must be among {ROWS_FULL}, got {unknown}")
        if not set(ROWS_QUICK) <= set(self.rows):
            raise ValueError(f"E2LoraSettings.rows must include the compared rows {ROWS_QUICK}, got {self.rows}")
        missing = [r for r in self.rows if r not in {x[0] for x in self.lrs}]
        if missing:
            raise ValueError(f"E2LoraSettings.lrs has no learning rate for {missing}")


SETTINGS: dict[str, E2LoraSettings] = {
    "smoke": E2LoraSettings(n_train=96, n_test=64, top_layers=3, steps=3, calib_batches=1, lrs=LRS["smoke"]),
    # quick (issue 14): the zoo's 'kind' task (all 792 training / 318 test docstrings, 24 tokens) instead of the
    # saturating negation task; one seed. 60 steps took 72 s on an idle 2-core machine, over the 60 s budget, so
    # quick trains the spec's 40 steps (at the same fixed rate, 3e-3)
    "quick": E2LoraSettings(max_length=24, steps=40, seeds=(0,), lrs=LRS["quick"]),
    "full": E2LoraSettings(max_length=24, steps=150, targets=FULL_TARGETS, rows=ROWS_FULL, lrs=LRS["full"]),
}
RATIO_MAX = 0.67        # (a) P(E²LoRA) / P(LoRA r0) <= 0.67
SLACK_LORA = -0.015     # (c) acc(E²LoRA) - acc(LoRA r0) >= -1.5 points
SLACK_MATCHED = -0.005  # (c) acc(E²LoRA) - acc(LoRA matched) >= -0.5 point
SATURATED = 0.99        # precondition: not every row at >= 99 % test accuracy (within one point of 100 %, the
#                         issue-14 definition; it was 0.999, which let rows at 99.5 % count as not saturated)
MIN_ABOVE_CHANCE = 0.10  # precondition: LoRA r0's accuracy - chance (1 / labels) > 0.10


def _calibration_loss(model: nn.Module, batch: Batch) -> torch.Tensor:
    return nn.functional.cross_entropy(model(**batch.inputs), batch.labels)


def locality(S: Sequence[Sequence[float]]) -> tuple[float, float]:
    """Mean similarity over adjacent pairs ``|i - j| = 1`` and over pairs at distance ``>= 2`` (NaN if none)."""
    N = len(S)
    adj = [S[i][i + 1] for i in range(N - 1)]
    far = [S[i][j] for i in range(N) for j in range(i + 2, N)]
    nan = float("nan")
    return (statistics.fmean(adj) if adj else nan, statistics.fmean(far) if far else nan)


def _with_head(model: nn.Module) -> nn.Module:
    for p in model.classifier.parameters():
        p.requires_grad_(True)
    return model


def _build_models(base: TopModel, calib: list[Batch], S: E2LoraSettings, seed: int, rows: Sequence[str]
                  ) -> tuple[dict[str, nn.Module], dict[str, Any]]:
    """The compared models (fresh copies of ``base``) and the E²LoRA plans (E²LoRA is always built)."""
    import peft

    targets, r0, alpha = S.targets, S.r0, S.alpha
    cfg = E.E2LoRAConfig(base_rank=r0, alpha=alpha, target=targets, n_calib_batches=S.calib_batches, seed=seed)
    models: dict[str, nn.Module] = {}
    plans: dict[str, E.E2LoRAPlan] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # HRA clamps are recorded in the plan
        models["E²LoRA"] = _with_head(E.adapt(copy.deepcopy(base), cfg, calib=calib, loss_fn=_calibration_loss))
        plans["E²LoRA"] = E.get_plan(models["E²LoRA"])
        variants = {"E²LoRA shifted": dict(hra_score="shifted"), "LSS only": dict(hra=False)}
        for row, kw in variants.items():
            if row in rows:
                c = dataclasses.replace(cfg, **kw)
                models[row] = _with_head(E.adapt(copy.deepcopy(base), c, calib=calib, loss_fn=_calibration_loss))
                plans[row] = E.get_plan(models[row])
        if "ShareLoRA" in rows:
            c = dataclasses.replace(cfg, sharing="sharelora")
            m = copy.deepcopy(base)
            models["ShareLoRA"] = _with_head(E.apply_e2lora(m, E.uniform_plan(m, c, intervals="each"), c))
    lora = peft_inject(copy.deepcopy(base), peft.LoraConfig(r=r0, lora_alpha=alpha, target_modules=list(targets)))
    p_lora = trainable_adapter_params(lora)
    r_match = max(1, round(r0 * plans["E²LoRA"].num_parameters() / p_lora))
    if "LoRA r0 (PEFT)" in rows:
        models["LoRA r0 (PEFT)"] = lora
    if "LoRA matched (PEFT)" in rows:
        models["LoRA matched (PEFT)"] = peft_inject(copy.deepcopy(base), peft.LoraConfig(
            r=r_match, lora_alpha=alpha / r0 * r_match, target_modules=list(targets)))
    order = [r for r in rows if r in models]
    return {r: models[r] for r in order}, {"plans": plans, "p_lora": p_lora, "r_match": r_match}


def task_labels(S: E2LoraSettings) -> list[str]:
    """The label names of the settings' task."""
    if S.task == "negation":
        return list(negation.LABELS)
    from rankwise.zoo.tasks import text_task_labels

    return text_task_labels(S.task)


def task_data(S: E2LoraSettings, seed: int) -> tuple[list[tuple[str, int]], list[tuple[str, int]]]:
    """``(train, test)`` of the settings' task for ``seed`` (a zoo task's test set does not depend on it)."""
    if S.task == "negation":
        return negation.negation_task(seed, S.n_train, S.n_test, films=S.neg_films, foods=S.neg_foods,
                                      positive=S.neg_positive, negative=S.neg_negative, fillers=S.neg_fillers)
    from rankwise import zoo

    t = zoo.text_task(S.task, seed=seed, max_train=S.n_train, max_test=S.n_test)
    return t.train, t.test


def _setup(seed: int, S: E2LoraSettings, bert: nn.Module, tok: Any, train: Sequence[tuple[str, int]]
           ) -> tuple[TopModel, FrozenPrefix, list[Batch], list[Batch]]:
    prefix = FrozenPrefix(bert, tok, len(bert.encoder.layer) - S.top_layers, S.max_length)
    idx_train = batch_indices(len(train), S.steps, S.batch_size, seed)
    idx_calib = batch_indices(len(train), S.calib_batches, S.batch_size, 10_000 + seed)
    split = CachedSplit(prefix, train, [idx_train, idx_calib])
    base = TopModel(bert, S.top_layers, len(task_labels(S)), seed)
    return base, prefix, split.batches(idx_train), split.batches(idx_calib)


def _plan_summary(plan: E.E2LoRAPlan) -> dict[str, Any]:
    out = {}
    for key, t in plan.types.items():
        adj, far = locality(t.similarity)
        out[key.split(".")[-1]] = {"entropies": t.entropies, "rmi": t.similarity, "thresholds": t.thresholds,
                                   "intervals": t.intervals, "ranks": t.ranks,
                                   "adjacent_rmi": None if adj != adj else adj,
                                   "far_rmi": None if far != far else far,
                                   "params": t.num_parameters(plan.sharing)}
    return out


COLUMNS = ["test accuracy", "trainable adapter params", "params / LoRA r0", "final train loss", "median step (ms)"]
COLUMN_NOTES = {"trainable adapter params": "distinct trainable parameters outside the head "
                                            "(shared factors counted once)"}


def _measure(seed: int, S: E2LoraSettings, bert: nn.Module, tok: Any) -> dict[str, Any]:
    """One seed: the seed's table fragment, plan summary and per-example correctness (paired intervals)."""
    table = Table(columns=list(COLUMNS), notes=dict(COLUMN_NOTES))
    lrs = {row: (a, h) for row, a, h in S.lrs}
    train, test = task_data(S, seed)
    base, prefix, batches, calib = _setup(seed, S, bert, tok, train)
    test_split = CachedSplit(prefix, test, keep_all=True)
    models, info = _build_models(base, calib, S, seed, S.rows)
    trainers = train_lockstep(models, batches, seed, {name: lrs[name] for name in models})
    p_lora = info["p_lora"]
    correct: dict[str, list[float]] = {}
    for row, model in models.items():
        acc, logits = evaluate_cached(model, test_split.hidden, test_split.mask, test_split.labels)
        correct[row] = (logits.argmax(-1) == test_split.labels).double().tolist()
        p = trainable_adapter_params(model)
        table.add(row, "test accuracy", acc)
        table.add(row, "trainable adapter params", p)
        table.add(row, "params / LoRA r0", p / p_lora)
        table.add(row, "final train loss", statistics.fmean(trainers[row].losses[-max(1, len(batches) // 5):]))
        table.add(row, "median step (ms)", median_step_ms(trainers[row]))
    # the lower bound (issue 14): a linear probe on the frozen encoder (the head fitted alone, then evaluated)
    probe = copy.deepcopy(base)
    tr_all = CachedSplit(prefix, train, keep_all=True)
    fit_probe_head(probe, tr_all.hidden, tr_all.mask, tr_all.labels)
    acc_probe, logits = evaluate_cached(probe, test_split.hidden, test_split.mask, test_split.labels)
    correct[HEAD_ROW] = (logits.argmax(-1) == test_split.labels).double().tolist()
    table.add(HEAD_ROW, "test accuracy", acc_probe)
    table.add(HEAD_ROW, "trainable adapter params", 0)
    table.add(HEAD_ROW, "params / LoRA r0", 0.0)
    plan = info["plans"]["E²LoRA"]
    rec = {
        "plan": _plan_summary(plan), "plan_params": plan.num_parameters(),
        "measured_params": trainable_adapter_params(models["E²LoRA"]), "lora_params": p_lora,
        "r_match": info["r_match"], "labels": len(task_labels(S)), "n_train": len(train), "n_test": len(test),
        "other_plans": {r: {k.split(".")[-1]: {"intervals": t.intervals, "ranks": t.ranks}
                            for k, t in pl.types.items()} for r, pl in info["plans"].items() if r != "E²LoRA"},
        "losses": {row: t.losses for row, t in trainers.items()}}
    return {"table": table, "info": rec, "correct": correct}


def lr_sweep(grid: Sequence[float] = (3e-4, 1e-3, 3e-3, 1e-2), seed: int = 100, mode: str = "quick",
             n_val: int = 400, rows: Sequence[str] = ROWS_FULL, settings: E2LoraSettings | None = None
             ) -> dict[str, dict[float, float]]:
    """Validation accuracy of every row at each adapter learning rate of ``grid`` (head at ``LR_HEAD``) on a
    development seed with the settings of ``mode`` (or ``settings``): train on the first ``n_train - n_val``
    training sentences, score the last ``n_val`` (never the test set). This is how :data:`LRS` was chosen, once,
    before the reported runs; every row gets the same grid and budget."""
    from rankwise import zoo

    S = dataclasses.replace(settings if settings is not None else SETTINGS[mode], rows=tuple(rows))
    bert, tok = zoo.minilm()
    pool, _ = task_data(S, seed)
    train, val = pool[: len(pool) - n_val], pool[len(pool) - n_val:]
    base, prefix, batches, calib = _setup(seed, S, bert, tok, train)
    va = CachedSplit(prefix, val, keep_all=True)

    def fit(lr: float) -> dict[str, Any]:
        models, _ = _build_models(base, calib, S, seed, S.rows)
        train_lockstep(models, batches, seed, {n: (lr, LR_HEAD) for n in models})
        return models

    return sweep_val_accuracy(grid, fit, va)


class E2LoraReproduction(MiniLMReproduction):
    id = ID
    claim = CLAIM
    settings = SETTINGS
    columns = COLUMNS
    column_notes = COLUMN_NOTES

    def measure(self, settings: E2LoraSettings, seed: int) -> dict[str, Any]:
        bert, tok = self.minilm()  # one load shared by every seed
        return _measure(seed, settings, bert, tok)

    def table(self, settings: E2LoraSettings, records: Records[dict]) -> Table:
        table = super().table(settings, records)
        self._acc = {r: table.mean(r, "test accuracy") for r in table.rows if r != HEAD_ROW}
        self._probe = table.mean(HEAD_ROW, "test accuracy")
        return table

    def preconditions(self, settings: E2LoraSettings, records: Records[dict]) -> list[Precondition]:
        return [
            Precondition("the task does not saturate: min over rows of mean test accuracy", min(self._acc.values()),
                         "<", SATURATED),
            Precondition(f"LoRA r0 (PEFT) learned: mean test accuracy - chance (1/{records.first['info']['labels']})",
                         self._acc["LoRA r0 (PEFT)"] - 1.0 / records.first["info"]["labels"], ">", MIN_ABOVE_CHANCE),
            Precondition("the adapters matter: LoRA r0's mean test accuracy - a linear probe's on the frozen encoder "
                         "(else (c) compares rows that the head alone explains)", self._acc["LoRA r0 (PEFT)"] -
                         self._probe, ">", 0.0),
        ]

    def checks(self, settings: E2LoraSettings, records: Records[dict]) -> list[ClaimCheck]:
        per_seed = [r["info"] for r in records]
        identity = max(abs(s["measured_params"] - s["plan_params"]) for s in per_seed)
        ratio = max(s["plan_params"] / s["lora_params"] for s in per_seed)
        gaps = [t["adjacent_rmi"] - t["far_rmi"] for s in per_seed for t in s["plan"].values()
                if t["adjacent_rmi"] is not None and t["far_rmi"] is not None]
        local = min(gaps) if gaps else float("nan")  # N <= 2 has no pair at distance >= 2
        acc = self._acc

        def paired(other: str) -> list[list[float]]:
            return [[a - b for a, b in zip(r["correct"]["E²LoRA"], r["correct"][other])] for r in records]

        return [
            ClaimCheck("(a) |trainable adapter params - sum_types sum_k r_k (d_in + d_out)|, max over seeds",
                       identity, "<=", 0, unit="params", note="exact identity", kind="wiring"),
            ClaimCheck("(a) E²LoRA params / LoRA(r0) params, max over seeds", ratio, "<=", RATIO_MAX),
            ClaimCheck("(b) mean adjacent RMI - mean RMI at distance >= 2, minimum over module types and seeds",
                       local, ">", 0.0),
            ClaimCheck("(c) test accuracy E²LoRA - LoRA r0 (PEFT), mean over seeds",
                       acc["E²LoRA"] - acc["LoRA r0 (PEFT)"], ">=", SLACK_LORA, unit="acc",
                       samples=paired("LoRA r0 (PEFT)")),
            ClaimCheck("(c) test accuracy E²LoRA - LoRA at matched parameters (PEFT), mean over seeds",
                       acc["E²LoRA"] - acc["LoRA matched (PEFT)"], ">=", SLACK_MATCHED, unit="acc",
                       samples=paired("LoRA matched (PEFT)")),
        ]

    def figures(self, settings: E2LoraSettings, records: Records[dict], out_dir: Path) -> list[str]:
        return _figures(self._table, records.first["info"]["plan"], out_dir)

    def notes(self, settings: E2LoraSettings, records: Records[dict]) -> str:
        S = settings
        first = records.first["info"]
        plan_txt = "; ".join(f"{k}: intervals {v['intervals']} ranks {v['ranks']}" for k, v in first["plan"].items())
        notes = (
            f"MiniLM, all {S.top_layers} encoder layers adapted on {', '.join(S.targets)} (embeddings cached), "
            f"{S.steps} steps of batch {S.batch_size}, AdamW at the per-row rates of the settings (one lr_sweep per "
            f"mode on a development seed, the same grid for every row), linear schedule, head at {LR_HEAD}. "
            f"Plan from {S.calib_batches} calibration batch(es) with the fresh head (eval mode). Seed "
            f"{records.seeds[0]} plan: {plan_txt}; LoRA matched used r={first['r_match']}. With all entropies "
            "negative the paper's literal HRA gives slightly more rank to lower-entropy intervals; 'E²LoRA shifted' "
            "(full mode) is the monotone reading. (a) holds by construction once the plan has fewer intervals than "
            "layers (the ratio is K/N for uniform ranks); (b) is a property of the pretrained gradients; (c) depends "
            f"on tens of training steps on a small task ('{S.task}', {first['n_train']} training / {first['n_test']} "
            f"test examples, {S.max_length} tokens; a linear probe on the frozen encoder reaches {self._probe:.3f}) and "
            "is qualitative at this scale; its paired intervals decide. E²X plug-ins on "
            "DoRA/VeRA/LoRI, full fine-tuning and the KL/L1/L2 similarity ablations of the paper are not run.")
        if min(self._acc.values()) >= SATURATED:
            notes += (" Every row reached 100 % test accuracy: the task saturates at this budget, so the accuracy "
                      "checks (c) do not discriminate between the rows (compare the final training losses) and the "
                      "verdict is inconclusive.")
        return notes

    def config(self, settings: E2LoraSettings, records: Records[dict]) -> dict[str, Any]:
        return {"lrs": {k: [a, h] for k, a, h in settings.lrs if k in settings.rows}}

    def extra(self, settings: E2LoraSettings, records: Records[dict]) -> dict[str, Any]:
        return {"seeds": {str(s): r["info"] for s, r in records.items()}}


def _figures(table: Table, first: dict[str, Any], out_dir: Path) -> list[str]:
    plt = pyplot()
    types = list(first)
    fig, ax = plt.subplots(1, 2 + len(types), figsize=(5 * (2 + len(types)), 4))
    rows = list(table.rows)
    means = [table.mean(r, "test accuracy") for r in rows]
    ax[0].barh(rows, means, xerr=[table.std(r, "test accuracy") for r in rows], color="tab:blue")
    ax[0].set_xlim(max(0.0, min(means) - 0.1), 1.0)
    ax[0].set_xlabel("test accuracy (mean over seeds)")
    for r, m in zip(rows, means):
        ax[0].text(max(0.0, min(means) - 0.1) + 0.005, r, f"{table.mean(r, 'params / LoRA r0'):.2f}x params",
                   va="center", fontsize=7, color="white")
    for key, t in first.items():
        ax[1].plot(range(len(t["entropies"])), t["entropies"], marker="o", label=key)
        for iv in t["intervals"]:
            ax[1].axvspan(iv[0] - 0.4, iv[-1] + 0.4, alpha=0.08)
    ax[1].set_xlabel("layer")
    ax[1].set_ylabel("proxy entropy H(G_l)")
    ax[1].legend(fontsize=7)
    ax[1].set_title("entropy profile (shaded: intervals, first seed)")
    for k, key in enumerate(types):
        im = ax[2 + k].imshow(first[key]["rmi"], cmap="viridis")
        ax[2 + k].set_title(f"RMI, {key}: intervals {first[key]['intervals']}, ranks {first[key]['ranks']}",
                            fontsize=8)
        fig.colorbar(im, ax=ax[2 + k])
    fig.tight_layout()
    return [save_figure(fig, out_dir / "e2lora_accuracy_plan.png", dpi=110)]


REPRODUCTION = E2LoraReproduction
run = E2LoraReproduction.run
