"""Reproduction of RankTuner (arXiv 2602.01745): relative-rank token weights separate under-learned tokens
from intrinsically uncertain ones and from noise, and fine-tune better than plain and entropy-weighted SFT.

World (:class:`rankwise.zoo.synthetic.ArithmeticWorld`, word-level vocabulary of 300): templated
explanations of carry-free 3-digit addition, ``"q 2 3 4 + 4 5 1 ;" -> " so 2 + 4 = 6 , thus 3 + 5 = 8 ,
hence 4 + 1 = 5 ; ans 6 8 5"``, each connective one of 4 synonyms drawn uniformly.

* Stage A (the prior): the cached warm-up model ``zoo.warm_lm("ranktuner")`` (tiny Llama, 4 layers,
  hidden 128, 4 heads, FFN 512), 1500 AdamW steps of 32 on 20k ``add`` explanations, whole-sequence
  loss (the spec's stage A, budgeted in steps rather than seconds so that it is deterministic; a few
  minutes cold, built once by ``rankwise zoo build`` and shared by every mode and seed, so quick mode
  uses the same prior rather than a shorter one).
* Stage B (the new operation the prior gets wrong): the same explanations with the answer written
  least-significant digit first (``ans 5 8 6``); 2000 training problems, 10 % of the targets with one
  filler (``umm``/``uh``) at a random completion position; 500 held-out problems (disjoint, seeded).
* Arms, all trained through TRL's ``SFTTrainer`` from the same stage-A copy with the same seed, data
  order, optimizer (AdamW lr 1e-3, constant, clipping 1) and steps (batch 32): TRL's ``loss_type="nll"``
  (plain SFT) and ``"dft"`` (the peer rows), and ``compute_loss_func`` = RankTuner, ``1 - p``
  (prob-dominant), entropy (EAFT-style), focal (gamma 2). Exact match of the greedy-decoded ``ans`` field.

Checks (thresholds are the spec's, stated before any run):

(1)  mechanistic, on a fixed probe set at the start of stage B (the stage-A model, the first
     ``n_probe`` training targets): mean RankTuner weight on answer-digit positions / on synonym-connective
     positions >= 2; and the same ratio for ``w = 1 - p`` <= 0.7 x RankTuner's ratio.
(1b) share of the filler tokens among the top 10 % highest-scoring target tokens: RankTuner's < the entropy
     scheme's, and RankTuner's <= the ``1 - p`` scheme's (tokens ranked by each scheme's raw score, before
     clamping, so clamp ties do not decide the ranking).
(2)  outcome (full mode): mean exact match RankTuner >= plain SFT + 1 point and >= entropy-weighted SFT,
     with paired per-problem differences (bootstrap over problems and seeds).
Wiring: TRL's shifted ``compute_loss_func`` path with unit weights equals the model's own causal-LM loss;
the rank statistics do not depend on the chunk size.
Preconditions: the prior learned stage A (exact match on held-out ``add`` problems >= 0.5), the new
operation is new to it (its exact match on the target task <= 0.2), and, where exact match is compared,
plain SFT learned (>= 0.05) and no arm saturates (<= 0.99).
"""

from __future__ import annotations

import copy
import dataclasses
import statistics
import time
import warnings
from pathlib import Path
from typing import Any

import torch

from rankwise.repro.result import ClaimCheck, Precondition, Table
from rankwise.repro.skeleton import Records, Reproduction, Settings, pyplot, save_figure, setting
from rankwise.train.ranktuner import RankTunerLoss, TokenWeightedLoss, rank_stats, sft_trainer, trl_loss_func
from rankwise.core.lmdata import collate, encode_pair
from rankwise.train.sft import exact_match, generate

ID = "ranktuner"
CLAIM = ("RankTuner's relative-rank weights put >= 2x more weight on the new operation's answer digits than on "
         "synonym connectives (the 1 - p weight separates them at most 0.7x as well), rank injected filler tokens "
         "lower than entropy weighting does, and fine-tune to a higher exact match than plain SFT (+1 point) and "
         "entropy-weighted SFT.")

