"""Reproduction of mtLoRA (block-level adapters, fine-grained routing, spectral-aware regularisation) on MiniLM.

Setting (spec "Reproduction at small scale", adapted to the zoo): the pretrained all-MiniLM-L6-v2
(:func:`rankwise.zoo.minilm`) frozen; the top ``top_layers`` encoder blocks are adapted and the
blocks below are run once and cached (:class:`rankwise.repro.kit.cached_encoder.FrozenPrefix` / ``CachedSplit``);
mean-pooled final hidden states go to ONE shared linear head over the union of the tasks' label
spaces. The tasks are the zoo's docstring text tasks (:func:`rankwise.zoo.text_task`); every text is
prefixed with a task tag (``"[t03] ..."``) so that one model serves all tasks (the same docstring can
appear in several tasks with different labels); routing never receives the task id explicitly.
``T = 5`` tasks (quick and full) and ``T = 12`` (every zoo task; the spec's 15 do not exist in the zoo).

Rows (same batches, same steps, Adam lr 1e-3 for adapters, routers and the head, batch 32):

* **LoRA (PEFT)**: ``peft.LoraConfig(r=8, lora_alpha=32)`` on query/value;
* **HydraLoRA (q,v)**: shared A, E = 4 experts B_i, coarse token router, CV^2 balance loss, on
  query/value of every adapted block (:func:`rankwise.adapt.mtlora.hydralora_config`);
* **mtLoRA**: block-FFN adapter, r = 8, E = 4, FGR group size 192 (G = 2), spectral term
  (lambda 0.5, singular basis), balance 0.01;
* ablations (full mode): **block only** (coarse router, no spectral), **block+spectral**, **block+FGR**.

Claims: quick (T = 5, 2 blocks, the HydraLoRA and mtLoRA rows only): the adapter output is zero at
initialisation (64 test examples, first seed), mtLoRA >= HydraLoRA - 2 points (mean over seeds), mtLoRA
uses <= 70 % of HydraLoRA's trainable parameters (exact relation).
Full (T = 5 and 12, 3 seeds): at T = 12 mtLoRA >= HydraLoRA + 1 point, <= 70 % of its parameters,
and the accuracy drop from T = 5 to T = 12 is smaller for mtLoRA than for HydraLoRA.

Settings (:class:`MtLoRASettings`, ``SETTINGS[mode]``; ``rankwise reproduce mtlora --set epochs=3``): the model
and its adapted top blocks, the task sets, the data sizes, the training budget, the adapters' shapes and
the rows.

Issue 14 (the review found the quick gap mtLoRA - HydraLoRA of -3.4 points inside a seed spread of the same
size, with a head trained jointly by every row): the head is now fitted first as a linear probe on the frozen
encoder and then *fixed* for every row (``head="probe"``; ``head="trained"`` restores the old protocol), so the
rows differ only in their adapters, and the probe is reported as the head-only row; quick mode runs one seed
at twice the steps. Two preconditions join the chance floor: the adapters matter (HydraLoRA above the probe)
and the tasks do not saturate (best row below 0.99).

Check kinds: the zero-at-initialisation check is ``wiring`` (an identity only a bug breaks); the
parameter relation and the accuracy comparisons are ``claim`` checks. The accuracy comparisons at one T
carry paired per-example samples: each test example's correctness difference (mtLoRA - HydraLoRA) weighted
by ``N / (T n_task)``, so that their mean is the mean over tasks of the per-task accuracy difference (the
table's metric) and the harness bootstraps an interval over the examples. Precondition (stated before any
run; its floor is chance, not a tuned number, and it can move a verdict to ``inconclusive``): the compared
baseline HydraLoRA learned, i.e. its mean accuracy at the largest T exceeds the mean over tasks of
1 / (labels of the task), the accuracy of guessing uniformly among the task's own labels.
"""

from __future__ import annotations

import copy
import dataclasses
import statistics
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
from torch import nn

