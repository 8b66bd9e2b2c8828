"""Reproduction of Swift-SVD (ICML 2026) at small scale: all-MiniLM-L6-v2 on CPU.

Setting (``shared/methods/swift_svd.md``, "Reproduction at small scale"): the real pretrained
all-MiniLM-L6-v2 (6 layers, hidden 384, FFN 1536; its 36 linears compressed); calibration sentences
from the docstrings of the calibration split of the embedded corpus, evaluation sentences from the
disjoint evaluation split (max 64 tokens); embedding = mean-pooled, L2-normalised last hidden state;
metrics: mean cosine between compressed and original embeddings on the evaluation sentences,
per-layer relative output error ``e = ||Y - X W_k^T||_F^2 / ||Y||_F^2`` on the calibration data, and
the wall-clock of the decomposition. Every method fits from the same calibration statistics (one
pass collects ``X^T X``, ``Y^T Y``, ``mean |x|`` and the Fisher rows), at the same ranks.

Checks (one :class:`~rankwise.repro.result.ClaimCheck` each, from measured numbers; 1 and the
undamped-Cholesky part of 4 are ``wiring`` checks, consequences of the optimum that only a bug can break;
the cosine comparisons carry their per-sentence paired differences, so their bootstrap intervals are
reported). Everything below is a field of :class:`SwiftSVDSettings` (``SETTINGS[mode]``;
``rankwise reproduce swift_svd --set pairs=64 rhos=0.5,0.4``):

1. per layer, Swift-SVD's ``e`` equals SVD-LLM(W)'s within 1e-4 relative and is <= plain SVD's,
   ASVD's and FWSVD's;
2. at ``rho = 0.4`` (uniform ranks), mean cosine of Swift-SVD >= plain SVD + 0.05 and >= ASVD + 0.01;
3. (full) the dynamic allocation is not worse than uniform Swift-SVD by more than 0.005 cosine;
4. (full) with 64 calibration sentences (fewer tokens than 1536: ``X^T X`` of every FFN-output layer
   is singular) Swift-SVD runs without damping and stays optimal, while an undamped Cholesky raises;
5. (full) decomposition time of the 36 layers from the accumulated statistics, each as the pipeline
   fits it (Swift-SVD's six FFN-input layers, wider at the output, through ``R H R^T``): the ratio
   ``t_SVD-LLM(W) / t_Swift`` is reported; the check is ``t_Swift <= 1.5 t_SVD-LLM(W)``.

Modes: smoke (wiring only: 8 sentence pairs, the attention layers of the first two blocks); quick
(<= 60 s: 64 calibration / 64 evaluation sentences, ``rho = 0.4``, claims 1-2; the spec's 128
evaluation sentences made the default two seeds take 47 s of single-thread CPU, and the evaluation
was the largest part that is not the methods' own cost); full (<= 10 min: 256 / 512 sentences,
``rho`` in {0.6, 0.4}, all claims). Seeds draw the calibration pairs; the evaluation sentences are one
fixed draw shared by all seeds (the original model's reference embeddings are computed once).
"""

from __future__ import annotations

import copy
import dataclasses
import math
import random
import statistics
import time
from pathlib import Path
from typing import Any, Sequence

import torch
from torch import nn

from rankwise.repro.result import ClaimCheck, Table
from rankwise.repro.skeleton import Records, Reproduction, Settings, pyplot, save_figure, setting

ID = "swift_svd"
CLAIM = ("Swift-SVD reaches the activation-aware optimum of every layer with one eigendecomposition of the "
         "output covariance (the same per-layer error as SVD-LLM(W), below plain SVD, ASVD and FWSVD), which "
         "gives higher embedding fidelity than plain SVD and ASVD at the same parameter budget, without damping "
         "and without being slower than SVD-LLM(W).")

BASELINES = ("svd", "asvd", "fwsvd", "svd-llm")
LABEL = {"svd": "plain SVD", "asvd": "ASVD", "fwsvd": "FWSVD", "svd-llm": "SVD-LLM(W)", "swift-svd": "Swift-SVD",
         "swift-dyn": "Swift-SVD + dynamic ranks"}