ARMS = ("nll", "dft", "ranktuner", "one_minus_p", "entropy", "focal")
ROW = {"nll": "SFT (TRL nll)", "dft": "DFT (TRL dft)", "ranktuner": "RankTuner", "one_minus_p": "1 - p",
       "entropy": "entropy (EAFT-style)", "focal": "focal (gamma 2)"}
PROBE_SCHEMES = ("ranktuner", "one_minus_p", "entropy", "dft")
TAGS = ("answer", "syn", "result", "filler")

MIN_RATIO = 2.0          # claim 1: RankTuner answer / connective weight ratio
MAX_REL_RATIO = 0.7      # claim 1: (1 - p) ratio / RankTuner ratio
TOP_SHARE = 0.10         # claim 1b: the top 10 % of target tokens
MARGIN_SFT = 0.01        # claim 2: RankTuner - SFT exact match
MARGIN_ENT = 0.0         # claim 2: RankTuner - entropy exact match
MIN_PRIOR_ADD = 0.5      # precondition: stage A learned addition
MAX_PRIOR_TARGET = 0.2   # precondition: the target operation is new to the prior
MIN_SFT_EM = 0.05        # precondition: plain SFT learned
MAX_EM = 0.99            # precondition: no saturation
TOL_WIRING = 1e-5


@dataclasses.dataclass(frozen=True, kw_only=True)
class RankTunerSettings(Settings):
    """What the RankTuner reproduction runs; ``SETTINGS[mode]`` holds each mode's values."""

    warm: str = setting("ranktuner", "stage-A model (zoo.warm recipe)", choices=("ranktuner", "ranktuner-smoke"))
    op: str = setting("add_rev", "stage-B operation", choices=("add_rev", "sub"))
    n_train: int = setting(2000, "stage-B training problems", lo=1)
    n_test: int = setting(500, "held-out problems for exact match", lo=1)
    n_probe: int = setting(256, "training targets of the fixed probe set (claims 1, 1b)", lo=8)
    filler_rate: float = setting(0.1, "share of training targets with one inserted filler", lo=0.0, hi=1.0)
    arms: tuple[str, ...] = setting(("nll", "dft", "ranktuner"), "trained arms (TRL SFTTrainer each), from "
                                    "nll, dft, ranktuner, one_minus_p, entropy, focal")
    steps: int = setting(150, "optimizer steps per arm (the same budget for every arm)", lo=1)
    batch_size: int = setting(32, "examples per step", lo=1)
    lr: float = setting(1e-3, "AdamW learning rate (the spec's, every arm)", lo=0.0)
    s_max: float = setting(5.0, "RankTuner clamp", lo=0.0)
    gamma: float = setting(1.0, "RankTuner power", lo=0.0)
    outcome: bool = setting(False, "check claim 2 (exact match; needs nll, ranktuner and entropy arms)")
    max_new_tokens: int = setting(32, "greedy decoding budget", lo=1)

    def validate(self) -> None:
        bad = [a for a in self.arms if a not in ARMS]
        if bad:
            raise ValueError(f"RankTunerSettings.arms must be a subset of {list(ARMS)}, got {self.arms}")
        if self.outcome and not {"nll", "ranktuner", "entropy"} <= set(self.arms):
            raise ValueError("RankTunerSettings.outcome needs the arms nll, ranktuner and entropy")
        if self.n_probe > self.n_train:
            raise ValueError(f"RankTunerSettings.n_probe must be <= n_train, got {self.n_probe} > {self.n_train}")


