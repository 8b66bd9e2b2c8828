"""Reproduction of PSOFT on the embedded MiniLM, against PEFT's LoRA, PiSSA, OFT and PEFT's own PSOFT.

Setting (spec "Reproduction at small scale"; shared with the CDKA reproduction, see
:mod:`rankwise.repro.cdka`): pretrained all-MiniLM-L6-v2 + a linear head on mean-pooled tokens, the
seeded 4-class "negated sentiment x topic" task (2 000 train / 1 000 test, at most 16 tokens, batch
16), adapters on the four square 384 x 384 attention matrices (``query``, ``key``, ``value``,
``attention.output.dense``) of the top ``top_layers`` layers (the frozen layers below are cached).
Every model is trained with the shared loop in lock step on the same batches.

Rows at (about) equal per-matrix trainable budget (head excluded; exact counts in the table):

* **PSOFT (rankwise)**: ``PSOFTConfig(r=38, cayley="exact")``: 703 + 76 = 779 parameters, the Cayley
  map solved exactly (the method's definition, PEFT's default);
* **PSOFT (PEFT)**: ``peft.PsoftConfig(r=38)`` (exact Cayley; ``psoft_alpha = r``, which PSOFT's update
  does not depend on), the side-by-side twin;
* **PSOFT Neumann t=5 (rankwise)** (full mode): the spec's default configuration, the Cayley map by
  the truncated Neumann series, which is accurate only while ``||Q|| < 1``;
* **PSOFT orth only (rankwise)** (full mode): exact Cayley without the relaxation vectors (703), the
  strictly orthogonal ablation;
* **LoRA (PEFT)**: ``r=1`` (768), ``lora_alpha=2``;
* **PiSSA (PEFT)**: ``LoraConfig(r=1, init_lora_weights="pissa")`` (768);
* **LoRA-XS** (full mode): rankwise PSOFT with ``orth=False`` and no vectors, ``r=27`` (729);
* **OFT (PEFT)**: ``OFTConfig(oft_block_size=6)`` (960, the block size closest to the budget; block 4
  gives 576);
* **head only** (full mode): frozen encoder, trained head.

Learning rates: the spec's (:data:`LRS`): 5e-3 for PSOFT's core and 1e-3 for LoRA; rows the spec does not
rate take the rate of the parametrisation they share (OFT, LoRA-XS and the PSOFT variants 5e-3, PiSSA 1e-3);
the head trains at 1e-3 in every row. (Until issue 14 they came from :func:`lr_sweep`, which gave LoRA the
grid's lowest rate and PSOFT six times the spec's; see docs/methods/psoft.md.)
What runs is :class:`PsoftSettings` (``SETTINGS[mode]``; ``rankwise reproduce psoft --set steps=30``): the
model, targets, data and probe sizes, steps, rows, the ranks of PSOFT, LoRA/PiSSA and LoRA-XS, OFT's block
size and the learning rates.

Measured: test accuracy; *semantic preservation* = mean cosine similarity between the pretrained and
the fine-tuned mean-pooled embeddings of 300 probe sentences (standard-library docstrings from the zoo
corpus, "eval" then "calib" splits); the orthogonality error ``||M^T M - I||_F`` of PSOFT over training; and, side by
side with PEFT's PSOFT, the outputs at initialisation, the outputs after copying rankwise's trained
core into PEFT's layers, and the training-step time ratio.

Checks: (a) PSOFT mean accuracy >= LoRA's - 0.5 point and >= OFT's - 0.5 point (qualitative at this
scale; ``claim`` checks, paired over the test sentences); (b) PSOFT's semantic-preservation cosine >= LoRA's
and >= PiSSA's + 0.02 at *matched training loss* (``claim`` checks, paired over the probe sentences): every
``match_every`` steps PSOFT, LoRA and PiSSA are evaluated on ``n_match`` fixed training sentences (mean
cross-entropy) and on the probe set; the matched level is the higher of the two rows' final losses, and each
row's per-sentence cosines are taken where its loss first reaches that level (linear interpolation between
checkpoints). Comparing cosines after equal steps instead measures how far each row travelled, which a row
at a lower learning rate wins by not training; (c) rankwise's PSOFT computes PEFT's PSOFT: max |logit difference| <= 1e-5 at
initialisation and <= 1e-4 after the trained core is copied across (``wiring`` checks).

Preconditions (they can only move the verdict to ``inconclusive``): PSOFT stays near-orthogonal
(``||M^T M - I||_F / sqrt(r) <= 0.10`` at every measured step: the claim's geometry argument needs an
orthogonal transform, and at six times the spec's rate M drifted far from it); each matched comparison is
between fine-tuned models (matched loss <= half the initial loss); the task does not saturate (not every row of (a) at >= 99 % test accuracy, the design's
"within a point of 100 %") and LoRA and OFT learned (test accuracy above chance 1/4 by more than 0.10, the
floor the LoRA reproduction uses).
"""