@dataclasses.dataclass(frozen=True, kw_only=True)
class SwiftSVDSettings(Settings):
    """What the Swift-SVD reproduction runs; ``SETTINGS[mode]`` holds each mode's values."""

    model: str = setting("all-MiniLM-L6-v2", "the model compressed (zoo.minilm)", choices=("all-MiniLM-L6-v2",))
    target: str | None = setting(None, "layers compressed: a name, glob or 're:' regex (None: every nn.Linear "
                                       "in encoder.layer)")
    pairs: int = setting(32, "calibration sentence pairs per seed (the seed draws them)", lo=1)
    eval: int = setting(64, "evaluation sentences (one fixed draw shared by all seeds)", lo=1)
    rhos: tuple[float, ...] = setting((0.4,), "compression ratios rho (0.4 is the claims' budget)", lo=0.0, hi=1.0)
    dynamic: bool = setting(False, "add Swift-SVD with dynamic rank allocation (claim 3)")
    claim4: bool = setting(False, "run claim 4 (64 calibration sentences, singular X^T X)")
    timing: bool = setting(False, "time the decompositions (claim 5)")
    max_length: int = setting(64, "tokens per sentence", lo=1)
    eval_seed: int = setting(12345, "seed of the evaluation draw (fixed across seeds)", lo=0)
    batch_pairs: int = setting(8, "pairs per calibration batch ([a_1..a_k, b_1..b_k])", lo=1)
    timing_repeats: int = setting(3, "repeats of the timing (median)", lo=1)

    def validate(self) -> None:
        if not self.rhos:
            raise ValueError("SwiftSVDSettings.rhos must hold at least one ratio")


SETTINGS: dict[str, SwiftSVDSettings] = {
    "smoke": SwiftSVDSettings(pairs=8, eval=16, target=r"re:encoder\.layer\.[01]\.attention\..*"),
    # quick: one seed, as the spec's quick mode (two seeds took 72 s on an idle 2-core machine, over the 60 s budget)
    "quick": SwiftSVDSettings(seeds=(0,)),
    "full": SwiftSVDSettings(pairs=128, eval=512, rhos=(0.6, 0.4), dynamic=True, claim4=True, timing=True),
}
# module constants of the quick mode, kept for readers of the old layout
MAX_LENGTH = SETTINGS["quick"].max_length
EVAL_SEED = SETTINGS["quick"].eval_seed
BATCH_PAIRS = SETTINGS["quick"].batch_pairs
TIMING_REPEATS = SETTINGS["quick"].timing_repeats


def _data(seed: int, n_pairs: int, n_eval: int, eval_seed: int = EVAL_SEED
          ) -> tuple[list[str], list[str], list[tuple[str, str]]]:
    """``(calibration sentences, evaluation sentences, calibration pairs)``: the seed draws the pairs; the
    evaluation draw is fixed (``eval_seed``), the same for every seed, so the original model's reference
    embeddings are computed once."""
    from rankwise.zoo.text import docstring_sentences, sentence_pairs

    pairs = sentence_pairs(docstring_sentences("calib"))
    if len(pairs) < n_pairs:
        raise RuntimeError(f"the corpus has only {len(pairs)} calibration sentence pairs, {n_pairs} needed")
    take = random.Random(seed).sample(pairs, n_pairs)
    pool = [s for ss in docstring_sentences("eval") for s in ss]
    evals = random.Random(eval_seed).sample(pool, min(n_eval, len(pool)))
    calib = [s for p in take for s in p]
    return calib, evals, take


def _batches(tokenizer: Any, pairs: Sequence[tuple[str, str]], batch_pairs: int = BATCH_PAIRS,
             max_length: int = MAX_LENGTH) -> list[dict[str, torch.Tensor]]:
    """Batches of ``batch_pairs`` pairs ``[a_1..a_8, b_1..b_8]``, the pairs taken in order of their longer
    sentence's token count (ties: draw order).

    Length order cuts the padding the forward and backward passes carry (random order: ~55% of the
    calibration tokens were padding; sorted: ~30%). The statistics sum over non-padding tokens, so only
    FWSVD's batch-squared Fisher sees the change: its in-batch negatives are pairs of similar length.
    """
    from rankwise.core.textfiles import tokenize_batches

    if not pairs:
        return []
    lengths = [len(ids) for ids in tokenizer([s for p in pairs for s in p], truncation=True,
                                            max_length=max_length)["input_ids"]]
    order = sorted(range(len(pairs)), key=lambda i: (max(lengths[2 * i], lengths[2 * i + 1]), i))
    pairs = [pairs[i] for i in order]
    out = []
    for i in range(0, len(pairs), batch_pairs):
        chunk = pairs[i:i + batch_pairs]
        out += tokenize_batches(tokenizer, [a for a, _ in chunk] + [b for _, b in chunk], 2 * len(chunk), max_length)
    return out


