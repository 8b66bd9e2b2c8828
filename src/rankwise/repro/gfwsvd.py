"""Reproduction of GFWSVD (spec ``shared/methods/gfwsvd.md``) on the real all-MiniLM-L6-v2.

Task: sentence pairs ``(s_i, s_{i+1})`` of one docstring paragraph of the standard-library corpus
(:func:`rankwise.zoo.corpus`). Loss (for the gradients and the evaluation): in-batch contrastive
cross-entropy of ``cos(a_i, b_j) / 0.05`` with the partner as the label (mean-pooled, normalised
embeddings, as sentence-transformers computes them). Calibration pairs come from the corpus's
``calib`` modules (the seed draws them); evaluation pairs from the disjoint ``eval`` and ``train``
modules (a fixed draw, the same for every seed). Metrics on the evaluation pairs: increase of the
contrastive loss over all evaluation pairs at once, top-1 pair-retrieval accuracy among them, mean
cosine to the original embeddings.

Rows at the same uniform ranks ``floor(rho m n / (m + n))`` (``rho`` = kept fraction): GFWSVD (MFF
Kronecker factors), FWSVD (row Fisher from the same per-sample gradients), plain SVD, SVD-LLM(W),
ASVD, and the K-FAC-factor ablation, all from the same calibration batches and loss. Each seed runs
ONE forward/backward pass (:func:`~rankwise.compress.gfwsvd.collect_sample_factors`) whose per-sample
gradient factors ``(X_s, D_s)`` give GFWSVD's MFF factors and the K-FAC ablation
(:func:`~rankwise.compress.gfwsvd.factors_from_samples`), FWSVD's row Fisher
(``fisher='sample'``, applied with the FWSVD method's own defaults) and the input statistics of the
same tokens that SVD-LLM(W), ASVD and plain SVD read through :func:`rankwise.compress.compress`
(:func:`~rankwise.compress.gfwsvd.layer_stats_from_samples`, a ``Calibration``). GFWSVD is applied by
:func:`~rankwise.compress.gfwsvd.gfwsvd_compress` (the documented factor re-use path; identical to
``compress(..., method="gfwsvd")``, which the unit tests check), so the same factors serve both
ratios and the per-layer predicted-increase check. The original model's embeddings of the fixed
evaluation pairs are computed once; every model embeds the pairs once, in length-sorted batches
tokenised once (less padding, same embeddings).

Quick: 32 calibration pairs, ``T = 5``, the 12 FFN linears, ``rho = 0.3``, 256 evaluation pairs, rows
GFWSVD / FWSVD / SVD / SVD-LLM(W) (the claims' rows). Full: 128 calibration pairs, ``T = 10``, all 36
linears, ``rho`` in {0.5, 0.3}, 512 evaluation pairs, plus ASVD and the K-FAC ablation at ``rho = 0.3``.
Smoke: 8 pairs, two FFN linears, ``T = 2``, 32 evaluation pairs. MFF contractions run in float32 in
quick and full (summed in float64) to fit the time budgets.
"""

from __future__ import annotations

import copy
import random
import time
from pathlib import Path
from typing import Any, Sequence

import torch
from torch import nn

from rankwise.compress.gfwsvd import (GFWSVDConfig, collect_sample_factors, factors_from_samples, gfwsvd_compress,
                                      kronecker_whiteners, layer_stats_from_samples)
from rankwise.compress.pipeline import Calibration, CompressConfig, compress
from rankwise.core.errors import NumericalError
from rankwise.core.layers import LowRankLinear
from rankwise.repro.result import MODES, ClaimCheck, ReproResult, Table, environment

ID = "gfwsvd"
CLAIM = ("GFWSVD's Kronecker-factored Fisher weighting loses less task performance than diagonal FWSVD and plain "
         "SVD at the same ranks (keep 30%: held-out loss increase <= 0.9x FWSVD's and <= 0.8x SVD's, retrieval "
         "accuracy >= FWSVD + 1 point) and stays close to SVD-LLM(W).")

GF, FW, SVD, SVDLLM, ASVD, KFAC = ("GFWSVD", "FWSVD", "SVD", "SVD-LLM(W)", "ASVD", "K-FAC factors (ablation)")
TEMP = 0.05
EVAL_SEED = 12345
MAX_LEN = 64
FFN = "re:.*layer\\.\\d+\\.(intermediate\\.dense|output\\.dense)"