from __future__ import annotations

import copy
import dataclasses
import statistics
import warnings
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
from torch import nn

from rankwise.adapt import psoft
from rankwise.repro.cdka import LABELS, TARGETS, negation_task
from rankwise.repro.kit.cached_encoder import (
    CachedSplit,
    FrozenPrefix,
    TopModel,
    batch_indices,
    evaluate_cached,
    median_step_ms,
    peft_inject,
    sweep_val_accuracy,
    pooled_cached,
    trainable_adapter_params,
    train_lockstep,
)
from rankwise.repro.result import ClaimCheck, Precondition, Table
from rankwise.repro.kit.minilm import MiniLMReproduction
from rankwise.repro.skeleton import Records, Settings, pyplot, save_figure, setting

ID = "psoft"
CLAIM = ("Confining an orthogonal transform (with two relaxation vectors) to the principal subspace of each weight "
         "fine-tunes about as well as LoRA and OFT at the same parameter budget while preserving the pretrained "
         "model's geometry, hence its representations, better than LoRA and PiSSA.")

R_PSOFT, T_NEUMANN = 38, 5
R_LORA, ALPHA_LORA = 1, 2.0
R_XS = 27
OFT_BLOCK = 6
LR_HEAD = 1e-3
ALWAYS = ("PSOFT (rankwise)", "PSOFT (PEFT)")
ROWS = ALWAYS + ("PSOFT Neumann t=5 (rankwise)", "PSOFT orth only (rankwise)", "LoRA (PEFT)", "PiSSA (PEFT)",
                 "LoRA-XS", "OFT (PEFT)", "head only")
# (adapter lr, head lr) per row: the spec's rates (issue 14). The spec names two: 5e-3 for PSOFT's core and
# 1e-3 for LoRA. A row the spec does not rate takes the rate of the parametrisation it shares: every PSOFT
# variant, LoRA-XS (PSOFT's r x r core without the Cayley map) and OFT (a Cayley-parametrised orthogonal
# transform, like PSOFT's core) 5e-3; PiSSA (LoRA's factors, SVD-initialised) 1e-3. The head trains at 1e-3
# in every row (head only included), so no row's head is tuned differently from another's.
# Until issue 14 the rates came from lr_sweep() (validation accuracy at 60 steps): it gave LoRA 1e-4 (the
# grid's lowest; LoRA then barely moves and its cosine to the pretrained model is 1.000 by not training) and
# PSOFT 3e-2, six times the spec's rate, where M is far from orthogonal. That made claim (b) a measure of
# distance travelled; (b) is now compared at matched training loss (see _matched) with near-orthogonality
# as a precondition, and lr_sweep stays available for a documented sweep with equal effort for every row.
LR_PSOFT, LR_LORA = 5e-3, 1e-3
LRS: tuple[tuple[str, float, float], ...] = (
    ("PSOFT (rankwise)", LR_PSOFT, LR_HEAD),
    ("PSOFT (PEFT)", LR_PSOFT, LR_HEAD),
    ("PSOFT Neumann t=5 (rankwise)", LR_PSOFT, LR_HEAD),
    ("PSOFT orth only (rankwise)", LR_PSOFT, LR_HEAD),
    ("LoRA (PEFT)", LR_LORA, LR_HEAD),
    ("PiSSA (PEFT)", LR_LORA, LR_HEAD),
    ("LoRA-XS", LR_PSOFT, LR_HEAD),
    ("OFT (PEFT)", LR_PSOFT, LR_HEAD),
    ("head only", LR_HEAD, LR_HEAD),
)
COMPARED = ("LoRA (PEFT)", "PiSSA (PEFT)", "OFT (PEFT)")


