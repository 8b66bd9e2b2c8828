"""Reproduction of the reference LoRA (Hu et al., 2021) on the embedded MiniLM, side by side with PEFT.

Three ways to fine-tune all-MiniLM-L6-v2 (:func:`rankwise.zoo.minilm_classifier`) on the zoo's text
task ``kind`` (does a docstring document a class, a function or a method?), with the same data,
order, optimizer (AdamW, linear schedule with warm-up, gradient clipping) and budget:

* **rankwise LoRA**: :func:`rankwise.adapt.lora.adapt`, rank 8, alpha 16, dropout 0.1 on
  ``query``/``value`` of every layer, and the classification head unfrozen;
* **PEFT LoRA**: ``peft.get_peft_model(model, LoraConfig(task_type="SEQ_CLS", r=8, lora_alpha=16,
  lora_dropout=0.1, target_modules=["query", "value"]))``, whose ``modules_to_save`` keeps the head
  trainable; its A/B factors are overwritten with rankwise's, so both start from the same point;
* **full fine-tuning**: every parameter trainable (its own learning rate, see below).

rankwise and PEFT are trained in lock step on the same batches (:func:`rankwise.train.finetune.lockstep`,
alternating which goes first), with per-step dropout seeds, so their dropout masks agree too.

Checks ((a)-(c) are ``wiring`` checks, identities only a bug can break; (d) and (e) are ``claim`` checks,
(d) with its paired per-example accuracy differences, so its bootstrap interval is reported; (f) is a
precondition: when it fails the verdict is ``inconclusive``). The sizes, model, targets, rank and learning
rates are :class:`LoraSettings` (``SETTINGS[mode]``; ``rankwise reproduce lora --set rank=4``):

(a) the same factors give the same logits: max |logit difference| rankwise vs PEFT <= 1e-5, measured
    with identical *non-zero* factors (at the true init B = 0 both equal the base model trivially);
(b) the same loss curves: max |loss difference| over all training steps <= 1e-4 (float32: another
    order of operations, e.g. another BLAS path, perturbs a step's loss by ~1e-7 relative and the
    perturbation can compound over the steps; 1e-4 leaves room for that, while a real difference,
    such as another scaling, dropout placement or initialisation, moves the losses by far more);
(c) the same accuracy: |mean accuracy rankwise - PEFT| <= 0.01;
(d) LoRA roughly matches full fine-tuning (Hu et al., Table 2: within about a point on GLUE at
    RoBERTa/DeBERTa scale): mean accuracy LoRA - full >= -0.05; the slack is about two standard
    errors of an accuracy measured on 120-318 test examples, for a comparison at a scale (a 22M
    model, a few hundred examples, one or two epochs) far from the paper's;
(e) rankwise is no slower than PEFT: median over steps of the per-step time ratio rankwise / PEFT
    (the same step of the lock-stepped pair; the first step excluded as warm-up) <= 1.10;
(f) preconditions that make (d) meaningful: LoRA *and* full fine-tuning learn the task (each one's mean
    accuracy exceeds chance, 1/3, by more than 0.10), and the task does not saturate (the better of the two
    below 0.99, i.e. not within a point of 100 %).

Sizes (issue 14): at two epochs of 240 examples both models sat near 0.55-0.61 and (d) changed its verdict
with the seeds (LoRA - full -0.008 on seeds 0, 1; -0.054 on seeds 7, 11). Quick mode therefore runs one seed
at twice the training set (480 examples, 120 steps) and scores the whole test set (318 examples), and full
mode every training example (792, two epochs) on three seeds; the verdict on (d) comes from its paired
bootstrap interval (over test examples, and over seeds in full mode), ``inconclusive`` when it contains -0.05.

Learning rates (LoRA 5e-3, full fine-tuning 3e-4) were chosen once, before the reported runs, by the
same three-point sweep for both ({2e-3, 5e-3, 1e-2} and {1e-4, 3e-4, 1e-3}) at the quick-mode budget
on a development seed (100), scored on 180 validation examples held out from the training pool
(LoRA 0.52 / 0.64 / 0.57, full 0.62 / 0.63 / 0.33, which diverged); see docs/reproductions.md.
The batch size is 8 rather than 16 because LoRA (B = 0 at the start, the head reading BERT's pooler,
whose output barely varies across inputs for this sentence-embedding checkpoint) needs updates more
than examples: one epoch (15 steps of 16, or 30 of 8) left it at chance for every learning rate tried
up to 3e-2, two epochs of 8 (60 steps) did not.
"""