def _embed(model: nn.Module, tokenizer: Any, texts: Sequence[str], max_length: int = MAX_LENGTH) -> torch.Tensor:
    """Embeddings of ``texts`` (in their order), computed in batches of similar length (less padding)."""
    from rankwise import zoo

    order = sorted(range(len(texts)), key=lambda i: (len(texts[i]), i))
    emb = zoo.embed(model, tokenizer, [texts[i] for i in order], batch_size=32, max_length=max_length)
    out = torch.empty_like(emb)
    out[torch.tensor(order)] = emb
    return out


def _rel_gap(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-300)


def _exact_optimum(W: torch.Tensor, H: torch.Tensor, rank: int) -> float:
    """``sum_{i>k} lambda_i / sum_i lambda_i`` of ``W H W^T`` (the optimum, computed from ``X^T X``, not from the streamed ``Y^T Y``)."""
    W64 = W.detach().double()
    lam = torch.linalg.eigvalsh(W64 @ H.double() @ W64.mT).flip(0).clamp_min(0)
    return float(lam[rank:].sum() / lam.sum())


def _time_decompositions(model: nn.Module, cal: Any, names: Sequence[str], rho: float,
                         repeats: int = TIMING_REPEATS) -> dict[str, float]:
    """Median seconds to decompose every target from the accumulated statistics: Swift-SVD vs SVD-LLM(W)."""
    from rankwise.compress import uniform_rank
    from rankwise.compress.svd_baselines import svd_llm_factors
    from rankwise.compress.swift_svd import swift_svd_factors, swift_svd_spectrum

    layers = {n: model.get_submodule(n) for n in names}
    ranks = {n: uniform_rank(l.out_features, l.in_features, rho) for n, l in layers.items()}

    def swift() -> None:
        # as the pipeline fits it: eigh of Y^T Y where m <= n, the n x n problem R H R^T from X^T X for
        # a layer wider at the output (MiniLM's six FFN-input layers)
        for n, l in layers.items():
            if l.out_features > l.in_features:
                swift_svd_factors(l.weight, None, ranks[n], input_cov=cal.stats[n].input_cov(False))
            else:
                spec = swift_svd_spectrum(cal.stats[n].output_cov(False))
                swift_svd_factors(l.weight, None, ranks[n], spectrum=spec)

    def llm() -> None:
        for n, l in layers.items():
            svd_llm_factors(l.weight, cal.stats[n].input_cov(False), ranks[n])

    ts: dict[str, list[float]] = {"swift": [], "llm": []}
    for i in range(repeats):
        for key, fn in ((("swift", swift), ("llm", llm)) if i % 2 == 0 else (("llm", llm), ("swift", swift))):
            t0 = time.perf_counter()
            fn()
            ts[key].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in ts.items()}