@dataclasses.dataclass(frozen=True, kw_only=True)
class PsoftSettings(Settings):
    """What the PSOFT reproduction runs; ``SETTINGS[mode]`` holds each mode's values."""

    model: str = setting("all-MiniLM-L6-v2", "the pretrained encoder (zoo.minilm)", choices=("all-MiniLM-L6-v2",))
    targets: tuple[str, ...] = setting(TARGETS, "adapted module names of the top layers")
    n_train: int = setting(2000, "training sentences (a multiple of 4)", lo=4)
    n_test: int = setting(1000, "test sentences (a multiple of 4)", lo=4)
    n_probe: int = setting(300, "probe sentences of the semantic-preservation cosine", lo=1)
    top_layers: int = setting(2, "adapted top encoder layers (the layers below are cached)", lo=1, hi=6)
    steps: int = setting(60, "training steps of every row (the same batches)", lo=1)
    batch_size: int = setting(16, "sentences per step", lo=1)
    max_length: int = setting(16, "tokens per sentence", lo=1)
    rows: tuple[str, ...] | None = setting(COMPARED, "rows trained besides both PSOFTs (None: all)")
    r_psoft: int = setting(R_PSOFT, "PSOFT rank r (r(r-1)/2 + 2r parameters per matrix)", lo=1)
    r_lora: int = setting(R_LORA, "LoRA and PiSSA rank (alpha = 2 r)", lo=1)
    r_xs: int = setting(R_XS, "LoRA-XS rank (r^2 parameters per matrix)", lo=1)
    oft_block: int = setting(OFT_BLOCK, "OFT block size", lo=2)
    lrs: tuple[tuple[str, float, float], ...] = setting(LRS, "(row, adapter lr, head lr) per row (the spec's "
                                                             "rates; see LRS)")
    orth_every: int = setting(10, "steps between orthogonality-error measurements", lo=1)
    match_every: int = setting(10, "steps between the checkpoints of claim (b)'s matched-loss comparison (loss on "
                                  "the match set and probe cosines of PSOFT, LoRA and PiSSA)", lo=1)
    n_match: int = setting(128, "training sentences whose mean loss is the matched quantity of claim (b)", lo=1)

    def validate(self) -> None:
        if self.n_train % 4 or self.n_test % 4:
            raise ValueError(f"PsoftSettings.n_train and n_test must be multiples of 4, got {self.n_train}, "
                             f"{self.n_test}")
        if self.n_match > self.n_train:
            raise ValueError(f"PsoftSettings.n_match must be <= n_train ({self.n_train}), got {self.n_match}")
        unknown = [r for r in (self.rows or ()) if r not in ROWS]
        if unknown:
            raise ValueError(f"PsoftSettings.rows must be among {ROWS}, got {unknown}")
        if self.rows is not None and not set(COMPARED) <= set(self.rows):
            raise ValueError(f"PsoftSettings.rows must include the compared rows {COMPARED}, got {self.rows}")
        missing = [r for r in (self.rows or ROWS) + ALWAYS if r not in {x[0] for x in self.lrs}]
        if missing:
            raise ValueError(f"PsoftSettings.lrs has no learning rate for {missing}")


SETTINGS: dict[str, PsoftSettings] = {
    "smoke": PsoftSettings(n_train=96, n_test=64, n_probe=32, n_match=32, top_layers=1, steps=3, rows=None,
                           match_every=1),
    # LoRA, PiSSA, OFT + both PSOFTs; one seed, as the spec's quick mode (the claims' intervals come from the 1 000
    # test and 300 probe sentences)
    "quick": PsoftSettings(seeds=(0,)),
    "full": PsoftSettings(top_layers=6, steps=150, rows=None),
}
ACC_SLACK = -0.005       # (a) PSOFT >= LoRA - 0.5 pt and >= OFT - 0.5 pt
COS_MARGIN_PISSA = 0.02  # (b) PSOFT >= PiSSA + 0.02 (at matched training loss)
# precondition (issue 14, stated before the first run with the spec's rates): PSOFT's transform stays near
# orthogonal, i.e. the RMS entry of M^T M - I, ||M^T M - I||_F / sqrt(r), is <= 0.10 at every measured step
# (mean over layers; max over steps and seeds); the claim's geometry argument needs it
NEAR_ORTH = 0.10
# precondition: the matched loss level of (b) is at most half the initial loss (both rows fine-tuned, not one
# fine-tuned and one barely moved)
MATCH_MAX_FRACTION = 0.5
MATCHED = ("LoRA (PEFT)", "PiSSA (PEFT)")  # compared with PSOFT (rankwise) at matched training loss
TOL_INIT, TOL_TRANSPLANT = 1e-5, 1e-4
SATURATED = 0.99         # precondition: not every row of (a) at >= 99 % test accuracy (within a point of 100 %)
MIN_ABOVE_CHANCE = 0.10  # precondition: LoRA's and OFT's accuracy - chance (1/4) > 0.10


def probe_sentences(n: int) -> list[str]:
    """``n`` distinct docstring sentences (the first sentence, >= 4 words, of each document of the zoo
    corpus' "eval" split, then of its "calib" split)."""
    from rankwise import zoo

    out: list[str] = []
    c = zoo.corpus()
    for doc in c.split("eval") + c.split("calib"):
        first = " ".join(doc.text.split()).split(". ")[0]
        if len(first.split()) >= 4 and first not in out:
            out.append(first)
        if len(out) == n:
            return out
    raise RuntimeError(f"the corpus' eval and calib splits have only {len(out)} usable sentences, {n} asked")


def _peft_psoft_pairs(ours: nn.Module, theirs: nn.Module) -> list[tuple[Any, Any]]:
    pairs = [(layer, theirs.get_submodule(name)) for name, layer in psoft.psoft_layers(ours)]
    if any("default" not in getattr(p, "psoft_R", {}) for _, p in pairs):
        raise RuntimeError("PEFT did not adapt the same modules as rankwise")
    return pairs