def docstring_pairs(split: str) -> list[tuple[str, str]]:
    """Unique consecutive-sentence pairs ``(s_i, s_{i+1})`` within one paragraph of the split's docstrings."""
    from rankwise import zoo
    from rankwise.repro.saes_svd import docstring_sentences

    seen: dict[tuple[str, str], None] = {}
    for d in zoo.corpus().split(split):
        for para in docstring_sentences(d.text):
            for a, b in zip(para, para[1:]):
                seen.setdefault((a, b), None)
    return list(seen)


def _sizes(mode: str) -> dict[str, Any]:
    if mode == "smoke":
        return {"n_calib": 8, "n_eval": 32, "iters": 2, "ratios": [0.3], "target": "re:.*layer\\.0\\.(intermediate|output)\\.dense",
                "batch": 8, "extra_rows": True}
    if mode == "quick":
        return {"n_calib": 32, "n_eval": 256, "iters": 5, "ratios": [0.3], "target": FFN, "batch": 32, "extra_rows": False}
    return {"n_calib": 128, "n_eval": 512, "iters": 10, "ratios": [0.5, 0.3], "target": None, "batch": 32,
            "extra_rows": True}


def _pair_batches(tok: Any, pairs: Sequence[tuple[str, str]], bs: int) -> list[dict[str, torch.Tensor]]:
    """Each batch holds the ``a`` sentences then the ``b`` sentences of ``bs`` pairs (one padded call)."""
    out = []
    for i in range(0, len(pairs), bs):
        chunk = pairs[i:i + bs]
        texts = [a for a, _ in chunk] + [b for _, b in chunk]
        out.append(dict(tok(texts, padding=True, truncation=True, max_length=MAX_LEN, return_tensors="pt")))
    return out