def _claim4(base: nn.Module, tokenizer: Any, pairs: Sequence[tuple[str, str]], names: Sequence[str], rho: float,
            S: SwiftSVDSettings = SETTINGS["full"]) -> dict[str, Any]:
    """64 calibration sentences: singular X^T X on the FFN-output layers; undamped Cholesky vs Swift-SVD."""
    from rankwise.compress import CompressConfig, calibrate, compress
    from rankwise.train.losses import contrastive_loss
    from rankwise.core.errors import NumericalError
    from rankwise.core.linalg import damped_cholesky

    batches = _batches(tokenizer, pairs[:32], S.batch_pairs, S.max_length)
    cal = calibrate(base, batches, CompressConfig(method="svd-llm"), target=list(names),
                    extra_kinds=("output_cov", "input_abs_mean", "fisher_diag"), loss_fn=contrastive_loss)
    tokens = cal.tokens
    singular = [n for n in names if cal.stats[n].in_features > tokens]
    raised = 0
    for n in singular:
        try:
            damped_cholesky(cal.stats[n].input_cov(False), damping=0.0, name=n)
        except NumericalError:
            raised += 1
    errs: dict[str, dict[str, float]] = {}
    for meth in ("swift-svd",) + BASELINES:
        model = copy.deepcopy(base)
        rep = compress(model, CompressConfig(method=meth, ratio=rho), calibration=cal, target=list(names))
        errs[meth] = {k: float(v) for k, v in rep.layer_errors.items()}
        if meth == "swift-svd":
            ranks = rep.ranks
    opt_gap = max(_rel_gap(errs["swift-svd"][n], _exact_optimum(base.get_submodule(n).weight,
                                                                 cal.stats[n].input_cov(False), ranks[n]))
                  for n in names)
    worst = max((errs["swift-svd"][n] - errs[b][n]) / max(errs[b][n], 1e-300) for n in names for b in BASELINES)
    return {"tokens": tokens, "singular_layers": singular, "undamped_raised": raised, "opt_gap": opt_gap,
            "worst_vs_baselines": worst}


def _cosines(a: torch.Tensor, b: torch.Tensor) -> list[float]:
    """Per-sentence cosine of matching rows (their mean is :func:`rankwise.compress.job.mean_cosine`)."""
    return torch.nn.functional.cosine_similarity(a.double(), b.double(), dim=-1).tolist()