@torch.no_grad()
def transplant(pairs: list[tuple[Any, Any]]) -> None:
    """Give PEFT's PSOFT layers rankwise's frozen factors and trained core (PEFT's B is ours / scaling)."""
    for layer, other in pairs:
        core = layer.psoft["default"]
        s = other.scaling["default"]
        other._set_psoft_ab_cache_buffers("default", core.A.clone(), core.B.clone() / s)
        R = other.psoft_R["default"]
        R.weight.copy_(core.q)
        R.vector_a.copy_(core.alpha)
        R.vector_b.copy_(core.beta)


def _orth_error(model: nn.Module) -> float:
    rows = psoft.orthogonality_report(model)
    return statistics.fmean(r["orth_error"] for r in rows)


@torch.no_grad()
def _peft_orth_error(model: nn.Module) -> float:
    errs = []
    for m in model.modules():
        R = getattr(m, "psoft_R", None)
        if isinstance(R, nn.ModuleDict) and "default" in R:
            M = R["default"].get_matrix().double()
            errs.append(float(torch.linalg.matrix_norm(M.T @ M - torch.eye(M.shape[0], dtype=M.dtype))))
    return statistics.fmean(errs)


def _build_models(base: TopModel, S: PsoftSettings, rows: Sequence[str] | None = None) -> dict[str, nn.Module]:
    """The compared models (only ``rows`` if given, both PSOFTs always), fresh copies of ``base``; every one
    starts at the base model's function. Ranks, block size and targets come from ``S``."""
    import peft

    def want(row: str) -> bool:
        return rows is None or row in rows or row in ALWAYS

    T = S.targets
    alpha_lora = ALPHA_LORA / R_LORA * S.r_lora

    def ours(cfg: psoft.PSOFTConfig) -> nn.Module:
        m = psoft.adapt(copy.deepcopy(base), cfg, target=T)
        for p in m.classifier.parameters():
            p.requires_grad_(True)
        return m

    builders: dict[str, Callable[[], nn.Module]] = {
        "PSOFT (rankwise)": lambda: ours(psoft.PSOFTConfig(r=S.r_psoft, cayley="exact", target=T)),
        "PSOFT (PEFT)": lambda: peft_inject(copy.deepcopy(base), peft.PsoftConfig(
            r=S.r_psoft, psoft_alpha=S.r_psoft, use_cayley_neumann=False, target_modules=list(T))),
        "PSOFT Neumann t=5 (rankwise)": lambda: ours(psoft.PSOFTConfig(r=S.r_psoft, cayley="neumann",
                                                                       neumann_terms=T_NEUMANN, target=T)),
        "PSOFT orth only (rankwise)": lambda: ours(psoft.PSOFTConfig(r=S.r_psoft, cayley="exact", train_alpha=False,
                                                                     train_beta=False, target=T)),
        "LoRA (PEFT)": lambda: peft_inject(copy.deepcopy(base), peft.LoraConfig(
            r=S.r_lora, lora_alpha=alpha_lora, target_modules=list(T))),
        "PiSSA (PEFT)": lambda: peft_inject(copy.deepcopy(base), peft.LoraConfig(
            r=S.r_lora, lora_alpha=alpha_lora, init_lora_weights="pissa", target_modules=list(T))),
        "LoRA-XS": lambda: ours(psoft.PSOFTConfig(r=S.r_xs, orth=False, train_alpha=False, train_beta=False,
                                                  target=T)),
        "OFT (PEFT)": lambda: peft_inject(copy.deepcopy(base), peft.OFTConfig(
            r=0, oft_block_size=S.oft_block, target_modules=list(T))),
        "head only": lambda: _head_only(base),
    }
    return {row: build() for row, build in builders.items() if want(row)}


def _head_only(base: TopModel) -> nn.Module:
    model = copy.deepcopy(base)
    for p in model.parameters():
        p.requires_grad_(False)
    for p in model.classifier.parameters():
        p.requires_grad_(True)
    return model


COLUMNS = ["test accuracy", "semantic cosine", "matched loss (b)", "cosine @ matched loss", "PSOFT cosine @ matched loss",
           "trainable params / matrix", "final train loss", "median step (ms)", "final orth error",
           "step-time ratio vs PEFT PSOFT"]
COLUMN_NOTES = {"semantic cosine": "mean cosine(pretrained, fine-tuned) sentence embedding of the probe set, after "
                                   "training (equal steps; not claim (b)'s quantity)",
                "matched loss (b)": "claim (b): the loss on the match set (training sentences) that both this row "
                                    "and PSOFT (rankwise) reached (the higher of their final losses)",
                "cosine @ matched loss": "this row's probe cosine where it first reaches the matched loss",
                "PSOFT cosine @ matched loss": "PSOFT (rankwise)'s probe cosine where it first reaches the same loss",
                "final orth error": "mean over layers of ||M^T M - I||_F after training"}