SETTINGS: dict[str, RankTunerSettings] = {
    "smoke": RankTunerSettings(warm="ranktuner-smoke", n_train=64, n_test=16, n_probe=32, steps=2, batch_size=8,
                               max_new_tokens=4, arms=("nll", "ranktuner")),
    # quick: one seed, the mechanistic claims (1, 1b) on the stage-A model, which need no training; no arm
    # is trained (2 arms x 150 TRL steps + 4 x 500 greedy decodes took 118-166 CPU s, and 100 steps leave
    # plain SFT at 3.5 % exact match: an outcome at a budget that says nothing about claim 2)
    "quick": RankTunerSettings(arms=(), n_test=200, seeds=(0,)),
    # full: claim 2 with the three arms it compares (DFT, 1 - p and focal stay probe rows; DFT's trained row
    # is opt-in: --set arms=nll,dft,ranktuner,entropy, about +45 CPU s per seed), 120 steps, 300 held-out
    # problems, 3 seeds. Sized from the measured per-step CPU cost (STEP_CPU_S) to about 500 CPU s; at 120
    # steps plain SFT reached 0.27 and 0.24 exact match (seeds 0, 1): learned, not saturated (claim 2's regime)
    "full": RankTunerSettings(arms=("nll", "ranktuner", "entropy"), steps=120, n_test=300, outcome=True,
                              seeds=(0, 1, 2)),
}
#: CPU seconds per TRL step of each arm, measured in the 150-step full run (2026-12-02, one thread beside one
#: other job; the loss-function arms pay TRL's extra no-grad forward), and the rest of one seed (probe,
#: decodes, loading): what the full mode's size comes from (docs/methods/ranktuner.md).
STEP_CPU_S = {"nll": 0.360, "dft": 0.353, "ranktuner": 0.439, "entropy": 0.454}
SEED_OVERHEAD_CPU_S = 16.0


def estimated_cpu_s(s: RankTunerSettings) -> float:
    """The CPU seconds ``s`` should take on one idle core, from :data:`STEP_CPU_S` (arms without a
    measurement count as the slowest)."""
    step = sum(STEP_CPU_S.get(a, max(STEP_CPU_S.values())) for a in s.arms)
    return len(s.seeds or (0,)) * (s.steps * step + SEED_OVERHEAD_CPU_S)


def _arm_loss(arm: str, s: RankTunerSettings) -> Any:
    if arm in ("nll", "dft"):
        return arm
    if arm == "ranktuner":
        return RankTunerLoss(s_max=s.s_max, gamma=s.gamma)
    return TokenWeightedLoss(arm)


def _em(model: Any, tok: Any, world: Any, test: list[Any], s: RankTunerSettings) -> list[float]:
    outs = generate(model, tok, [e.prompt for e in test], max_new_tokens=s.max_new_tokens)
    return exact_match([world.parse_answer(o) for o in outs], [e.meta["answer"] for e in test])


def _probe(model: Any, tok: Any, probe: list[Any], s: RankTunerSettings) -> dict[str, Any]:
    """Weights of every scheme on the probe set (one forward of the stage-A model), by tag."""
    batch = collate([encode_pair(tok, e.prompt, e.completion) for e in probe], tok.pad_token_id)  # in order
    tags: list[list[str | None]] = []
    for i, (e, plen) in enumerate(zip(probe, batch.prompt_lens.tolist())):
        tags.append([None] * (plen - 1) + list(e.tags) + ["eos"])  # aligned with labels[:, 1:]
    with torch.no_grad():
        out = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask)
    logits, labels = out.logits[:, :-1], batch.labels[:, 1:]
    mask = labels != -100
    if [sum(t is not None for t in row) for row in tags] != mask.sum(1).tolist():
        raise RuntimeError("probe tags do not align with the target tokens")
    flat_tags = [t for row in tags for t in row if t is not None]
    flat_ex = [i for i, row in enumerate(tags) for t in row if t is not None]
    res: dict[str, Any] = {"n_tokens": int(mask.sum()), "n_filler": flat_tags.count("filler")}
    for scheme in PROBE_SCHEMES:
        loss = RankTunerLoss(s_max=s.s_max, gamma=s.gamma) if scheme == "ranktuner" else TokenWeightedLoss(scheme)
        w, score, _ = loss.weights(logits, labels)
        wv, sv = w[mask].tolist(), score[mask].tolist()
        by = {t: statistics.fmean([x for x, tt in zip(wv, flat_tags) if tt == t] or [float("nan")]) for t in TAGS}
        k = max(1, int(round(TOP_SHARE * len(sv))))
        top = sorted(range(len(sv)), key=lambda i: -sv[i])[:k]
        per_ex = [0] * len(probe)  # fillers of each probe example among the top k (paired samples of 1b)
        for i in top:
            if flat_tags[i] == "filler":
                per_ex[flat_ex[i]] += 1
        res[scheme] = {"mean": by, "ratio": by["answer"] / by["syn"], "filler_share": sum(per_ex) / k,
                       "top_fillers": per_ex, "k": k}
    # wiring: TRL's shifted compute_loss_func path with unit weights == the model's own causal-LM loss
    with torch.no_grad():
        own = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, labels=batch.labels).loss
        via = trl_loss_func(TokenWeightedLoss("uniform"))(out, batch.labels)
        a = rank_stats(logits, labels)
        b = rank_stats(logits, labels, chunk=7)
    res["wiring_trl"] = abs(float(own) - float(via))
    res["wiring_chunk"] = max(float((a.rank - b.rank).abs().max()), float((a.expected_rank - b.expected_rank).abs().max()))
    return res