from __future__ import annotations

import copy
import dataclasses
import statistics
from pathlib import Path
from typing import Any

import torch

from rankwise.adapt import lora
from rankwise.core.lora import lora_layers
from rankwise.repro.result import ClaimCheck, Precondition, Table
from rankwise.repro.skeleton import Records, Reproduction, Settings, pyplot, save_figure, setting
from rankwise.train.finetune import (
    FinetuneConfig,
    Trainer,
    evaluate,
    lockstep,
    make_batches,
)

ID = "lora"
CLAIM = ("LoRA (rank 8 on query/value, head trainable) fine-tunes a pretrained encoder about as well as full "
         "fine-tuning, and rankwise's LoRA is the same computation as PEFT's: the same logits and loss curve from "
         "the same initialisation, the same accuracy, and no slower per training step.")


@dataclasses.dataclass(frozen=True, kw_only=True)
class LoraSettings(Settings):
    """What the LoRA reproduction runs; ``SETTINGS[mode]`` holds each mode's values."""

    model: str = setting("all-MiniLM-L6-v2", "the pretrained encoder (zoo.minilm_classifier)",
                         choices=("all-MiniLM-L6-v2",))
    task: str = setting("kind", "zoo text task (rankwise.zoo.text_task)")
    n_train: int | None = setting(240, "training examples (n_train // labels per class; None: all)", lo=1)
    n_test: int | None = setting(120, "test examples (None: the whole test set)", lo=1)
    steps: int | None = setting(None, "training steps (None: epochs over the training set)", lo=1)
    epochs: float = setting(2.0, "epochs over the training subset when steps is None", lo=0.0)
    batch_size: int = setting(8, "examples per step", lo=1)
    max_length: int = setting(32, "tokens per input", lo=1)
    head_only: bool = setting(False, "also train a head-only (frozen encoder) baseline")
    rank: int = setting(8, "LoRA rank", lo=1)
    alpha: float = setting(16.0, "LoRA alpha (scale alpha / rank)", lo=0.0)
    lora_dropout: float = setting(0.1, "LoRA dropout", lo=0.0, hi=1.0)
    targets: tuple[str, ...] = setting(("query", "value"), "adapted module names (LoRA and PEFT)")
    lr_lora: float = setting(5e-3, "learning rate of both LoRAs (and the head-only baseline)", lo=0.0)
    lr_full: float = setting(3e-4, "learning rate of full fine-tuning", lo=0.0)


SETTINGS: dict[str, LoraSettings] = {
    # n_train / n_test cap the task (n // 3 per class); epochs over the training subset
    "smoke": LoraSettings(n_train=24, n_test=12, steps=3, epochs=1.0, batch_size=8, max_length=16),
    # quick (issue 14): one seed and the whole test set (318 examples), so that the paired interval of (d) is as
    # narrow as the task allows. 480 training examples (120 steps of 8) took 108 s on an idle 2-core machine, over
    # the 60 s budget, so quick trains on 240 (60 steps); training both models far enough for (d) to be about the
    # method rather than the stage of training is full mode's job (every example, 64 tokens, three seeds).
    "quick": LoraSettings(n_train=240, n_test=None, seeds=(0,)),
    # full: every training example (792 instead of 600; 198 steps instead of 150), 64 tokens, three seeds (the
    # interval of (d) then resamples the seeds too), the frozen-encoder baseline
    "full": LoraSettings(n_train=None, n_test=None, epochs=2.0, batch_size=8, max_length=64, head_only=True),
}