def sentence_embeddings(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Normalised mean-pooled (non-padding tokens) last hidden states, ``(batch, hidden)``."""
    h = model(**batch).last_hidden_state
    m = batch["attention_mask"].unsqueeze(-1).to(h.dtype)
    return nn.functional.normalize((h * m).sum(1) / m.sum(1).clamp_min(1.0), dim=-1)


def pair_forward(model: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Normalised mean-pooled embeddings of the ``a`` half and the ``b`` half of a pair batch."""
    e = sentence_embeddings(model, batch)
    B = e.shape[0] // 2
    return e[:B], e[B:]


def contrastive_loss(out: tuple[torch.Tensor, torch.Tensor], batch: Any = None) -> torch.Tensor:
    """In-batch contrastive cross-entropy of ``cos(a_i, b_j) / 0.05`` with label ``j = i``."""
    ea, eb = out
    logits = ea @ eb.mT / TEMP
    return nn.functional.cross_entropy(logits, torch.arange(ea.shape[0], device=ea.device))


class _EvalSet:
    """The evaluation sentences (all ``a`` then all ``b``), tokenised once into length-sorted batches.

    Sorting by token length only removes padding (about half of the padded tokens of the unsorted
    evaluation set): every sentence's embedding is the same masked mean as in :func:`rankwise.zoo.embed`
    (up to float rounding), so the metrics do not change, only their cost.
    """

    def __init__(self, tok: Any, pairs: Sequence[tuple[str, str]], batch_size: int = 32):
        texts = [a for a, _ in pairs] + [b for _, b in pairs]
        self.n_pairs = len(pairs)
        lengths = [len(ids) for ids in tok(texts, truncation=True, max_length=MAX_LEN)["input_ids"]]
        order = sorted(range(len(texts)), key=lambda i: lengths[i])
        self.batches: list[tuple[torch.Tensor, dict[str, torch.Tensor]]] = []
        for i in range(0, len(order), batch_size):
            idx = order[i:i + batch_size]
            enc = tok([texts[j] for j in idx], padding=True, truncation=True, max_length=MAX_LEN, return_tensors="pt")
            self.batches.append((torch.tensor(idx), dict(enc)))


@torch.no_grad()
def _evaluate(model: nn.Module, ev: _EvalSet) -> tuple[torch.Tensor, torch.Tensor]:
    """Normalised mean-pooled embeddings ``(a, b)`` (each ``n_pairs x hidden``) of the evaluation pairs."""
    was_training = model.training
    model.eval()
    try:
        parts = [(idx, sentence_embeddings(model, enc).float()) for idx, enc in ev.batches]
    finally:
        model.train(was_training)
    hidden = parts[0][1].shape[1]
    emb = torch.empty(2 * ev.n_pairs, hidden)
    for idx, e in parts:
        emb[idx] = e
    if not bool(torch.isfinite(emb).all()):
        raise NumericalError("the model produced non-finite embeddings on the evaluation pairs")
    return emb[:ev.n_pairs], emb[ev.n_pairs:]


def _metrics(e: tuple[torch.Tensor, torch.Tensor], ref: tuple[torch.Tensor, torch.Tensor]) -> dict[str, float]:
    ea, eb = e
    logits = ea @ eb.mT / TEMP
    labels = torch.arange(ea.shape[0])
    return {"loss": float(nn.functional.cross_entropy(logits, labels)),
            "acc": float((logits.argmax(1) == labels).double().mean()),
            "cos": float(torch.cat([(ea * ref[0]).sum(1), (eb * ref[1]).sum(1)]).mean())}


def run(mode: str, seeds: Sequence[int], out_dir: Path) -> ReproResult:
    """Run the reproduction (module docstring) and return its :class:`ReproResult`."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    seeds = [int(s) for s in seeds]
    if not seeds:
        raise ValueError("seeds must be a non-empty sequence of ints")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    from rankwise import zoo

    sz = _sizes(mode)
    fp, tok = zoo.minilm()
    calib_pool = docstring_pairs("calib")
    eval_pool = docstring_pairs("eval") + docstring_pairs("train")
    if len(calib_pool) < sz["n_calib"] or len(eval_pool) < sz["n_eval"]:
        raise RuntimeError(f"the corpus has {len(calib_pool)} calibration / {len(eval_pool)} evaluation pairs, fewer "
                           f"than the {sz['n_calib']} / {sz['n_eval']} this mode needs")
    eval_pairs = random.Random(EVAL_SEED).sample(eval_pool, sz["n_eval"])
    ev = _EvalSet(tok, eval_pairs)
    ref = _evaluate(fp, ev)  # the original model once: the evaluation pairs do not depend on the seed
    base = _metrics(ref, ref)

    cols = []
    for r in sz["ratios"]:
        cols += [f"loss increase @{r}", f"retrieval acc @{r}", f"cosine @{r}"]
    cols += ["seconds"]
    table = Table(columns=cols, notes={
        **{f"loss increase @{r}": f"held-out contrastive loss minus the original's ({base['loss']:.4f}), keep {r:.0%}; "
           "lower is better" for r in sz["ratios"]},
        **{f"retrieval acc @{r}": f"top-1 pair retrieval among {sz['n_eval']} held-out pairs (original "
           f"{base['acc']:.4f}); higher is better" for r in sz["ratios"]},
        **{f"cosine @{r}": "mean cosine to the original embeddings" for r in sz["ratios"]},
        "seconds": "calibration + decomposition, all ratios; the one shared forward/backward pass per seed is counted "
                   "in full for GFWSVD, FWSVD and K-FAC (each needs it), SVD-LLM(W)/ASVD count the extraction of "
                   "their input statistics from it, plain SVD needs none"})
    pred_wins: list[bool] = []
    pred_rows: list[dict[str, Any]] = []
    mff_info: list[dict[str, Any]] = []
    svd_cache: dict[float, tuple[dict[str, float], float, Any]] = {}
    gcfg = GFWSVDConfig(power_iters=sz["iters"], compute_dtype=torch.float32 if mode != "smoke" else torch.float64)
    targets = _selector(fp, sz["target"])
    for seed in seeds:
        calib_pairs = random.Random(seed).sample(calib_pool, sz["n_calib"])
        batches = _pair_batches(tok, calib_pairs, sz["batch"])
        secs: dict[str, float] = {}
        # ONE forward + backward pass per seed: GFWSVD's per-sample gradient factors (X_s, D_s) of every target;
        # FWSVD's row Fisher, the K-FAC ablation and the activation baselines' input statistics come from them
        t0 = time.perf_counter()
        samples = collect_sample_factors(fp, batches, contrastive_loss, target=targets, forward=pair_forward,
                                         compute_dtype=gcfg.compute_dtype)
        t_pass = time.perf_counter() - t0
        _check_tokens(samples, batches)
        t0 = time.perf_counter()
        fac = factors_from_samples(samples, gcfg, row_fisher=False)
        secs[GF] = t_pass + time.perf_counter() - t0
        t0 = time.perf_counter()
        rowf = {k: sf.row_fisher() / sf.samples for k, sf in samples.items()}  # FWSVD, fisher='sample'
        secs[FW] = t_pass + time.perf_counter() - t0
        for k, v in rowf.items():
            fac[k].row_fisher = v
        kfac = None
        if sz["extra_rows"]:
            t0 = time.perf_counter()
            kfac = factors_from_samples(samples, GFWSVDConfig(approximation="kfac"), row_fisher=False)
            secs[KFAC] = t_pass + time.perf_counter() - t0
        t0 = time.perf_counter()
        cal = Calibration(stats=layer_stats_from_samples(samples), kinds=("input_cov", "input_abs_mean"),
                          n_batches=len(batches))
        t_stats = time.perf_counter() - t0
        del samples
        mff_info.append({k: {"iters": f.iters, "converged": f.converged, "sigma": f.sigma} for k, f in fac.items()})
        for ratio in sz["ratios"]:
            lowrank: dict[str, dict[str, tuple[torch.Tensor, torch.Tensor]]] = {}
            rows = [GF, FW, SVD, SVDLLM] + ([KFAC, ASVD] if sz["extra_rows"] and ratio == sz["ratios"][-1] else [])
            for row in rows:
                if row == SVD and ratio in svd_cache:  # plain SVD does not depend on the calibration draw
                    m, s_svd, lr_svd = svd_cache[ratio]
                    for key, val in (("loss increase", m["loss"] - base["loss"]), ("retrieval acc", m["acc"]),
                                     ("cosine", m["cos"])):
                        table.add(row, f"{key} @{ratio}", val)
                    secs[row] = secs.get(row, 0.0) + s_svd
                    if lr_svd is not None:
                        lowrank[row] = lr_svd
                    continue
                model = copy.deepcopy(fp)
                t0 = time.perf_counter()
                if row in (GF, KFAC):
                    gfwsvd_compress(model, fac if row == GF else kfac, GFWSVDConfig(param_ratio=ratio))  # type: ignore[arg-type]
                elif row == FW:
                    _fwsvd_compress(model, rowf, ratio)
                else:
                    method = {SVD: "svd", SVDLLM: "svd-llm", ASVD: "asvd"}[row]
                    compress(model, CompressConfig(method=method, ratio=ratio, measure_error=False), target=list(fac),
                             mode="whole", calibration=cal)  # (the output-error report is not used here)
                    if row != SVD:
                        secs[row] = secs.get(row, 0.0) + t_stats
                dt = time.perf_counter() - t0
                secs[row] = secs.get(row, 0.0) + dt
                m = _metrics(_evaluate(model, ev), ref)
                table.add(row, f"loss increase @{ratio}", m["loss"] - base["loss"])
                table.add(row, f"retrieval acc @{ratio}", m["acc"])
                table.add(row, f"cosine @{ratio}", m["cos"])
                if row in (GF, FW, SVD) and ratio == sz["ratios"][-1]:
                    lowrank[row] = {}
                    for name in fac:
                        lay = model.get_submodule(name)
                        assert isinstance(lay, LowRankLinear)
                        lowrank[row][name] = (lay.up.weight.detach().double(), lay.down.weight.detach().double())
                if row == SVD:
                    svd_cache[ratio] = (m, dt, lowrank.get(SVD))
                del model
            if ratio == sz["ratios"][-1]:
                for name, f in fac.items():
                    W = fp.get_submodule(name).weight.detach().double()
                    L_P, L_Q = kronecker_whiteners(f.P, f.Q, damping=gcfg.damping, name=name)
                    Wt = L_Q.mT @ W @ L_P
                    # 1/2 ||L_Q^T (W - A B) L_P||^2 with the low-rank product kept factored (exact, cheaper)
                    pred = {row: 0.5 * float((Wt - (L_Q.mT @ lowrank[row][name][0]) @ (lowrank[row][name][1] @ L_P))
                                             .square().sum()) for row in (GF, FW, SVD)}
                    pred_wins.append(pred[GF] <= min(pred[FW], pred[SVD]))
                    pred_rows.append({"layer": name, "seed": seed, **pred})
            del lowrank
        del cal
        for row, s in secs.items():
            table.add(row, "seconds", s)

    r = sz["ratios"][-1]
    li = lambda row: table.mean(row, f"loss increase @{r}")  # noqa: E731
    acc = lambda row: table.mean(row, f"retrieval acc @{r}")  # noqa: E731
    checks = [
        ClaimCheck(f"keep {r}: held-out loss increase of GFWSVD / FWSVD", li(GF) / li(FW), "<=", 0.9, unit="x"),
        ClaimCheck(f"keep {r}: held-out loss increase of GFWSVD / plain SVD", li(GF) / li(SVD), "<=", 0.8, unit="x"),
        ClaimCheck(f"keep {r}: retrieval accuracy of GFWSVD minus FWSVD", acc(GF) - acc(FW), ">=", 0.01),
        ClaimCheck(f"keep {r}: retrieval accuracy of GFWSVD minus SVD-LLM(W) (qualitative at this scale)",
                   acc(GF) - acc(SVDLLM), ">=", -0.02),
        ClaimCheck("fraction of layers where the predicted increase 1/2||L_Q^T dW L_P||^2 of GFWSVD is <= that of "
                   "FWSVD and SVD", sum(pred_wins) / len(pred_wins), ">=", 0.8),
    ]
    figures = _figures(out_dir, table, sz["ratios"], pred_rows)
    conv = [v["converged"] for mi in mff_info for v in mi.values()]
    notes = (
        f"Gradients of the in-batch contrastive loss (temperature {TEMP}) on {sz['n_calib']} calibration pairs per "
        f"seed, batches of {sz['batch']} pairs; a sample is one sentence (the a and b halves of a batch are one "
        "padded call), so G_s is the part of the batch gradient flowing through that sentence's tokens. One "
        "forward/backward pass per seed serves every method: GFWSVD's MFF, FWSVD's row Fisher (row sums of the same "
        "per-sample squared gradients, fisher='sample'), the K-FAC ablation, and the input statistics (X^T X, "
        "mean |x|) of SVD-LLM(W), ASVD and the pipeline's error report over the same (all non-padding) tokens. "
        "MFF: Q0 = I/sqrt(m), "
        f"T = {sz['iters']} power iterations (early stop at relative change 1e-6; "
        f"{sum(conv)}/{len(conv)} layer factorisations converged), contractions in "
        f"{str(gcfg.compute_dtype).replace('torch.', '')} summed in float64; damping 1e-4 * mean diag. Evaluation "
        f"pairs ({sz['n_eval']}) come from modules disjoint from the calibration modules (the corpus's eval split, "
        "topped up from its train split because the eval split alone has fewer consecutive-sentence pairs). "
        "The per-layer predicted increase uses the same Kronecker factors for every method, so GFWSVD wins it by "
        "construction on the calibration data; the held-out metrics are the real test.")
    result = ReproResult(
        id=ID, mode=mode, seeds=seeds, claim=CLAIM, table=table, checks=checks, figures=figures, notes=notes,
        config={"model": "all-MiniLM-L6-v2", "targets": sz["target"] or "all 36 linears",
                "n_calib_pairs": sz["n_calib"], "n_eval_pairs": sz["n_eval"], "power_iters": sz["iters"],
                "kept_ratios": sz["ratios"], "temperature": TEMP, "max_length": MAX_LEN, "damping": gcfg.damping,
                "original_eval": base},
        wall_time_s=time.perf_counter() - t_start, environment=environment(seeds),
        extra={"predicted_increase": pred_rows, "mff": mff_info})
    result.save(out_dir)
    return result


def _check_tokens(samples: dict[str, Any], batches: Sequence[dict[str, torch.Tensor]]) -> None:
    """The shared pass keeps the tokens with a non-zero output gradient; the activation statistics derived
    from it are those of all non-padding tokens only when every such token got a gradient (checked)."""
    want = sum(int(b["attention_mask"].sum()) for b in batches)
    off = {k: sf.tokens for k, sf in samples.items() if sf.tokens != want}
    if off:
        raise RuntimeError(f"layers {list(off)[:5]} received output gradients on {list(off.values())[:5]} tokens, "
                           f"not on all {want} non-padding tokens; their input statistics would miss tokens")


def _fwsvd_compress(model: nn.Module, row_fisher: dict[str, torch.Tensor], ratio: float) -> None:
    """FWSVD (``fisher='sample'``) of every layer in ``row_fisher``, in place, all or nothing.

    The same computation as ``compress(model, CompressConfig("fwsvd", ratio, options={"fisher": "sample"}))``
    (the method's own defaults, uniform ranks) with the row Fisher taken from the shared per-sample gradients
    instead of a second backward pass (the unit tests check both equalities).
    """
    from rankwise.compress.base import uniform_rank
    from rankwise.compress.svd_baselines import fwsvd_factors
    from rankwise.core.surgery import replace_module, transaction

    meth = CompressConfig(method="fwsvd", ratio=ratio, options={"fisher": "sample"}).build_method()
    new = {}
    for name, f in row_fisher.items():
        lay = model.get_submodule(name)
        assert isinstance(lay, nn.Linear)
        m, n = lay.weight.shape
        fw = fwsvd_factors(lay.weight, f, uniform_rank(m, n, ratio), floor=meth.floor, balance=meth.balance,
                           dtype=meth.compute_dtype, name=name)
        new[name] = LowRankLinear.from_linear(lay, factors=(fw.B, fw.A))
    with transaction(model):
        for name, layer in new.items():
            replace_module(model, name, layer)


def _selector(model: nn.Module, target: str | None) -> Any:
    """Exact names of the targets: a pattern's linears, or every linear inside the encoder blocks."""
    from rankwise.compress.pipeline import resolve_targets

    return [n for n, _ in resolve_targets(model, target)]


def _figures(out_dir: Path, table: Table, ratios: Sequence[float], pred_rows: list[dict[str, Any]]) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    files = []
    rows = [r for r in (GF, KFAC, FW, SVDLLM, ASVD, SVD) if r in table.rows]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    width = 0.8 / len(ratios)
    for j, ratio in enumerate(ratios):
        xs = [i + j * width for i in range(len(rows))]
        axes[0].bar(xs, [table.mean(r, f"loss increase @{ratio}") for r in rows], width, label=f"keep {ratio}")
        axes[1].bar(xs, [table.mean(r, f"retrieval acc @{ratio}") for r in rows], width, label=f"keep {ratio}")
    for ax, title in zip(axes, ("held-out contrastive loss increase (lower is better)",
                                "pair-retrieval accuracy (higher is better)")):
        ax.set_xticks([i + width * (len(ratios) - 1) / 2 for i in range(len(rows))])
        ax.set_xticklabels(rows, rotation=30, ha="right", fontsize=8)
        ax.set_title(title, fontsize=9)
        ax.legend(fontsize=8)
        ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(out_dir / "task_metrics.png", dpi=110)
    plt.close(fig)
    files.append("task_metrics.png")

    if pred_rows:
        fig, ax = plt.subplots(figsize=(6, 4))
        g = [max(p[GF], 1e-30) for p in pred_rows]
        for row, mk in ((FW, "o"), (SVD, "s")):
            ax.scatter(g, [max(p[row], 1e-30) for p in pred_rows], marker=mk, s=16, label=row)
        lo, hi = min(g), max(max(p[FW], p[SVD]) for p in pred_rows)
        ax.plot([lo, hi], [lo, hi], color="grey", lw=0.8, ls="--")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("GFWSVD predicted increase 1/2||L_Q^T dW L_P||^2")
        ax.set_ylabel("baseline predicted increase")
        ax.set_title("per-layer predicted loss increase (above the diagonal: GFWSVD lower)", fontsize=9)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out_dir / "predicted_increase.png", dpi=110)
        plt.close(fig)
        files.append("predicted_increase.png")
    return files