class SwiftSVDReproduction(Reproduction[SwiftSVDSettings, dict]):
    id = ID
    claim = CLAIM
    settings = SETTINGS
    threads = 1  # small matrices; on a shared 2-core machine threads only add contention

    def _prepare(self, S: SwiftSVDSettings, seed: int) -> None:
        """Once per run: the model, the target names and the original model's evaluation embeddings."""
        from rankwise import zoo
        from rankwise.compress import resolve_targets

        self.base, self.tokenizer = zoo.minilm()
        self.names = [n for n, _ in resolve_targets(self.base, S.target)]
        self.rows = ["svd", "asvd", "fwsvd", "svd-llm", "swift-svd"] + (["swift-dyn"] if S.dynamic else [])
        self.evals = _data(seed, S.pairs, S.eval, S.eval_seed)[1]
        self.ref = _embed(self.base, self.tokenizer, self.evals, S.max_length)  # once for all seeds

    def measure(self, S: SwiftSVDSettings, seed: int) -> dict[str, Any]:
        from rankwise.compress import CompressConfig, calibrate, compress
        from rankwise.compress.job import mean_cosine
        from rankwise.train.losses import contrastive_loss

        if not hasattr(self, "ref"):
            self._prepare(S, seed)
        base, tokenizer = self.base, self.tokenizer
        _, _, pairs = _data(seed, S.pairs, S.eval, S.eval_seed)
        batches = _batches(tokenizer, pairs, S.batch_pairs, S.max_length)
        cal = calibrate(base, batches, CompressConfig(method="svd-llm"), target=S.target,
                        extra_kinds=("output_cov", "input_abs_mean", "fisher_diag"), loss_fn=contrastive_loss)
        rec: dict[str, Any] = {"tokens": cal.tokens, "cos": {}, "cosines": {}, "errs": {}}
        for rho in S.rhos:
            for row in self.rows:
                meth, alloc = ("swift-svd", "dynamic") if row == "swift-dyn" else (row, "uniform")
                model = copy.deepcopy(base)
                rep = compress(model, CompressConfig(method=meth, ratio=rho, allocation=alloc), calibration=cal,
                               target=S.target)
                emb = _embed(model, tokenizer, self.evals, S.max_length)
                rec["cos"][(row, rho)] = mean_cosine(emb, self.ref)
                rec["cosines"][(row, rho)] = _cosines(emb, self.ref)
                rec["errs"][(row, rho)] = {k: float(v) for k, v in rep.layer_errors.items()}
                del model
        return rec

    def measure_joint(self, S: SwiftSVDSettings, records: Records[dict]) -> dict[str, Any]:
        joint: dict[str, Any] = {}
        if S.claim4:
            joint["claim4"] = [_claim4(self.base, self.tokenizer, _data(s, S.pairs, 1, S.eval_seed)[2], self.names,
                                       0.4, S) for s in records.seeds]
        if S.timing:
            from rankwise.compress import CompressConfig, calibrate

            cal_t = calibrate(self.base, _batches(self.tokenizer, _data(records.seeds[0], S.pairs, 1, S.eval_seed)[2],
                                                  S.batch_pairs, S.max_length),
                              CompressConfig(method="swift-svd"), target=S.target)
            joint["timing"] = _time_decompositions(self.base, cal_t, self.names, 0.4, S.timing_repeats)
        return joint

    def table(self, S: SwiftSVDSettings, records: Records[dict]) -> Table:
        columns = []
        for rho in S.rhos:
            columns += [f"cosine @ rho={rho}", f"mean layer error @ rho={rho}"]
        table = Table(columns=columns, notes={c: ("higher is better" if c.startswith("cosine") else
                                                  "e = ||Y - X W_k^T||^2 / ||Y||^2 on calibration data, mean over "
                                                  "layers") for c in columns})
        for r in records:
            for rho in S.rhos:
                for row in self.rows:
                    table.add(LABEL[row], f"cosine @ rho={rho}", r["cos"][(row, rho)])
                    table.add(LABEL[row], f"mean layer error @ rho={rho}",
                              statistics.fmean(r["errs"][(row, rho)].values()))
        return table

    def _mean_cos(self, records: Records[dict], row: str, rho: float) -> float:
        return statistics.fmean(r["cos"][(row, rho)] for r in records)

    def _paired(self, records: Records[dict], a: str, b: str, rho: float) -> list[list[float]]:
        return [[x - y for x, y in zip(r["cosines"][(a, rho)], r["cosines"][(b, rho)])] for r in records]

    def checks(self, S: SwiftSVDSettings, records: Records[dict]) -> list[ClaimCheck]:
        gap_llm, margin_others = 0.0, math.inf
        for r in records:
            for rho in S.rhos:
                es = r["errs"][("swift-svd", rho)]
                for n in self.names:
                    gap_llm = max(gap_llm, _rel_gap(es[n], r["errs"][("svd-llm", rho)][n]))
                    for b in ("svd", "asvd", "fwsvd"):
                        eb = r["errs"][(b, rho)][n]
                        margin_others = min(margin_others, (eb - es[n]) / max(eb, 1e-300))
        mean_cos = lambda row, rho: self._mean_cos(records, row, rho)  # noqa: E731
        n_layers = len(self.names)
        checks = [
            ClaimCheck(f"Swift-SVD's per-layer error equals SVD-LLM(W)'s within 1e-4 relative (max over {n_layers} "
                       f"layers, {len(records)} seed(s), rho in {list(S.rhos)})", gap_llm, "<=", 1e-4,
                       unit="relative", kind="wiring"),
            ClaimCheck("Swift-SVD's per-layer error is <= plain SVD's, ASVD's and FWSVD's on every layer (smallest "
                       "relative margin (e_baseline - e_Swift) / e_baseline)", margin_others, ">=", 0.0,
                       unit="relative", kind="wiring"),
        ]
        if 0.4 in S.rhos:
            checks += [
                ClaimCheck("rho = 0.4, uniform ranks: mean cosine of Swift-SVD minus plain SVD's",
                           mean_cos("swift-svd", 0.4) - mean_cos("svd", 0.4), ">=", 0.05, unit="cosine",
                           samples=self._paired(records, "swift-svd", "svd", 0.4)),
                ClaimCheck("rho = 0.4, uniform ranks: mean cosine of Swift-SVD minus ASVD's",
                           mean_cos("swift-svd", 0.4) - mean_cos("asvd", 0.4), ">=", 0.01, unit="cosine",
                           samples=self._paired(records, "swift-svd", "asvd", 0.4)),
            ]
            if S.dynamic:
                checks.append(ClaimCheck("rho = 0.4: mean cosine of Swift-SVD with dynamic ranks minus uniform "
                                         "Swift-SVD's", mean_cos("swift-dyn", 0.4) - mean_cos("swift-svd", 0.4), ">=",
                                         -0.005, unit="cosine",
                                         samples=self._paired(records, "swift-dyn", "swift-svd", 0.4)))
        joint = records.joint
        if "claim4" in joint:
            c4 = joint["claim4"]
            n_sing = sum(len(c["singular_layers"]) for c in c4)
            checks += [
                ClaimCheck("64 calibration sentences: fraction of the layers with singular X^T X (fewer tokens than "
                           "inputs) on which an undamped Cholesky (SVD-LLM(W) without damping) raises",
                           (sum(c["undamped_raised"] for c in c4) / n_sing) if n_sing else float("nan"), ">=", 1.0,
                           kind="wiring"),
                ClaimCheck("64 calibration sentences: Swift-SVD without damping attains the exact optimum "
                           "(max relative gap of e to the tail eigenvalues of W X^T X W^T)",
                           max(c["opt_gap"] for c in c4), "<=", 1e-4, unit="relative"),
                ClaimCheck("64 calibration sentences: Swift-SVD's e is <= every baseline's (damped SVD-LLM(W) "
                           "included), worst relative excess", max(c["worst_vs_baselines"] for c in c4), "<=", 1e-4,
                           unit="relative"),
            ]
        if "timing" in joint:
            t = joint["timing"]
            checks.append(ClaimCheck(f"decomposition of the {n_layers} layers from accumulated statistics: t_Swift / "
                                     f"t_SVD-LLM(W) (t_SVD-LLM(W) / t_Swift = {t['llm'] / t['swift']:.2f}x)",
                                     t["swift"] / t["llm"], "<=", 1.5, unit="x"))
        return checks

    def extra(self, S: SwiftSVDSettings, records: Records[dict]) -> dict[str, Any]:
        extra: dict[str, Any] = {
            "cosine": {f"{row}@{rho}": [r["cos"][(row, rho)] for r in records] for rho in S.rhos for row in self.rows},
            "layer_errors": {f"{row}@{rho}@seed{s}": r["errs"][(row, rho)]
                             for s, r in records.items() for rho in S.rhos for row in self.rows},
            "calibration_tokens": [r["tokens"] for r in records], "layers": self.names}
        extra.update(records.joint)
        return extra

    def figures(self, S: SwiftSVDSettings, records: Records[dict], out_dir: Path) -> list[str]:
        seed = records.seeds[0]
        layer_err = {(row, rho, s): r["errs"][(row, rho)] for s, r in records.items() for rho in S.rhos
                     for row in self.rows}
        cos = {(row, rho): [r["cos"][(row, rho)] for r in records] for rho in S.rhos for row in self.rows}
        return _figures(out_dir, self.names, layer_err, cos, self.rows, S.rhos, seed)

    def notes(self, S: SwiftSVDSettings, records: Records[dict]) -> str:
        n_layers = len(self.names)
        tokens_seen = [r["tokens"] for r in records]
        notes = [(
            f"MiniLM-L6 ({n_layers} target linears), calibration = {S.pairs} pairs of consecutive docstring "
            f"sentences ({2 * S.pairs} sentences, {tokens_seen} tokens per seed) from the corpus's calib "
            f"split (the seed draws them; batches of {S.batch_pairs} pairs in order of length), evaluation = "
            f"{S.eval} sentences of the eval split (disjoint modules; one fixed draw for all seeds), max "
            f"{S.max_length} tokens. All methods fit from one set of float64 statistics at identical ranks; FWSVD's "
            "Fisher uses the in-batch contrastive loss (temperature 0.05) of the sentence pairs, squared per batch "
            "(its original recipe). SVD-LLM(W) uses damping 1e-6 mean(diag), x10 per failure. When the calibration "
            "set has fewer tokens than 1536, X^T X of the FFN-output layers is singular and SVD-LLM(W) only runs "
            "thanks to its damping, which is why its error can differ slightly from Swift-SVD's exact optimum "
            "there.")]
        joint = records.joint
        if "claim4" in joint:
            c4 = joint["claim4"]
            n_sing = sum(len(c["singular_layers"]) for c in c4)
            notes.append(f"Claim 4 used {[c['tokens'] for c in c4]} calibration tokens (64 sentences) per seed; "
                         f"{n_sing // max(1, len(c4))} layers per seed had a singular X^T X.")
        if "timing" in joint:
            t = joint["timing"]
            notes.append(f"Decomposition of all {n_layers} layers (median of {S.timing_repeats}, 1 thread): Swift-SVD "
                         f"{t['swift']:.2f} s, SVD-LLM(W) {t['llm']:.2f} s, ratio t_SVD-LLM(W)/t_Swift = "
                         f"{t['llm'] / t['swift']:.2f}x. The paper's 2.5-3.9x speed-up comes from LLM shapes and large "
                         "calibration sets; at MiniLM shapes one eigh of the 1536 x 1536 output covariance of each "
                         "FFN-input layer costs about as much as SVD-LLM(W)'s Cholesky + SVD (see "
                         "benchmarks/bench_compress.py for 4096-wide layers).")
        return " ".join(notes)

    def config(self, S: SwiftSVDSettings, records: Records[dict]) -> dict[str, Any]:
        return {"model": "all-MiniLM-L6-v2", "layers": len(self.names), "calibration_pairs": S.pairs,
                "evaluation_sentences": S.eval, "rhos": list(S.rhos), "max_length": S.max_length,
                "batch_sentences": 2 * S.batch_pairs, "alpha": 2.5, "accumulation": "float64",
                "methods": [LABEL[r] for r in self.rows], "target": S.target or "every nn.Linear in encoder.layer"}