# tolerances / thresholds of the claims (stated before any run)
TOL_LOGITS = 1e-5
TOL_LOSS = 1e-4
TOL_ACC_PEFT = 0.01
MARGIN_FULL = 0.05
MAX_TIME_RATIO = 1.10
MIN_ABOVE_CHANCE = 0.10
SATURATED = 0.99  # precondition (issue 14): a compared row within one point of 100 % cannot show a difference

ROWS = ("rankwise LoRA", "PEFT LoRA", "full fine-tuning", "head only (frozen encoder)")
COLUMNS = ["accuracy", "final loss", "trainable", "step (ms)", "time / PEFT", "Δlogit init", "Δloss max",
           "Δlogit end"]


def _peft_lora(model: torch.nn.Module, S: LoraSettings) -> torch.nn.Module:
    """PEFT's LoRA on ``model`` with the same rank/alpha/dropout/targets; SEQ_CLS keeps the head trainable."""
    import peft

    cfg = peft.LoraConfig(task_type="SEQ_CLS", r=S.rank, lora_alpha=S.alpha, lora_dropout=S.lora_dropout,
                          target_modules=list(S.targets))
    with torch.random.fork_rng(devices=[]):  # PEFT draws its own A from the global RNG; we overwrite it
        return peft.get_peft_model(model, cfg)


def _pairs(rw: torch.nn.Module, pm: torch.nn.Module) -> list[tuple[Any, Any]]:
    """(rankwise LoraLinear, PEFT LoRA layer) for every adapted module, matched by name."""
    base = pm.base_model.model
    out = []
    for name, layer in lora_layers(rw):
        other = base.get_submodule(name)
        if "default" not in getattr(other, "lora_A", {}):
            raise RuntimeError(f"PEFT did not adapt {name!r}; the two models are not comparable")
        out.append((layer, other))
    if len(out) != sum(1 for n, m in base.named_modules() if hasattr(m, "lora_A") and "default" in m.lora_A):
        raise RuntimeError("rankwise and PEFT adapted different sets of modules")
    return out


@torch.no_grad()
def _copy_factors(pairs: list[tuple[Any, Any]], b: list[torch.Tensor] | None = None) -> None:
    """Give PEFT rankwise's A; set B in both (to ``b`` if given, else copy rankwise's B)."""
    for i, (layer, other) in enumerate(pairs):
        other.lora_A["default"].weight.copy_(layer.lora_A["default"].weight)
        if b is not None:
            layer.lora_B["default"].weight.copy_(b[i])
        other.lora_B["default"].weight.copy_(layer.lora_B["default"].weight)


def _init_logit_diff(rw: torch.nn.Module, pm: torch.nn.Module, pairs: list[tuple[Any, Any]], tokenizer: Any,
                     texts: list[str], max_length: int, seed: int) -> tuple[float, float]:
    """Max |logit diff| rankwise vs PEFT (eval mode) with B = 0 and with the same random non-zero B.

    The non-zero B (std 0.05) makes each adapter's update comparable to the base layer's output, so
    the comparison exercises the adapter path; B is reset to zero in both models afterwards.
    """
    enc = tokenizer(texts, padding=True, truncation=True, max_length=max_length, return_tensors="pt")
    enc = {k: v for k, v in dict(enc).items() if isinstance(v, torch.Tensor)}

    @torch.no_grad()
    def diff() -> float:
        was = rw.training, pm.training
        rw.eval(), pm.eval()
        try:
            return float((rw(**enc).logits - pm(**enc).logits).abs().max())
        finally:
            rw.train(was[0]), pm.train(was[1])

    zero = diff()
    g = torch.Generator().manual_seed(10_000 + seed)
    shapes = [layer.lora_B["default"].weight.shape for layer, _ in pairs]
    _copy_factors(pairs, [torch.randn(s, generator=g) * 0.05 for s in shapes])
    nonzero = diff()
    _copy_factors(pairs, [torch.zeros(s) for s in shapes])
    return zero, nonzero