def _train_arm(base: Any, tok: Any, train: list[Any], arm: str, s: RankTunerSettings, seed: int) -> dict[str, Any]:
    model = copy.deepcopy(base).train()
    t0 = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = sft_trainer(model, tok, train, _arm_loss(arm, s), steps=s.steps, batch_size=s.batch_size, lr=s.lr,
                              seed=seed, max_length=128)
        trainer.train()
    wall = time.perf_counter() - t0
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return {"model": model.eval(), "losses": losses, "step_s": wall / s.steps}


class RankTunerReproduction(Reproduction[RankTunerSettings, dict]):
    id = ID
    claim = CLAIM
    settings = SETTINGS

    def _prior(self, s: RankTunerSettings) -> tuple[Any, Any, Any]:
        if getattr(self, "_warm", None) is None:
            from rankwise import zoo

            model, tok = zoo.warm_lm(s.warm)
            self._warm = (model, tok, zoo.warm_world(s.warm))
        return self._warm

    def measure(self, s: RankTunerSettings, seed: int) -> dict[str, Any]:
        base, tok, world = self._prior(s)
        tr, te = world.split(s.n_train, s.n_test, seed=1000 + seed)
        train = world.examples(tr, s.op, seed=seed, filler_rate=s.filler_rate)
        test = world.examples(te, s.op, seed=seed)
        rec: dict[str, Any] = {"probe": _probe(base, tok, train[: s.n_probe], s)}
        rec["prior_target"] = statistics.fmean(_em(base, tok, world, test, s))
        rec["prior_add"] = statistics.fmean(_em(base, tok, world, world.examples(te, "add", seed=seed), s))
        rec["arms"] = {}
        for arm in s.arms:
            r = _train_arm(base, tok, train, arm, s, seed)
            rec["arms"][arm] = {"correct": _em(r["model"], tok, world, test, s), "losses": r["losses"],
                                "step_s": r["step_s"]}
        return rec

    def table(self, s: RankTunerSettings, records: Records[dict]) -> Table:
        t = Table(columns=["exact match", "final loss", "step (ms)", "w answer", "w connective", "w filler",
                           "answer/connective", "filler share top10%"], notes={
            "exact match": "greedy exact match of the ans field on the held-out problems",
            "final loss": "training loss (the arm's own objective), mean of the last fifth of the steps",
            "step (ms)": "TRL SFTTrainer wall time per step, under whatever load the machine had",
            "w answer": "mean weight on answer digits, stage-A model, probe set (mean-normalised schemes)",
            "w connective": "mean weight on synonym connectives (same probe)",
            "w filler": "mean weight on inserted fillers (same probe)",
            "answer/connective": "ratio of the two means (claim 1)",
            "filler share top10%": "share of fillers among the top 10% tokens by raw score (claim 1b)"})
        for r in records:
            for arm in ARMS:
                if arm in r["arms"]:
                    a = r["arms"][arm]
                    k = max(1, len(a["losses"]) // 5)
                    t.add(ROW[arm], "exact match", statistics.fmean(a["correct"]))
                    t.add(ROW[arm], "final loss", statistics.fmean(a["losses"][-k:]) if a["losses"] else float("nan"))
                    t.add(ROW[arm], "step (ms)", 1e3 * a["step_s"])
                if arm in PROBE_SCHEMES:
                    p = r["probe"][arm]
                    t.add(ROW[arm], "w answer", p["mean"]["answer"])
                    t.add(ROW[arm], "w connective", p["mean"]["syn"])
                    t.add(ROW[arm], "w filler", p["mean"]["filler"])
                    t.add(ROW[arm], "answer/connective", p["ratio"])
                    t.add(ROW[arm], "filler share top10%", p["filler_share"])
            t.add("stage-A prior (no SFT)", "exact match", r["prior_target"])
        self._t = t
        return t

    def preconditions(self, s: RankTunerSettings, records: Records[dict]) -> list[Precondition]:
        pre = [Precondition("the prior learned stage A: exact match on held-out add problems",
                            statistics.fmean(r["prior_add"] for r in records), ">=", MIN_PRIOR_ADD),
               Precondition("the target operation is new to the prior: its exact match on the target task",
                            statistics.fmean(r["prior_target"] for r in records), "<=", MAX_PRIOR_TARGET)]
        if s.outcome:
            pre.append(Precondition("plain SFT learned the target task: exact match",
                                    self._t.mean(ROW["nll"], "exact match"), ">=", MIN_SFT_EM))
            pre.append(Precondition("no arm saturates: highest exact match",
                                    max(self._t.mean(ROW[a], "exact match") for a in s.arms), "<=", MAX_EM))
        return pre

    def checks(self, s: RankTunerSettings, records: Records[dict]) -> list[ClaimCheck]:
        mean = lambda f: statistics.fmean(f(r) for r in records)  # noqa: E731
        rt = mean(lambda r: r["probe"]["ranktuner"]["ratio"])
        omp = mean(lambda r: r["probe"]["one_minus_p"]["ratio"])
        sh = {k: mean(lambda r, k=k: r["probe"][k]["filler_share"]) for k in ("ranktuner", "entropy", "one_minus_p")}
        checks = [
            ClaimCheck("(1) RankTuner mean weight, answer digits / synonym connectives (stage-A model)", rt, ">=",
                       MIN_RATIO, unit="x"),
            ClaimCheck("(1) the 1 - p weight's answer/connective ratio relative to RankTuner's", omp / rt, "<=",
                       MAX_REL_RATIO, unit="x"),
            ClaimCheck("(1b) filler share of the top 10% tokens: RankTuner - entropy scheme",
                       sh["ranktuner"] - sh["entropy"], "<", 0.0, samples=self._share_diff(records, "entropy")),
            ClaimCheck("(1b) filler share of the top 10% tokens: RankTuner - (1 - p) scheme",
                       sh["ranktuner"] - sh["one_minus_p"], "<=", 0.0,
                       samples=self._share_diff(records, "one_minus_p")),
            ClaimCheck("TRL compute_loss_func path (unit weights) vs the model's own loss: |difference|",
                       max(r["probe"]["wiring_trl"] for r in records), "<=", TOL_WIRING, kind="wiring"),
            ClaimCheck("rank statistics independent of the chunk size: max |difference|",
                       max(r["probe"]["wiring_chunk"] for r in records), "<=", TOL_WIRING, kind="wiring"),
        ]
        if s.outcome:
            def paired(a: str, b: str) -> list[list[float]]:
                return [[x - y for x, y in zip(r["arms"][a]["correct"], r["arms"][b]["correct"])] for r in records]

            for other, margin in (("nll", MARGIN_SFT), ("entropy", MARGIN_ENT)):
                d = paired("ranktuner", other)
                checks.append(ClaimCheck(f"(2) exact match RankTuner - {ROW[other]}",
                                         statistics.fmean(statistics.fmean(x) for x in d), ">=", margin, samples=d))
        return checks

    @staticmethod
    def _share_diff(records: Records[dict], other: str) -> list[list[float]]:
        """Per probe example: (its fillers in RankTuner's top k - in ``other``'s) x n_examples / k, whose
        mean is the difference of the two shares (a paired bootstrap over probe examples)."""
        out = []
        for r in records:
            a, b = r["probe"]["ranktuner"], r["probe"][other]
            n = len(a["top_fillers"])
            out.append([(x - y) * n / a["k"] for x, y in zip(a["top_fillers"], b["top_fillers"])])
        return out

    def figures(self, s: RankTunerSettings, records: Records[dict], out_dir: Path) -> list[str]:
        plt = pyplot()
        fig, axes = plt.subplots(1, 2, figsize=(12, 3.8))
        ax = axes[0]
        width = 0.2
        for j, scheme in enumerate(PROBE_SCHEMES):
            vals = [statistics.fmean(r["probe"][scheme]["mean"][t] for r in records) for t in TAGS]
            label = ROW[scheme] + (" (p, not normalised)" if scheme == "dft" else "")
            ax.bar([i + j * width for i in range(len(TAGS))], vals, width, label=label)
        ax.set_xticks([i + 1.5 * width for i in range(len(TAGS))], ["answer digit", "connective", "step result",
                                                                     "filler"])
        ax.set_ylabel("mean token weight (stage-A model)")
        ax.set_title("where each scheme puts its weight", fontsize=10)
        ax.legend(fontsize=8)
        ax = axes[1]
        rows = [ROW[a] for a in ARMS if a in s.arms] + ["stage-A prior (no SFT)"]
        means = [self._t.mean(r, "exact match") for r in rows]
        ax.bar(range(len(rows)), means, color=["C0"] * (len(rows) - 1) + ["C7"])
        for i, r in enumerate(rows):
            ax.plot([i] * len(self._t.values(r, "exact match")), self._t.values(r, "exact match"), "k.", ms=4)
        ax.set_xticks(range(len(rows)), [r.replace(" (", "\n(") for r in rows], fontsize=7)
        ax.set_ylim(0, 1)
        ax.set_ylabel("exact match (held-out)")
        ax.set_title(f"{s.steps} TRL SFT steps per arm, {len(records.seeds)} seed(s)", fontsize=10)
        return [save_figure(fig, out_dir / "ranktuner.png")]

    def config(self, s: RankTunerSettings, records: Records[dict]) -> dict[str, Any]:
        return {"probe_tokens": records.first["probe"]["n_tokens"], "probe_fillers": records.first["probe"]["n_filler"],
                "trainer": "trl.SFTTrainer (compute_loss_func for the rankwise losses)", "optimizer": "AdamW",
                "threads": torch.get_num_threads()}

    def notes(self, s: RankTunerSettings, records: Records[dict]) -> str:
        p = records.first["probe"]
        share = {k: statistics.fmean(r["probe"][k]["filler_share"] for r in records)
                 for k in ("ranktuner", "entropy", "one_minus_p")}
        return (f"Probe set (seed {records.seeds[0]}): {p['n_tokens']} target tokens, {p['n_filler']} of them "
                f"fillers. Filler share of the top 10%: RankTuner {share['ranktuner']:.3f}, entropy "
                f"{share['entropy']:.3f}, 1 - p {share['one_minus_p']:.3f}. By construction of the schemes: a "
                "filler never occurs in stage A, so the prior gives it a poor rank R at a position where E[R] is "
                "small, and its RankTuner score R / E[R] is large, as is its 1 - p; the entropy score H_t / log V "
                "depends only on the position's predictive distribution, not on which token is the target, so it "
                "ranks a filler like any token at the same kind of position (the synonym connectives have the "
                "highest entropy in this world). The paper's noise diagnostic (26% RankTuner vs 55% entropy) "
                "injected noise into real text, where noise may sit at high-entropy positions; (1b) is reported as "
                "measured here. Stage A is the cached 1500-step prior for every mode (the spec's 60 s full-mode "
                "stage A; its 20 s quick variant is not used because the cache removes its cost). Claim 2 is "
                "checked in full mode only (the spec's quick mode reports exact match without a verdict on it).")


REPRODUCTION = RankTunerReproduction
run = RankTunerReproduction.run