def _figures(out_dir: Path, names: Sequence[str], layer_err: dict, cos: dict, rows: Sequence[str],
             rhos: Sequence[float], seed: int) -> list[str]:
    plt = pyplot()
    rho = 0.4 if 0.4 in rhos else rhos[0]
    fig, ax = plt.subplots(figsize=(10, 4))
    x = list(range(len(names)))
    for row in rows:
        errs = layer_err[(row, rho, seed)]
        style = dict(ls="--", marker="s", ms=6, mfc="none", lw=1.5) if row == "svd-llm" else dict(marker="o", ms=3, lw=1)
        ax.plot(x, [max(errs[n], 1e-12) for n in names], label=LABEL[row], **style)
    ax.set_yscale("log")
    ax.set_xticks(x)
    ax.set_xticklabels([n.replace("encoder.layer.", "L").replace("attention.self.", "").replace("attention.output.dense",
                        "attn_out").replace(".dense", "") for n in names], rotation=90, fontsize=6)
    ax.set_ylabel("relative output error e (calibration)")
    ax.set_title(f"Per-layer error, rho = {rho}, seed {seed} (Swift-SVD and SVD-LLM(W) coincide)")
    ax.legend(fontsize=7, ncol=len(rows), loc="upper center", bbox_to_anchor=(0.5, -0.32), frameon=False)
    fig.tight_layout()
    f1 = save_figure(fig, out_dir / "layer_errors.png")

    fig, ax = plt.subplots(figsize=(7, 3.6))
    width = 0.8 / len(rhos)
    for j, r in enumerate(rhos):
        means = [statistics.fmean(cos[(row, r)]) for row in rows]
        errs = [statistics.stdev(cos[(row, r)]) if len(cos[(row, r)]) > 1 else 0.0 for row in rows]
        ax.bar([i + j * width for i in range(len(rows))], means, width, yerr=errs, capsize=2, label=f"rho = {r}")
    ax.set_xticks([i + width * (len(rhos) - 1) / 2 for i in range(len(rows))])
    ax.set_xticklabels([LABEL[r] for r in rows], rotation=20, fontsize=7)
    ax.set_ylabel("mean cosine to the original embeddings")
    lo = min(min(v) for v in cos.values())
    ax.set_ylim(max(0.0, lo - 0.05), 1.0)
    ax.legend(fontsize=7)
    ax.set_title("Embedding fidelity (evaluation sentences)")
    fig.tight_layout()
    f2 = save_figure(fig, out_dir / "cosine.png")
    return [f1, f2]


REPRODUCTION = SwiftSVDReproduction
run = SwiftSVDReproduction.run