def _median_ratio(a: list[float], b: list[float]) -> float:
    """Median of the per-step ratios a[i] / b[i], skipping step 0 (warm-up) when there are more steps."""
    pairs = list(zip(a, b))[1:] if len(a) > 1 else list(zip(a, b))
    return statistics.median(x / y for x, y in pairs if y > 0)


def _final_loss(losses: list[float]) -> float:
    k = max(1, len(losses) // 5)  # mean over the last fifth of the steps
    return statistics.fmean(losses[-k:])


def _correct(ev: Any, test: list[tuple[str, int]]) -> list[float]:
    """1.0 / 0.0 per test example: whether the prediction is right (the accuracy's terms)."""
    y = torch.tensor([label for _, label in test], dtype=torch.long)
    return (ev.logits.argmax(-1) == y).double().tolist()


def _measure(seed: int, S: LoraSettings) -> dict[str, Any]:
    from rankwise import zoo

    task = zoo.text_task(S.task, seed=seed, max_train=S.n_train, max_test=S.n_test)
    base, tok = zoo.minilm_classifier(task.num_labels, seed=seed)
    common = dict(epochs=S.epochs, steps=S.steps, batch_size=S.batch_size, max_length=S.max_length, seed=seed)
    cfg_lora = FinetuneConfig(lr=S.lr_lora, **common)
    cfg_full = FinetuneConfig(lr=S.lr_full, **common)
    batches = make_batches(tok, task.train, cfg_lora)
    steps = len(batches)

    # the three models: one load, two copies
    rw = copy.deepcopy(base)
    lora.adapt(rw, lora.LoraConfig(rank=S.rank, alpha=S.alpha, dropout=S.lora_dropout, target=S.targets, seed=seed))
    for p in rw.classifier.parameters():  # what PEFT's SEQ_CLS modules_to_save does
        p.requires_grad_(True)
    pm = _peft_lora(copy.deepcopy(base), S)
    pairs = _pairs(rw, pm)
    _copy_factors(pairs)
    full = base
    for p in full.parameters():
        p.requires_grad_(True)

    n_check = min(16, len(task.test))
    zero_diff, init_diff = _init_logit_diff(rw, pm, pairs, tok, [t for t, _ in task.test[:n_check]],
                                            S.max_length, seed)

    trainers = {"rankwise": Trainer(rw, cfg_lora, steps), "peft": Trainer(pm, cfg_lora, steps)}
    n_rw = sum(p.numel() for p in trainers["rankwise"].params)
    n_pm = sum(p.numel() for p in trainers["peft"].params)
    if n_rw != n_pm:
        raise RuntimeError(f"rankwise trains {n_rw} parameters but PEFT trains {n_pm}; the set-ups differ")
    lockstep(trainers, batches)
    t_full = Trainer(full, cfg_full, steps)
    for b in batches:
        t_full.step(b)

    ev = {k: evaluate(m, tok, task.test, max_length=S.max_length)
          for k, m in (("rankwise", rw), ("peft", pm), ("full", full))}
    curves = {"rankwise": trainers["rankwise"].losses, "peft": trainers["peft"].losses, "full": t_full.losses}
    times = {"rankwise": trainers["rankwise"].step_times, "peft": trainers["peft"].step_times,
             "full": t_full.step_times}
    trained = {"rankwise": trainers["rankwise"], "peft": trainers["peft"], "full": t_full}
    if S.head_only:
        probe, _ = zoo.minilm_classifier(task.num_labels, seed=seed)
        for n, p in probe.named_parameters():
            p.requires_grad_(n.startswith("classifier."))
        t_head = Trainer(probe, cfg_lora, steps)
        for b in batches:
            t_head.step(b)
        ev["head"] = evaluate(probe, tok, task.test, max_length=S.max_length)
        curves["head"], times["head"], trained["head"] = t_head.losses, t_head.step_times, t_head

    return {"steps": steps, "n_train": len(task.train), "n_test": len(task.test), "labels": task.labels,
            "chance": 1.0 / task.num_labels, "zero_diff": zero_diff, "init_diff": init_diff,
            "loss_diff": max(abs(a - b) for a, b in zip(curves["rankwise"], curves["peft"])),
            "test_diff": float((ev["rankwise"].logits - ev["peft"].logits).abs().max()),
            "ratio": _median_ratio(times["rankwise"], times["peft"]),
            "accuracy": {k: e.accuracy for k, e in ev.items()},
            "correct": {k: _correct(e, task.test) for k, e in ev.items()},
            "trainable": {k: sum(p.numel() for p in tr.params) for k, tr in trained.items()},
            "curves": curves, "times": times}


ROW_KEYS = (("rankwise LoRA", "rankwise"), ("PEFT LoRA", "peft"), ("full fine-tuning", "full"),
            ("head only (frozen encoder)", "head"))


class LoraReproduction(Reproduction[LoraSettings, dict]):
    id = ID
    claim = CLAIM
    settings = SETTINGS

    def measure(self, settings: LoraSettings, seed: int) -> dict[str, Any]:
        return _measure(seed, settings)

    def table(self, settings: LoraSettings, records: Records[dict]) -> Table:
        table = Table(columns=list(COLUMNS), notes={
            "accuracy": "test accuracy, higher is better",
            "final loss": "training loss, mean over the last fifth of the steps",
            "trainable": "trained parameters",
            "step (ms)": "median forward + backward + optimizer step, under whatever load the machine had",
            "time / PEFT": "median over steps of t_rankwise / t_PEFT of the same lock-stepped step",
            "Δlogit init": "max |logit rankwise - PEFT|, same non-zero A and B in both, eval mode",
            "Δloss max": "max over steps of |training loss rankwise - PEFT|",
            "Δlogit end": "max |test logit rankwise - PEFT| after training",
        })
        for r in records:
            for row, key in ROW_KEYS:
                if key not in r["accuracy"]:
                    continue
                table.add(row, "accuracy", r["accuracy"][key])
                table.add(row, "final loss", _final_loss(r["curves"][key]))
                table.add(row, "trainable", r["trainable"][key])
                table.add(row, "step (ms)", 1e3 * statistics.median(r["times"][key]))
            table.add("rankwise LoRA", "time / PEFT", r["ratio"])
            table.add("rankwise LoRA", "Δlogit init", r["init_diff"])
            table.add("rankwise LoRA", "Δloss max", r["loss_diff"])
            table.add("rankwise LoRA", "Δlogit end", r["test_diff"])
        self._table = table
        return table

    def preconditions(self, settings: LoraSettings, records: Records[dict]) -> list[Precondition]:
        chance = records.first["chance"]
        pre = [Precondition(f"{name} learns the task (else (d) compares a model near chance): mean accuracy {name} - "
                            "chance", self._table.mean(row, "accuracy") - chance, ">", MIN_ABOVE_CHANCE)
               for name, row in (("LoRA", "rankwise LoRA"), ("full fine-tuning", "full fine-tuning"))]
        pre.append(Precondition("the task does not saturate: the best compared row's mean accuracy",
                                max(self._table.mean(r, "accuracy") for r in ("rankwise LoRA", "full fine-tuning")),
                                "<", SATURATED))
        return pre

    def checks(self, settings: LoraSettings, records: Records[dict]) -> list[ClaimCheck]:
        table = self._table
        acc_rw = table.mean("rankwise LoRA", "accuracy")
        acc_pm = table.mean("PEFT LoRA", "accuracy")
        acc_full = table.mean("full fine-tuning", "accuracy")
        ratio = statistics.median(table.values("rankwise LoRA", "time / PEFT"))
        paired = [[a - b for a, b in zip(r["correct"]["rankwise"], r["correct"]["full"])] for r in records]
        return [
            ClaimCheck("(a) same factors give the same logits: max |logit rankwise - PEFT| (non-zero A, B)",
                       max(r["init_diff"] for r in records), "<=", TOL_LOGITS, kind="wiring"),
            ClaimCheck("(b) same loss curve: max over steps of |loss rankwise - loss PEFT| (float32 op-order "
                       "tolerance)", max(r["loss_diff"] for r in records), "<=", TOL_LOSS, unit="nats", kind="wiring"),
            ClaimCheck("(c) same accuracy: |mean accuracy rankwise LoRA - PEFT LoRA|", abs(acc_rw - acc_pm), "<=",
                       TOL_ACC_PEFT, kind="wiring"),
            ClaimCheck("(d) LoRA roughly matches full fine-tuning: mean accuracy LoRA - full fine-tuning",
                       acc_rw - acc_full, ">=", -MARGIN_FULL, samples=paired),
            ClaimCheck("(e) rankwise no slower than PEFT: median per-step time ratio rankwise / PEFT", ratio, "<=",
                       MAX_TIME_RATIO, unit="x"),
        ]

    def figures(self, settings: LoraSettings, records: Records[dict], out_dir: Path) -> list[str]:
        return [_figure(out_dir, self._table, self.extra(settings, records), records.seeds, settings.task)]

    def extra(self, settings: LoraSettings, records: Records[dict]) -> dict[str, Any]:
        return {"curves": {str(s): r["curves"] for s, r in records.items()},
                "step_times_s": {str(s): r["times"] for s, r in records.items()},
                "logit_diff_at_init_B0": {str(s): r["zero_diff"] for s, r in records.items()},
                "chance": records.first["chance"]}

    def config(self, settings: LoraSettings, records: Records[dict]) -> dict[str, Any]:
        info = records.first
        return {"labels": info["labels"], "n_train": info["n_train"], "n_test": info["n_test"],
                "steps": info["steps"], "optimizer": "AdamW", "weight_decay": 0.0, "schedule": "linear, 6% warm-up",
                "grad_clip": 1.0, "model": "all-MiniLM-L6-v2 + seeded head (zoo.minilm_classifier)",
                "threads": torch.get_num_threads()}

    def notes(self, settings: LoraSettings, records: Records[dict]) -> str:
        return _notes(settings, self._table, list(records), records.first)


def _figure(out_dir: Path, table: Table, extra: dict[str, Any], seeds: list[int], task: str) -> str:
    plt = pyplot()
    import numpy as np

    curves = extra["curves"]
    names = {"rankwise": "rankwise LoRA", "peft": "PEFT LoRA", "full": "full fine-tuning",
             "head": "head only (frozen encoder)"}
    styles = {"rankwise": dict(color="C0", lw=2.2), "peft": dict(color="C1", lw=1.2, ls="--"),
              "full": dict(color="C2", lw=1.5), "head": dict(color="C7", lw=1.2, ls=":")}
    fig, axes = plt.subplots(1, 3, figsize=(14, 3.9))
    ax = axes[0]
    for key in names:
        runs = [curves[str(s)][key] for s in seeds if key in curves[str(s)]]
        if not runs:
            continue
        mean = np.mean(np.array(runs), axis=0)
        ax.plot(np.arange(1, len(mean) + 1), mean, label=names[key], **styles[key])
    ax.set_xlabel("training step")
    ax.set_ylabel(f"training loss (mean over {len(seeds)} seed{'s' if len(seeds) > 1 else ''})")
    ax.set_title("loss curves")
    ax.legend(fontsize=8)

    ax = axes[1]
    floor = 1e-12
    any_nonzero = False
    for s in seeds:
        d = np.abs(np.array(curves[str(s)]["rankwise"]) - np.array(curves[str(s)]["peft"]))
        any_nonzero |= bool((d > 0).any())
        ax.plot(np.arange(1, len(d) + 1), np.maximum(d, floor), marker="o", ms=3, lw=1, label=f"seed {s}")
    ax.axhline(TOL_LOSS, color="r", ls="--", lw=1, label=f"tolerance {TOL_LOSS:g}")
    ax.set_yscale("log")
    ax.set_ylim(floor / 3, 1e-2)
    ax.set_xlabel("training step")
    ax.set_ylabel("|loss rankwise − loss PEFT|")
    ax.set_title("rankwise vs PEFT" + ("" if any_nonzero else f" (bit-identical: plotted at {floor:g})"),
                 fontsize=10)
    ax.legend(fontsize=8)

    ax = axes[2]
    rows = [r for r in ROWS if table.values(r, "accuracy")]
    means = [table.mean(r, "accuracy") for r in rows]
    stds = [table.std(r, "accuracy") for r in rows]
    colors = ["C0", "C1", "C2", "C7"][: len(rows)]
    ax.bar(range(len(rows)), means, yerr=stds, color=colors, capsize=4)
    for i, r in enumerate(rows):
        for v in table.values(r, "accuracy"):
            ax.plot(i, v, "k.", ms=4)
        ax.text(i, means[i] + stds[i] + 0.015, f"{means[i]:.3f}", ha="center", va="bottom", fontsize=8)
    chance = extra.get("chance")
    if chance:
        ax.axhline(chance, color="k", ls=":", lw=1, label="chance")
        ax.legend(fontsize=8, loc="lower right")
    ax.set_xticks(range(len(rows)), [r.replace(" (frozen encoder)", "\n(frozen encoder)").replace(" fine-", "\nfine-")
                                     for r in rows], fontsize=8)
    ax.set_ylim(0, 1)
    ax.set_ylabel("test accuracy")
    ax.set_title(f"task '{task}' (bars: mean ± std over seeds)", fontsize=10)
    fig.tight_layout()
    return save_figure(fig, out_dir / "lora.png")


def _notes(S: LoraSettings, table: Table, per_seed: list[dict[str, Any]], info: dict[str, Any]) -> str:
    acc = {r: table.mean(r, "accuracy") for r in ROWS if table.values(r, "accuracy")}
    lines = [
        f"Task '{S.task}' of rankwise.zoo (3 balanced classes: class / function / method docstrings; "
        f"{info['n_train']} training and {info['n_test']} test examples here). Chosen because it is learnable but "
        "not trivial for the pretrained encoder: a logistic regression on frozen mean-pooled MiniLM embeddings "
        "reaches only about 0.65 on it (chance 0.33; measured with 400 training examples), the lowest of the "
        "seven zoo tasks measured, so fine-tuning has room to help and differences between methods are visible.",
        "Mean test accuracy: " + ", ".join(f"{r} {a:.3f}" for r, a in acc.items()) + ".",
        "rankwise and PEFT compute the same thing in the same order (base output, then B(A(dropout(x))) * s "
        "added), so with the same factors, batches and per-step dropout seeds their logits and losses should "
        "agree up to float32 reordering: " + (
            "here they agree to the last bit (max differences exactly 0)."
            if max(p["init_diff"] for p in per_seed) == 0 and max(p["loss_diff"] for p in per_seed) == 0 else
            f"here the largest differences are {max(p['init_diff'] for p in per_seed):.2g} (logits) and "
            f"{max(p['loss_diff'] for p in per_seed):.2g} (loss)."),
        "Step times are wall-clock under whatever load the machine had; the ratio (e) pairs each rankwise step "
        "with the PEFT step on the same batch, run back to back in alternating order, which cancels most drift.",
    ]
    if S == SETTINGS["smoke"]:
        lines.append("Smoke mode: 3 steps on a tiny subset; it checks the wiring and its verdict means nothing "
                     "(the precondition, that LoRA learned the task, cannot hold after 3 steps).")
    elif S == SETTINGS["quick"]:
        lines.append(f"Quick mode runs one seed: {S.epochs:g} epochs on {S.n_train} examples (batches of "
                     f"{S.batch_size}) with inputs cut at {S.max_length} tokens (about the median length), tested on "
                     "the whole test set (318 examples); the interval of (d) is over test examples only, and after "
                     "this little training (d) says more about how far each model got than about the method. Full "
                     "mode (every training example, two epochs, 64 tokens, three seeds, a frozen-encoder baseline) "
                     "trains further and also resamples the seeds.")
    elif S.head_only:
        lines.append("The head-only row trains just the classification head (the encoder frozen) on the same batches "
                     "with the LoRA learning rate; it shows how much of the accuracy comes from adapting the encoder.")
    return "\n".join(lines)


REPRODUCTION = LoraReproduction
run = LoraReproduction.run
