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

Learning rates: every row gets its best rate from the same grid, chosen once by :func:`lr_sweep` on a
development seed with a validation split (:data:`LRS`); the head trains at 1e-3 in every adapter row.

Measured: test accuracy; *semantic preservation* = mean cosine similarity between the pretrained and
the fine-tuned mean-pooled embeddings of 300 probe sentences (standard-library docstrings from the zoo
corpus, "eval" then "calib" splits); the orthogonality error ``||M^T M - I||_F`` of PSOFT over training; and, side by
side with PEFT's PSOFT, the outputs at initialisation, the outputs after copying rankwise's trained
core into PEFT's layers, and the training-step time ratio.

Claims: (a) PSOFT mean accuracy >= LoRA's - 0.5 point and >= OFT's - 0.5 point (qualitative at this
scale); (b) PSOFT's semantic-preservation cosine >= LoRA's and >= PiSSA's + 0.02; (c) rankwise's PSOFT
computes PEFT's PSOFT: max |logit difference| <= 1e-5 at initialisation and <= 1e-4 after the trained
core is copied across.
"""

from __future__ import annotations

import copy
import statistics
import time
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
    pooled_cached,
    trainable_adapter_params,
    train_lockstep,
)
from rankwise.repro.result import MODES, ClaimCheck, ReproResult, Table, environment

ID = "psoft"
CLAIM = ("Confining an orthogonal transform (with two relaxation vectors) to the principal subspace of each weight "
         "fine-tunes about as well as LoRA and OFT at the same parameter budget while preserving the pretrained "
         "model's geometry, hence its representations, better than LoRA and PiSSA.")

R_PSOFT, T_NEUMANN = 38, 5
R_LORA, ALPHA_LORA = 1, 2.0
R_XS = 27
OFT_BLOCK = 6
LR_HEAD = 1e-3
# (adapter lr, head lr) per row and mode, chosen by lr_sweep() on a development seed (see docs/methods/psoft.md).
# quick: grid {1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2} (+ 1e-1 where the best was at the upper edge), seed 100,
# quick settings, 400 validation sentences; best validation accuracy: PSOFT exact Cayley 0.990 @3e-2 (PEFT's
# PSOFT computes the same function and trains at the same rate), PSOFT Neumann t=5 (rankwise and PEFT alike)
# 0.845 @1e-2, LoRA r=1 0.673 @1e-4, PiSSA 0.680 @1e-3, LoRA-XS 0.985 @3e-2, OFT 0.998 @1e-1,
# head only 0.865 @1e-1 (grid edge; the head's own rate).
# full: the quick-mode rates (no separate sweep was run at the full settings; a per-mode table so one can be added).
LRS: dict[str, dict[str, tuple[float, float]]] = {
    "quick": {
        "PSOFT (rankwise)": (3e-2, LR_HEAD),
        "PSOFT (PEFT)": (3e-2, LR_HEAD),
        "PSOFT Neumann t=5 (rankwise)": (1e-2, LR_HEAD),
        "PSOFT orth only (rankwise)": (3e-2, LR_HEAD),
        "LoRA (PEFT)": (1e-4, LR_HEAD),
        "PiSSA (PEFT)": (1e-3, LR_HEAD),
        "LoRA-XS": (3e-2, LR_HEAD),
        "OFT (PEFT)": (1e-1, LR_HEAD),
        "head only": (1e-1, 1e-1),
    },
}
LRS["smoke"] = LRS["quick"]
LRS["full"] = LRS["quick"]
SETTINGS: dict[str, dict[str, Any]] = {
    "smoke": dict(n_train=96, n_test=64, n_probe=32, top_layers=1, steps=3, batch_size=16, max_length=16),
    "quick": dict(n_train=2000, n_test=1000, n_probe=300, top_layers=2, steps=60, batch_size=16, max_length=16,
                  rows=("LoRA (PEFT)", "PiSSA (PEFT)", "OFT (PEFT)")),  # + both PSOFTs
    "full": dict(n_train=2000, n_test=1000, n_probe=300, top_layers=6, steps=150, batch_size=16, max_length=16),
}
ACC_SLACK = -0.005       # (a) PSOFT >= LoRA - 0.5 pt and >= OFT - 0.5 pt
COS_MARGIN_PISSA = 0.02  # (b) PSOFT >= PiSSA + 0.02
TOL_INIT, TOL_TRANSPLANT = 1e-5, 1e-4
ORTH_EVERY = 10


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


def _build_models(base: TopModel, rows: Sequence[str] | None = None) -> dict[str, nn.Module]:
    """The compared models (only ``rows`` if given, both PSOFTs always), fresh copies of ``base``; every one
    starts at the base model's function."""
    import peft

    def want(row: str) -> bool:
        return rows is None or row in rows or row in ("PSOFT (rankwise)", "PSOFT (PEFT)")

    def ours(cfg: psoft.PSOFTConfig) -> nn.Module:
        m = psoft.adapt(copy.deepcopy(base), cfg, target=TARGETS)
        for p in m.classifier.parameters():
            p.requires_grad_(True)
        return m

    builders: dict[str, Callable[[], nn.Module]] = {
        "PSOFT (rankwise)": lambda: ours(psoft.PSOFTConfig(r=R_PSOFT, cayley="exact", target=TARGETS)),
        "PSOFT (PEFT)": lambda: peft_inject(copy.deepcopy(base), peft.PsoftConfig(
            r=R_PSOFT, psoft_alpha=R_PSOFT, use_cayley_neumann=False, target_modules=list(TARGETS))),
        "PSOFT Neumann t=5 (rankwise)": lambda: ours(psoft.PSOFTConfig(r=R_PSOFT, cayley="neumann",
                                                                       neumann_terms=T_NEUMANN, target=TARGETS)),
        "PSOFT orth only (rankwise)": lambda: ours(psoft.PSOFTConfig(r=R_PSOFT, cayley="exact", train_alpha=False,
                                                                     train_beta=False, target=TARGETS)),
        "LoRA (PEFT)": lambda: peft_inject(copy.deepcopy(base), peft.LoraConfig(
            r=R_LORA, lora_alpha=ALPHA_LORA, target_modules=list(TARGETS))),
        "PiSSA (PEFT)": lambda: peft_inject(copy.deepcopy(base), peft.LoraConfig(
            r=R_LORA, lora_alpha=ALPHA_LORA, init_lora_weights="pissa", target_modules=list(TARGETS))),
        "LoRA-XS": lambda: ours(psoft.PSOFTConfig(r=R_XS, orth=False, train_alpha=False, train_beta=False,
                                                  target=TARGETS)),
        "OFT (PEFT)": lambda: peft_inject(copy.deepcopy(base), peft.OFTConfig(
            r=0, oft_block_size=OFT_BLOCK, target_modules=list(TARGETS))),
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


def _run_seed(seed: int, S: dict[str, Any], bert: nn.Module, tok: Any, probes: list[str], table: Table,
              extra: dict[str, Any]) -> None:
    train, test = negation_task(seed, S["n_train"], S["n_test"])
    prefix = FrozenPrefix(bert, tok, len(bert.encoder.layer) - S["top_layers"], S["max_length"])
    idx = batch_indices(len(train), S["steps"], S["batch_size"], seed)
    batches = CachedSplit(prefix, train, [idx]).batches(idx)
    te = CachedSplit(prefix, test, keep_all=True)
    h_te, m_te, y_te = te.hidden, te.mask, te.labels
    h_pr, m_pr = prefix.encode(probes)
    base = TopModel(bert, S["top_layers"], len(LABELS), seed)
    emb0 = pooled_cached(base, h_pr, m_pr)
    models = _build_models(base, S.get("rows"))

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
        if (i + 1) % ORTH_EVERY == 0 or i + 1 == len(batches):
            orth_curve["rankwise"].append((i + 1, _orth_error(models["PSOFT (rankwise)"])))
            orth_curve["PEFT"].append((i + 1, _peft_orth_error(models["PSOFT (PEFT)"])))
            if neumann in models:
                orth_curve["rankwise Neumann t=5"].append((i + 1, _orth_error(models[neumann])))

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", UserWarning)
        trainers = train_lockstep(models, batches, seed, {name: S["lrs"][name] for name in models}, callback=track)
    neumann_warnings = sum("truncated Neumann series" in str(w.message) for w in caught)

    n_matrices = len(psoft.psoft_layers(models["PSOFT (rankwise)"]))
    for row, model in models.items():
        acc, _ = evaluate_cached(model, h_te, m_te, y_te)
        cos = float(nn.functional.cosine_similarity(pooled_cached(model, h_pr, m_pr), emb0, dim=-1).mean())
        table.add(row, "test accuracy", acc)
        table.add(row, "semantic cosine", cos)
        table.add(row, "trainable params / matrix", trainable_adapter_params(model) / n_matrices)
        table.add(row, "final train loss", statistics.fmean(trainers[row].losses[-max(1, len(batches) // 5):]))
        table.add(row, "median step (ms)", median_step_ms(trainers[row]))
    table.add("PSOFT (rankwise)", "final orth error", orth_curve["rankwise"][-1][1])
    table.add("PSOFT (PEFT)", "final orth error", orth_curve["PEFT"][-1][1])
    if neumann in models:
        table.add(neumann, "final orth error", orth_curve["rankwise Neumann t=5"][-1][1])
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
    extra.setdefault("seeds", {})[str(seed)] = {
        "init_logit_diff_vs_peft": init_diff, "init_logit_diff_vs_base": init_vs_base,
        "transplant_logit_diff": transplant_diff, "step_time_ratio": ratio, "neumann_warnings": neumann_warnings,
        "orth_curve": orth_curve, "losses": {row: t.losses for row, t in trainers.items()},
        "q_norm_final": [r["q_norm"] for r in psoft.orthogonality_report(models["PSOFT (rankwise)"])],
        "q_norm_final_neumann": ([r["q_norm"] for r in psoft.orthogonality_report(models[neumann])]
                                 if neumann in models else None),
    }


def lr_sweep(grid: Sequence[float] = (3e-4, 1e-3, 3e-3, 1e-2), seed: int = 100, mode: str = "quick",
             n_val: int = 400, rows: Sequence[str] | None = None) -> dict[str, dict[float, float]]:
    """Validation accuracy of every row at each adapter learning rate of ``grid`` (head at ``LR_HEAD``;
    the head-only row sweeps the head's rate) on a development seed with the settings of ``mode``: train on the first
    ``n_train - n_val`` training sentences, score the last ``n_val`` (never the test set). This is how
    :data:`LRS` was chosen, once, before the reported runs (docs/methods/psoft.md)."""
    from rankwise import zoo

    S = SETTINGS[mode]
    bert, tok = zoo.minilm()
    pool, _ = negation_task(seed, S["n_train"], S["n_test"])
    train, val = pool[: len(pool) - n_val], pool[len(pool) - n_val:]
    prefix = FrozenPrefix(bert, tok, len(bert.encoder.layer) - S["top_layers"], S["max_length"])
    idx = batch_indices(len(train), S["steps"], S["batch_size"], seed)
    batches = CachedSplit(prefix, train, [idx]).batches(idx)
    va = CachedSplit(prefix, val, keep_all=True)
    base = TopModel(bert, S["top_layers"], len(LABELS), seed)
    out: dict[str, dict[float, float]] = {}
    for lr in grid:
        models = _build_models(base, rows)
        if rows is not None:
            models = {k: v for k, v in models.items() if k in rows}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            train_lockstep(models, batches, seed, {n: (lr, lr if n == "head only" else LR_HEAD) for n in models})
        for row, model in models.items():
            out.setdefault(row, {})[lr] = evaluate_cached(model, va.hidden, va.mask, va.labels)[0]
    return out


def _figures(table: Table, extra: dict[str, Any], out_dir: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = list(table.rows)
    fig, ax = plt.subplots(1, 3, figsize=(15, 4))
    for k, (col, title) in enumerate((("test accuracy", "test accuracy"),
                                      ("semantic cosine", "semantic preservation (cosine to pretrained)"))):
        means = [table.mean(r, col) for r in rows]
        ax[k].barh(rows, means, xerr=[table.std(r, col) for r in rows], color=["tab:red" if "PSOFT" in r else
                                                                             "tab:blue" for r in rows])
        ax[k].set_xlim(max(0.0, min(means) - 0.05), 1.0)
        ax[k].set_title(title)
    for seed, s in extra["seeds"].items():
        for impl, curve in s["orth_curve"].items():
            ax[2].plot([c[0] for c in curve], [c[1] for c in curve], marker=".",
                       label=f"{impl} seed {seed}")
    ax[2].set_xlabel("step")
    ax[2].set_ylabel("mean ||M^T M - I||_F")
    ax[2].set_title("PSOFT drift from orthogonality")
    ax[2].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out_dir / "psoft_accuracy_preservation.png", dpi=120)
    plt.close(fig)
    return ["psoft_accuracy_preservation.png"]


def run(mode: str, seeds: Sequence[int], out_dir: Path) -> ReproResult:
    """Run the PSOFT reproduction in ``mode`` ("smoke", "quick", "full") over ``seeds``; see the module docstring."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    seeds = list(seeds)
    if not seeds:
        raise ValueError("seeds must not be empty")
    from rankwise import zoo

    t0 = time.perf_counter()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    S = dict(SETTINGS[mode], lrs=LRS[mode])
    bert, tok = zoo.minilm()
    probes = probe_sentences(S["n_probe"])
    table = Table(columns=["test accuracy", "semantic cosine", "trainable params / matrix", "final train loss",
                           "median step (ms)", "final orth error", "step-time ratio vs PEFT PSOFT"],
                  notes={"semantic cosine": "mean cosine(pretrained, fine-tuned) sentence embedding of the probe set",
                         "final orth error": "mean over layers of ||M^T M - I||_F after training"})
    extra: dict[str, Any] = {}
    for seed in seeds:
        _run_seed(seed, S, bert, tok, probes, table, extra)

    acc = {r: table.mean(r, "test accuracy") for r in table.rows}
    cos = {r: table.mean(r, "semantic cosine") for r in table.rows}
    per = extra["seeds"].values()
    checks = [
        ClaimCheck("(a) test accuracy PSOFT - LoRA (PEFT, equal budget), mean over seeds",
                   acc["PSOFT (rankwise)"] - acc["LoRA (PEFT)"], ">=", ACC_SLACK, unit="acc"),
        ClaimCheck("(a) test accuracy PSOFT - OFT (PEFT, closest budget), mean over seeds",
                   acc["PSOFT (rankwise)"] - acc["OFT (PEFT)"], ">=", ACC_SLACK, unit="acc"),
        ClaimCheck("(b) semantic-preservation cosine PSOFT - LoRA (PEFT)", cos["PSOFT (rankwise)"] - cos["LoRA (PEFT)"],
                   ">=", 0.0),
        ClaimCheck("(b) semantic-preservation cosine PSOFT - PiSSA (PEFT)",
                   cos["PSOFT (rankwise)"] - cos["PiSSA (PEFT)"], ">=", COS_MARGIN_PISSA),
        ClaimCheck("(c) max |logit diff| rankwise PSOFT vs PEFT PSOFT at initialisation",
                   max(s["init_logit_diff_vs_peft"] for s in per), "<=", TOL_INIT),
        ClaimCheck("(c) max |logit diff| after copying rankwise's trained core into PEFT's PSOFT",
                   max(s["transplant_logit_diff"] for s in per), "<=", TOL_TRANSPLANT),
    ]
    ratio = statistics.median(s["step_time_ratio"] for s in per)
    figures = _figures(table, extra, out_dir)
    notes = (
        f"MiniLM top {S['top_layers']} layer(s) adapted (q, k, v, attention.output.dense; lower layers cached), "
        f"{S['steps']} steps of batch {S['batch_size']}; AdamW, linear schedule, per-method learning rates (LRS, "
        "chosen by lr_sweep on a development seed with a validation split). The PSOFT rows compared in the claims "
        "use the exact Cayley map (the method's definition and PEFT's default); the spec's default, the truncated "
        "Neumann series with t = 5 terms, is accurate only while ||Q|| < 1, and at the learning rates this short "
        "schedule needs ||Q|| passes 1 (rankwise warns), the series stops being orthogonal and training degrades: "
        "see the 'PSOFT Neumann t=5' row and its orthogonality error in full mode. PSOFT puts the singular "
        "values on the output side (B = U S, A = V^T, rows of A orthonormal), the PSOFT authors' reading as in "
        "PEFT's psoft_init; with the same frozen factors rankwise and PEFT compute the same function (claim c). "
        f"Median training-step time ratio rankwise / PEFT PSOFT (lock-stepped, same batches): {ratio:.3f}. "
        "Semantic preservation compares mean-pooled final hidden states (the encoder's sentence embedding, not the "
        "head) on 300 standard-library docstring sentences, which the task never shows. BOFT is not run: its "
        "smallest configuration on a 384 x 384 layer (block 2) has 1 152 trainable parameters, 48 % over the "
        "budget. Claim (a) depends on training at small scale and is qualitative.")
    result = ReproResult(
        id=ID, mode=mode, seeds=seeds, claim=CLAIM, table=table, checks=checks, figures=figures, notes=notes,
        config={"settings": {k: v for k, v in S.items() if k != "lrs"}, "targets": list(TARGETS), "r_psoft": R_PSOFT,
                "neumann_terms": T_NEUMANN,
                "r_lora": R_LORA, "alpha_lora": ALPHA_LORA, "r_lora_xs": R_XS, "oft_block_size": OFT_BLOCK,
                "lrs": {k: list(v) for k, v in LRS[mode].items()},
                "params_per_matrix": {"PSOFT": psoft.num_parameters(R_PSOFT), "LoRA": R_LORA * 768,
                                      "PiSSA": R_LORA * 768, "LoRA-XS": R_XS * R_XS,
                                      "OFT": 384 * (OFT_BLOCK - 1) // 2}},
        wall_time_s=time.perf_counter() - t0, environment=environment(seeds), extra=extra)
    result.save(out_dir)
    return result