from rankwise.adapt import mtlora
from rankwise.repro.kit.cached_encoder import (CachedSplit, FrozenPrefix, TopModel, fit_probe_head, peft_inject,
                                               trim_padding as _trim)
from rankwise.repro.result import ClaimCheck, Precondition, Table
from rankwise.repro.skeleton import Records, Reproduction, Settings, pyplot, save_figure, setting

ID = "mtlora"
CLAIM = ("Block-level adapters with fine-grained routing and spectral-aware regularisation (mtLoRA) beat "
         "HydraLoRA's component-level mixture in multi-task fine-tuning with about half of its trainable "
         "parameters, and degrade less as the number of tasks grows.")

ALL_TASKS = ("topic", "kind", "raises", "mentions_none", "length", "dunder", "private", "returns_bool",
             "has_example", "c_signature", "asyncio_vs_threads", "files_vs_formats")
T5 = ALL_TASKS[:5]
ROW_NAMES = ("LoRA (PEFT)", "HydraLoRA (q,v)", "mtLoRA", "block only", "block+spectral", "block+FGR")


@dataclasses.dataclass(frozen=True, kw_only=True)
class MtLoRASettings(Settings):
    """What the mtLoRA reproduction runs; ``SETTINGS[mode]`` holds each mode's values."""

    model: str = setting("all-MiniLM-L6-v2", "the frozen pretrained encoder (zoo.minilm)", choices=("all-MiniLM-L6-v2",))
    top_layers: int = setting(2, "adapted top encoder blocks (the blocks below are cached)", lo=1, hi=6)
    task_sets: tuple[tuple[str, ...], ...] = setting((T5,), "task sets, each trained and evaluated on its own (zoo "
                                                     "text tasks); the last is the claims' T")
    max_train: int | None = setting(128, "training examples per task (None: all)", lo=1)
    max_test: int | None = setting(100, "test examples per task (None: all)", lo=1)
    max_length: int = setting(32, "tokens per text", lo=1)
    epochs: int = setting(2, "epochs over the training set (every row, the same batches)", lo=1)
    batch_size: int = setting(32, "examples per step", lo=1)
    lr: float = setting(1e-3, "Adam learning rate of adapters, routers and the head (every row)", lo=0.0)
    rank: int = setting(8, "adapter rank (every row)", lo=1)
    alpha: float = setting(32.0, "adapter alpha (every row)", lo=0.0)
    experts: int = setting(4, "experts E of HydraLoRA and mtLoRA", lo=1)
    group_size: int = setting(192, "mtLoRA fine-grained routing group size (384: one group, the coarse router)", lo=1)
    spectral_lambda: float = setting(0.5, "weight of mtLoRA's spectral term", lo=0.0)
    spectral_every: int = setting(10, "apply the spectral term every this many steps", lo=1)
    init_examples: int = setting(64, "test examples of the zero-at-initialisation check (first seed; 0: no check)",
                                 lo=0)
    rows: tuple[str, ...] = setting(("HydraLoRA (q,v)", "mtLoRA"), "rows run (HydraLoRA and mtLoRA are required by "
                                    "the checks)")
    head: str = setting("probe", "probe: the head is fitted first as a linear probe on the frozen encoder and then "
                        "fixed for every row, so accuracy differences come from the adapters (and the probe is the "
                        "head-only row); trained: every row trains its own head with its adapters",
                        choices=("probe", "trained"))
    probe_steps: int = setting(300, "full-batch Adam steps of the probe head (head=probe)", lo=1)
    probe_lr: float = setting(1e-2, "learning rate of the probe head (head=probe)", lo=0.0)

    def validate(self) -> None:
        bad = [r for r in self.rows if r not in ROW_NAMES]
        if bad:
            raise ValueError(f"MtLoRASettings.rows must be among {list(ROW_NAMES)}, got {bad!r}")
        for r in ("HydraLoRA (q,v)", "mtLoRA"):
            if r not in self.rows:
                raise ValueError(f"MtLoRASettings.rows must include {r!r}, got {self.rows!r}")
        if not self.task_sets or not all(self.task_sets):
            raise ValueError(f"MtLoRASettings.task_sets must hold non-empty task sets, got {self.task_sets!r}")