def _lrs(S: PsoftSettings, names: Sequence[str]) -> dict[str, tuple[float, float]]:
    table = {row: (a, h) for row, a, h in S.lrs}
    return {name: table[name] for name in names}


def _measure(seed: int, S: PsoftSettings, bert: nn.Module, tok: Any, probes: list[str]) -> dict[str, Any]:
    """One seed: the seed's table fragment, its side-by-side record and the per-example values of the checks."""
    table = Table(columns=list(COLUMNS), notes=dict(COLUMN_NOTES))
    train, test = negation_task(seed, S.n_train, S.n_test)
    prefix = FrozenPrefix(bert, tok, len(bert.encoder.layer) - S.top_layers, S.max_length)
    idx = batch_indices(len(train), S.steps, S.batch_size, seed)
    batches = CachedSplit(prefix, train, [idx]).batches(idx)
    te = CachedSplit(prefix, test, keep_all=True)
    h_te, m_te, y_te = te.hidden, te.mask, te.labels
    h_pr, m_pr = prefix.encode(probes)
    base = TopModel(bert, S.top_layers, len(LABELS), seed)
    emb0 = pooled_cached(base, h_pr, m_pr)
    models = _build_models(base, S, S.rows)
    # claim (b) at matched training loss: checkpoints of PSOFT, LoRA and PiSSA (loss on a fixed set of training
    # sentences, per-probe-sentence cosines); evaluation only, so training is unchanged
    ma = CachedSplit(prefix, train[:S.n_match], keep_all=True)
    ckpt: dict[str, list[tuple[int, float, list[float]]]] = {r: [] for r in ("PSOFT (rankwise)",) + MATCHED}

    def snapshot(step: int) -> None:
        for r, points in ckpt.items():
            _, lg = evaluate_cached(models[r], ma.hidden, ma.mask, ma.labels)
            cos = nn.functional.cosine_similarity(pooled_cached(models[r], h_pr, m_pr), emb0, dim=-1)
            points.append((step, float(nn.functional.cross_entropy(lg.double(), ma.labels)), cos.double().tolist()))

    snapshot(0)

    _, logits_rw0 = evaluate_cached(models["PSOFT (rankwise)"], h_te, m_te, y_te)
    _, logits_pm0 = evaluate_cached(models["PSOFT (PEFT)"], h_te, m_te, y_te)
    _, logits_base = evaluate_cached(base, h_te, m_te, y_te)
    init_diff = float((logits_rw0 - logits_pm0).abs().max())
    init_vs_base = float((logits_rw0 - logits_base).abs().max())

    orth_curve: dict[str, list[tuple[int, float]]] = {"rankwise": [(0, _orth_error(models["PSOFT (rankwise)"]))],
                                                      "PEFT": [(0, _peft_orth_error(models["PSOFT (PEFT)"]))]}

    neumann = "PSOFT Neumann t=5 (rankwise)"
    if neumann in models:
        orth_curve["rankwise Neumann t=5"] = [(0, _orth_error(models[neumann]))]

    def track(i: int, _: dict[str, float]) -> None:
        if (i + 1) % S.match_every == 0 or i + 1 == len(batches):
            snapshot(i + 1)
        if (i + 1) % S.orth_every == 0 or i + 1 == len(batches):
            orth_curve["rankwise"].append((i + 1, _orth_error(models["PSOFT (rankwise)"])))
            orth_curve["PEFT"].append((i + 1, _peft_orth_error(models["PSOFT (PEFT)"])))
            if neumann in models:
                orth_curve["rankwise Neumann t=5"].append((i + 1, _orth_error(models[neumann])))

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", UserWarning)
        trainers = train_lockstep(models, batches, seed, _lrs(S, list(models)), callback=track)
    neumann_warnings = sum("truncated Neumann series" in str(w.message) for w in caught)

    n_matrices = len(psoft.psoft_layers(models["PSOFT (rankwise)"]))
    correct: dict[str, list[float]] = {}
    cosines: dict[str, list[float]] = {}
    for row, model in models.items():
        acc, logits = evaluate_cached(model, h_te, m_te, y_te)
        cos_each = nn.functional.cosine_similarity(pooled_cached(model, h_pr, m_pr), emb0, dim=-1)
        cos = float(cos_each.mean())
        correct[row] = (logits.argmax(-1) == y_te).double().tolist()
        cosines[row] = cos_each.double().tolist()
        table.add(row, "test accuracy", acc)
        table.add(row, "semantic cosine", cos)
        table.add(row, "trainable params / matrix", trainable_adapter_params(model) / n_matrices)
        table.add(row, "final train loss", statistics.fmean(trainers[row].losses[-max(1, len(batches) // 5):]))
        table.add(row, "median step (ms)", median_step_ms(trainers[row]))
    table.add("PSOFT (rankwise)", "final orth error", orth_curve["rankwise"][-1][1])
    table.add("PSOFT (PEFT)", "final orth error", orth_curve["PEFT"][-1][1])
    if neumann in models:
        table.add(neumann, "final orth error", orth_curve["rankwise Neumann t=5"][-1][1])
    matched: dict[str, dict[str, Any]] = {}
    for other in MATCHED:
        matched[other] = _matched(ckpt["PSOFT (rankwise)"], ckpt[other])
        m = matched[other]
        table.add(other, "matched loss (b)", m["level"])
        table.add(other, "cosine @ matched loss", statistics.fmean(m["cos_other"]))
        table.add(other, "PSOFT cosine @ matched loss", statistics.fmean(m["cos_psoft"]))
    t_rw, t_pm = trainers["PSOFT (rankwise)"].step_times[1:], trainers["PSOFT (PEFT)"].step_times[1:]
    ratios = [a / b for a, b in zip(t_rw, t_pm) if b > 0]
    ratio = statistics.median(ratios) if ratios else float("nan")
    table.add("PSOFT (rankwise)", "step-time ratio vs PEFT PSOFT", ratio)

    # rankwise's trained core, copied into PEFT's PSOFT, must give the same outputs
    pairs = _peft_psoft_pairs(models["PSOFT (rankwise)"], models["PSOFT (PEFT)"])
    transplant(pairs)
    _, logits_rw = evaluate_cached(models["PSOFT (rankwise)"], h_te, m_te, y_te)
    with torch.no_grad():
        models["PSOFT (PEFT)"].classifier.load_state_dict(models["PSOFT (rankwise)"].classifier.state_dict())
    _, logits_pm = evaluate_cached(models["PSOFT (PEFT)"], h_te, m_te, y_te)
    transplant_diff = float((logits_rw - logits_pm).abs().max())
    info = {
        "init_logit_diff_vs_peft": init_diff, "init_logit_diff_vs_base": init_vs_base,
        "transplant_logit_diff": transplant_diff, "step_time_ratio": ratio, "neumann_warnings": neumann_warnings,
        "orth_curve": orth_curve, "losses": {row: t.losses for row, t in trainers.items()},
        "matched": {k: {x: v for x, v in m.items() if x not in ("cos_psoft", "cos_other")} for k, m in matched.items()},
        "match_curve": {r: [(st, loss, statistics.fmean(c)) for st, loss, c in pts] for r, pts in ckpt.items()},
        "q_norm_final": [r["q_norm"] for r in psoft.orthogonality_report(models["PSOFT (rankwise)"])],
        "q_norm_final_neumann": ([r["q_norm"] for r in psoft.orthogonality_report(models[neumann])]
                                 if neumann in models else None),
    }
    diffs = {k: [a - b for a, b in zip(m["cos_psoft"], m["cos_other"])] for k, m in matched.items()}
    return {"table": table, "info": info, "correct": correct, "cosines": cosines, "matched_diff": diffs}


def _at_level(points: Sequence[tuple[int, float, list[float]]], level: float) -> tuple[float, list[float]]:
    """``(step, per-sentence cosines)`` where the checkpoints' loss first reaches ``level``, linearly
    interpolated between the two checkpoints around the crossing (the first checkpoint if it is already there)."""
    prev = points[0]
    if prev[1] <= level:
        return float(prev[0]), list(prev[2])
    for cur in points[1:]:
        if cur[1] <= level:
            t = (prev[1] - level) / (prev[1] - cur[1])
            return prev[0] + t * (cur[0] - prev[0]), [(1 - t) * a + t * b for a, b in zip(prev[2], cur[2])]
        prev = cur
    raise AssertionError("the level is the final loss of one row, so the other reaches it or ends above it")


def _matched(psoft_pts: Sequence[tuple[int, float, list[float]]], other_pts: Sequence[tuple[int, float, list[float]]]
             ) -> dict[str, Any]:
    """PSOFT and another row compared at matched training loss: the level is the higher of their final losses
    on the match set (the lowest loss both reached by the end); each row's probe cosines where it first
    reaches that level. Without this, a row that trains less travels less and "preserves" more."""
    level = max(psoft_pts[-1][1], other_pts[-1][1])
    step_p, cos_p = _at_level(psoft_pts, level)
    step_o, cos_o = _at_level(other_pts, level)
    return {"level": level, "loss0": psoft_pts[0][1], "step_psoft": step_p, "step_other": step_o,
            "cos_psoft": cos_p, "cos_other": cos_o}


def lr_sweep(grid: Sequence[float] = (3e-4, 1e-3, 3e-3, 1e-2), seed: int = 100, mode: str = "quick",
             n_val: int = 400, rows: Sequence[str] | None = None, settings: PsoftSettings | None = None
             ) -> dict[str, dict[float, float]]:
    """Validation accuracy of every row at each adapter learning rate of ``grid`` (head at ``LR_HEAD``;
    the head-only row sweeps the head's rate) on a development seed with the settings of ``mode`` (or
    ``settings``): train on the first ``n_train - n_val`` training sentences, score the last ``n_val`` (never
    the test set). This is how :data:`LRS` was chosen, once, before the reported runs (docs/methods/psoft.md)."""
    from rankwise import zoo

    S = settings if settings is not None else SETTINGS[mode]
    bert, tok = zoo.minilm()
    pool, _ = negation_task(seed, S.n_train, S.n_test)
    train, val = pool[: len(pool) - n_val], pool[len(pool) - n_val:]
    prefix = FrozenPrefix(bert, tok, len(bert.encoder.layer) - S.top_layers, S.max_length)
    idx = batch_indices(len(train), S.steps, S.batch_size, seed)
    batches = CachedSplit(prefix, train, [idx]).batches(idx)
    va = CachedSplit(prefix, val, keep_all=True)
    base = TopModel(bert, S.top_layers, len(LABELS), seed)

    def fit(lr: float) -> dict[str, Any]:
        models = _build_models(base, S, rows)
        if rows is not None:
            models = {k: v for k, v in models.items() if k in rows}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            train_lockstep(models, batches, seed, {n: (lr, lr if n == "head only" else LR_HEAD) for n in models})
        return models

    return sweep_val_accuracy(grid, fit, va)


class PsoftReproduction(MiniLMReproduction):
    id = ID
    claim = CLAIM
    settings = SETTINGS
    columns = COLUMNS
    column_notes = COLUMN_NOTES

    def measure(self, settings: PsoftSettings, seed: int) -> dict[str, Any]:
        if not hasattr(self, "_probes"):  # one probe set shared by every seed
            self._probes = probe_sentences(settings.n_probe)
        bert, tok = self.minilm()  # one load shared by every seed
        return _measure(seed, settings, bert, tok, self._probes)

    def preconditions(self, settings: PsoftSettings, records: Records[dict]) -> list[Precondition]:
        acc = {r: self._table.mean(r, "test accuracy") for r in ("PSOFT (rankwise)", "LoRA (PEFT)", "OFT (PEFT)")}
        chance = 1.0 / len(LABELS)
        orth = max(v for r in records for _, v in r["info"]["orth_curve"]["rankwise"]) / settings.r_psoft ** 0.5
        return [
            Precondition("PSOFT (rankwise) stays near-orthogonal: max over measured steps and seeds of the mean over "
                         "layers of ||M^T M - I||_F / sqrt(r)", orth, "<=", NEAR_ORTH),
            *[Precondition(f"(b) PSOFT and {o} both fine-tuned: matched loss / initial loss, max over seeds",
                           max(r["info"]["matched"][o]["level"] / r["info"]["matched"][o]["loss0"] for r in records),
                           "<=", MATCH_MAX_FRACTION) for o in MATCHED],
            Precondition("the task does not saturate: min over PSOFT, LoRA and OFT of mean test accuracy",
                         min(acc.values()), "<", SATURATED),
            Precondition("LoRA (PEFT) learned: mean test accuracy - chance (1/4)", acc["LoRA (PEFT)"] - chance, ">",
                         MIN_ABOVE_CHANCE),
            Precondition("OFT (PEFT) learned: mean test accuracy - chance (1/4)", acc["OFT (PEFT)"] - chance, ">",
                         MIN_ABOVE_CHANCE),
        ]

    def checks(self, settings: PsoftSettings, records: Records[dict]) -> list[ClaimCheck]:
        acc = {r: self._table.mean(r, "test accuracy") for r in self._table.rows}
        per = [r["info"] for r in records]

        def paired(key: str, other: str) -> list[list[float]]:
            return [[a - b for a, b in zip(r[key]["PSOFT (rankwise)"], r[key][other])] for r in records]

        def mean_of(samples: list[list[float]]) -> float:
            return statistics.fmean(statistics.fmean(s) for s in samples)

        cos_lora = [r["matched_diff"]["LoRA (PEFT)"] for r in records]
        cos_pissa = [r["matched_diff"]["PiSSA (PEFT)"] for r in records]
        return [
            ClaimCheck("(a) test accuracy PSOFT - LoRA (PEFT, equal budget), mean over seeds",
                       acc["PSOFT (rankwise)"] - acc["LoRA (PEFT)"], ">=", ACC_SLACK, unit="acc",
                       samples=paired("correct", "LoRA (PEFT)")),
            ClaimCheck("(a) test accuracy PSOFT - OFT (PEFT, closest budget), mean over seeds",
                       acc["PSOFT (rankwise)"] - acc["OFT (PEFT)"], ">=", ACC_SLACK, unit="acc",
                       samples=paired("correct", "OFT (PEFT)")),
            ClaimCheck("(b) semantic-preservation cosine PSOFT - LoRA (PEFT) at matched training loss, mean over "
                       "probe sentences and seeds", mean_of(cos_lora), ">=", 0.0, samples=cos_lora),
            ClaimCheck("(b) semantic-preservation cosine PSOFT - PiSSA (PEFT) at matched training loss, mean over "
                       "probe sentences and seeds", mean_of(cos_pissa), ">=", COS_MARGIN_PISSA, samples=cos_pissa),
            ClaimCheck("(c) max |logit diff| rankwise PSOFT vs PEFT PSOFT at initialisation",
                       max(s["init_logit_diff_vs_peft"] for s in per), "<=", TOL_INIT, kind="wiring"),
            ClaimCheck("(c) max |logit diff| after copying rankwise's trained core into PEFT's PSOFT",
                       max(s["transplant_logit_diff"] for s in per), "<=", TOL_TRANSPLANT, kind="wiring"),
        ]

    def figures(self, settings: PsoftSettings, records: Records[dict], out_dir: Path) -> list[str]:
        return _figures(self._table, {str(s): r["info"] for s, r in records.items()}, out_dir)

    def notes(self, settings: PsoftSettings, records: Records[dict]) -> str:
        S = settings
        ratio = statistics.median(r["info"]["step_time_ratio"] for r in records)
        return (
            f"MiniLM top {S.top_layers} layer(s) adapted ({', '.join(S.targets)}; lower layers cached), "
            f"{S.steps} steps of batch {S.batch_size}; AdamW, linear schedule, the spec's learning rates (PSOFT core "
            "5e-3, LoRA 1e-3; unrated rows the rate of the parametrisation they share; head 1e-3 everywhere). Claim (b) "
            f"compares probe cosines at matched training loss (checkpoints every {S.match_every} steps, loss on "
            f"{S.n_match} training sentences), not after equal steps. The PSOFT rows compared in the "
            "claims use the exact Cayley map (the method's definition and PEFT's default); the spec's default, the "
            "truncated Neumann series with t = 5 terms, is accurate only while ||Q|| < 1; where ||Q|| passes 1 "
            "(rankwise warns) the series stops being orthogonal: see the 'PSOFT Neumann t=5' row and its "
            "orthogonality error in full mode. PSOFT puts "
            "the singular values on the output side (B = U S, A = V^T, rows of A orthonormal), the PSOFT authors' "
            "reading as in PEFT's psoft_init; with the same frozen factors rankwise and PEFT compute the same function "
            f"(claim c). Median training-step time ratio rankwise / PEFT PSOFT (lock-stepped, same batches): "
            f"{ratio:.3f}. Semantic preservation compares mean-pooled final hidden states (the encoder's sentence "
            f"embedding, not the head) on {S.n_probe} standard-library docstring sentences, which the task never "
            "shows; its checks are paired over those sentences. BOFT is not run: its smallest configuration on a "
            "384 x 384 layer (block 2) has 1 152 trainable parameters, 48 % over the budget. Claim (a) depends on "
            "training at small scale and is qualitative.")

    def config(self, settings: PsoftSettings, records: Records[dict]) -> dict[str, Any]:
        S = settings
        return {"neumann_terms": T_NEUMANN,
                "params_per_matrix": {"PSOFT": psoft.num_parameters(S.r_psoft), "LoRA": S.r_lora * 768,
                                      "PiSSA": S.r_lora * 768, "LoRA-XS": S.r_xs * S.r_xs,
                                      "OFT": 384 * (S.oft_block - 1) // 2}}

    def extra(self, settings: PsoftSettings, records: Records[dict]) -> dict[str, Any]:
        return {"seeds": {str(s): r["info"] for s, r in records.items()}}


def _figures(table: Table, seeds: dict[str, Any], out_dir: Path) -> list[str]:
    plt = pyplot()
    rows = list(table.rows)
    fig, ax = plt.subplots(1, 3, figsize=(15, 4))
    for k, (col, title) in enumerate((("test accuracy", "test accuracy"),
                                      ("semantic cosine", "semantic preservation (cosine to pretrained)"))):
        means = [table.mean(r, col) for r in rows]
        ax[k].barh(rows, means, xerr=[table.std(r, col) for r in rows], color=["tab:red" if "PSOFT" in r else
                                                                             "tab:blue" for r in rows])
        ax[k].set_xlim(max(0.0, min(means) - 0.05), 1.0)
        ax[k].set_title(title)
    for seed, s in seeds.items():
        for impl, curve in s["orth_curve"].items():
            ax[2].plot([c[0] for c in curve], [c[1] for c in curve], marker=".",
                       label=f"{impl} seed {seed}")
    ax[2].set_xlabel("step")
    ax[2].set_ylabel("mean ||M^T M - I||_F")
    ax[2].set_title("PSOFT drift from orthogonality")
    ax[2].legend(fontsize=7)
    fig.tight_layout()
    return [save_figure(fig, out_dir / "psoft_accuracy_preservation.png", dpi=120)]


REPRODUCTION = PsoftReproduction
run = PsoftReproduction.run