SETTINGS: dict[str, MtLoRASettings] = {
    "smoke": MtLoRASettings(task_sets=(T5[:2],), max_train=32, max_test=16, top_layers=1, epochs=1, batch_size=16,
                            spectral_every=2, init_examples=16, rows=("LoRA (PEFT)", "HydraLoRA (q,v)", "mtLoRA")),
    # quick (time): the rows of its checks only (HydraLoRA, mtLoRA; the PEFT LoRA row runs in smoke and full), the
    # zero-at-init check (an exact identity) on 64 test examples of the first seed. 2 epochs, not the spec's 1:
    # after one epoch (20 steps) mtLoRA's block adapters are far from trained (mean accuracy 0.18 vs 0.24).
    # issue 14: one seed at twice the steps (4 epochs = 76 steps; the same cost as two seeds of 38), the head fixed
    # to a probe fitted on the frozen encoder, so that the adapters carry the accuracy and (d) compares them
    "quick": MtLoRASettings(epochs=4, seeds=(0,)),
    # full: the zero-at-init check (a wiring property, checked by quick and smoke) is not repeated: evaluating
    # every row before training cost ~12 % of the run
    "full": MtLoRASettings(task_sets=(T5, ALL_TASKS), spectral_every=20, init_examples=0, rows=ROW_NAMES),
}
ACC_SLACK_QUICK = -0.02   # quick: mtLoRA >= HydraLoRA - 2 points
SATURATED = 0.99          # precondition: the best row's mean accuracy below 0.99 (not within a point of 100 %)
HEAD_ROW = "head only (probe, frozen encoder)"
ACC_MARGIN_FULL = 0.01    # full: mtLoRA >= HydraLoRA + 1 point at the largest T
PARAM_RATIO = 0.70        # mtLoRA trainable parameters <= 70 % of HydraLoRA's


# ------------------------------------------------------------------------------------------------
# multi-task data (shared with the LoRA-Mixer reproduction)
# ------------------------------------------------------------------------------------------------

def multitask_data(tasks: Sequence[str], seed: int, max_train: int | None, max_test: int | None, *, tag: bool = True
                   ) -> tuple[list[tuple[str, int]], list[tuple[str, int]], list[int], list[int], list[int]]:
    """Union-label multi-task data from the zoo's text tasks.

    Returns ``(train, test, train_task, test_task, offsets)``: ``(text, union label)`` pairs (text
    prefixed with ``"[tNN] "`` when ``tag``), the task index of every example, and each task's first
    label in the union label space (``offsets[-1]`` = number of union labels). Training examples are
    interleaved in a seeded order.
    """
    import random

    from rankwise import zoo

    train, test, tr_task, te_task, offsets = [], [], [], [], [0]
    for t, name in enumerate(tasks):
        task = zoo.text_task(name, seed=seed, max_train=max_train, max_test=max_test)
        pre = f"[t{t:02d}] " if tag else ""
        off = offsets[-1]
        train += [(pre + x, off + y, t) for x, y in task.train]
        test += [(pre + x, off + y, t) for x, y in task.test]
        offsets.append(off + len(task.labels))
    random.Random(seed).shuffle(train)
    return ([(x, y) for x, y, _ in train], [(x, y) for x, y, _ in test], [t for *_, t in train],
            [t for *_, t in test], offsets)


def epoch_batches(n: int, epochs: int, batch_size: int, seed: int) -> list[torch.Tensor]:
    """Example indices of ``epochs`` shuffled passes over ``range(n)`` (last partial batch dropped)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(epochs):
        order = torch.randperm(n, generator=gen)
        out += [order[s:s + batch_size] for s in range(0, n - batch_size + 1, batch_size)]
    return out


class TextCache:
    """A :class:`~rankwise.repro.kit.cached_encoder.FrozenPrefix` that encodes every distinct text once per run.

    The prefix outputs depend only on the text (the prefix is frozen and runs in eval mode), so the test
    sets (seed independent), the T = 5 data (a subset of the T = 12 data: same tasks, same tags) and the
    training examples that several seeds share are encoded once. Duck-types ``FrozenPrefix.encode``:
    returns hidden states ``(N, max_length, H)`` and the mask ``(N, max_length)``. A text's features can
    differ in the last float bits from an encoding in another chunk (different padding of the chunk).
    """

    def __init__(self, prefix: FrozenPrefix) -> None:
        self.prefix = prefix
        self._store: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def encode(self, texts: Sequence[str]) -> tuple[torch.Tensor, torch.Tensor]:
        # new texts in order of length, so that the prefix's chunks (padded to their longest text) pad little
        new = sorted((t for t in dict.fromkeys(texts) if t not in self._store), key=len)
        if new:
            h, m = self.prefix.encode(new)
            self._store.update({t: (h[i], m[i]) for i, t in enumerate(new)})
        rows = [self._store[t] for t in texts]
        return torch.stack([r[0] for r in rows]), torch.stack([r[1] for r in rows])


class _Rows:
    """Cached rows (``hidden``, ``mask``, ``labels``) for :func:`logits_on`."""

    def __init__(self, hidden: torch.Tensor, mask: torch.Tensor, labels: torch.Tensor) -> None:
        self.hidden, self.mask, self.labels = hidden, mask, labels


Regularizer = Callable[[nn.Module, int, torch.Tensor], torch.Tensor]


def train_rows(models: dict[str, nn.Module], split: CachedSplit, indices: list[torch.Tensor], seed: int,
               lrs: dict[str, float], regs: dict[str, Regularizer] | None = None, grad_clip: float = 1.0
               ) -> dict[str, dict[str, list[float]]]:
    """Train every model on the same batches (Adam, constant lr, clipping), alternating who goes first.

    Loss = cross-entropy + ``regs[name](model, step, attention_mask)`` (when given). The shared
    :class:`rankwise.train.finetune.Trainer` computes plain cross-entropy only, hence this loop.
    Returns per-model ``{"loss": [...], "step_s": [...]}``.
    """
    regs = regs or {}
    opts = {n: torch.optim.Adam([p for p in m.parameters() if p.requires_grad], lr=lrs[n]) for n, m in models.items()}
    log: dict[str, dict[str, list[float]]] = {n: {"loss": [], "step_s": []} for n in models}
    names = list(models)
    batches = split.batches(indices)
    for step, b in enumerate(batches):
        for n in (names if step % 2 == 0 else names[::-1]):
            model, opt = models[n], opts[n]
            model.train()
            t0 = time.perf_counter()
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed * 100_003 + step)
                logits = model(**b.inputs)
                loss = nn.functional.cross_entropy(logits, b.labels)
                if n in regs:
                    loss = loss + regs[n](model, step, b.inputs["attention_mask"])
                if not torch.isfinite(loss):
                    raise FloatingPointError(f"{n}: non-finite loss at step {step}")
                opt.zero_grad(set_to_none=True)
                loss.backward()
            torch.nn.utils.clip_grad_norm_([p for g in opt.param_groups for p in g["params"]], grad_clip)
            opt.step()
            log[n]["step_s"].append(time.perf_counter() - t0)
            log[n]["loss"].append(float(loss.detach()))
    return log


@torch.no_grad()
def logits_on(model: nn.Module, split: CachedSplit, chunk: int = 64) -> torch.Tensor:
    """Logits ``(N, C)`` of ``model`` on every cached example, in eval mode (mode restored).

    The examples are run in chunks of similar length (sorted by their number of real tokens, so that
    little padding is computed) and the logits returned in the original order.
    """
    was = model.training
    model.eval()
    order = length_order(split.mask)
    try:
        out = torch.cat([model(*_trim(split.hidden[r], split.mask[r])) for r in order.split(chunk)])
    finally:
        model.train(was)
    return out[order.argsort()]


def length_order(mask: torch.Tensor) -> torch.Tensor:
    """Row indices sorted by the number of real tokens (``mask`` (N, L)), stable."""
    return torch.sort(mask.sum(1), stable=True).indices


def per_task_accuracy(logits: torch.Tensor, labels: torch.Tensor, task_of: Sequence[int], n_tasks: int) -> list[float]:
    """Accuracy of each task (argmax over the whole union label space)."""
    hit = (logits.argmax(-1) == labels).double()
    t = torch.tensor(list(task_of))
    return [float(hit[t == k].mean()) for k in range(n_tasks)]


def adapter_params(model: nn.Module) -> int:
    """Trainable parameters outside the classification head."""
    return sum(p.numel() for n, p in model.named_parameters() if p.requires_grad and "classifier" not in n)


# ------------------------------------------------------------------------------------------------
# the run
# ------------------------------------------------------------------------------------------------

def _mt_config(S: MtLoRASettings, seed: int, *, fgr: bool, spectral: bool) -> mtlora.MtLoRAConfig:
    return mtlora.MtLoRAConfig(rank=S.rank, alpha=S.alpha, num_experts=S.experts, placement="ffn",
                               routing_group_size=S.group_size if fgr else 384, dropout=0.05, balance_alpha=0.01,
                               spectral_lambda=S.spectral_lambda if spectral else 0.0,
                               spectral_every=S.spectral_every, seed=seed)


def _build(base: TopModel, S: MtLoRASettings, seed: int) -> tuple[dict[str, nn.Module], dict[str, Regularizer]]:
    import peft

    def head_on(m: nn.Module) -> nn.Module:
        m.classifier.requires_grad_(S.head == "trained")  # a probe head stays fixed
        return m

    def reg(model: nn.Module, step: int, _mask: torch.Tensor) -> torch.Tensor:
        return mtlora.mtlora_regularizers(model, step)

    models: dict[str, nn.Module] = {}
    regs: dict[str, Regularizer] = {}
    for row in S.rows:
        m = copy.deepcopy(base)
        if row == "LoRA (PEFT)":
            models[row] = head_on(peft_inject(m, peft.LoraConfig(r=S.rank, lora_alpha=S.alpha, lora_dropout=0.05,
                                                                 target_modules=["query", "value"])))
            continue
        if row == "HydraLoRA (q,v)":
            cfg = mtlora.hydralora_config(rank=S.rank, alpha=S.alpha, num_experts=S.experts, seed=seed)
        else:
            fgr = row in ("mtLoRA", "block+FGR")
            spectral = row in ("mtLoRA", "block+spectral")
            cfg = _mt_config(S, seed, fgr=fgr, spectral=spectral)
        models[row] = head_on(mtlora.adapt(m, cfg))
        regs[row] = reg
    return models, regs


def _run_tasks(tasks: Sequence[str], seed: int, S: MtLoRASettings, bert: nn.Module, prefix: TextCache,
               init_examples: int) -> dict[str, Any]:
    """Train and evaluate every row of ``S`` on ``tasks`` for one seed; with ``init_examples`` > 0, also the
    largest |logit change| of the adapted rows at initialisation on that many test examples (spread over tasks)."""
    train, test, _tr_task, te_task, offsets = multitask_data(tasks, seed, S.max_train, S.max_test)
    idx = epoch_batches(len(train), S.epochs, S.batch_size, seed)
    split = CachedSplit(prefix, train, [idx])
    test_split = CachedSplit(prefix, test, keep_all=True)
    base = TopModel(bert, S.top_layers, offsets[-1], seed)
    probe = (fit_probe_head(base, split.hidden, split.mask, split.labels, steps=S.probe_steps, lr=S.probe_lr)
             if S.head == "probe" else None)
    models, regs = _build(base, S, seed)
    init_gap = None
    if init_examples:
        pick = torch.linspace(0, len(test) - 1, min(init_examples, len(test))).round().long().unique()
        sub = _Rows(test_split.hidden[pick], test_split.mask[pick], test_split.labels[pick])
        base_logits = logits_on(base, sub)
        init_gap = max(float((logits_on(m, sub) - base_logits).abs().max())
                       for n, m in models.items() if n != "LoRA (PEFT)")
    log = train_rows(models, split, idx, seed, {n: S.lr for n in models}, regs)
    out: dict[str, Any] = {"tasks": list(tasks), "steps": len(idx), "n_train": len(train), "n_test": len(test),
                           "init_max_abs_diff": init_gap, "rows": {},
                           "labels": [offsets[t + 1] - offsets[t] for t in range(len(tasks))],
                           "test_task": list(te_task)}
    for n, m in models.items():
        logits = logits_on(m, test_split)
        acc = per_task_accuracy(logits, test_split.labels, te_task, len(tasks))
        out["rows"][n] = {"per_task": acc, "mean_acc": statistics.fmean(acc), "params": adapter_params(m),
                          "ms_per_step": 1e3 * statistics.median(log[n]["step_s"]),
                          "final_loss": statistics.fmean(log[n]["loss"][-max(1, len(idx) // 5):]),
                          "loss": log[n]["loss"],
                          "hits": (logits.argmax(-1) == test_split.labels).double().tolist()}
    if probe is not None:  # the fixed head on the frozen encoder: what every row starts from
        logits = logits_on(base, test_split)
        acc = per_task_accuracy(logits, test_split.labels, te_task, len(tasks))
        out["rows"][HEAD_ROW] = {"per_task": acc, "mean_acc": statistics.fmean(acc), "params": 0,
                                 "probe_train_acc": probe["train_acc"],
                                 "hits": (logits.argmax(-1) == test_split.labels).double().tolist()}
    return out


def weighted_differences(a: Sequence[float], b: Sequence[float], task_of: Sequence[int]) -> list[float]:
    """Per-example ``(a_i - b_i) * N / (T n_task(i))``: their mean is the mean over tasks of the per-task mean
    difference (the mean-over-tasks accuracy difference when ``a``, ``b`` are 0/1 correctness)."""
    counts: dict[int, int] = {}
    for t in task_of:
        counts[t] = counts.get(t, 0) + 1
    n, T = len(task_of), len(counts)
    return [(x - y) * n / (T * counts[t]) for x, y, t in zip(a, b, task_of)]


class MtLoRAReproduction(Reproduction[MtLoRASettings, dict]):
    id = ID
    claim = CLAIM
    settings = SETTINGS

    def measure(self, S: MtLoRASettings, seed: int) -> dict[str, Any]:
        first = not hasattr(self, "prefix")  # measure runs in seed order: the first call is the first seed
        if first:
            from rankwise import zoo

            self.bert, tok = zoo.minilm()
            # every distinct text's frozen-prefix features once per run (shared by the seeds and the task sets)
            self.prefix = TextCache(FrozenPrefix(self.bert, tok, len(self.bert.encoder.layer) - S.top_layers,
                                                 S.max_length))
        return {str(len(ts)): _run_tasks(ts, seed, S, self.bert, self.prefix, S.init_examples if first else 0)
                for ts in S.task_sets}

    def table(self, S: MtLoRASettings, records: Records[dict]) -> Table:
        Ts = [len(ts) for ts in S.task_sets]
        cols = [f"mean acc T={T}" for T in Ts] + ["trainable params", "ms / step"]
        table = Table(columns=cols, notes={"trainable params": "adapter + router parameters, head excluded",
                                           **{f"mean acc T={T}": "mean over tasks of the test accuracy (argmax over "
                                              "the union label space)" for T in Ts}})
        for res in records:
            for T in Ts:
                for r, v in res[str(T)]["rows"].items():
                    table.add(r, f"mean acc T={T}", v["mean_acc"])
            for r, v in res[str(Ts[-1])]["rows"].items():
                table.add(r, "trainable params", v["params"])
                if "ms_per_step" in v:
                    table.add(r, "ms / step", v["ms_per_step"])
        self._table = table
        return table

    def preconditions(self, S: MtLoRASettings, records: Records[dict]) -> list[Precondition]:
        T_hi = len(S.task_sets[-1])
        first = records.first[str(T_hi)]
        chance = statistics.fmean(1.0 / k for k in first["labels"])
        col = f"mean acc T={T_hi}"
        hydra = self._table.mean("HydraLoRA (q,v)", col)
        pre = [Precondition(f"the compared baseline learned: HydraLoRA's mean accuracy at T={T_hi} - chance (mean "
                            f"over tasks of 1 / labels = {chance:.3f})", hydra - chance, ">", 0.0)]
        if HEAD_ROW in first["rows"]:
            pre.append(Precondition(f"the adapters matter: HydraLoRA's mean accuracy at T={T_hi} - the fixed probe "
                                    "head's on the frozen encoder (else the comparison is between two ways of "
                                    "leaving the encoder as it was)", hydra - self._table.mean(HEAD_ROW, col), ">",
                                    0.0))
        pre.append(Precondition(f"the tasks do not saturate: the best row's mean accuracy at T={T_hi}",
                                max(self._table.mean(r, col) for r in S.rows), "<", SATURATED))
        return pre

    def checks(self, S: MtLoRASettings, records: Records[dict]) -> list[ClaimCheck]:
        table = self._table
        Ts = [len(ts) for ts in S.task_sets]
        T_hi, T_lo = Ts[-1], Ts[0]
        mt, hy = "mtLoRA", "HydraLoRA (q,v)"
        paired = [weighted_differences(res[str(T_hi)]["rows"][mt]["hits"], res[str(T_hi)]["rows"][hy]["hits"],
                                       res[str(T_hi)]["test_task"]) for res in records]
        acc_diff = statistics.fmean(statistics.fmean(p) for p in paired)
        ratio = table.mean(mt, "trainable params") / table.mean(hy, "trainable params")
        checks = [ClaimCheck("mtLoRA trainable parameters / HydraLoRA's (exact relation of the designs)", ratio, "<=",
                             PARAM_RATIO)]
        if S.init_examples:
            init_gap = max(records.first[str(T)]["init_max_abs_diff"] for T in Ts)
            checks.append(ClaimCheck(f"adapter output at initialisation: max |logits(adapted) - logits(base)| on "
                                     f"{S.init_examples} test examples (first seed)", init_gap, "<=", 0.0,
                                     kind="wiring"))
        if len(Ts) > 1:
            drop = {r: table.mean(r, f"mean acc T={T_lo}") - table.mean(r, f"mean acc T={T_hi}") for r in (mt, hy)}
            checks += [
                ClaimCheck(f"mean accuracy at T={T_hi}: mtLoRA - HydraLoRA, mean over seeds", acc_diff, ">=",
                           ACC_MARGIN_FULL, unit="acc", samples=paired),
                ClaimCheck(f"accuracy drop T={T_lo} -> T={T_hi}: HydraLoRA's - mtLoRA's (positive: mtLoRA degrades "
                           "less)", drop[hy] - drop[mt], ">", 0.0, unit="acc"),
            ]
        else:
            checks.append(ClaimCheck(f"mean accuracy at T={T_hi}: mtLoRA - HydraLoRA (quick: within 2 points)",
                                     acc_diff, ">=", ACC_SLACK_QUICK, unit="acc", samples=paired))
        return checks

    def figures(self, S: MtLoRASettings, records: Records[dict], out_dir: Path) -> list[str]:
        plt = pyplot()
        rows = list(S.rows)
        Ts = [len(ts) for ts in S.task_sets]
        fig, ax = plt.subplots(1, 2, figsize=(11, 4))
        width = 0.8 / len(Ts)
        for j, T in enumerate(Ts):
            vals = [[s[str(T)]["rows"][r]["mean_acc"] for s in records] for r in rows]
            means = [statistics.fmean(v) for v in vals]
            errs = [statistics.pstdev(v) if len(v) > 1 else 0.0 for v in vals]
            ax[0].barh([i + j * width for i in range(len(rows))], means, height=width, xerr=errs, label=f"T={T}")
        ax[0].set_yticks([i + width * (len(Ts) - 1) / 2 for i in range(len(rows))])
        ax[0].set_yticklabels(rows)
        ax[0].set_xlabel("mean test accuracy over tasks (union label space)")
        ax[0].legend()
        first = records.first[str(Ts[-1])]["rows"]
        ax[1].barh(rows, [first[r]["params"] for r in rows], color="tab:gray")
        ax[1].set_xlabel("trainable adapter parameters (head excluded)")
        fig.tight_layout()
        return [save_figure(fig, out_dir / "mtlora_accuracy_params.png", dpi=120)]

    def notes(self, S: MtLoRASettings, records: Records[dict]) -> str:
        Ts = [len(ts) for ts in S.task_sets]
        first = records.first[str(Ts[-1])]
        return (
            f"MiniLM top {S.top_layers} block(s) adapted, lower blocks cached; tasks: the zoo's docstring tasks "
            f"({', '.join(str(T) for T in Ts)} tasks; the zoo has 12, not the spec's 15 synthetic tasks), at most "
            f"{S.max_train} train / {S.max_test} test examples per task, texts tagged with the task and cut to "
            f"{S.max_length} tokens, one head over the union label space ({first['n_train']} training examples, "
            f"{first['steps']} steps of batch {S.batch_size} at T={Ts[-1]}). Every row: Adam lr {S.lr} (adapters, "
            f"routers, head), {S.epochs} epoch(s), the same batches; r={S.rank}, alpha={S.alpha}, E={S.experts}. The "
            f"spectral term is applied every {S.spectral_every} steps (the spec's 50 scaled to the shorter runs). "
            "The accuracy claims are expected to hold only qualitatively at this scale (a few hundred steps, two "
            "adapted blocks); the parameter relation is exact: per block mtLoRA has d r + E r d + E G d = 18,432 "
            "parameters vs HydraLoRA's 2 (d r + E r d + E d) = 33,792 on query+value. The ablation rows isolate each "
            "piece (block+spectral vs block only: the spectral term; block+FGR vs block only: fine-grained routing); "
            "the spectral penalty is quartic in B_i, so early in training (small B_i) its gradient is small next to "
            "the task's (docs/methods/mtlora.md reports a measurement). " + (
                f"Head: fitted once as a linear probe on the frozen encoder ({S.probe_steps} full-batch Adam steps, "
                f"lr {S.probe_lr}) and then fixed for every row, so the rows differ only in their adapters; the probe "
                f"alone reaches {self._table.mean(HEAD_ROW, f'mean acc T={Ts[-1]}'):.3f} mean accuracy (row "
                f"'{HEAD_ROW}')." if S.head == "probe" else "Head: trained with the adapters in every row.") + (
                " Quick mode runs one seed at twice the steps (the cost of two seeds), so its interval is over the "
                "test examples only." if len(records.seeds) == 1 else ""))

    def config(self, S: MtLoRASettings, records: Records[dict]) -> dict[str, Any]:
        return {"dropout": 0.05, "balance_alpha": 0.01}

    def extra(self, S: MtLoRASettings, records: Records[dict]) -> dict[str, Any]:
        drop = ("rows", "labels", "test_task")
        return {"seeds": {s: {T: {k: v for k, v in r.items() if k not in drop} | {
            "rows": {n: {k: v for k, v in row.items() if k not in ("loss", "hits")} for n, row in r["rows"].items()}}
            for T, r in res.items()} for s, res in records.items()}}


REPRODUCTION = MtLoRAReproduction
run = MtLoRAReproduction.run
